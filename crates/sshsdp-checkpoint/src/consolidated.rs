//! Consolidated (unsharded) safetensors files, streamed both ways:
//!
//! * [`export_safetensors`] writes a sharded model's fp32 masters as one safetensors file,
//!   bucket by bucket: each bucket's pieces are gathered to rank 0, which writes the
//!   parameters they complete and drops them, so no rank holds more than about one bucket
//!   besides its shards. Tensors are named by module path, in Burn's shapes, so plain Burn
//!   (`burn-store`'s `SafetensorsStore`) loads the file into the unsharded module.
//! * [`SafetensorsSource`] gives `sshsdp_backend::Shard::from_source` a safetensors file (ours, or a
//!   Hugging Face one with names mapped by [`SafetensorsSource::with_names`]) as initial
//!   values: each rank reads only the byte ranges of its own runtime shard, with positioned
//!   reads (`pread`), and the header is checked against the model (names, shapes, dtypes)
//!   before anything is read. Nothing in the file is trusted: the header's size, offsets and
//!   shapes are validated against the file's length first.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use burn::module::Module;
use burn::tensor::backend::Backend;
use safetensors::tensor::{Metadata, TensorInfo};
use safetensors::Dtype;
use sshsdp_backend::{BufferSpec, HsdpRuntime, NamedParam, ParamSource};

use crate::buffers::{refuse_buffers, saved_buffers};
use crate::CheckpointError;

/// The largest header this reader accepts (safetensors' own limit).
const MAX_HEADER: u64 = 100_000_000;

/// Writes the model's fp32 master weights as one safetensors file at `path` (rank 0 writes it,
/// through `path` + `.tmp` renamed when complete; every rank calls this, a collective call).
/// Tensors are f32, named by module path, in plan order. An error on any rank (rank 0's I/O
/// included) is an error on every rank, and `path` is then left as it was.
///
/// A model with module buffers is refused on every rank: export it with [`export_model`],
/// which writes them too.
pub fn export_safetensors<B: Backend>(
    runtime: &HsdpRuntime<B>,
    path: &Path,
) -> Result<(), CheckpointError> {
    refuse_buffers(runtime, "export_safetensors", "export_model")?;
    export(runtime, path, Ok(Vec::new()))
}

/// [`export_safetensors`] of a model with module buffers: rank 0's buffers (read from
/// `module`, the sharded module) follow the parameters in the file, named by their module
/// paths, so plain Burn loads the whole module state (BatchNorm's running statistics
/// included). Works for models without buffers too.
pub fn export_model<B: Backend, MB: Backend, M: Module<MB>>(
    module: &M,
    runtime: &HsdpRuntime<B>,
    path: &Path,
) -> Result<(), CheckpointError> {
    export(runtime, path, saved_buffers(runtime, module))
}

/// The export; `buffers` are rank 0's buffer values (empty elsewhere), or why it could not
/// read them (an error on every rank).
fn export<B: Backend>(
    runtime: &HsdpRuntime<B>,
    path: &Path,
    buffers: Result<Vec<NamedParam>, CheckpointError>,
) -> Result<(), CheckpointError> {
    let plan = runtime.plan();
    let writer_rank = runtime.rank() == 0;
    let tmp = PathBuf::from(format!("{}.tmp", path.display()));
    let mut writer = if writer_rank {
        Some(StreamWriter::create(plan, runtime.buffers(), &tmp))
    } else {
        None
    };
    let (buffers, mut local_error) = match buffers {
        Ok(buffers) => (buffers, None),
        Err(e) => (Vec::new(), Some(e)),
    };
    let outer = runtime.master_pieces(|pieces, group| {
        let count = group.pieces();
        for p in pieces.iter_mut() {
            let bucket = &plan.buckets()[p.bucket];
            let pe = bucket.piece_elements as usize;
            let (bucket_index, start, mine) = (p.bucket, p.start, group.piece());
            let (master, _) = p.host()?;
            // Every piece to the holder of piece 0 (rank 0 in its update group).
            let mut send = vec![Vec::new(); count];
            send[0] = master.to_vec();
            let recv_counts: Vec<usize> = (0..count)
                .map(|_| if mine == 0 { pe } else { 0 })
                .collect();
            let (gathered, ranges) = group.exchange_flat(send, &recv_counts)?;
            let gathered: Vec<&[f32]> = ranges.into_iter().map(|r| &gathered[r]).collect();
            if let Some(w) = writer.as_mut() {
                if start != mine * pe || mine != 0 {
                    local_error.get_or_insert(CheckpointError::Mismatch {
                        file: path.to_path_buf(),
                        reason: format!(
                            "rank 0 holds the piece at {start} of bucket {bucket_index}, not piece 0"
                        ),
                    });
                } else if local_error.is_none() {
                    if let Err(e) = w.add_bucket(plan, bucket_index, &gathered) {
                        local_error = Some(e);
                    }
                }
            }
        }
        Ok(())
    });
    if let Some(w) = writer.take() {
        if local_error.is_none() && outer.is_ok() {
            if let Err(e) = w.finish(plan.params().len(), &buffers, &tmp, path) {
                let _ = std::fs::remove_file(&tmp);
                local_error = Some(e);
            }
        } else {
            let _ = std::fs::remove_file(&tmp);
        }
    }
    outer.map_err(CheckpointError::Runtime)?;
    // Rank 0's verdict reaches every rank.
    let verdicts = runtime
        .all_gather_world(vec![u8::from(local_error.is_some())])
        .map_err(CheckpointError::Runtime)?;
    match (local_error, verdicts.iter().position(|&v| v != 0)) {
        (Some(e), _) => Err(e),
        (None, Some(r)) => Err(CheckpointError::Runtime(sshsdp_backend::HsdpError::Failed(
            format!("rank {r} failed to export {}", path.display()),
        ))),
        (None, None) => Ok(()),
    }
}

/// Rank 0's side of [`export_safetensors`]: the header up front (every offset is known from
/// the plan), then each bucket's parameters in plan order as the bucket arrives.
struct StreamWriter {
    /// The file being written (`path` + `.tmp`).
    tmp: PathBuf,
    out: Result<BufWriter<File>, CheckpointError>,
    /// The next parameter to write.
    next: usize,
}

impl StreamWriter {
    fn create(plan: &sshsdp_plan::Plan, buffers: &[BufferSpec], tmp: &Path) -> Self {
        let io = |source| CheckpointError::Io {
            file: tmp.to_path_buf(),
            source,
        };
        let out = (|| {
            let mut offset = 0;
            let tensors = plan
                .params()
                .iter()
                .map(|p| {
                    let n = 4 * p.spec.numel() as usize;
                    let info = TensorInfo {
                        dtype: Dtype::F32,
                        shape: p.spec.shape.clone(),
                        data_offsets: (offset, offset + n),
                    };
                    offset += n;
                    (p.spec.path.clone(), info)
                })
                .collect::<Vec<_>>();
            let mut tensors = tensors;
            for b in buffers {
                let n = 4 * b.numel();
                tensors.push((
                    b.path.clone(),
                    TensorInfo {
                        dtype: Dtype::F32,
                        shape: b.shape.clone(),
                        data_offsets: (offset, offset + n),
                    },
                ));
                offset += n;
            }
            let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
            let header =
                Metadata::new(Some(meta), tensors).map_err(|e| CheckpointError::Corrupt {
                    file: tmp.to_path_buf(),
                    reason: format!("building the header: {e}"),
                })?;
            let mut bytes = serde_json::to_vec(&header).map_err(|e| CheckpointError::Corrupt {
                file: tmp.to_path_buf(),
                reason: format!("serialising the header: {e}"),
            })?;
            bytes.resize(bytes.len().next_multiple_of(8), b' ');
            let mut out = BufWriter::new(File::create(tmp).map_err(io)?);
            out.write_all(&(bytes.len() as u64).to_le_bytes())
                .map_err(io)?;
            out.write_all(&bytes).map_err(io)?;
            Ok(out)
        })();
        Self {
            tmp: tmp.to_path_buf(),
            out,
            next: 0,
        }
    }

    /// Takes bucket `b`'s gathered pieces (piece `p`'s fp32 elements at `gathered[p]`) and
    /// writes its parameters straight from them, in order (a bucket holds whole parameters,
    /// consecutive in plan order: the plan's layout).
    fn add_bucket(
        &mut self,
        plan: &sshsdp_plan::Plan,
        b: usize,
        gathered: &[&[f32]],
    ) -> Result<(), CheckpointError> {
        let bucket = &plan.buckets()[b];
        // Each parameter's slices: (elements, piece, offset in the piece).
        let mut slices: BTreeMap<usize, Vec<(Range<usize>, usize, usize)>> = BTreeMap::new();
        for (piece, views) in bucket.views.iter().enumerate() {
            for view in views {
                for (run, master) in view.runs() {
                    slices.entry(view.param).or_default().push((
                        run.start as usize..run.end as usize,
                        piece,
                        master as usize,
                    ));
                }
            }
        }
        for param in bucket.params.clone() {
            let mut parts = slices.remove(&param).unwrap_or_default();
            parts.sort_by_key(|(e, _, _)| e.start);
            let numel = plan.params()[param].spec.numel() as usize;
            let contiguous = parts
                .iter()
                .try_fold(0, |at, (e, _, _)| (e.start == at).then_some(e.end));
            if param != self.next || contiguous != Some(numel) {
                return Err(CheckpointError::Mismatch {
                    file: self.tmp.clone(),
                    reason: format!(
                        "bucket {b} does not hold parameter {param} whole, in plan order"
                    ),
                });
            }
            for (e, piece, at) in &parts {
                self.write(&gathered[*piece][*at..*at + e.len()])?;
            }
            self.next += 1;
        }
        Ok(())
    }

    /// Appends `values` as little-endian f32 (in chunks: no second copy of a whole
    /// parameter). After an earlier error, writes nothing: `finish` returns that error.
    fn write(&mut self, values: &[f32]) -> Result<(), CheckpointError> {
        let Ok(out) = self.out.as_mut() else {
            return Ok(());
        };
        for chunk in values.chunks(1 << 14) {
            let bytes: Vec<u8> = chunk.iter().flat_map(|v| v.to_le_bytes()).collect();
            out.write_all(&bytes)
                .map_err(|source| CheckpointError::Io {
                    file: self.tmp.clone(),
                    source,
                })?;
        }
        Ok(())
    }

    /// Writes the buffers after the parameters, flushes and syncs the file and renames it
    /// into place.
    fn finish(
        mut self,
        params: usize,
        buffers: &[NamedParam],
        tmp: &Path,
        path: &Path,
    ) -> Result<(), CheckpointError> {
        let io = |file: &Path| {
            let file = file.to_path_buf();
            move |source| CheckpointError::Io { file, source }
        };
        if self.next != params {
            return Err(CheckpointError::Missing {
                location: tmp.to_path_buf(),
                what: format!("{} of {params} parameters were written", self.next),
            });
        }
        for buffer in buffers {
            self.write(&buffer.values)?;
        }
        let out = self.out?;
        let file = out.into_inner().map_err(|e| io(tmp)(e.into_error()))?;
        file.sync_all().map_err(io(tmp))?;
        std::fs::rename(tmp, path).map_err(io(path))
    }
}

/// A safetensors file as the initial values of `sshsdp_backend::Shard::from_source`: parameters are
/// looked up by module path (mapped by [`Self::with_names`]) and read as f32 from F32, BF16,
/// F16 or F64 tensors, only the requested elements.
pub struct SafetensorsSource {
    path: PathBuf,
    file: File,
    /// Byte offset of the data section.
    data_start: u64,
    tensors: HashMap<String, TensorInfo>,
    names: Box<dyn Fn(&str) -> String + Send + Sync>,
}

impl SafetensorsSource {
    /// Opens `path` and validates its header against the file (size, offsets, shapes, dtypes'
    /// sizes); reads no tensor data.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, CheckpointError> {
        let path = path.as_ref().to_path_buf();
        let io = |source| CheckpointError::Io {
            file: path.clone(),
            source,
        };
        let corrupt = |reason: String| CheckpointError::Corrupt {
            file: path.clone(),
            reason,
        };
        let file = File::open(&path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        let mut n = [0u8; 8];
        file.read_exact_at(&mut n, 0)
            .map_err(|_| corrupt(format!("{len} bytes: too short for a safetensors header")))?;
        let n = u64::from_le_bytes(n);
        if n > MAX_HEADER || n > len.saturating_sub(8) {
            return Err(corrupt(format!(
                "header of {n} bytes in a file of {len} bytes"
            )));
        }
        let mut header = vec![0u8; n as usize];
        file.read_exact_at(&mut header, 8).map_err(io)?;
        let meta: Metadata =
            serde_json::from_slice(&header).map_err(|e| corrupt(format!("invalid header: {e}")))?;
        let data_start = 8 + n;
        if data_start + meta.data_len() as u64 != len {
            return Err(corrupt(format!(
                "the header describes {} data bytes, the file holds {}",
                meta.data_len(),
                len - data_start
            )));
        }
        let tensors = meta
            .tensors()
            .into_iter()
            .map(|(name, info)| (name, info.clone()))
            .collect();
        Ok(Self {
            path,
            file,
            data_start,
            tensors,
            names: Box::new(str::to_string),
        })
    }

    /// Maps module paths to the file's tensor names (e.g. `blocks.0.attn.query.weight` to a
    /// Hugging Face name); identity by default. Shapes are compared as they are: a file in
    /// another layout (PyTorch's `[out, in]` linear weights against Burn's `[in, out]`) is a
    /// shape mismatch, not a silent transpose.
    pub fn with_names(mut self, names: impl Fn(&str) -> String + Send + Sync + 'static) -> Self {
        self.names = Box::new(names);
        self
    }

    /// The file's tensor names.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// The shape of the file's tensor for parameter `path` (after [`Self::with_names`]).
    pub fn shape(&self, path: &str) -> Result<&[usize], String> {
        self.tensor(path).map(|(_, info)| info.shape.as_slice())
    }

    fn tensor(&self, path: &str) -> Result<(String, &TensorInfo), String> {
        let name = (self.names)(path);
        match self.tensors.get(&name) {
            Some(info) => Ok((name, info)),
            None => Err(format!(
                "parameter '{path}': no tensor '{name}' in {}",
                self.path.display()
            )),
        }
    }
}

/// Bytes per element of the dtypes a [`SafetensorsSource`] reads.
fn element_bytes(dtype: Dtype) -> Option<usize> {
    match dtype {
        Dtype::F32 => Some(4),
        Dtype::BF16 | Dtype::F16 => Some(2),
        Dtype::F64 => Some(8),
        _ => None,
    }
}

impl ParamSource for SafetensorsSource {
    fn check(&self, path: &str, shape: &[usize]) -> Result<(), String> {
        let (name, info) = self.tensor(path)?;
        if info.shape != shape {
            return Err(format!(
                "parameter '{path}' has shape {shape:?}; tensor '{name}' in {} has shape {:?}",
                self.path.display(),
                info.shape
            ));
        }
        if element_bytes(info.dtype).is_none() {
            return Err(format!(
                "parameter '{path}': tensor '{name}' in {} is {:?}; floats are read from F32, \
                 BF16, F16 or F64",
                self.path.display(),
                info.dtype
            ));
        }
        Ok(())
    }

    fn read(&self, path: &str, range: Range<usize>, out: &mut [f32]) -> Result<(), String> {
        let (name, info) = self.tensor(path)?;
        let size = element_bytes(info.dtype)
            .ok_or_else(|| format!("tensor '{name}' is {:?}", info.dtype))?;
        let numel: usize = info.shape.iter().product();
        if range.end > numel || out.len() != range.len() {
            return Err(format!(
                "parameter '{path}': elements {range:?} of a tensor of {numel}"
            ));
        }
        let mut bytes = vec![0u8; range.len() * size];
        let at = self.data_start + (info.data_offsets.0 + range.start * size) as u64;
        self.file.read_exact_at(&mut bytes, at).map_err(|e| {
            format!(
                "parameter '{path}': reading tensor '{name}' of {}: {e}",
                self.path.display()
            )
        })?;
        let chunks = bytes.chunks_exact(size);
        match info.dtype {
            Dtype::F32 => out
                .iter_mut()
                .zip(chunks)
                .for_each(|(o, c)| *o = f32::from_le_bytes(c.try_into().expect("4 bytes"))),
            Dtype::BF16 => out.iter_mut().zip(chunks).for_each(|(o, c)| {
                *o = half::bf16::from_le_bytes(c.try_into().expect("2 bytes")).to_f32()
            }),
            Dtype::F16 => out.iter_mut().zip(chunks).for_each(|(o, c)| {
                *o = half::f16::from_le_bytes(c.try_into().expect("2 bytes")).to_f32()
            }),
            _ => out
                .iter_mut()
                .zip(chunks)
                .for_each(|(o, c)| *o = f64::from_le_bytes(c.try_into().expect("8 bytes")) as f32),
        }
        Ok(())
    }
}

//! Device copies of a codec's operation lists ([`DeviceTables`]), made once per device and
//! list: what the device codec (`storage/cube/codec.rs`) launches its kernels from.

use std::any::Any;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cubecl::device::DeviceId;

/// Which of a codec's operation lists a device table holds: a piece's encode or the decode of a
/// gathered bucket.
#[cfg_attr(not(any(feature = "wgpu", feature = "cuda")), allow(dead_code))]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum TableOf {
    /// [`BucketCodec::encode_ops`](crate::storage::codec::BucketCodec::encode_ops) of this piece.
    Encode(usize),
    /// [`BucketCodec::decode_ops`](crate::storage::codec::BucketCodec::decode_ops).
    Decode,
}

/// A codec's operation lists as uploaded to devices (`storage/cube/codec.rs`), each made once
/// per device and list and shared by the codec's clones: the kernels read their operations from
/// device memory (a kernel takes no list of operations as arguments), and uploading them for
/// every gather would be a host-to-device copy per bucket and pass.
#[derive(Clone, Default)]
pub(crate) struct DeviceTables(Arc<Mutex<TablesByDevice>>);

/// Each table, by device and operation list (type-erased: the device codec knows its type).
type TablesByDevice = HashMap<(DeviceId, TableOf), Arc<dyn Any + Send + Sync>>;

impl DeviceTables {
    /// The table of `which` on `device`, made by `make` the first time.
    #[cfg_attr(not(any(feature = "wgpu", feature = "cuda")), allow(dead_code))]
    pub fn get_or_make<T: Any + Send + Sync, E>(
        &self,
        device: DeviceId,
        which: TableOf,
        make: impl FnOnce() -> Result<T, E>,
    ) -> Result<Arc<T>, E> {
        let mut tables = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(table) = tables.get(&(device, which)) {
            if let Ok(table) = table.clone().downcast::<T>() {
                return Ok(table);
            }
        }
        let table = Arc::new(make()?);
        tables.insert((device, which), table.clone());
        Ok(table)
    }
}

impl std::fmt::Debug for DeviceTables {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.0.lock().map(|t| t.len()).unwrap_or(0);
        write!(f, "DeviceTables({n})")
    }
}

//! Burn optimizer state records as named `f32` arrays plus scalars, and back.
//!
//! A record is turned into its serde item with [`FullPrecisionSettings`] and serialized
//! into a small in-memory tree (a custom serde `Serializer`: tensor bytes stay bytes, no
//! per-element JSON values). Every float tensor (Burn serialises tensor records as
//! `TensorData { bytes, shape, dtype }`) becomes an array named by its dotted field path
//! (`momentum.moment_1`; a tensor at the root is named `""`); every number or bool becomes
//! a scalar (`momentum.time`); `None` options are left out. Decoding rebuilds the tree from
//! the names and deserializes it with type hints, so integer fields get integers, floats
//! get floats and bools get `0`/`1`, then calls `Record::from_item`.
mod de;
mod ser;

use std::collections::BTreeMap;
use std::fmt;

use burn::record::{FullPrecisionSettings, Record};
use burn::tensor::backend::Backend;
use serde::{de as serde_de, ser as serde_ser, Deserialize, Serialize};

use de::{insert, DNode};
use ser::{flatten, shown, NodeSer};

/// Integers up to this magnitude are exact in an `f64`.
const MAX_EXACT: u64 = 1 << 53;

/// Why an optimizer state record could not be encoded or decoded (a record this codec does not
/// support, or arrays and scalars that do not make one).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CodecError(pub String);

impl fmt::Display for CodecError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for CodecError {}

impl serde_ser::Error for CodecError {
    fn custom<T: fmt::Display>(msg: T) -> Self {
        Self(msg.to_string())
    }
}

impl serde_de::Error for CodecError {
    fn custom<T: fmt::Display>(msg: T) -> Self {
        Self(msg.to_string())
    }
}

fn codec<T>(msg: impl Into<String>) -> Result<T, CodecError> {
    Err(CodecError(msg.into()))
}

/// Named float arrays (one per tensor) and scalars of an optimizer state record.
pub type EncodedState = (BTreeMap<String, Vec<f32>>, BTreeMap<String, f64>);

/// A Burn record (e.g. an element-wise optimizer's `SimpleOptimizer::State<1>`) as named
/// `f32` arrays (one per 1-D float tensor, named by dotted field path such as
/// `momentum.moment_1`; a tensor at the root is named `""`) and scalars (numbers, and
/// bools as `0`/`1`, e.g. `momentum.time`); `None` options are left out.
///
/// Supported: structs, options, tuples, vectors and `[T; N]` arrays of 1-D float tensors
/// and numbers: every element-wise `SimpleOptimizer::State<1>` in Burn (`SgdState`,
/// `AdamState`, `AdamWState`, ...). Not supported (a [`CodecError`]):
/// tensors of rank other than 1, int, bool or quantized tensors, strings, enums with data,
/// integers beyond 2^53 (not exact in `f64`). Empty vectors and unit fields encode to
/// nothing, so [`decode_state`] cannot rebuild them.
pub fn encode_state<B: Backend, R: Record<B>>(record: R) -> Result<EncodedState, CodecError> {
    let item = record.into_item::<FullPrecisionSettings>();
    let tree = item.serialize(NodeSer)?;
    let (mut arrays, mut scalars) = (BTreeMap::new(), BTreeMap::new());
    flatten(tree, "", &mut arrays, &mut scalars)?;
    Ok((arrays, scalars))
}

/// Rebuilds a record from [`encode_state`]'s output (e.g. re-assembled for another slice of
/// the parameter): every array must have `len` values (the slice length). Names the
/// record's item does not know are ignored; a missing `Option` becomes `None`. The input is
/// untrusted: names of more than 64 dotted components and integer fields beyond 2^53 (which
/// [`encode_state`] never writes) are [`CodecError`]s.
pub fn decode_state<B: Backend, R: Record<B>>(
    arrays: &BTreeMap<String, Vec<f32>>,
    scalars: &BTreeMap<String, f64>,
    len: usize,
    device: &B::Device,
) -> Result<R, CodecError> {
    let mut root = DNode::Map(BTreeMap::new());
    for (name, values) in arrays {
        if values.len() != len {
            return Err(CodecError(format!(
                "array '{}' has {} values, expected {len}",
                shown(name),
                values.len()
            )));
        }
        insert(&mut root, name, DNode::Tensor(values))?;
    }
    for (name, &v) in scalars {
        insert(&mut root, name, DNode::Scalar(v))?;
    }
    let item = R::Item::<FullPrecisionSettings>::deserialize(root)?;
    Ok(R::from_item(item, device))
}

/// `map` with `prefix` put before every name (e.g. `"state."` to store optimizer state
/// arrays next to `"master"` in a checkpoint's slice entry).
pub fn with_prefix<V>(map: BTreeMap<String, V>, prefix: &str) -> BTreeMap<String, V> {
    map.into_iter()
        .map(|(k, v)| (format!("{prefix}{k}"), v))
        .collect()
}

/// The entries of `map` whose names start with `prefix`, with the prefix removed (the
/// inverse of [`with_prefix`]).
pub fn strip_prefix<V: Clone>(map: &BTreeMap<String, V>, prefix: &str) -> BTreeMap<String, V> {
    map.iter()
        .filter_map(|(k, v)| Some((k.strip_prefix(prefix)?.to_owned(), v.clone())))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn insert_rejects_clashing_names() {
        let mut root = DNode::Map(BTreeMap::new());
        insert(&mut root, "a.b", DNode::Scalar(1.0)).unwrap();
        assert!(insert(&mut root, "a.b.c", DNode::Scalar(1.0)).is_err());
        assert!(insert(&mut root, "a.b", DNode::Scalar(2.0)).is_err());
        assert!(insert(&mut root, "a..c", DNode::Scalar(2.0)).is_err());
        assert!(insert(&mut root, "", DNode::Scalar(2.0)).is_err());
        let mut root = DNode::Map(BTreeMap::new());
        insert(&mut root, "", DNode::Scalar(2.0)).unwrap();
        assert!(insert(&mut root, "x", DNode::Scalar(2.0)).is_err());
    }

    #[test]
    fn typed_hints_round_trip_numbers() {
        #[derive(serde::Serialize, serde::Deserialize, PartialEq, Debug)]
        struct S {
            a: usize,
            b: i32,
            c: f32,
            d: bool,
            e: Option<f64>,
            f: Option<u8>,
            g: (u16, f64),
            h: Vec<i64>,
            z: [f32; 3],
        }
        let s = S {
            a: 7,
            b: -3,
            c: -0.0,
            d: true,
            e: Some(0.5),
            f: None,
            g: (1, f64::INFINITY),
            h: (0..12).collect(),
            z: [1.5, -2.0, f32::MIN_POSITIVE],
        };
        let (mut arrays, mut scalars) = (BTreeMap::new(), BTreeMap::new());
        flatten(s.serialize(NodeSer).unwrap(), "", &mut arrays, &mut scalars).unwrap();
        assert!(arrays.is_empty());
        assert_eq!(scalars["g.1"], f64::INFINITY);
        assert!(!scalars.contains_key("f"));
        let mut root = DNode::Map(BTreeMap::new());
        for (k, &v) in &scalars {
            insert(&mut root, k, DNode::Scalar(v)).unwrap();
        }
        let back = S::deserialize(root).unwrap();
        assert_eq!(back, s);
        assert!(back.c.is_sign_negative());
    }
}

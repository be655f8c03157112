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

use std::collections::BTreeMap;
use std::fmt;

use burn::record::{FullPrecisionSettings, Record};
use burn::tensor::backend::Backend;
use serde::de::value::{MapDeserializer, SeqDeserializer};
use serde::de::{self, IntoDeserializer, Visitor};
use serde::ser::{self, Serialize};
use serde::{Deserialize, Deserializer};

use crate::CheckpointError;

/// Integers up to this magnitude are exact in an `f64`.
const MAX_EXACT: u64 = 1 << 53;

/// A serde error carrying a message.
#[derive(Debug)]
struct CodecError(String);

impl fmt::Display for CodecError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for CodecError {}

impl ser::Error for CodecError {
    fn custom<T: fmt::Display>(msg: T) -> Self {
        Self(msg.to_string())
    }
}

impl de::Error for CodecError {
    fn custom<T: fmt::Display>(msg: T) -> Self {
        Self(msg.to_string())
    }
}

impl From<CodecError> for CheckpointError {
    fn from(e: CodecError) -> Self {
        CheckpointError::Codec(e.0)
    }
}

fn codec<T>(msg: impl Into<String>) -> Result<T, CodecError> {
    Err(CodecError(msg.into()))
}

// ------------------------------------------------------------------------------------------
// Encoding: record item -> tree -> arrays + scalars.

/// What the serializer builds.
enum Node {
    /// `()`, `None`, unit structs: nothing to store.
    Unit,
    Bool(bool),
    U64(u64),
    I64(i64),
    F64(f64),
    Str(String),
    Bytes(Vec<u8>),
    Seq(Vec<Node>),
    /// A map or struct; `name` is the struct's name.
    Map {
        name: Option<&'static str>,
        entries: Vec<(String, Node)>,
    },
}

struct NodeSer;

struct SeqSer(Vec<Node>);

struct MapSer {
    name: Option<&'static str>,
    entries: Vec<(String, Node)>,
    key: Option<String>,
}

impl ser::Serializer for NodeSer {
    type Ok = Node;
    type Error = CodecError;
    type SerializeSeq = SeqSer;
    type SerializeTuple = SeqSer;
    type SerializeTupleStruct = SeqSer;
    type SerializeTupleVariant = ser::Impossible<Node, CodecError>;
    type SerializeMap = MapSer;
    type SerializeStruct = MapSer;
    type SerializeStructVariant = ser::Impossible<Node, CodecError>;

    fn serialize_bool(self, v: bool) -> Result<Node, CodecError> {
        Ok(Node::Bool(v))
    }
    fn serialize_i8(self, v: i8) -> Result<Node, CodecError> {
        Ok(Node::I64(v.into()))
    }
    fn serialize_i16(self, v: i16) -> Result<Node, CodecError> {
        Ok(Node::I64(v.into()))
    }
    fn serialize_i32(self, v: i32) -> Result<Node, CodecError> {
        Ok(Node::I64(v.into()))
    }
    fn serialize_i64(self, v: i64) -> Result<Node, CodecError> {
        Ok(Node::I64(v))
    }
    fn serialize_u8(self, v: u8) -> Result<Node, CodecError> {
        Ok(Node::U64(v.into()))
    }
    fn serialize_u16(self, v: u16) -> Result<Node, CodecError> {
        Ok(Node::U64(v.into()))
    }
    fn serialize_u32(self, v: u32) -> Result<Node, CodecError> {
        Ok(Node::U64(v.into()))
    }
    fn serialize_u64(self, v: u64) -> Result<Node, CodecError> {
        Ok(Node::U64(v))
    }
    fn serialize_f32(self, v: f32) -> Result<Node, CodecError> {
        Ok(Node::F64(v.into()))
    }
    fn serialize_f64(self, v: f64) -> Result<Node, CodecError> {
        Ok(Node::F64(v))
    }
    fn serialize_char(self, v: char) -> Result<Node, CodecError> {
        Ok(Node::Str(v.to_string()))
    }
    fn serialize_str(self, v: &str) -> Result<Node, CodecError> {
        Ok(Node::Str(v.to_owned()))
    }
    fn serialize_bytes(self, v: &[u8]) -> Result<Node, CodecError> {
        Ok(Node::Bytes(v.to_vec()))
    }
    fn serialize_none(self) -> Result<Node, CodecError> {
        Ok(Node::Unit)
    }
    fn serialize_some<T: ?Sized + Serialize>(self, value: &T) -> Result<Node, CodecError> {
        value.serialize(self)
    }
    fn serialize_unit(self) -> Result<Node, CodecError> {
        Ok(Node::Unit)
    }
    fn serialize_unit_struct(self, _name: &'static str) -> Result<Node, CodecError> {
        Ok(Node::Unit)
    }
    fn serialize_unit_variant(
        self,
        _name: &'static str,
        _index: u32,
        variant: &'static str,
    ) -> Result<Node, CodecError> {
        Ok(Node::Str(variant.to_owned()))
    }
    fn serialize_newtype_struct<T: ?Sized + Serialize>(
        self,
        _name: &'static str,
        value: &T,
    ) -> Result<Node, CodecError> {
        value.serialize(self)
    }
    /// Only the variant's name is kept: enough to reject e.g. a `DType::QFloat(..)` tensor
    /// with a clear message; anywhere else a string is an error anyway.
    fn serialize_newtype_variant<T: ?Sized + Serialize>(
        self,
        _name: &'static str,
        _index: u32,
        variant: &'static str,
        _value: &T,
    ) -> Result<Node, CodecError> {
        Ok(Node::Str(variant.to_owned()))
    }
    fn serialize_seq(self, len: Option<usize>) -> Result<SeqSer, CodecError> {
        Ok(SeqSer(Vec::with_capacity(len.unwrap_or(0))))
    }
    fn serialize_tuple(self, len: usize) -> Result<SeqSer, CodecError> {
        Ok(SeqSer(Vec::with_capacity(len)))
    }
    fn serialize_tuple_struct(self, _name: &'static str, len: usize) -> Result<SeqSer, CodecError> {
        Ok(SeqSer(Vec::with_capacity(len)))
    }
    fn serialize_tuple_variant(
        self,
        name: &'static str,
        _index: u32,
        variant: &'static str,
        _len: usize,
    ) -> Result<Self::SerializeTupleVariant, CodecError> {
        codec(format!(
            "enum variant {name}::{variant} with fields is not supported"
        ))
    }
    fn serialize_map(self, _len: Option<usize>) -> Result<MapSer, CodecError> {
        Ok(MapSer {
            name: None,
            entries: Vec::new(),
            key: None,
        })
    }
    fn serialize_struct(self, name: &'static str, len: usize) -> Result<MapSer, CodecError> {
        Ok(MapSer {
            name: Some(name),
            entries: Vec::with_capacity(len),
            key: None,
        })
    }
    fn serialize_struct_variant(
        self,
        name: &'static str,
        _index: u32,
        variant: &'static str,
        _len: usize,
    ) -> Result<Self::SerializeStructVariant, CodecError> {
        codec(format!(
            "enum variant {name}::{variant} with fields is not supported"
        ))
    }
}

impl SeqSer {
    fn push<T: ?Sized + Serialize>(&mut self, value: &T) -> Result<(), CodecError> {
        self.0.push(value.serialize(NodeSer)?);
        Ok(())
    }
}

impl ser::SerializeSeq for SeqSer {
    type Ok = Node;
    type Error = CodecError;
    fn serialize_element<T: ?Sized + Serialize>(&mut self, value: &T) -> Result<(), CodecError> {
        self.push(value)
    }
    fn end(self) -> Result<Node, CodecError> {
        Ok(Node::Seq(self.0))
    }
}

impl ser::SerializeTuple for SeqSer {
    type Ok = Node;
    type Error = CodecError;
    fn serialize_element<T: ?Sized + Serialize>(&mut self, value: &T) -> Result<(), CodecError> {
        self.push(value)
    }
    fn end(self) -> Result<Node, CodecError> {
        Ok(Node::Seq(self.0))
    }
}

impl ser::SerializeTupleStruct for SeqSer {
    type Ok = Node;
    type Error = CodecError;
    fn serialize_field<T: ?Sized + Serialize>(&mut self, value: &T) -> Result<(), CodecError> {
        self.push(value)
    }
    fn end(self) -> Result<Node, CodecError> {
        Ok(Node::Seq(self.0))
    }
}

impl ser::SerializeMap for MapSer {
    type Ok = Node;
    type Error = CodecError;
    fn serialize_key<T: ?Sized + Serialize>(&mut self, key: &T) -> Result<(), CodecError> {
        self.key = Some(match key.serialize(NodeSer)? {
            Node::Str(s) => s,
            Node::U64(v) => v.to_string(),
            Node::I64(v) => v.to_string(),
            _ => return codec("map keys must be strings or integers"),
        });
        Ok(())
    }
    fn serialize_value<T: ?Sized + Serialize>(&mut self, value: &T) -> Result<(), CodecError> {
        let key = self
            .key
            .take()
            .ok_or_else(|| CodecError("map value without a key".into()))?;
        self.entries.push((key, value.serialize(NodeSer)?));
        Ok(())
    }
    fn end(self) -> Result<Node, CodecError> {
        Ok(Node::Map {
            name: self.name,
            entries: self.entries,
        })
    }
}

impl ser::SerializeStruct for MapSer {
    type Ok = Node;
    type Error = CodecError;
    fn serialize_field<T: ?Sized + Serialize>(
        &mut self,
        key: &'static str,
        value: &T,
    ) -> Result<(), CodecError> {
        self.entries
            .push((key.to_owned(), value.serialize(NodeSer)?));
        Ok(())
    }
    fn end(self) -> Result<Node, CodecError> {
        Ok(Node::Map {
            name: self.name,
            entries: self.entries,
        })
    }
}

fn join(prefix: &str, key: &str) -> String {
    if prefix.is_empty() {
        key.to_owned()
    } else {
        format!("{prefix}.{key}")
    }
}

fn shown(name: &str) -> &str {
    if name.is_empty() {
        "(root)"
    } else {
        name
    }
}

/// The values of a serialized `TensorData` at `name`, which must be 1-D `F32`.
fn tensor_values(name: &str, entries: Vec<(String, Node)>) -> Result<Vec<f32>, CodecError> {
    let (mut bytes, mut shape, mut dtype) = (None, None, None);
    for (key, node) in entries {
        match (key.as_str(), node) {
            ("bytes", Node::Bytes(b)) => bytes = Some(b),
            ("shape", Node::Seq(dims)) => shape = Some(dims),
            ("dtype", Node::Str(d)) => dtype = Some(d),
            _ => {
                return codec(format!(
                    "tensor '{}': unexpected field '{key}'",
                    shown(name)
                ))
            }
        }
    }
    let (Some(bytes), Some(shape), Some(dtype)) = (bytes, shape, dtype) else {
        return codec(format!("tensor '{}': incomplete TensorData", shown(name)));
    };
    if dtype != "F32" {
        return codec(format!(
            "tensor '{}' has dtype {dtype}: only float tensors are supported",
            shown(name)
        ));
    }
    let len = match shape.as_slice() {
        [Node::U64(n)] => usize::try_from(*n).ok(),
        _ => None,
    };
    match len {
        Some(len) if len.checked_mul(4) == Some(bytes.len()) => Ok(bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()),
        Some(_) => codec(format!("tensor '{}': byte count mismatch", shown(name))),
        None => codec(format!(
            "tensor '{}' is not 1-D: only 1-D states (SimpleOptimizer::State<1>) are supported",
            shown(name)
        )),
    }
}

fn flatten(
    node: Node,
    name: &str,
    arrays: &mut BTreeMap<String, Vec<f32>>,
    scalars: &mut BTreeMap<String, f64>,
) -> Result<(), CodecError> {
    let mut scalar = |v: f64| {
        scalars.insert(name.to_owned(), v);
        Ok(())
    };
    match node {
        Node::Unit => Ok(()),
        Node::Bool(b) => scalar(if b { 1.0 } else { 0.0 }),
        Node::U64(v) if v <= MAX_EXACT => scalar(v as f64),
        Node::I64(v) if v.unsigned_abs() <= MAX_EXACT => scalar(v as f64),
        Node::U64(_) | Node::I64(_) => codec(format!(
            "integer '{}' beyond 2^53 is not exact as a scalar",
            shown(name)
        )),
        Node::F64(v) => scalar(v),
        Node::Str(s) => codec(format!(
            "'{}' is a string or enum ({s:?}): only tensors and numbers are supported",
            shown(name)
        )),
        Node::Bytes(_) => codec(format!("'{}': raw bytes are not supported", shown(name))),
        Node::Map {
            name: Some("TensorData"),
            entries,
        } => {
            arrays.insert(name.to_owned(), tensor_values(name, entries)?);
            Ok(())
        }
        Node::Map { entries, .. } => {
            for (key, child) in entries {
                if key.is_empty() || key.contains('.') {
                    return codec(format!(
                        "key {key:?} under '{}' is empty or contains '.'",
                        shown(name)
                    ));
                }
                flatten(child, &join(name, &key), arrays, scalars)?;
            }
            Ok(())
        }
        Node::Seq(items) => {
            for (i, child) in items.into_iter().enumerate() {
                flatten(child, &join(name, &i.to_string()), arrays, scalars)?;
            }
            Ok(())
        }
    }
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
/// `AdamState`, `AdamWState`, ...). Not supported (a [`CheckpointError::Codec`] error):
/// tensors of rank other than 1, int, bool or quantized tensors, strings, enums with data,
/// integers beyond 2^53 (not exact in `f64`). Empty vectors and unit fields encode to
/// nothing, so [`decode_state`] cannot rebuild them.
pub fn encode_state<B: Backend, R: Record<B>>(record: R) -> Result<EncodedState, CheckpointError> {
    let item = record.into_item::<FullPrecisionSettings>();
    let tree = item.serialize(NodeSer)?;
    let (mut arrays, mut scalars) = (BTreeMap::new(), BTreeMap::new());
    flatten(tree, "", &mut arrays, &mut scalars)?;
    Ok((arrays, scalars))
}

// ------------------------------------------------------------------------------------------
// Decoding: arrays + scalars -> tree -> record item.

/// What the deserializer reads.
enum DNode<'a> {
    Tensor(&'a [f32]),
    Scalar(f64),
    Map(BTreeMap<String, DNode<'a>>),
    // The parts of a tensor, in the shape `TensorData` deserializes.
    Bytes(Vec<u8>),
    Dims(Vec<usize>),
    Str(&'static str),
}

fn insert<'a>(root: &mut DNode<'a>, name: &str, leaf: DNode<'a>) -> Result<(), CodecError> {
    if name.is_empty() {
        return match root {
            DNode::Map(m) if m.is_empty() => {
                *root = leaf;
                Ok(())
            }
            _ => codec("a value at the root ('') cannot share the state with other names"),
        };
    }
    let mut node = root;
    let mut parts = name.split('.').peekable();
    while let Some(part) = parts.next() {
        let DNode::Map(map) = node else {
            return codec(format!("'{name}' lies under a tensor or scalar"));
        };
        if part.is_empty() {
            return codec(format!("'{name}' has an empty component"));
        }
        if parts.peek().is_none() {
            if map.insert(part.to_owned(), leaf).is_some() {
                return codec(format!("'{name}' is both an array and a scalar"));
            }
            return Ok(());
        }
        node = map
            .entry(part.to_owned())
            .or_insert_with(|| DNode::Map(BTreeMap::new()));
    }
    Ok(())
}

impl<'de> IntoDeserializer<'de, CodecError> for DNode<'_> {
    type Deserializer = Self;
    fn into_deserializer(self) -> Self {
        self
    }
}

impl DNode<'_> {
    fn kind(&self) -> &'static str {
        match self {
            DNode::Tensor(_) => "a tensor",
            DNode::Scalar(_) => "a scalar",
            DNode::Map(_) => "a group of fields",
            DNode::Bytes(_) => "bytes",
            DNode::Dims(_) => "a shape",
            DNode::Str(_) => "a string",
        }
    }

    fn expected(self, what: &str) -> CodecError {
        CodecError(format!("expected {what}, found {}", self.kind()))
    }

    /// An integral scalar, or `None`.
    fn integer(&self) -> Option<f64> {
        match *self {
            DNode::Scalar(v) if v.is_finite() && v.fract() == 0.0 => Some(v),
            _ => None,
        }
    }
}

/// Visits an integral `v` as `u64` (non-negative) or `i64`.
fn visit_integer<'de, V: Visitor<'de>>(v: f64, visitor: V) -> Result<V::Value, CodecError> {
    // 2^64 and -2^63, exact in f64.
    if (0.0..18_446_744_073_709_551_616.0).contains(&v) {
        visitor.visit_u64(v as u64)
    } else if (-9_223_372_036_854_775_808.0..0.0).contains(&v) {
        visitor.visit_i64(v as i64)
    } else {
        codec(format!("integer {v} out of range"))
    }
}

macro_rules! integer_hint {
    ($($method:ident)*) => {$(
        fn $method<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, CodecError> {
            match self.integer() {
                Some(v) => visit_integer(v, visitor),
                None => Err(self.expected("an integer")),
            }
        }
    )*};
}

macro_rules! forward_to_any {
    ($($method:ident)*) => {$(
        fn $method<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, CodecError> {
            self.deserialize_any(visitor)
        }
    )*};
}

impl<'de> Deserializer<'de> for DNode<'_> {
    type Error = CodecError;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, CodecError> {
        match self {
            DNode::Scalar(v) if v.is_finite() && v.fract() == 0.0 => visit_integer(v, visitor),
            DNode::Scalar(v) => visitor.visit_f64(v),
            DNode::Map(map) => {
                let mut access = MapDeserializer::new(map.into_iter());
                let value = visitor.visit_map(&mut access)?;
                access.end()?;
                Ok(value)
            }
            DNode::Tensor(values) => {
                let entries = [
                    (
                        "bytes".to_owned(),
                        DNode::Bytes(values.iter().flat_map(|v| v.to_le_bytes()).collect()),
                    ),
                    ("shape".to_owned(), DNode::Dims(vec![values.len()])),
                    ("dtype".to_owned(), DNode::Str("F32")),
                ];
                let mut access = MapDeserializer::new(entries.into_iter());
                let value = visitor.visit_map(&mut access)?;
                access.end()?;
                Ok(value)
            }
            DNode::Bytes(bytes) => visitor.visit_byte_buf(bytes),
            DNode::Dims(dims) => {
                let mut access = SeqDeserializer::new(dims.into_iter());
                let value = visitor.visit_seq(&mut access)?;
                access.end()?;
                Ok(value)
            }
            DNode::Str(s) => visitor.visit_str(s),
        }
    }

    fn deserialize_bool<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, CodecError> {
        match self {
            DNode::Scalar(v) if v == 0.0 || v == 1.0 => visitor.visit_bool(v == 1.0),
            other => Err(other.expected("a bool (scalar 0 or 1)")),
        }
    }

    integer_hint!(
        deserialize_i8 deserialize_i16 deserialize_i32 deserialize_i64
        deserialize_u8 deserialize_u16 deserialize_u32 deserialize_u64
    );

    fn deserialize_f32<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, CodecError> {
        self.deserialize_f64(visitor)
    }

    fn deserialize_f64<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, CodecError> {
        match self {
            DNode::Scalar(v) => visitor.visit_f64(v),
            other => Err(other.expected("a number")),
        }
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, CodecError> {
        visitor.visit_some(self)
    }

    fn deserialize_unit<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, CodecError> {
        match self {
            DNode::Map(m) if m.is_empty() => visitor.visit_unit(),
            other => Err(other.expected("nothing (unit)")),
        }
    }

    fn deserialize_unit_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        visitor: V,
    ) -> Result<V::Value, CodecError> {
        self.deserialize_unit(visitor)
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        visitor: V,
    ) -> Result<V::Value, CodecError> {
        visitor.visit_newtype_struct(self)
    }

    /// Sequences were flattened to fields `0`, `1`, ...: read them back in numeric order.
    fn deserialize_seq<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, CodecError> {
        let map = match self {
            DNode::Map(map) => map,
            other => return other.deserialize_any(visitor),
        };
        let mut items: Vec<(usize, DNode<'_>)> = Vec::with_capacity(map.len());
        for (key, node) in map {
            match key.parse::<usize>() {
                Ok(i) if i.to_string() == key => items.push((i, node)),
                _ => return codec(format!("expected sequence indices, found field '{key}'")),
            }
        }
        items.sort_unstable_by_key(|(i, _)| *i);
        if items.iter().enumerate().any(|(n, (i, _))| n != *i) {
            return codec("sequence indices are not 0, 1, 2, ...");
        }
        let mut access = SeqDeserializer::new(items.into_iter().map(|(_, node)| node));
        let value = visitor.visit_seq(&mut access)?;
        access.end()?;
        Ok(value)
    }

    fn deserialize_tuple<V: Visitor<'de>>(
        self,
        _len: usize,
        visitor: V,
    ) -> Result<V::Value, CodecError> {
        self.deserialize_seq(visitor)
    }

    fn deserialize_tuple_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        _len: usize,
        visitor: V,
    ) -> Result<V::Value, CodecError> {
        self.deserialize_seq(visitor)
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        _name: &'static str,
        _variants: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, CodecError> {
        match self {
            DNode::Str(s) => visitor.visit_enum(s.into_deserializer()),
            other => Err(other.expected("a unit enum variant")),
        }
    }

    fn deserialize_ignored_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, CodecError> {
        visitor.visit_unit()
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        _fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, CodecError> {
        self.deserialize_any(visitor)
    }

    forward_to_any!(
        deserialize_i128 deserialize_u128 deserialize_char deserialize_str deserialize_string
        deserialize_bytes deserialize_byte_buf deserialize_map deserialize_identifier
    );
}

/// Rebuilds a record from [`encode_state`]'s output (e.g. re-assembled for another slice of
/// the parameter): every array must have `len` values (the slice length). Names the
/// record's item does not know are ignored; a missing `Option` becomes `None`.
pub fn decode_state<B: Backend, R: Record<B>>(
    arrays: &BTreeMap<String, Vec<f32>>,
    scalars: &BTreeMap<String, f64>,
    len: usize,
    device: &B::Device,
) -> Result<R, CheckpointError> {
    let mut root = DNode::Map(BTreeMap::new());
    for (name, values) in arrays {
        if values.len() != len {
            return Err(CheckpointError::Codec(format!(
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
/// arrays next to `"master"` in a [`SliceEntry`](super::SliceEntry)).
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

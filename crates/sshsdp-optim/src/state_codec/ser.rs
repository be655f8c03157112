//! Encoding: a record item serialized into a small tree (tensor bytes stay bytes), then
//! flattened into named arrays and scalars.

use std::collections::BTreeMap;

use serde::ser::{self, Serialize};

use super::{codec, CodecError, MAX_EXACT};

// ------------------------------------------------------------------------------------------
// Encoding: record item -> tree -> arrays + scalars.

/// What the serializer builds.
pub(super) enum Node {
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

pub(super) struct NodeSer;

pub(super) struct SeqSer(Vec<Node>);

pub(super) struct MapSer {
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

pub(super) fn shown(name: &str) -> &str {
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

pub(super) fn flatten(
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

//! Decoding: named arrays and scalars rebuilt into a tree, then deserialized into a record item
//! with the item's own type hints.

use std::collections::BTreeMap;

use serde::de::value::{MapDeserializer, SeqDeserializer};
use serde::de::{IntoDeserializer, Visitor};
use serde::Deserializer;

use super::{codec, CodecError, MAX_EXACT};

/// The most dotted components a state name may have. A name read from a file becomes a chain
/// of nested nodes, one per component, whose drop recurses; Burn's optimizer states nest two
/// or three levels deep, so 64 is ample and keeps a hostile name from overflowing the stack.
pub(super) const MAX_NAME_DEPTH: usize = 64;

// ------------------------------------------------------------------------------------------
// Decoding: arrays + scalars -> tree -> record item.

/// What the deserializer reads.
pub(super) enum DNode<'a> {
    Tensor(&'a [f32]),
    Scalar(f64),
    Map(BTreeMap<String, DNode<'a>>),
    // The parts of a tensor, in the shape `TensorData` deserializes.
    Bytes(Vec<u8>),
    Dims(Vec<usize>),
    Str(&'static str),
}

pub(super) fn insert<'a>(
    root: &mut DNode<'a>,
    name: &str,
    leaf: DNode<'a>,
) -> Result<(), CodecError> {
    if name.is_empty() {
        return match root {
            DNode::Map(m) if m.is_empty() => {
                *root = leaf;
                Ok(())
            }
            _ => codec("a value at the root ('') cannot share the state with other names"),
        };
    }
    if name.split('.').nth(MAX_NAME_DEPTH).is_some() {
        return codec(format!(
            "'{}…' has more than {MAX_NAME_DEPTH} components",
            name.chars().take(32).collect::<String>()
        ));
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

    /// An integral scalar of magnitude at most 2^53 (the only integers [`super::encode_state`]
    /// writes), or why not.
    fn exact_integer(self) -> Result<f64, CodecError> {
        match self.integer() {
            Some(v) if v.abs() <= MAX_EXACT as f64 => Ok(v),
            Some(v) => codec(format!(
                "integer {v} beyond 2^53 (encoding never writes one)"
            )),
            None => Err(self.expected("an integer")),
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
            visit_integer(self.exact_integer()?, visitor)
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

//! Parameter descriptions: path, shape, dtype and the role that decides which optimizer family
//! steps it (whole-matrix or element-wise).

use std::cmp::Ordering;

use serde::{Deserialize, Serialize};

use crate::PlanError;

/// Storage type of a parameter as the model defines it (the update parameters are always fp32).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum DType {
    /// IEEE binary32.
    F32,
    /// IEEE binary16.
    F16,
    /// bfloat16.
    Bf16,
}

impl DType {
    /// Bytes per element.
    pub fn size_bytes(self) -> u64 {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::Bf16 => 2,
        }
    }
}

/// How the optimizer sees a parameter.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Role {
    /// Stepped whole by a matrix optimizer such as Muon; must be 2-D.
    Matrix,
    /// Stepped element by element (AdamW, SGD…); any split is allowed.
    Elementwise,
}

/// The default role rule: a 2-D parameter is a [`Role::Matrix`] unless the module holding it is
/// of an element-wise type (a burn-nn `Embedding`, whatever it is called) or one of its path
/// segments names an embedding or an output head; everything else is [`Role::Elementwise`].
///
/// The module's type says more than its field name: a lookup table is not a linear map, so
/// Muon's orthogonalisation does not apply to it ([`RoleRule::role_in`]; the registration's
/// module visitor sees the type). Names are the fallback, for modules of other types and for
/// callers that know only paths ([`RoleRule::role_of`]): a segment matches when one of its
/// `_`-separated words equals a marker, so `lm_head`, `tok_embeddings` and `wte` match while
/// `multihead` or `heads` do not. Callers with other conventions build their own rule or
/// override single specs with [`ParamSpec::with_role`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RoleRule {
    /// Words that mark a 2-D parameter as element-wise.
    pub elementwise_markers: Vec<String>,
    /// Module types whose parameters are element-wise (`Embedding`), by their type name.
    #[serde(default)]
    pub elementwise_modules: Vec<String>,
}

impl Default for RoleRule {
    fn default() -> Self {
        let markers = [
            "embed",
            "embeds",
            "embedding",
            "embeddings",
            "emb",
            "wte",
            "wpe",
            "head",
        ];
        Self {
            elementwise_markers: markers.iter().map(|m| m.to_string()).collect(),
            elementwise_modules: vec!["Embedding".to_string()],
        }
    }
}

impl RoleRule {
    /// The role this rule gives a parameter at `path` with `shape`, by its path alone.
    pub fn role_of(&self, path: &str, shape: &[usize]) -> Role {
        self.role_in(path, shape, None)
    }

    /// The role this rule gives a parameter at `path` with `shape` held by a module of type
    /// `module` (its type name, e.g. `Embedding`; `None` when unknown): element-wise for the
    /// rule's module types, else as [`RoleRule::role_of`].
    pub fn role_in(&self, path: &str, shape: &[usize], module: Option<&str>) -> Role {
        if shape.len() != 2 {
            return Role::Elementwise;
        }
        if module.is_some_and(|m| self.elementwise_modules.iter().any(|e| e == m)) {
            return Role::Elementwise;
        }
        let marked = path
            .split('.')
            .flat_map(|segment| segment.split('_'))
            .any(|word| {
                self.elementwise_markers
                    .iter()
                    .any(|m| word.eq_ignore_ascii_case(m))
            });
        if marked {
            Role::Elementwise
        } else {
            Role::Matrix
        }
    }
}

/// The module type named by a Burn module visitor's container description (`Struct:Linear` →
/// `Linear`, `Enum:MyEnum` → `MyEnum`); `None` for `Vec`, tuples and arrays.
pub fn module_type(container: &str) -> Option<&str> {
    container
        .strip_prefix("Struct:")
        .or_else(|| container.strip_prefix("Enum:"))
}

/// One parameter as the planner sees it.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ParamSpec {
    /// Module path, e.g. `layers.3.attn.query.weight`; the key all ranks agree on.
    pub path: String,
    /// Shape in the model's own layout (Burn's `Linear` stores `[d_input, d_output]`).
    pub shape: Vec<usize>,
    /// Storage type in the model.
    pub dtype: DType,
    /// Optimizer role.
    pub role: Role,
    /// Position in execution order when known (recorded in the first step). Parameters with
    /// an order come first, by order; the rest follow in natural path order.
    pub order: Option<u64>,
    /// Frozen (`require_grad` false when planned): it never receives a gradient, so it never
    /// shares a bucket with a trainable parameter (a bucket of frozen parameters is never
    /// reduced). Absent from the serialized plan when false, so plans of models without frozen
    /// parameters are unchanged.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub frozen: bool,
}

impl ParamSpec {
    /// A spec whose role comes from [`RoleRule::default`].
    pub fn new(path: impl Into<String>, shape: impl Into<Vec<usize>>, dtype: DType) -> Self {
        let path = path.into();
        let shape = shape.into();
        let role = RoleRule::default().role_of(&path, &shape);
        Self {
            path,
            shape,
            dtype,
            role,
            order: None,
            frozen: false,
        }
    }

    /// The same spec with an explicit role.
    pub fn with_role(mut self, role: Role) -> Self {
        self.role = role;
        self
    }

    /// The same spec marked frozen (or not): see [`ParamSpec::frozen`].
    pub fn with_frozen(mut self, frozen: bool) -> Self {
        self.frozen = frozen;
        self
    }

    /// The same spec with its position in execution order.
    pub fn with_order(mut self, order: u64) -> Self {
        self.order = Some(order);
        self
    }

    /// Number of elements (saturating; [`ParamSpec::validate`] rejects overflow).
    pub fn numel(&self) -> u64 {
        self.shape
            .iter()
            .fold(1u64, |acc, &d| acc.saturating_mul(d as u64))
    }

    /// `(rows, cols)` of the 2-D view: all leading dimensions folded into rows, the last
    /// (contiguous) dimension as columns. A 1-D parameter is one row.
    pub fn matrix_dims(&self) -> (u64, u64) {
        let cols = *self.shape.last().unwrap_or(&1) as u64;
        let rows = self.shape[..self.shape.len().saturating_sub(1)]
            .iter()
            .fold(1u64, |acc, &d| acc.saturating_mul(d as u64));
        (rows, cols)
    }

    /// Checks the spec on its own: non-empty path, at least one dimension, none zero, size
    /// fits 64 bits, and `Matrix` only on 2-D shapes.
    pub fn validate(&self) -> Result<(), PlanError> {
        if self.path.is_empty() {
            return Err(PlanError::EmptyPath);
        }
        if self.shape.is_empty() || self.shape.contains(&0) {
            return Err(PlanError::ZeroSized {
                path: self.path.clone(),
                shape: self.shape.clone(),
            });
        }
        let fits = self
            .shape
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d as u64))
            .is_some_and(|n| n.checked_mul(8).is_some());
        if !fits {
            return Err(PlanError::ShapeOverflow {
                path: self.path.clone(),
                shape: self.shape.clone(),
            });
        }
        if self.role == Role::Matrix && self.shape.len() != 2 {
            return Err(PlanError::MatrixNot2d {
                path: self.path.clone(),
                shape: self.shape.clone(),
            });
        }
        Ok(())
    }
}

/// Canonical plan order: specs with an execution order first (by order), then the rest by
/// natural path order (`layers.9` before `layers.10`), ties by path bytes.
pub(crate) fn canonical_cmp(a: &ParamSpec, b: &ParamSpec) -> Ordering {
    match (a.order, b.order) {
        (Some(x), Some(y)) => x.cmp(&y),
        (Some(_), None) => Ordering::Less,
        (None, Some(_)) => Ordering::Greater,
        (None, None) => Ordering::Equal,
    }
    .then_with(|| natural_cmp(&a.path, &b.path))
    .then_with(|| a.path.cmp(&b.path))
}

/// Compares strings with runs of ASCII digits compared as numbers.
pub(crate) fn natural_cmp(a: &str, b: &str) -> Ordering {
    let (mut a, mut b) = (a.as_bytes(), b.as_bytes());
    loop {
        match (a.first(), b.first()) {
            (None, None) => return Ordering::Equal,
            (None, Some(_)) => return Ordering::Less,
            (Some(_), None) => return Ordering::Greater,
            (Some(x), Some(y)) if x.is_ascii_digit() && y.is_ascii_digit() => {
                let (na, ra) = split_digits(a);
                let (nb, rb) = split_digits(b);
                let ord = na
                    .trim_start_matches('0')
                    .len()
                    .cmp(&nb.trim_start_matches('0').len())
                    .then_with(|| na.trim_start_matches('0').cmp(nb.trim_start_matches('0')));
                if ord != Ordering::Equal {
                    return ord;
                }
                a = ra;
                b = rb;
            }
            (Some(x), Some(y)) => {
                if x != y {
                    return x.cmp(y);
                }
                a = &a[1..];
                b = &b[1..];
            }
        }
    }
}

fn split_digits(s: &[u8]) -> (&str, &[u8]) {
    let n = s.iter().take_while(|c| c.is_ascii_digit()).count();
    // Digits are ASCII, so this prefix is valid UTF-8.
    (std::str::from_utf8(&s[..n]).unwrap_or(""), &s[n..])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A module's type routes its parameters whatever they are called; names stay the fallback.
    #[test]
    fn module_types_route_before_names() {
        let rule = RoleRule::default();
        let embedding = module_type("Struct:Embedding");
        assert_eq!(embedding, Some("Embedding"));
        assert_eq!(
            rule.role_in("pos.weight", &[8, 16], embedding),
            Role::Elementwise
        );
        assert_eq!(rule.role_of("pos.weight", &[8, 16]), Role::Matrix);
        let linear = module_type("Struct:Linear");
        assert_eq!(rule.role_in("up.weight", &[16, 64], linear), Role::Matrix);
        assert_eq!(
            rule.role_in("lm_head.weight", &[16, 64], linear),
            Role::Elementwise
        );
        assert_eq!(
            rule.role_in("pos.weight", &[8], embedding),
            Role::Elementwise
        );
        assert_eq!(module_type("Vec"), None);
        assert_eq!(
            rule.role_in("x.weight", &[8, 16], module_type("Vec")),
            Role::Matrix
        );
        // A rule serialised before module types were known reads back without them.
        let old: RoleRule = serde_json::from_str(r#"{"elementwise_markers":["head"]}"#).unwrap();
        assert!(old.elementwise_modules.is_empty());
    }

    #[test]
    fn default_roles() {
        let rule = RoleRule::default();
        assert_eq!(
            rule.role_of("layers.0.attn.query.weight", &[64, 64]),
            Role::Matrix
        );
        assert_eq!(
            rule.role_of("layers.0.multihead.weight", &[64, 64]),
            Role::Matrix
        );
        assert_eq!(
            rule.role_of("tok_embeddings.weight", &[100, 64]),
            Role::Elementwise
        );
        assert_eq!(
            rule.role_of("embedding.weight", &[100, 64]),
            Role::Elementwise
        );
        assert_eq!(
            rule.role_of("lm_head.weight", &[64, 100]),
            Role::Elementwise
        );
        assert_eq!(rule.role_of("wte.weight", &[100, 64]), Role::Elementwise);
        assert_eq!(
            rule.role_of("layers.0.norm.gamma", &[64]),
            Role::Elementwise
        );
        assert_eq!(
            rule.role_of("conv.weight", &[8, 3, 3, 3]),
            Role::Elementwise
        );
    }

    #[test]
    fn natural_order() {
        let mut paths = vec![
            "layers.10.w",
            "layers.9.w",
            "layers.1.w",
            "embed",
            "layers.09.x",
        ];
        paths.sort_by(|a, b| natural_cmp(a, b).then_with(|| a.cmp(b)));
        assert_eq!(
            paths,
            vec![
                "embed",
                "layers.1.w",
                "layers.9.w",
                "layers.09.x",
                "layers.10.w"
            ]
        );
    }

    #[test]
    fn validation_errors() {
        let ok = ParamSpec::new("a", vec![2, 3], DType::F32);
        assert!(ok.validate().is_ok());
        assert_eq!(ok.numel(), 6);
        assert_eq!(ok.matrix_dims(), (2, 3));
        assert!(matches!(
            ParamSpec::new("", vec![2], DType::F32).validate(),
            Err(PlanError::EmptyPath)
        ));
        assert!(matches!(
            ParamSpec::new("a", vec![2, 0], DType::F32).validate(),
            Err(PlanError::ZeroSized { .. })
        ));
        assert!(matches!(
            ParamSpec::new("a", Vec::<usize>::new(), DType::F32).validate(),
            Err(PlanError::ZeroSized { .. })
        ));
        assert!(matches!(
            ParamSpec::new("a", vec![4], DType::F32)
                .with_role(Role::Matrix)
                .validate(),
            Err(PlanError::MatrixNot2d { .. })
        ));
        assert!(matches!(
            ParamSpec::new("a", vec![usize::MAX, 4], DType::F32).validate(),
            Err(PlanError::ShapeOverflow { .. })
        ));
    }
}

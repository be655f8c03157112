//! The user's module as Burn builds it, read and rewritten by path: parameters (names, shapes,
//! frozen flags, values), buffers (module state that is not a parameter, such as BatchNorm's
//! running statistics) and the autodiff leaves that hand gradients to the runtime.
//!
//! Below the runtime's public handle and registration (`shard/`), above the backend's tensor
//! types; it knows nothing of storage or communication.

pub(crate) mod buffers;
pub(crate) mod leaves;
pub(crate) mod params;
pub(crate) mod paths;

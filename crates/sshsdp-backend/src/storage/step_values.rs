//! What an update step holds of a piece, wherever it lives: the fp32 master moved out of its
//! bucket ([`TakenMaster`]) and the values the optimizer sees ([`PieceValues`]: master and
//! gradient side by side, on the host or the device). Their placement branches are here, so
//! the update stage (`runtime/update.rs`) has none.

use std::ops::{Deref, DerefMut, Range};

use burn_backend::{Backend, TensorMetadata};

use super::roles::F32Buf;
use crate::config::Placement;
use crate::error::HsdpError;
use crate::traffic::Traffic;

/// A piece's fp32 master weights and world-averaged gradient, where they live, held by the
/// update step (moved out of the runtime for it).
pub enum PieceValues<B: Backend> {
    /// Host memory.
    Host {
        /// Master elements (padding elements included), updated in place (a `[f32]`).
        master: HostMaster,
        /// Their gradient (empty when handing out masters only).
        grad: Vec<f32>,
    },
    /// Tensors on the decorated backend's device (1-D, the piece's element count).
    Device {
        /// Master elements; the optimizer replaces the tensor with the updated one.
        master: B::FloatTensorPrimitive,
        /// Their gradient.
        grad: B::FloatTensorPrimitive,
    },
}

/// A piece's fp32 master elements on the host during an update step: dereferences to the
/// piece's `[f32]`. (In the f32 runtime format with host masters they are the runtime shard's
/// own elements, which the step holds whole.)
pub struct HostMaster {
    elements: Vec<f32>,
    slot: Range<usize>,
    /// Whether `elements` is the runtime shard (see above).
    in_shard: bool,
}

impl Deref for HostMaster {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        &self.elements[self.slot.clone()]
    }
}

impl DerefMut for HostMaster {
    fn deref_mut(&mut self) -> &mut [f32] {
        &mut self.elements[self.slot.clone()]
    }
}

/// A piece's fp32 master while an update step holds it.
pub(crate) enum TakenMaster<B: Backend> {
    /// The separate master, where the step wants it.
    Apart(F32Buf<B>),
    /// The runtime shard's fp32 elements (f32 format, host masters): the piece is `slot`.
    InShard {
        /// The shard's elements.
        elements: Vec<f32>,
        /// The piece's elements among them.
        slot: Range<usize>,
    },
}

impl<B: Backend> TakenMaster<B> {
    /// The values the optimizer sees: this master with `grad`, moved to where the master is
    /// (staging, charged to `traffic`). On an error the master comes back with it.
    pub fn with_grad(
        self,
        grad: F32Buf<B>,
        device: &B::Device,
        traffic: &Traffic,
    ) -> Result<PieceValues<B>, (Self, HsdpError)> {
        let at = match &self {
            TakenMaster::Apart(master) => master.placement(),
            TakenMaster::InShard { .. } => Placement::Host,
        };
        let grad = match grad.to(at, device, traffic) {
            Ok(grad) => grad,
            Err(e) => return Err((self, e)),
        };
        Ok(match (self, grad) {
            (TakenMaster::Apart(F32Buf::Device(master)), F32Buf::Device(grad)) => {
                PieceValues::Device { master, grad }
            }
            (TakenMaster::Apart(F32Buf::Host(elements)), F32Buf::Host(grad)) => {
                let slot = 0..elements.len();
                let master = HostMaster {
                    elements,
                    slot,
                    in_shard: false,
                };
                PieceValues::Host { master, grad }
            }
            (TakenMaster::InShard { elements, slot }, F32Buf::Host(grad)) => {
                let master = HostMaster {
                    elements,
                    slot,
                    in_shard: true,
                };
                PieceValues::Host { master, grad }
            }
            (master, _) => {
                let e = HsdpError::Failed("a gradient moved apart from its master".into());
                return Err((master, e));
            }
        })
    }
}

impl<B: Backend> PieceValues<B> {
    /// The master, as its bucket takes it back (the gradient dropped).
    pub(crate) fn into_master(self) -> TakenMaster<B> {
        match self {
            PieceValues::Device { master, .. } => TakenMaster::Apart(F32Buf::Device(master)),
            PieceValues::Host { master, .. } if master.in_shard => TakenMaster::InShard {
                elements: master.elements,
                slot: master.slot,
            },
            PieceValues::Host { master, .. } => TakenMaster::Apart(F32Buf::Host(master.elements)),
        }
    }

    /// The device master, as it is now (`None` on the host): what a deferred verdict puts back
    /// when the step must not apply.
    pub(crate) fn device_master(&self) -> Option<&B::FloatTensorPrimitive> {
        match self {
            PieceValues::Device { master, .. } => Some(master),
            PieceValues::Host { .. } => None,
        }
    }

    /// The device gradient (`None` on the host).
    pub(crate) fn device_grad(&self) -> Option<&B::FloatTensorPrimitive> {
        match self {
            PieceValues::Device { grad, .. } => Some(grad),
            PieceValues::Host { .. } => None,
        }
    }

    /// Multiplies the device gradient by `factor` (a 1-element tensor, broadcast); nothing on
    /// the host.
    pub(crate) fn scale_device_grad(&mut self, factor: &B::FloatTensorPrimitive) {
        if let PieceValues::Device { grad, .. } = self {
            let n = grad.shape().num_elements();
            let factor = B::float_expand(factor.clone(), [n].into());
            *grad = B::float_mul(grad.clone(), factor);
        }
    }

    /// Replaces the device master with `master` (nothing on the host).
    pub(crate) fn set_device_master(&mut self, master: B::FloatTensorPrimitive) {
        if let PieceValues::Device { master: m, .. } = self {
            *m = master;
        }
    }

    /// Number of elements (padding included).
    pub fn len(&self) -> usize {
        match self {
            PieceValues::Host { master, .. } => master.len(),
            PieceValues::Device { master, .. } => master.shape().num_elements(),
        }
    }

    /// Whether the piece has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The host master and gradient slices, if the values are on the host.
    pub fn host(&mut self) -> Option<(&mut [f32], &[f32])> {
        match self {
            PieceValues::Host { master, grad } => Some((&mut **master, &**grad)),
            PieceValues::Device { .. } => None,
        }
    }
}

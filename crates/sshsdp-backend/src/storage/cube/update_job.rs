//! An update-group collective of an f32 tensor on the device (an optimizer's exchange: Muon's
//! split matrices), run by the engine that moves device memory (NCCL, or ranks of this process
//! sharing the device: `exchange.rs`): the all-reduce sums the tensor in place; the
//! all-to-all-v sends from it into a receive buffer allocated with the job. The ordering is the
//! reduction's (`reduce.rs`): the job is made on the model thread once the kernels writing the
//! tensor are queued (on fusion [`to_cube`] drains them first), with a [`stream_mark`] of that
//! moment, so the lane's engine waits for those writes; the receive buffer is allocated there
//! too, on the model thread's stream, so no write of the model stream queued before can reach
//! it after the engine's; the model thread reads the result after the lane's reply, when the
//! engine's work is complete.

use std::sync::Arc;

use burn_backend::{Backend, DType, TensorMetadata};
use burn_cubecl::CubeRuntime;
use cubecl::client::ComputeClient;
use cubecl::server::Handle;
use sshsdp_comm::{CommResult, ElementKind};

use super::adapter::{to_cube, Inner};
use super::codec::CubeUnits;
use super::exchange::{CubeBuffers, Span};
use super::{for_each_runtime, is_cube, lane_client, stream_mark};
use crate::lanes::comm::DeviceBuffers;
use crate::lanes::DeviceGatherJob;
use crate::runtime_units::{DeviceUnits, Elems};
use crate::traffic::Traffic;

/// The job of an update-group collective on `tensor` (f32, 1-D): summed in place when `recv`
/// is `None`, else sent into a new receive buffer of `recv` elements; `None` if `B` is not a
/// CubeCL backend this build supports.
pub(crate) fn update_job_if_cube<B: Backend>(
    tensor: B::FloatTensorPrimitive,
    recv: Option<usize>,
    traffic: &Arc<Traffic>,
) -> Option<Box<dyn DeviceGatherJob>> {
    for_each_runtime!(R => {
        if is_cube::<B, R>() {
            let mut cube = to_cube::<B, R>(tensor);
            if cube.dtype != DType::F32 {
                cube = <Inner<R> as burn_backend::ops::FloatTensorOps<Inner<R>>>::float_cast(
                    cube,
                    burn_backend::FloatDType::F32,
                );
            }
            cube = burn_cubecl::kernel::into_contiguous(cube);
            if recv.is_none() && !cube.can_mut() {
                // Another tensor shares the buffer: the engine sums a copy in place.
                cube = <Inner<R> as burn_backend::ops::FloatTensorOps<Inner<R>>>::float_mul_scalar(
                    cube,
                    1f32.into(),
                );
            }
            let client = lane_client(cube.client.clone());
            let written = stream_mark(&client);
            let (send, handle, len) = match recv {
                // At least one word: a collective that receives nothing still names a buffer.
                Some(n) => (Some(cube.handle), client.empty(4 * n.max(1)), n),
                None => {
                    let n = cube.shape().num_elements();
                    (None, cube.handle, n)
                }
            };
            return Some(Box::new(UpdateJob::<R> {
                client,
                send,
                handle,
                len,
                written: Some(written),
                buffers: None,
                traffic: traffic.clone(),
            }));
        }
    });
    let _ = (tensor, recv, traffic);
    None
}

/// One rank's buffers of an update-group collective on their way through the replica lane.
struct UpdateJob<R: CubeRuntime> {
    client: ComputeClient<R>,
    /// The send buffer when apart from the result (the all-to-all-v).
    send: Option<Handle>,
    /// The result: the buffer summed in place, or the receive buffer.
    handle: Handle,
    /// Elements of the result.
    len: usize,
    /// A mark made once the buffer's writes were queued (see the module docs).
    written: Option<Handle>,
    buffers: Option<CubeBuffers<R>>,
    /// Charged with each host wait for the device.
    traffic: Arc<Traffic>,
}

impl<R: CubeRuntime> DeviceGatherJob for UpdateJob<R> {
    fn count(&self) -> usize {
        self.len
    }

    fn buffers(&mut self) -> CommResult<&mut dyn DeviceBuffers> {
        let (client, kind) = (self.client.clone(), ElementKind::F32);
        let result = Span::of(self.handle.clone());
        let buffers = match &self.send {
            Some(send) => CubeBuffers::apart(client, kind, Span::of(send.clone()), result),
            None => CubeBuffers::in_place(client, kind, result),
        };
        let buffers = buffers.after(self.written.clone()).charging(&self.traffic);
        Ok(self.buffers.insert(buffers))
    }

    fn into_units(self: Box<Self>) -> DeviceUnits {
        let job = *self;
        drop(job.buffers);
        DeviceUnits {
            buffer: Box::new(CubeUnits::<R>::new(job.client, job.handle)),
            len: job.len,
            kind: Elems::F32(Vec::new()),
            narrowed: None,
        }
    }
}

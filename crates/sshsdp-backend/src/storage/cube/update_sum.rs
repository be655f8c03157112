//! An update-group all-reduce of an f32 tensor on the device (an optimizer's exchange: Muon's
//! split matrices), summed in place by the engine that moves device memory (NCCL, or ranks of
//! this process sharing the device: `exchange.rs`). The ordering is the reduction's
//! (`reduce.rs`): the job is made on the model thread once the kernels writing the buffer are
//! queued (on fusion [`to_cube`] drains them first), with a [`stream_mark`] of that moment, so
//! the lane's engine waits for those writes; the model thread reads the sum after the lane's
//! reply, when the engine's work is complete.

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

/// The in-place all-reduce job of `tensor` (f32, 1-D), if `B` is a CubeCL backend this build
/// supports (`None` otherwise).
pub(crate) fn update_sum_job_if_cube<B: Backend>(
    tensor: B::FloatTensorPrimitive,
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
            if !cube.can_mut() {
                // Another tensor shares the buffer: the engine sums a copy in place.
                cube = <Inner<R> as burn_backend::ops::FloatTensorOps<Inner<R>>>::float_mul_scalar(
                    cube,
                    1f32.into(),
                );
            }
            let len = cube.shape().num_elements();
            let client = lane_client(cube.client.clone());
            let written = stream_mark(&client);
            return Some(Box::new(UpdateSumJob::<R> {
                client,
                handle: cube.handle,
                len,
                written: Some(written),
                buffers: None,
                traffic: traffic.clone(),
            }));
        }
    });
    let _ = (tensor, traffic);
    None
}

/// One rank's buffer of an update-group all-reduce on its way through the replica lane.
struct UpdateSumJob<R: CubeRuntime> {
    client: ComputeClient<R>,
    handle: Handle,
    len: usize,
    /// A mark made once the buffer's writes were queued (see the module docs).
    written: Option<Handle>,
    buffers: Option<CubeBuffers<R>>,
    /// Charged with each host wait for the device.
    traffic: Arc<Traffic>,
}

impl<R: CubeRuntime> DeviceGatherJob for UpdateSumJob<R> {
    fn count(&self) -> usize {
        self.len
    }

    fn buffers(&mut self) -> CommResult<&mut dyn DeviceBuffers> {
        let buffers = CubeBuffers::in_place(
            self.client.clone(),
            ElementKind::F32,
            Span::of(self.handle.clone()),
        )
        .after(self.written.clone())
        .charging(&self.traffic);
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

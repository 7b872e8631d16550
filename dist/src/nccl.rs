//! NCCL for a tensor-parallel group (feature `nccl`): the collectives an engine runs
//! between its ranks, next to pagedkv's kernels. Compiled in CI, run only on GPUs.
//!
//! pagedkv's attention is independent per head, so the only collective a layer needs
//! is the engine's: after each rank's attention over its heads, the row-parallel output
//! projection gives every rank a partial sum of the hidden state, and
//! [`NcclGroup::all_reduce_sum`] adds them (Megatron-LM's layout, which vLLM and SGLang
//! follow). The leader makes the group's id ([`NcclGroup::unique_id`]) and sends it in
//! [`Hello::engine`](crate::wire::Hello::engine); every rank then joins with
//! [`NcclGroup::new`] on its own stream, the one its backend launches on.

use std::sync::Arc;

use cudarc::driver::CudaStream;
use cudarc::nccl::{Comm, Id, ReduceOp};

use pagedkv_host::DType;
use pagedkv_host::cuda::DeviceTensor;

use crate::{DistError, ShardSpec};

/// Bytes of an NCCL unique id.
pub const ID_BYTES: usize = 128;

/// One rank's NCCL communicator.
pub struct NcclGroup {
    comm: Comm,
    shard: ShardSpec,
}

fn nccl(what: &str, e: impl std::fmt::Debug) -> DistError {
    DistError::Mismatch(format!("NCCL {what}: {e:?}"))
}

impl NcclGroup {
    /// A new group id (on the leader; send its bytes to every rank).
    pub fn unique_id() -> Result<Vec<u8>, DistError> {
        let id = Id::new().map_err(|e| nccl("unique id", e))?;
        Ok(id.internal().iter().map(|&c| c as u8).collect())
    }

    /// Joins the group `id` (from [`unique_id`](Self::unique_id)) as `shard.rank` of
    /// `shard.size`, its collectives on `stream`.
    pub fn new(stream: Arc<CudaStream>, shard: ShardSpec, id: &[u8]) -> Result<Self, DistError> {
        let shard = ShardSpec::new(shard.rank, shard.size)?;
        let bytes: [u8; ID_BYTES] = id.try_into().map_err(|_| {
            DistError::Mismatch(format!("an NCCL id is {ID_BYTES} bytes, not {}", id.len()))
        })?;
        let internal = bytes.map(|b| b as std::ffi::c_char);
        let comm = Comm::from_rank(
            stream,
            shard.rank as usize,
            shard.size as usize,
            Id::uninit(internal),
        )
        .map_err(|e| nccl("init", e))?;
        Ok(Self { comm, shard })
    }

    /// This rank.
    pub fn shard(&self) -> ShardSpec {
        self.shard
    }

    /// Sums `t` over the group's ranks, every rank getting the sum (an f32, f16 or
    /// bf16 tensor of the same shape on every rank); enqueued on the group's stream.
    pub fn all_reduce_sum(&self, t: DeviceTensor) -> Result<DeviceTensor, DistError> {
        let (dtype, shape) = (t.dtype(), t.shape().to_vec());
        let n: usize = shape.iter().product();
        let mut buf = t.into_cuda_slice();
        // SAFETY (each arm): `buf` holds the `n` elements of a `dtype` tensor, `n *
        // size_of` bytes, as `DeviceTensor` guarantees; f32, f16 and bf16 have no
        // invalid bit patterns; the view lives only for the call.
        let res = match dtype {
            DType::F32 => {
                let mut v = unsafe { buf.transmute_mut::<f32>(n) }
                    .ok_or_else(|| nccl("all_reduce", "tensor smaller than its shape"))?;
                self.comm.all_reduce_in_place(&mut v, &ReduceOp::Sum)
            }
            DType::F16 => {
                let mut v = unsafe { buf.transmute_mut::<half::f16>(n) }
                    .ok_or_else(|| nccl("all_reduce", "tensor smaller than its shape"))?;
                self.comm.all_reduce_in_place(&mut v, &ReduceOp::Sum)
            }
            DType::Bf16 => {
                let mut v = unsafe { buf.transmute_mut::<half::bf16>(n) }
                    .ok_or_else(|| nccl("all_reduce", "tensor smaller than its shape"))?;
                self.comm.all_reduce_in_place(&mut v, &ReduceOp::Sum)
            }
            other => {
                return Err(DistError::Mismatch(format!(
                    "all_reduce_sum of a {other:?} tensor: f32, f16 or bf16 only"
                )));
            }
        };
        res.map_err(|e| nccl("all_reduce", e))?;
        DeviceTensor::from_cuda_slice(buf, dtype, &shape)
            .map_err(|e| DistError::Mismatch(e.to_string()))
    }
}

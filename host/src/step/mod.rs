//! The step path an engine puts in its hot loop: plan once per step, run per layer.
//!
//! A decode step runs attention once per layer (32–80 layers), so whatever a backend
//! does per call is paid that many times per step. [`StepRunner`] splits the work the
//! way FlashInfer's `plan()` / `run()` does:
//!
//! 1. **Once per runner** ([`StepRunner::new`]): device buffers for the step metadata
//!    (block tables, context lengths, slot mapping), the split-K workspace and the ALiBi
//!    slopes, sized by a [`StepCapacity`]. The only allocations it makes.
//! 2. **Once per step** ([`StepRunner::plan`]): the scheduler's metadata ([`StepMeta`])
//!    is validated on the host (every block id inside the pool, lengths, slots inside
//!    the pool and distinct), the split-K plan is made, and the metadata goes to the
//!    device in one asynchronous copy into the persistent buffer.
//! 3. **Per layer** ([`StepRunner::kv_append`], [`StepRunner::decode`]): host-side
//!    checks of the layer's tensor views (space, dtype, alignment, lengths, row strides)
//!    and then launches, nothing else: no allocation, copy, memset, synchronisation or
//!    event. Because a run only launches, a whole step can be captured in a CUDA graph
//!    and replayed after the next `plan` updates the metadata in place.
//!
//! The runner is generic over a [`StepDevice`], the driver-facing seam: the CUDA
//! device (`crate::cuda::CudaStepDevice`), the emulator ([`EmuDevice`]: the same runner
//! code, proven against the CPU reference with no GPU), and [`Recorder`], which executes
//! nothing and records every call, so a test proves the run path is launch-only.
//!
//! ```
//! use pagedkv_host::emulator::Emulator;
//! use pagedkv_host::ops::attention::AttentionOptions;
//! use pagedkv_host::step::{
//!     KvAppendIo, DecodeIo, EmuDevice, StepCapacity, StepMeta, StepRunner, StepShape,
//!     TensorView, TensorViewMut,
//! };
//! use pagedkv_host::{DType, HostTensor};
//!
//! let shape = StepShape { num_q_heads: 4, num_kv_heads: 2, head_dim: 64, block_size: 16,
//!                         num_blocks: 8, dtype: DType::F32, kv_dtype: DType::F32 };
//! let cap = StepCapacity { max_seqs: 4, max_blocks_per_seq: 4, max_tokens: 64,
//!                          max_partitions: 8 };
//! let mut runner = StepRunner::new(EmuDevice::new(Emulator::new()), shape, cap, 1)?;
//! let pool = [8 * 2 * 16 * 64];
//! let (mut kc, mut vc) = (HostTensor::full(DType::F32, &pool, 0.0), HostTensor::full(DType::F32, &pool, 0.0));
//! // One sequence of 3 tokens in block 5: append all three, then decode.
//! runner.plan(&StepMeta { block_tables: &[5], max_blocks_per_seq: 1, context_lens: &[3],
//!                         slot_mapping: &[80, 81, 82], window: None })?;
//! let k = HostTensor::full(DType::F32, &[3, 2, 64], 0.5);
//! let v = HostTensor::full(DType::F32, &[3, 2, 64], 2.0);
//! let (mut kv, mut vv) = (TensorViewMut::of_host(&mut kc), TensorViewMut::of_host(&mut vc));
//! runner.kv_append(KvAppendIo { key: TensorView::of_host(&k), value: TensorView::of_host(&v),
//!                             key_cache: kv.reborrow(), value_cache: vv.reborrow(),
//!                             kv_scales: None, group: 0 })?;
//! let q = HostTensor::full(DType::F32, &[1, 4, 64], 1.0);
//! let mut out = HostTensor::full(DType::F32, &[1, 4, 64], f64::NAN);
//! runner.decode(&AttentionOptions::new(64), DecodeIo { q: TensorView::of_host(&q),
//!     key_cache: kv.as_view(), value_cache: vv.as_view(), kv_scales: None, sinks: None, group: 0,
//!     out: TensorViewMut::of_host(&mut out), lse: None })?;
//! drop((kv, vv));
//! assert!(out.to_f64().iter().all(|&x| (x - 2.0).abs() < 1e-6));
//! # Ok::<(), pagedkv_host::Error>(())
//! ```

mod cascade;
mod device;
mod emu;
mod merge;
pub mod once;
mod prefill;
mod run;
mod runner;

pub use cascade::PlannedCascade;
pub(crate) use device::check_reserved;
pub use device::{
    DeviceAddr, DeviceOp, HostElement, Recorder, Space, StepDevice, TensorView, TensorViewMut,
};
pub use emu::{EmuDevice, HostMemory};
pub use merge::MergeIo;
pub use prefill::{PlannedPrefill, PrefillIo, PrefillMeta};
pub use runner::{
    DecodeIo, KvAppendIo, MAX_STEP_META_BYTES, Planned, StepCapacity, StepMeta, StepRunner,
    StepShape,
};

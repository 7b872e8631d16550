//! # pagedkv-host: everything pagedkv does on the CPU
//!
//! * [`backend`]: [`backend::AttentionBackend`], the one engine-facing API of every
//!   backend (the CPU emulator and CUDA): cache, `kv_append`, decode, copies and swaps,
//!   with the scheduler's `Batch` as each step's input. Start here.
//! * [`cuda`]: the CUDA backend (cudarc, dynamic loading): loads the PTX, launches.
//! * [`emulator`]: the SIMT emulator that runs the kernel bodies of `pagedkv-kernels`
//!   thread by thread on the CPU, so the tests prove the real kernel source.
//! * [`block`]: the block pool, block tables, prefix caching, copy-on-write, swap.
//! * [`buffer`]: 16-byte aligned host buffers, the emulator's stand-in for device memory.
//! * [`step`]: the step path every backend runs on: [`step::StepRunner`] plans a step
//!   once (validates its metadata, one upload) and launches each layer's kernels over
//!   any [`step::StepDevice`] (the emulator, CUDA, a recorder). Each kernel's
//!   parameters are built there and nowhere else.
//! * [`ops`]: the host API of each kernel: input validation (shared by every backend),
//!   the CPU reference, and the per-call entry points (one-shot uses of the step path).
//! * [`scheduler`]: the decode scheduler (continuous batching, preemption, swap).
//! * [`tensor`]: [`DType`] and [`HostTensor`], typed host buffers.
//! * [`reference`](mod@reference): the CPU references (f64), the ground truth of the tests.
//! * [`error`]: the crate's error type.
//!
//! The `pagedkv` crate re-exports this crate as `pagedkv::host`: an engine that depends
//! on `pagedkv` writes `pagedkv::host::backend::…` for what these docs call
//! `pagedkv_host::backend::…`.
//!
//! Nothing in this crate needs a GPU or a CUDA installation to build or test; the CUDA
//! backend finds the driver at run time.

pub mod backend;
pub mod block;
pub mod buffer;
pub mod cuda;
pub mod emulator;
pub mod error;
mod mem;
pub mod ops;
pub mod reference;
pub mod scheduler;
pub mod step;
pub mod tensor;

pub use buffer::AlignedBuf;
pub use error::{Error, Result};
pub use tensor::{DType, HostTensor};

//! The C ABI of pagedkv (`include/pagedkv.h`).
//!
//! Built as `libpagedkv_c.a` and `libpagedkv_c.so`. Every function:
//! * returns a [`pagedkv_status`] (`PAGEDKV_OK` = 0), and on failure leaves a message
//!   for [`pagedkv_last_error_message`] (per thread);
//! * checks its pointers (null is `PAGEDKV_ERR_NULL`) and lengths before use: every
//!   count the library can check against its own state (the shapes, the last step's
//!   sequences) is checked before anything is read, and every size computed from the
//!   caller's numbers uses checked arithmetic;
//! * catches panics: none crosses the boundary (`PAGEDKV_ERR_PANIC`), and none prints:
//!   the panic message goes to the last-error message, not to the host's stderr;
//! * refuses a handle that was destroyed or never created (a registry of live handles)
//!   and a call on a handle that is already inside a call (re-entrance, or two threads
//!   at once): `PAGEDKV_ERR_INVALID_STATE`. The registry's lock covers both the "is it
//!   live" check and the "mark it busy" step, and destroy checks and unregisters under
//!   the same lock, so destroy racing another call is an error for one of them, never a
//!   use after free.
//!
//! Ownership: the library owns every handle (create/destroy) and the arrays a
//! [`pagedkv_batch`] points to, which stay valid until the next `pagedkv_step` or
//! `pagedkv_scheduler_destroy` on that scheduler. The caller owns everything it passes in.
//!
//! # Where things are
//!
//! One (private) module per concern; each one's doc walks through its part, the C side
//! first. Read them in this order:
//!
//! * `status.rs`: the status codes and the per-thread last-error message.
//! * `guard.rs`: how every entry point catches panics without printing them.
//! * `handle.rs`: the registry that turns a handle pointer into a `&mut` for one call,
//!   or a status for a null, destroyed or busy one.
//! * `args.rs`: the decode shape, and how buffers and counts from C are checked
//!   (checked sizes, lengths against the shape, then slices) before anything is read.
//! * `scheduler.rs`: creating a scheduler, queuing and aborting requests, its queries.
//! * `step.rs`: the step cycle, `pagedkv_step` and `pagedkv_on_step_done`.
//! * `reference.rs`: the CPU reference kernels on host `f32` buffers.
//! * `cuda.rs`: the CUDA backend handle; `cuda_ops.rs`: its kernels on the caller's
//!   device pointers; `scales.rs`: fp8 caches' per-KV-head scales (the check the fp8
//!   kernel functions run first, and a CPU calibration).
//! * `tests.rs`: unit tests of the machinery above; `header_check.rs` (feature
//!   `header-check`): compile-time proof that the header matches these definitions.
//!
//! The modules are private; every C type and function is re-exported here, at the
//! crate root, which is where `header_check` (feature `header-check`: bindgen on
//! `include/pagedkv.h`) and the fuzz targets find them.
#![allow(non_camel_case_types)]

mod args;
mod cuda;
mod cuda_ops;
mod guard;
mod handle;
#[cfg(feature = "header-check")]
mod header_check;
mod merge;
mod reference;
mod scales;
mod scheduler;
mod status;
mod step;
#[cfg(test)]
mod tests;

pub use args::pagedkv_decode_shape;
pub use cuda::{
    pagedkv_cuda_backend, pagedkv_cuda_backend_create, pagedkv_cuda_backend_create_on_stream,
    pagedkv_cuda_backend_destroy, pagedkv_cuda_synchronize, pagedkv_dtype,
};
pub use cuda_ops::{
    pagedkv_cuda_decode_attention, pagedkv_cuda_decode_attention_fp8,
    pagedkv_cuda_decode_attention_strided, pagedkv_cuda_kv_append, pagedkv_cuda_kv_append_fp8,
    pagedkv_cuda_merge_states,
};
pub use merge::{pagedkv_merge_shape, pagedkv_merge_states};
pub use reference::{pagedkv_reference_decode_attention, pagedkv_reference_kv_append};
pub use scales::{pagedkv_kv_scales, pagedkv_kv_scales_calibrate};
#[cfg(feature = "testing")]
pub use scheduler::pagedkv_testing_panic;
pub use scheduler::{
    pagedkv_abort, pagedkv_add_request, pagedkv_get_metrics, pagedkv_is_idle, pagedkv_metrics,
    pagedkv_request, pagedkv_reset_prefix_cache, pagedkv_scheduler, pagedkv_scheduler_config,
    pagedkv_scheduler_config_default, pagedkv_scheduler_create, pagedkv_scheduler_create_groups,
    pagedkv_scheduler_destroy, pagedkv_seq_tokens,
};
pub use status::{pagedkv_last_error_message, pagedkv_status, pagedkv_version};
pub use step::{
    pagedkv_accepted, pagedkv_batch, pagedkv_batch_group, pagedkv_group_tables,
    pagedkv_on_step_done, pagedkv_on_step_done_accepted, pagedkv_sampled, pagedkv_scheduled_seq,
    pagedkv_set_lookahead, pagedkv_step,
};

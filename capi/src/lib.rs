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
#![allow(non_camel_case_types)]

mod args;
mod guard;
mod handle;
#[cfg(feature = "header-check")]
mod header_check;
mod scheduler;
mod status;
mod step;
#[cfg(test)]
mod tests;

pub use args::pagedkv_decode_shape;
#[cfg(feature = "testing")]
pub use scheduler::pagedkv_testing_panic;
pub use scheduler::{
    pagedkv_abort, pagedkv_add_request, pagedkv_get_metrics, pagedkv_is_idle, pagedkv_metrics,
    pagedkv_request, pagedkv_scheduler, pagedkv_scheduler_config, pagedkv_scheduler_config_default,
    pagedkv_scheduler_create, pagedkv_scheduler_destroy, pagedkv_seq_tokens,
};
pub use status::{pagedkv_last_error_message, pagedkv_status, pagedkv_version};
pub use step::{
    pagedkv_batch, pagedkv_on_step_done, pagedkv_sampled, pagedkv_scheduled_seq, pagedkv_step,
};

use args::{check_len, checked_elems, pool_elems, slice, slice_mut};
use guard::guard;
use handle::{Handle, Registry, destroy, enter, register};
use pagedkv::host::ops::attention::{DecodeOptions, DecodeShape};
use pagedkv::host::ops::kv_append::kv_append_reference;
use pagedkv::host::reference::paged_decode_attention;
use pagedkv::host::{DType, Error, HostTensor};
use pagedkv::kernels::PagedLayout;
use pagedkv_status::*;
use status::{fail, from_error};

// ---------------------------------------------------------------------------------
// CPU reference kernels (f32 buffers)
// ---------------------------------------------------------------------------------

fn tensor(v: &[f32], shape: &[usize]) -> HostTensor {
    let f: Vec<f64> = v.iter().map(|&x| x as f64).collect();
    HostTensor::from_f64(DType::F32, shape, &f).expect("shape matches length")
}

/// The CPU reference of paged decode attention (f64 arithmetic, f32 buffers): `q`,
/// `out`: `[num_seqs, num_q_heads, head_dim]`; caches `[num_blocks, num_kv_heads,
/// block_size, head_dim]`; `block_tables` `[num_seqs, max_blocks_per_seq]`;
/// `context_lens` `[num_seqs]`. Each `*_len` is the buffer's element count and must
/// match the shape.
///
/// # Safety
/// Each pointer is null or valid for its `*_len` elements (`out` for writes).
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn pagedkv_reference_decode_attention(
    shape: *const pagedkv_decode_shape,
    scale: f32,
    q: *const f32,
    q_len: u64,
    key_cache: *const f32,
    value_cache: *const f32,
    cache_len: u64,
    block_tables: *const i32,
    block_tables_len: u64,
    context_lens: *const i32,
    context_lens_len: u64,
    out: *mut f32,
    out_len: u64,
) -> pagedkv_status {
    guard(|| {
        if shape.is_null() {
            return fail(PAGEDKV_ERR_NULL, "shape is null");
        }
        // SAFETY: non-null, valid for a read.
        let c = unsafe { shape.read() };
        let sh = DecodeShape::from(c);
        let run = || -> Result<pagedkv_status, pagedkv_status> {
            // Every length is checked against the shapes (sizes in checked arithmetic)
            // before any buffer is read.
            let l = sh.layout();
            pagedkv::host::ops::check_layout(&l).map_err(|e| from_error(&e))?;
            let pool = pool_elems(&l)?;
            let qn = checked_elems(
                &[c.num_seqs, c.num_q_heads, c.head_dim],
                "num_seqs",
                "num_seqs * num_q_heads * head_dim",
            )?;
            let btn = checked_elems(
                &[c.num_seqs, c.max_blocks_per_seq],
                "max_blocks_per_seq",
                "num_seqs * max_blocks_per_seq",
            )?;
            check_len("q", q_len, qn)?;
            check_len("cache_len", cache_len, pool)?;
            check_len("block_tables", block_tables_len, btn)?;
            check_len("context_lens", context_lens_len, c.num_seqs as u64)?;
            check_len("out", out_len, qn)?;
            // SAFETY: the caller's contract for each pointer and length.
            let (q, kc, vc, bt, cl, o) = unsafe {
                (
                    slice(q, q_len, "q")?,
                    slice(key_cache, cache_len, "key_cache")?,
                    slice(value_cache, cache_len, "value_cache")?,
                    slice(block_tables, block_tables_len, "block_tables")?,
                    slice(context_lens, context_lens_len, "context_lens")?,
                    slice_mut(out, out_len, "out")?,
                )
            };
            let qt = tensor(q, &[q.len()]);
            let kt = tensor(kc, &[kc.len()]);
            let vt = tensor(vc, &[vc.len()]);
            let mut ot = HostTensor::full(DType::F32, &[o.len()], 0.0);
            let mut opts = DecodeOptions::new(sh.head_dim.max(1));
            opts.scale = scale;
            pagedkv::host::ops::attention::validate(&sh, &opts, &qt, &kt, &vt, bt, cl, &ot)
                .map_err(|e| from_error(&e))?;
            let r = paged_decode_attention(&sh, &opts, &qt, &kt, &vt, bt, cl);
            for (i, v) in r.iter().enumerate() {
                ot.set(i, *v);
            }
            o.copy_from_slice(ot.buf().as_slice::<f32>());
            Ok(PAGEDKV_OK)
        };
        run().unwrap_or_else(|s| s)
    })
}

/// The CPU reference of `kv_append` (f32 buffers): writes token `i`'s K and V rows
/// (`key`, `value`: `[num_tokens, num_kv_heads, head_dim]`) into slot
/// `slot_mapping[i]` of the caches (`[num_blocks, num_kv_heads, block_size,
/// head_dim]`, `cache_len` elements each); negative slots are skipped.
///
/// # Safety
/// Each pointer is null or valid for its length (`key`/`value` for `num_tokens *
/// num_kv_heads * head_dim`, the caches for `cache_len` writes).
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn pagedkv_reference_kv_append(
    num_blocks: u32,
    num_kv_heads: u32,
    block_size: u32,
    head_dim: u32,
    key: *const f32,
    value: *const f32,
    num_tokens: u64,
    slot_mapping: *const i64,
    key_cache: *mut f32,
    value_cache: *mut f32,
    cache_len: u64,
) -> pagedkv_status {
    guard(|| {
        let layout = PagedLayout {
            num_blocks,
            num_kv_heads,
            block_size,
            head_dim,
        };
        let run = || -> Result<pagedkv_status, pagedkv_status> {
            // The sizes in checked arithmetic, and the caches' length checked against
            // the layout, before any buffer is read.
            pagedkv::host::ops::check_layout(&layout).map_err(|e| from_error(&e))?;
            check_len("cache_len", cache_len, pool_elems(&layout)?)?;
            let row = num_kv_heads as u64 * head_dim as u64;
            let n = num_tokens
                .checked_mul(row)
                .filter(|&n| usize::try_from(n).is_ok())
                .ok_or_else(|| {
                    fail(
                        PAGEDKV_ERR_INVALID_ARGUMENT,
                        format!(
                            "invalid argument `num_tokens`: num_tokens * num_kv_heads * head_dim = {num_tokens} * {num_kv_heads} * {head_dim} overflows"
                        ),
                    )
                })?;
            // SAFETY: the caller's contract for each pointer and length.
            let (k, v, sm, kc, vc) = unsafe {
                (
                    slice(key, n, "key")?,
                    slice(value, n, "value")?,
                    slice(slot_mapping, num_tokens, "slot_mapping")?,
                    slice_mut(key_cache, cache_len, "key_cache")?,
                    slice_mut(value_cache, cache_len, "value_cache")?,
                )
            };
            let (kt, vt) = (tensor(k, &[k.len()]), tensor(v, &[v.len()]));
            let (mut kct, mut vct) = (tensor(kc, &[kc.len()]), tensor(vc, &[vc.len()]));
            kv_append_reference(&layout, &kt, &vt, sm, &mut kct, &mut vct)
                .map_err(|e| from_error(&e))?;
            kc.copy_from_slice(kct.buf().as_slice::<f32>());
            vc.copy_from_slice(vct.buf().as_slice::<f32>());
            Ok(PAGEDKV_OK)
        };
        run().unwrap_or_else(|s| s)
    })
}

// ---------------------------------------------------------------------------------
// CUDA backend on caller-supplied device pointers
// ---------------------------------------------------------------------------------

/// Element type of device buffers.
#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum pagedkv_dtype {
    /// IEEE half precision.
    PAGEDKV_F16 = 0,
    /// bfloat16.
    PAGEDKV_BF16 = 1,
    /// IEEE single precision.
    PAGEDKV_F32 = 2,
}

fn dtype_of(d: i32) -> Result<DType, pagedkv_status> {
    match d {
        0 => Ok(DType::F16),
        1 => Ok(DType::Bf16),
        2 => Ok(DType::F32),
        other => Err(fail(
            PAGEDKV_ERR_INVALID_ARGUMENT,
            format!("dtype {other} (0 f16, 1 bf16, 2 f32)"),
        )),
    }
}

/// An opaque CUDA backend handle (a context, a stream, the loaded kernels).
pub struct pagedkv_cuda_backend {
    inner: pagedkv::cuda::CudaBackend,
}

static CUDA_BACKENDS: Registry = Registry::new();

impl Handle for pagedkv_cuda_backend {
    const WHAT: &'static str = "backend";
    fn registry() -> &'static Registry {
        &CUDA_BACKENDS
    }
}

fn with_cuda(
    b: *mut pagedkv_cuda_backend,
    f: impl FnOnce(&pagedkv::cuda::CudaBackend) -> Result<(), pagedkv_status>,
) -> pagedkv_status {
    enter(b, |h| f(&h.inner).err().unwrap_or(PAGEDKV_OK))
}

/// Creates a CUDA backend on device `ordinal` with the embedded PTX. Without an NVIDIA
/// driver or device this is `PAGEDKV_ERR_CUDA` ("no CUDA driver found" / "no CUDA
/// device"). Release with `pagedkv_cuda_backend_destroy`.
///
/// # Safety
/// `out` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pagedkv_cuda_backend_create(
    ordinal: i32,
    out: *mut *mut pagedkv_cuda_backend,
) -> pagedkv_status {
    guard(|| {
        if out.is_null() {
            return fail(PAGEDKV_ERR_NULL, "out is null");
        }
        if ordinal < 0 {
            return fail(PAGEDKV_ERR_INVALID_ARGUMENT, format!("ordinal {ordinal}"));
        }
        let inner = match pagedkv::cuda::backend(ordinal as usize) {
            Ok(b) => b,
            Err(e) => return from_error(&e),
        };
        let h = register(pagedkv_cuda_backend { inner });
        // SAFETY: non-null, valid for a write.
        unsafe { out.write(h) };
        PAGEDKV_OK
    })
}

/// Creates a CUDA backend like `pagedkv_cuda_backend_create`, whose every copy and
/// launch goes to `stream` (a `CUstream` / `cudaStream_t` of device `ordinal`'s primary
/// context that the caller owns), or to the context's default stream when `stream` is
/// null.
///
/// # Safety
/// `out` is null or valid for a write; a non-null `stream` is a live stream of that
/// context, kept alive until the backend is destroyed.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pagedkv_cuda_backend_create_on_stream(
    ordinal: i32,
    stream: *mut std::ffi::c_void,
    out: *mut *mut pagedkv_cuda_backend,
) -> pagedkv_status {
    guard(|| {
        if out.is_null() {
            return fail(PAGEDKV_ERR_NULL, "out is null");
        }
        if ordinal < 0 {
            return fail(PAGEDKV_ERR_INVALID_ARGUMENT, format!("ordinal {ordinal}"));
        }
        // SAFETY: the caller's contract on `stream`.
        let inner = match unsafe { pagedkv::cuda::backend_on_stream(ordinal as usize, stream) } {
            Ok(b) => b,
            Err(e) => return from_error(&e),
        };
        let h = register(pagedkv_cuda_backend { inner });
        // SAFETY: non-null, valid for a write.
        unsafe { out.write(h) };
        PAGEDKV_OK
    })
}

/// Destroys a CUDA backend (after waiting for its stream).
///
/// # Safety
/// `b` is null or a pointer this library returned (a destroyed one is detected).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pagedkv_cuda_backend_destroy(
    b: *mut pagedkv_cuda_backend,
) -> pagedkv_status {
    guard(|| match destroy(b) {
        Ok(h) => {
            let _ = h.inner.synchronize();
            PAGEDKV_OK
        }
        Err(st) => st,
    })
}

/// Waits for all work the backend queued.
///
/// # Safety
/// `b` is null or a pointer this library returned.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pagedkv_cuda_synchronize(b: *mut pagedkv_cuda_backend) -> pagedkv_status {
    with_cuda(b, |g| g.synchronize().map_err(|e| from_error(&e)))
}

/// `kv_append` on the GPU, on device buffers the caller owns: `key`, `value`:
/// `[num_tokens, num_kv_heads, head_dim]`; the caches `[num_blocks, num_kv_heads,
/// block_size, head_dim]`, all of `dtype`. `slot_mapping` is host memory
/// (`num_tokens` entries; negative: skip), validated before the launch. Asynchronous on
/// the backend's stream.
///
/// # Safety
/// The device pointers are allocations in the backend's context of at least the sizes
/// the shapes imply, unused by other work until the launch completes; `slot_mapping` is
/// null only when `num_tokens` is 0, else valid for `num_tokens` reads.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn pagedkv_cuda_kv_append(
    b: *mut pagedkv_cuda_backend,
    num_blocks: u32,
    num_kv_heads: u32,
    block_size: u32,
    head_dim: u32,
    dtype: i32,
    key: u64,
    value: u64,
    num_tokens: u64,
    slot_mapping: *const i64,
    key_cache: u64,
    value_cache: u64,
) -> pagedkv_status {
    with_cuda(b, |g| {
        let dt = dtype_of(dtype)?;
        let layout = PagedLayout {
            num_blocks,
            num_kv_heads,
            block_size,
            head_dim,
        };
        pagedkv::host::ops::check_layout(&layout).map_err(|e| from_error(&e))?;
        // Sizes in checked arithmetic: both fit in `usize` (so do the shapes' products,
        // every factor being at least 1 past `check_layout` and the early return).
        let pool = [pool_elems(&layout)? as usize];
        if num_tokens == 0 {
            return Ok(());
        }
        let rows = usize::try_from(num_tokens)
            .ok()
            .filter(|_| {
                num_tokens
                    .checked_mul(num_kv_heads as u64 * head_dim as u64)
                    .is_some_and(|n| usize::try_from(n).is_ok())
            })
            .ok_or_else(|| {
                fail(
                    PAGEDKV_ERR_INVALID_ARGUMENT,
                    format!(
                        "invalid argument `num_tokens`: {num_tokens} * num_kv_heads * head_dim overflows"
                    ),
                )
            })?;
        // SAFETY: the caller's contract.
        let sm = unsafe { slice(slot_mapping, num_tokens, "slot_mapping")? };
        let tok = [rows, num_kv_heads as usize, head_dim as usize];
        // SAFETY: the caller's contract (device allocations of these sizes, unused by
        // other work until the launch completes).
        let (k, v, mut kc, mut vc) = unsafe {
            use pagedkv::cuda::BorrowedDeviceTensor as B;
            let m = |e: Error| from_error(&e);
            (
                B::new(g, key, dt, &tok).map_err(m)?,
                B::new(g, value, dt, &tok).map_err(m)?,
                B::new(g, key_cache, dt, &pool).map_err(m)?,
                B::new(g, value_cache, dt, &pool).map_err(m)?,
            )
        };
        g.kv_append(&layout, &k, &v, sm, &mut kc, &mut vc)
            .map_err(|e| from_error(&e))
    })
}

/// Paged decode attention on the GPU, on device buffers the caller owns: `q`, `out`:
/// `[num_seqs, num_q_heads, head_dim]`; caches `[num_blocks, num_kv_heads, block_size,
/// head_dim]`, all of `dtype`. `block_tables` (`[num_seqs, max_blocks_per_seq]`) and
/// `context_lens` (`[num_seqs]`) are host memory, validated (ids in the pool, lengths in
/// the tables) before anything is launched; split-K is planned from the device's SM
/// count. Asynchronous on the backend's stream.
///
/// # Safety
/// As `pagedkv_cuda_kv_append`; the host arrays are valid for their `*_len` reads.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn pagedkv_cuda_decode_attention(
    b: *mut pagedkv_cuda_backend,
    shape: *const pagedkv_decode_shape,
    dtype: i32,
    scale: f32,
    q: u64,
    key_cache: u64,
    value_cache: u64,
    block_tables: *const i32,
    block_tables_len: u64,
    context_lens: *const i32,
    context_lens_len: u64,
    out: u64,
) -> pagedkv_status {
    with_cuda(b, |g| {
        let dt = dtype_of(dtype)?;
        if shape.is_null() {
            return Err(fail(PAGEDKV_ERR_NULL, "shape is null"));
        }
        // SAFETY: non-null, valid for a read.
        let c = unsafe { shape.read() };
        let sh = DecodeShape::from(c);
        pagedkv::host::ops::check_layout(&sh.layout()).map_err(|e| from_error(&e))?;
        // Sizes in checked arithmetic (each fits in `usize`, so do the shapes' partial
        // products: head_dim >= 1 past `check_layout`), and the host arrays' lengths
        // checked against the shape before they are read.
        let pool = [pool_elems(&sh.layout())? as usize];
        checked_elems(
            &[c.num_seqs, c.num_q_heads, c.head_dim],
            "num_seqs",
            "num_seqs * num_q_heads * head_dim",
        )?;
        let btn = checked_elems(
            &[c.num_seqs, c.max_blocks_per_seq],
            "max_blocks_per_seq",
            "num_seqs * max_blocks_per_seq",
        )?;
        check_len("block_tables", block_tables_len, btn)?;
        check_len("context_lens", context_lens_len, c.num_seqs as u64)?;
        // SAFETY: the caller's contract.
        let (bt, cl) = unsafe {
            (
                slice(block_tables, block_tables_len, "block_tables")?,
                slice(context_lens, context_lens_len, "context_lens")?,
            )
        };
        let qs = [
            c.num_seqs as usize,
            c.num_q_heads as usize,
            c.head_dim as usize,
        ];
        // SAFETY: the caller's contract (device allocations of these sizes).
        let (qt, kc, vc, mut ot) = unsafe {
            use pagedkv::cuda::BorrowedDeviceTensor as B;
            let m = |e: Error| from_error(&e);
            (
                B::new(g, q, dt, &qs).map_err(m)?,
                B::new(g, key_cache, dt, &pool).map_err(m)?,
                B::new(g, value_cache, dt, &pool).map_err(m)?,
                B::new(g, out, dt, &qs).map_err(m)?,
            )
        };
        let mut opts = DecodeOptions::new(c.head_dim.max(1));
        opts.scale = scale;
        g.paged_decode_attention(&sh, &opts, &qt, &kc, &vc, bt, cl, &mut ot, None)
            .map(|_| ())
            .map_err(|e| from_error(&e))
    })
}

/// Decode attention on the GPU like `pagedkv_cuda_decode_attention`, with `q` and `out`
/// as rows `q_row_stride` / `out_row_stride` elements apart (0: dense,
/// `num_q_heads * head_dim`): q can be a view into a fused QKV projection. A stride is
/// at least `num_q_heads * head_dim` and a multiple of 16 bytes, and every device
/// pointer 16-byte aligned, or the call is `PAGEDKV_ERR_INVALID_ARGUMENT` naming it.
/// Runs through the step path (one plan, one launch or two); asynchronous on the
/// backend's stream.
///
/// # Safety
/// As `pagedkv_cuda_decode_attention`, with `q` valid for `(num_seqs - 1) *
/// q_row_stride + num_q_heads * head_dim` elements and `out` likewise.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pagedkv_cuda_decode_attention_strided(
    b: *mut pagedkv_cuda_backend,
    shape: *const pagedkv_decode_shape,
    dtype: i32,
    scale: f32,
    q: u64,
    q_row_stride: u64,
    key_cache: u64,
    value_cache: u64,
    block_tables: *const i32,
    block_tables_len: u64,
    context_lens: *const i32,
    context_lens_len: u64,
    out: u64,
    out_row_stride: u64,
) -> pagedkv_status {
    use pagedkv::cuda::CudaStepDevice;
    use pagedkv::host::step::{
        DecodeIo, StepCapacity, StepDevice, StepMeta, StepRunner, StepShape, TensorView,
        TensorViewMut,
    };
    with_cuda(b, |g| {
        let dt = dtype_of(dtype)?;
        if shape.is_null() {
            return Err(fail(PAGEDKV_ERR_NULL, "shape is null"));
        }
        // SAFETY: non-null, valid for a read.
        let c = unsafe { shape.read() };
        let sh = DecodeShape::from(c);
        let m = |e: Error| from_error(&e);
        pagedkv::host::ops::check_layout(&sh.layout()).map_err(m)?;
        let pool = pool_elems(&sh.layout())?;
        let row = checked_elems(
            &[c.num_q_heads, c.head_dim],
            "num_q_heads",
            "num_q_heads * head_dim",
        )?;
        let btn = checked_elems(
            &[c.num_seqs, c.max_blocks_per_seq],
            "max_blocks_per_seq",
            "num_seqs * max_blocks_per_seq",
        )?;
        check_len("block_tables", block_tables_len, btn)?;
        check_len("context_lens", context_lens_len, c.num_seqs as u64)?;
        // SAFETY: the caller's contract.
        let (bt, cl) = unsafe {
            (
                slice(block_tables, block_tables_len, "block_tables")?,
                slice(context_lens, context_lens_len, "context_lens")?,
            )
        };
        // Elements a strided view spans: (num_seqs - 1) * stride + row, checked.
        let span = |what: &str, stride: u64| -> Result<(u64, u64), pagedkv_status> {
            let stride = if stride == 0 { row } else { stride };
            (c.num_seqs.max(1) as u64 - 1)
                .checked_mul(stride)
                .and_then(|x| x.checked_add(row))
                .map(|n| (n, stride))
                .ok_or_else(|| {
                    fail(
                        PAGEDKV_ERR_INVALID_ARGUMENT,
                        format!("`{what}`: num_seqs * row stride overflows"),
                    )
                })
        };
        let (q_elems, q_stride) = span("q_row_stride", q_row_stride)?;
        let (out_elems, out_stride) = span("out_row_stride", out_row_stride)?;
        let step_shape = StepShape {
            num_q_heads: c.num_q_heads,
            num_kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
            block_size: c.block_size,
            num_blocks: c.num_blocks,
            dtype: dt,
        };
        let cap = StepCapacity {
            max_seqs: c.num_seqs.max(1),
            max_blocks_per_seq: c.max_blocks_per_seq.max(1),
            max_tokens: 1,
            max_partitions: 1024,
        };
        let mut r =
            StepRunner::new(CudaStepDevice::new(g), step_shape, cap, g.sm_count()).map_err(m)?;
        r.plan(&StepMeta {
            block_tables: bt,
            max_blocks_per_seq: c.max_blocks_per_seq,
            context_lens: cl,
            slot_mapping: &[],
        })
        .map_err(m)?;
        let space = r.device().space();
        // SAFETY: the caller's contract: device allocations in the backend's context of
        // these sizes, unused by other work until the launch completes.
        let (qv, kv, vv, ov) = unsafe {
            (
                TensorView::from_raw(q, q_elems, dt, space).with_row_stride(q_stride),
                TensorView::from_raw(key_cache, pool, dt, space),
                TensorView::from_raw(value_cache, pool, dt, space),
                TensorViewMut::from_raw(out, out_elems, dt, space).with_row_stride(out_stride),
            )
        };
        let mut opts = DecodeOptions::new(c.head_dim.max(1));
        opts.scale = scale;
        r.decode(
            &opts,
            DecodeIo {
                q: qv,
                key_cache: kv,
                value_cache: vv,
                out: ov,
            },
        )
        .map(|_| ())
        .map_err(m)
    })
}

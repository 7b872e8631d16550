//! The CUDA kernels for C: `kv_append` and paged decode attention on device pointers.
//!
//! Each function takes a backend (see [`crate::cuda`]), the sizes, and device pointers
//! (`CUdeviceptr`, as `u64`) to buffers the caller owns in the backend's context:
//!
//! ```c
//! /* the new tokens' K/V into their slots (host slot_mapping, negative: skip) */
//! pagedkv_cuda_kv_append(gpu, num_blocks, num_kv_heads, block_size, head_dim,
//!                        PAGEDKV_F16, k, v, num_tokens, b.slot_mapping, kc, vc);
//! /* attention over the batch's tables (host arrays, as pagedkv_step gives them) */
//! pagedkv_cuda_decode_attention(gpu, &sh, PAGEDKV_F16, scale, q, kc, vc,
//!                               b.block_tables, b.num_seqs * b.max_blocks_per_seq,
//!                               b.context_lens, b.num_seqs, out);
//! ```
//!
//! What the library can check, it checks before anything is launched, in the order of
//! [`crate::args`]: the layout, every size in checked arithmetic, the host arrays'
//! lengths against the shape, then their contents (slots and block ids inside the pool,
//! context lengths inside the tables). What it cannot check is the caller's contract
//! (each function's `# Safety`): that the device pointers are allocations of the sizes
//! the shapes imply, unused by other work until the launch completes. The work is
//! asynchronous on the backend's stream; the caller keeps its buffers alive until
//! `pagedkv_cuda_synchronize`.
//!
//! Every function here is one-shot (the header says so): [`pagedkv_cuda_kv_append`]
//! and [`pagedkv_cuda_decode_attention`] wrap the device pointers as borrowed tensors
//! and call the device's per-call methods, each one step of a `StepRunner` made for
//! the call (split-K planned from the device's SM count);
//! [`pagedkv_cuda_decode_attention_strided`] lets `q` and `out` be rows a stride apart
//! (`q` can be a view into a fused QKV projection) and builds its `StepRunner` on a
//! `CudaStepDevice` itself. Either way the views' alignment and strides are checked
//! (`PAGEDKV_ERR_INVALID_ARGUMENT` naming the argument, never a misaligned-address
//! fault), and the launches are the step path's.
//!
//! fp8 caches: [`pagedkv_cuda_kv_append_fp8`] and [`pagedkv_cuda_decode_attention_fp8`]
//! take the cache's type apart from the queries' (f16 or bf16 over `PAGEDKV_E4M3` or
//! `PAGEDKV_E5M2`) and the per-KV-head scales ([`crate::scales`]). They check those host
//! arguments first, before the backend handle, then share the body of the plain
//! functions (`kv_append_on`, `decode_on`), which are the same call with one type and no
//! scales. An fp8 `dtype` in a function with one type (the plain ones, and the strided
//! decode, which takes no scales) would be fp8 queries:
//! `PAGEDKV_ERR_INVALID_ARGUMENT` pointing to the `_fp8` functions.

use pagedkv::cuda::CudaDevice;
use pagedkv::host::Error;
use pagedkv::host::ops::attention::{AttentionOptions, DecodeInputs, DecodeShape};
use pagedkv::host::ops::kv_append::KvAppendInputs;
use pagedkv::kernels::PagedLayout;

use crate::args::{check_len, checked_elems, pagedkv_decode_shape, pool_elems, slice, token_elems};
use crate::cuda::{dtype_of, pagedkv_cuda_backend, with_cuda};
use crate::guard::guard;
use crate::pagedkv_status::{self, *};
use crate::scales::{KvTypes, kv_types, pagedkv_kv_scales};
use crate::status::{fail, from_error};

/// `kv_append` on the GPU, on device buffers the caller owns: `key`, `value`:
/// `[num_tokens, num_kv_heads, head_dim]`; the caches `[num_blocks, num_kv_heads,
/// block_size, head_dim]`, all of `dtype`. `slot_mapping` is host memory
/// (`num_tokens` entries; negative: skip), validated before the launch. Asynchronous on
/// the backend's stream. `dtype` is f16, bf16 or f32: an fp8 one is
/// `PAGEDKV_ERR_INVALID_ARGUMENT` (an fp8 cache: `pagedkv_cuda_kv_append_fp8`).
///
/// # Safety
/// 1. The device pointers are allocations in the backend's context of at least the
///    sizes the shapes imply, unused by other work until the launch completes.
/// 2. `slot_mapping` is null only when `num_tokens` is 0, else valid for `num_tokens`
///    reads.
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
    let layout = PagedLayout {
        num_blocks,
        num_kv_heads,
        block_size,
        head_dim,
    };
    with_cuda(b, |g| {
        let t = KvTypes::plain(dtype_of(dtype)?)?;
        let io = AppendPtrs {
            key,
            value,
            num_tokens,
            slot_mapping,
            key_cache,
            value_cache,
        };
        // SAFETY: the caller's contract.
        unsafe { kv_append_on(g, &layout, t, io) }
    })
}

/// `kv_append` into a cache of another type than the new K/V: as
/// `pagedkv_cuda_kv_append`, with `key`, `value` of `dtype` (f16 or bf16) and the caches
/// of `cache_dtype`. For an fp8 cache (`PAGEDKV_E4M3`, `PAGEDKV_E5M2`) `scales` holds
/// one K and one V scale per KV head (finite, > 0) and each element is stored as
/// `encode(x / scale)`, rounded to nearest even and saturated to the format's finite
/// range; a cache of `dtype` itself takes `scales` null (the plain call).
///
/// The types and the scales are host arguments, checked first, before the backend:
/// an fp8 `dtype`, an fp8 cache under f32, scales for an unscaled cache, a `len` other
/// than `num_kv_heads`, or a scale that is not finite and positive is
/// `PAGEDKV_ERR_INVALID_ARGUMENT`; null `scales` (or `scales->k`, `scales->v`) for an fp8
/// cache is `PAGEDKV_ERR_NULL`. Nothing is launched then.
///
/// # Safety
/// 1. As `pagedkv_cuda_kv_append` (the caches hold elements of `cache_dtype`).
/// 2. `scales` is null or valid for a read, its `k` and `v` null or valid for `len`
///    reads each (read during the call only).
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn pagedkv_cuda_kv_append_fp8(
    b: *mut pagedkv_cuda_backend,
    num_blocks: u32,
    num_kv_heads: u32,
    block_size: u32,
    head_dim: u32,
    dtype: i32,
    cache_dtype: i32,
    scales: *const pagedkv_kv_scales,
    key: u64,
    value: u64,
    num_tokens: u64,
    slot_mapping: *const i64,
    key_cache: u64,
    value_cache: u64,
) -> pagedkv_status {
    let layout = PagedLayout {
        num_blocks,
        num_kv_heads,
        block_size,
        head_dim,
    };
    let io = AppendPtrs {
        key,
        value,
        num_tokens,
        slot_mapping,
        key_cache,
        value_cache,
    };
    guard(|| {
        // SAFETY: the caller's contract on `scales` (2).
        let t = match unsafe { kv_types(dtype, cache_dtype, scales, num_kv_heads) } {
            Ok(t) => t,
            Err(st) => return st,
        };
        // SAFETY: the caller's contract (1).
        with_cuda(b, |g| unsafe { kv_append_on(g, &layout, t, io) })
    })
}

/// The caller's buffers of a `kv_append`: device pointers, and the host slot mapping.
#[derive(Clone, Copy)]
struct AppendPtrs {
    key: u64,
    value: u64,
    num_tokens: u64,
    slot_mapping: *const i64,
    key_cache: u64,
    value_cache: u64,
}

/// `kv_append` on `g` with the types `t` (checked): the body of both C functions.
///
/// # Safety
/// `io`'s device pointers are allocations in `g`'s context of the sizes `layout`,
/// `num_tokens` and `t` imply, unused by other work until the launch completes;
/// `slot_mapping` is null or valid for `num_tokens` reads.
unsafe fn kv_append_on(
    g: &CudaDevice,
    layout: &PagedLayout,
    t: KvTypes,
    io: AppendPtrs,
) -> Result<(), pagedkv_status> {
    let m = |e: Error| from_error(&e);
    pagedkv::host::ops::check_layout(layout).map_err(m)?;
    // Sizes in checked arithmetic: both fit in `usize` (so do the shapes' products,
    // every factor being at least 1 past `check_layout` and the early return).
    let pool = [pool_elems(layout)? as usize];
    if io.num_tokens == 0 {
        return Ok(());
    }
    token_elems(io.num_tokens, layout.num_kv_heads, layout.head_dim)?;
    // SAFETY: the caller's contract.
    let sm = unsafe { slice(io.slot_mapping, io.num_tokens, "slot_mapping")? };
    let tok = [
        io.num_tokens as usize,
        layout.num_kv_heads as usize,
        layout.head_dim as usize,
    ];
    // SAFETY: the caller's contract (device allocations of these sizes, unused by
    // other work until the launch completes).
    let (k, v, mut kc, mut vc) = unsafe {
        use pagedkv::cuda::BorrowedDeviceTensor as B;
        (
            B::new(g, io.key, t.q, &tok).map_err(m)?,
            B::new(g, io.value, t.q, &tok).map_err(m)?,
            B::new(g, io.key_cache, t.cache, &pool).map_err(m)?,
            B::new(g, io.value_cache, t.cache, &pool).map_err(m)?,
        )
    };
    g.kv_append(KvAppendInputs {
        layout,
        key: &k,
        value: &v,
        slot_mapping: sm,
        key_cache: &mut kc,
        value_cache: &mut vc,
        scales: t.scales.as_ref(),
    })
    .map_err(m)
}

/// Paged decode attention on the GPU, on device buffers the caller owns: `q`, `out`:
/// `[num_seqs, num_q_heads, head_dim]`; caches `[num_blocks, num_kv_heads, block_size,
/// head_dim]`, all of `dtype`. `block_tables` (`[num_seqs, max_blocks_per_seq]`) and
/// `context_lens` (`[num_seqs]`) are host memory, validated (ids in the pool, lengths in
/// the tables) before anything is launched; split-K is planned from the device's SM
/// count. Asynchronous on the backend's stream. `dtype` is f16, bf16 or f32 (an fp8
/// cache: `pagedkv_cuda_decode_attention_fp8`).
///
/// # Safety
/// 1. As `pagedkv_cuda_kv_append` for the device pointers.
/// 2. `shape` is null or valid for a read; the host arrays are valid for their `*_len`
///    reads.
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
    let io = DecodePtrs {
        scale,
        q,
        key_cache,
        value_cache,
        block_tables,
        block_tables_len,
        context_lens,
        context_lens_len,
        out,
    };
    with_cuda(b, |g| {
        let t = KvTypes::plain(dtype_of(dtype)?)?;
        // SAFETY: the caller's contract (2).
        let c = unsafe { read_shape(shape)? };
        // SAFETY: the caller's contract.
        unsafe { decode_on(g, c, t, io) }
    })
}

/// Paged decode attention over a cache of another type than the queries: as
/// `pagedkv_cuda_decode_attention`, with `q`, `out` of `dtype` (f16 or bf16) and the
/// caches of `cache_dtype`. For an fp8 cache `scales` holds one K and one V scale per KV
/// head (`len == shape->num_kv_heads`), and the kernels read an element `b` of KV head
/// `h` as `decode(b) * scales->k[h]` (V likewise); a cache of `dtype` itself takes
/// `scales` null (the plain call). The types and scales are checked first, before the
/// backend, as in `pagedkv_cuda_kv_append_fp8`.
///
/// # Safety
/// 1. As `pagedkv_cuda_decode_attention` (the caches hold elements of `cache_dtype`).
/// 2. `scales` as in `pagedkv_cuda_kv_append_fp8`.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn pagedkv_cuda_decode_attention_fp8(
    b: *mut pagedkv_cuda_backend,
    shape: *const pagedkv_decode_shape,
    dtype: i32,
    cache_dtype: i32,
    scales: *const pagedkv_kv_scales,
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
    let io = DecodePtrs {
        scale,
        q,
        key_cache,
        value_cache,
        block_tables,
        block_tables_len,
        context_lens,
        context_lens_len,
        out,
    };
    guard(|| {
        let run = || -> Result<pagedkv_status, pagedkv_status> {
            // SAFETY: the caller's contract (1: `shape`).
            let c = unsafe { read_shape(shape)? };
            // SAFETY: the caller's contract (2).
            let t = unsafe { kv_types(dtype, cache_dtype, scales, c.num_kv_heads)? };
            // SAFETY: the caller's contract (1).
            Ok(with_cuda(b, |g| unsafe { decode_on(g, c, t, io) }))
        };
        run().unwrap_or_else(|st| st)
    })
}

/// The softmax scale and the caller's buffers of a decode: device pointers, and the
/// host tables.
#[derive(Clone, Copy)]
struct DecodePtrs {
    scale: f32,
    q: u64,
    key_cache: u64,
    value_cache: u64,
    block_tables: *const i32,
    block_tables_len: u64,
    context_lens: *const i32,
    context_lens_len: u64,
    out: u64,
}

/// `*shape`, or `PAGEDKV_ERR_NULL` when it is null.
///
/// # Safety
/// `shape` is null or valid for a read.
unsafe fn read_shape(
    shape: *const pagedkv_decode_shape,
) -> Result<pagedkv_decode_shape, pagedkv_status> {
    if shape.is_null() {
        return Err(fail(PAGEDKV_ERR_NULL, "shape is null"));
    }
    // SAFETY: non-null, valid for a read.
    Ok(unsafe { shape.read() })
}

/// Decode attention on `g` with the types `t` (checked): the body of both C functions.
///
/// # Safety
/// `io`'s device pointers are allocations in `g`'s context of the sizes `c` and `t`
/// imply, unused by other work until the launch completes; its host arrays are null or
/// valid for their `*_len` reads.
unsafe fn decode_on(
    g: &CudaDevice,
    c: pagedkv_decode_shape,
    t: KvTypes,
    io: DecodePtrs,
) -> Result<(), pagedkv_status> {
    let m = |e: Error| from_error(&e);
    let sh = DecodeShape::from(c);
    pagedkv::host::ops::check_layout(&sh.layout()).map_err(m)?;
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
    check_len("block_tables", io.block_tables_len, btn)?;
    check_len("context_lens", io.context_lens_len, c.num_seqs as u64)?;
    // SAFETY: the caller's contract.
    let (bt, cl) = unsafe {
        (
            slice(io.block_tables, io.block_tables_len, "block_tables")?,
            slice(io.context_lens, io.context_lens_len, "context_lens")?,
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
        (
            B::new(g, io.q, t.q, &qs).map_err(m)?,
            B::new(g, io.key_cache, t.cache, &pool).map_err(m)?,
            B::new(g, io.value_cache, t.cache, &pool).map_err(m)?,
            B::new(g, io.out, t.q, &qs).map_err(m)?,
        )
    };
    let mut opts = AttentionOptions::new(c.head_dim.max(1));
    opts.scale = io.scale;
    g.paged_decode_attention(
        DecodeInputs {
            shape: &sh,
            opts: &opts,
            q: &qt,
            key_cache: &kc,
            value_cache: &vc,
            block_tables: bt,
            context_lens: cl,
            plan: None,
            kv_scales: t.scales.as_ref(),
            sinks: None,
        },
        &mut *ot,
    )
    .map(|_| ())
    .map_err(m)
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
        // One type for q, out and the caches: this function takes no fp8 scales.
        let dt = KvTypes::plain(dtype_of(dtype)?)?.q;
        // SAFETY: the caller's contract.
        let c = unsafe { read_shape(shape)? };
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
            kv_dtype: dt,
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
            window: None,
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
        let mut opts = AttentionOptions::new(c.head_dim.max(1));
        opts.scale = scale;
        r.decode(
            &opts,
            DecodeIo {
                lse: None,
                q: qv,
                key_cache: kv,
                value_cache: vv,
                sinks: None,
                out: ov,
                kv_scales: None,
                group: 0,
            },
        )
        .map(|_| ())
        .map_err(m)
    })
}

/// Merges partial attention states on the GPU (see `pagedkv_merge_states`), on device
/// buffers of `dtype` (f16, bf16 or f32; fp8 is `PAGEDKV_ERR_INVALID_ARGUMENT`): `v`
/// `[num_rows, num_states, num_heads, head_dim]` of `dtype`; `lse` `[num_rows,
/// num_states, num_heads]` f32; `out` `[num_rows, num_heads, head_dim]` of `dtype`;
/// `lse_out` `[num_rows, num_heads]` f32, or 0 for none. `sinks` is host memory
/// (`[num_heads]` f32, or null with `sinks_len` 0). The shape, the dtype and the sinks
/// are checked before the backend; asynchronous on the backend's stream.
///
/// # Safety
/// 1. The device pointers are allocations in the backend's context of at least the
///    sizes the shape implies, 16-byte aligned, unused by other work until the launch
///    completes.
/// 2. `shape` is null or valid for a read; `sinks` is null or valid for `sinks_len`
///    reads.
/// 3. `out` and `lse_out` overlap neither `v` nor `lse`.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn pagedkv_cuda_merge_states(
    b: *mut pagedkv_cuda_backend,
    shape: *const crate::pagedkv_merge_shape,
    dtype: i32,
    v: u64,
    lse: u64,
    sinks: *const f32,
    sinks_len: u64,
    out: u64,
    lse_out: u64,
) -> pagedkv_status {
    use pagedkv::host::DType;
    use pagedkv::host::ops::attention::AttentionOut;
    use pagedkv::host::ops::merge::MergeInputs;
    guard(|| {
        let run = || -> Result<pagedkv_status, pagedkv_status> {
            // SAFETY: the caller's contract (2).
            let (s, [vn, ln, on, lon]) = unsafe { crate::merge::read_merge_shape(shape)? };
            let d = dtype_of(dtype)?;
            if d.is_fp8() {
                return Err(fail(
                    PAGEDKV_ERR_INVALID_ARGUMENT,
                    format!("invalid argument `dtype`: {d}: partial outputs are f16, bf16 or f32"),
                ));
            }
            // SAFETY: the caller's contract (2).
            let sinks =
                unsafe { crate::merge::optional(sinks, sinks_len, s.num_heads as u64, "sinks")? };
            Ok(with_cuda(b, |g| {
                let m = |e: Error| from_error(&e);
                // SAFETY: the caller's contract (1).
                let (vt, lt, mut ot, mut lot) = unsafe {
                    use pagedkv::cuda::BorrowedDeviceTensor as B;
                    (
                        B::new(g, v, d, &[vn as usize]).map_err(m)?,
                        B::new(g, lse, DType::F32, &[ln as usize]).map_err(m)?,
                        B::new(g, out, d, &[on as usize]).map_err(m)?,
                        if lse_out == 0 {
                            None
                        } else {
                            Some(B::new(g, lse_out, DType::F32, &[lon as usize]).map_err(m)?)
                        },
                    )
                };
                let inputs = MergeInputs {
                    shape: &s,
                    v: &*vt,
                    lse: &*lt,
                    sinks,
                };
                let to = AttentionOut {
                    out: &mut *ot,
                    lse: lot.as_deref_mut(),
                };
                g.merge_states(inputs, to).map_err(m)
            }))
        };
        run().unwrap_or_else(|s| s)
    })
}

//! The CPU reference kernels: decode attention and `kv_append` on host `f32` buffers.
//!
//! These are the crate's reference implementations (f64 arithmetic), exposed so that a
//! C engine can check its own kernels, or the CUDA backend's, against a known answer
//! on small inputs. They are slow by design; nothing here is meant for serving.
//!
//! Both take the same cache layout as the GPU kernels: two pools (K and V) of
//! `[num_blocks, num_kv_heads, block_size, head_dim]` elements. Attention takes its
//! sizes as a [`pagedkv_decode_shape`]:
//!
//! ```c
//! pagedkv_decode_shape sh = {.num_seqs = 2, .num_q_heads = 4, .num_kv_heads = 2,
//!                            .head_dim = 64, .block_size = 16, .num_blocks = 6,
//!                            .max_blocks_per_seq = 3};
//! /* q, out: 2 * 4 * 64 = 512; caches: 6 * 2 * 16 * 64; tables: 2 * 3; lens: 2 */
//! pagedkv_reference_decode_attention(&sh, 0.125f, q, 512, kc, vc, 6 * 2 * 16 * 64,
//!                                    tables, 6, lens, 2, out, 512);
//! ```
//!
//! Every buffer comes with its element count, and each count must equal the one the
//! shape implies (`PAGEDKV_ERR_INVALID_ARGUMENT` naming it otherwise), checked before
//! anything is read: the order of [`crate::args`]. The contents are validated next by
//! the same checks the GPU path runs (block ids inside the pool, context lengths inside
//! the tables). [`pagedkv_reference_kv_append`] takes the layout as four numbers and
//! writes token `i`'s K/V rows into slot `slot_mapping[i]` (a negative slot is skipped).
//!
//! Inside, the buffers are copied into the crate's `HostTensor`s, the reference runs,
//! and the result is copied back into the caller's output buffer(s): simple, and the
//! caller's memory is only touched through checked slices.

use pagedkv::host::ops::attention::{AttentionOptions, DecodeInputs, DecodeShape};
use pagedkv::host::ops::kv_append::{KvAppendInputs, kv_append_reference};
use pagedkv::host::reference::paged_decode_attention;
use pagedkv::host::{DType, HostTensor};
use pagedkv::kernels::PagedLayout;

use crate::args::{
    check_len, checked_elems, pagedkv_decode_shape, pool_elems, slice, slice_mut, token_elems,
};
use crate::guard::guard;
use crate::pagedkv_status::{self, *};
use crate::status::{fail, from_error};

/// The `f32` buffer `v` as a host tensor of `shape` (its length).
pub(crate) fn tensor(v: &[f32], shape: &[usize]) -> HostTensor {
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
            let mut opts = AttentionOptions::new(sh.head_dim.max(1));
            opts.scale = scale;
            let inputs = DecodeInputs {
                shape: &sh,
                opts: &opts,
                q: &qt,
                key_cache: &kt,
                value_cache: &vt,
                block_tables: bt,
                context_lens: cl,
                plan: None,
                kv_scales: None,
                sinks: None,
            };
            pagedkv::host::ops::attention::validate(&inputs, &ot).map_err(|e| from_error(&e))?;
            let r = paged_decode_attention(&inputs);
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
            let n = token_elems(num_tokens, num_kv_heads, head_dim)?;
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
            kv_append_reference(KvAppendInputs {
                layout: &layout,
                key: &kt,
                value: &vt,
                slot_mapping: sm,
                key_cache: &mut kct,
                value_cache: &mut vct,
                scales: None,
            })
            .map_err(|e| from_error(&e))?;
            kc.copy_from_slice(kct.buf().as_slice::<f32>());
            vc.copy_from_slice(vct.buf().as_slice::<f32>());
            Ok(PAGEDKV_OK)
        };
        run().unwrap_or_else(|s| s)
    })
}

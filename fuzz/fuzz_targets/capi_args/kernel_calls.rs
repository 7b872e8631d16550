//! The kernels' calls: the CPU reference kernels on real host buffers with fuzzed
//! shapes and counts (each buffer really as long as the count passed), and the CUDA
//! entry points without a device or on a null backend.

use std::ptr::{null, null_mut};

use libfuzzer_sys::arbitrary::{Result, Unstructured};
use pagedkv_c::pagedkv_status::*;
use pagedkv_c::*;

use crate::check;
use crate::generate::{LAYOUT_U32, floats, length, pick_u32, product, ptr};

/// Most elements of one buffer the target allocates for a kernel argument.
const MAX_ELEMS: u64 = 1 << 16;
/// Most elements of the attention's block tables and queries (its cost grows with both).
const MAX_TABLE: u64 = 256;
const MAX_Q: u64 = 4096;

pub(crate) fn reference_kv_append(u: &mut Unstructured) -> Result<()> {
    let nb = pick_u32(u, LAYOUT_U32)?;
    let nh = pick_u32(u, LAYOUT_U32)?;
    let bs = pick_u32(u, &[8, 16, 32, 0, 12])?;
    let hd = pick_u32(u, &[32, 64, 80, 96, 112, 128, 256, 0, 1, 63])?;
    let row = nh as u64 * hd as u64;
    // key/value hold num_tokens rows: the library cannot know their length, so the
    // count must really fit (or be 0).
    let max_tokens = if row == 0 {
        8
    } else {
        (MAX_ELEMS / row).min(8)
    };
    let num_tokens = u.int_in_range(0..=max_tokens)?;
    let kn = num_tokens * row;
    let mut k = floats(u, kn)?;
    let mut v = floats(u, kn)?;
    let slots_implied = product(&[nb, bs]).unwrap_or(u64::MAX);
    let mut slots: Vec<i64> = (0..num_tokens)
        .map(|_| {
            Ok(match u.int_in_range(0..=5)? {
                0 => u.arbitrary()?,
                1 => -1,
                _ => u.int_in_range(0..=slots_implied.min(1 << 20) as i64)?,
            })
        })
        .collect::<Result<_>>()?;
    let cache_len = length(u, product(&[nb, nh, bs, hd]), MAX_ELEMS)?;
    let mut kc = vec![0f32; cache_len as usize];
    let mut vc = vec![0f32; cache_len as usize];
    let (kp, vp, sp) = (ptr(u, &mut k)?, ptr(u, &mut v)?, ptr(u, &mut slots)?);
    let (kcp, vcp) = (ptr(u, &mut kc)?, ptr(u, &mut vc)?);
    // SAFETY: each pointer null or valid for its length.
    check(
        unsafe {
            pagedkv_reference_kv_append(nb, nh, bs, hd, kp, vp, num_tokens, sp, kcp, vcp, cache_len)
        },
        "reference_kv_append",
    );
    Ok(())
}

pub(crate) fn reference_attention(u: &mut Unstructured) -> Result<()> {
    let sh = pagedkv_decode_shape {
        num_seqs: pick_u32(u, &[0, 1, 2, 3, 4, 1 << 16, u32::MAX])?,
        num_q_heads: pick_u32(u, &[0, 1, 2, 4, 8, 3, 1 << 20])?,
        num_kv_heads: pick_u32(u, &[0, 1, 2, 4, 1 << 20, u32::MAX])?,
        head_dim: pick_u32(u, &[32, 64, 80, 96, 112, 128, 256, 0, 65])?,
        block_size: pick_u32(u, &[8, 16, 32, 0, 12])?,
        num_blocks: pick_u32(u, &[0, 1, 2, 4, 8, 1 << 31, u32::MAX])?,
        max_blocks_per_seq: pick_u32(u, &[0, 1, 2, 4, 8, u32::MAX])?,
        reserved: u.arbitrary()?,
    };
    let qn = product(&[sh.num_seqs, sh.num_q_heads, sh.head_dim]);
    let q_len = length(u, qn, MAX_Q)?;
    let out_len = length(u, qn, MAX_Q)?;
    let cache_len = length(
        u,
        product(&[sh.num_blocks, sh.num_kv_heads, sh.block_size, sh.head_dim]),
        MAX_ELEMS,
    )?;
    let bt_len = length(u, product(&[sh.num_seqs, sh.max_blocks_per_seq]), MAX_TABLE)?;
    let cl_len = length(u, Some(sh.num_seqs as u64), MAX_TABLE)?;
    let mut q = floats(u, q_len)?;
    let mut kc = floats(u, cache_len)?;
    let mut vc = floats(u, cache_len)?;
    let mut out = vec![0f32; out_len as usize];
    let ctx_max = (sh.max_blocks_per_seq as i64).saturating_mul(sh.block_size as i64);
    let mut bt: Vec<i32> = (0..bt_len)
        .map(|_| {
            Ok(match u.int_in_range(0..=5)? {
                0 => u.arbitrary()?,
                1 => -1,
                _ => u.int_in_range(0..=sh.num_blocks.min(64) as i32)?,
            })
        })
        .collect::<Result<_>>()?;
    let mut cl: Vec<i32> = (0..cl_len)
        .map(|_| {
            Ok(match u.int_in_range(0..=4)? {
                0 => u.arbitrary()?,
                1 => 0,
                _ => u.int_in_range(1..=ctx_max.clamp(1, i32::MAX as i64) as i32)?,
            })
        })
        .collect::<Result<_>>()?;
    let scale = match u.int_in_range(0..=5)? {
        0 => u.arbitrary()?,
        1 => 0.0,
        2 => f32::NAN,
        _ => 0.125,
    };
    let (qp, kp, vp) = (ptr(u, &mut q)?, ptr(u, &mut kc)?, ptr(u, &mut vc)?);
    let (bp, cp, op) = (ptr(u, &mut bt)?, ptr(u, &mut cl)?, ptr(u, &mut out)?);
    let shp: *const pagedkv_decode_shape = if u.ratio(1, 24)? { null() } else { &sh };
    // SAFETY: each pointer null or valid for its length.
    check(
        unsafe {
            pagedkv_reference_decode_attention(
                shp, scale, qp, q_len, kp, vp, cache_len, bp, bt_len, cp, cl_len, op, out_len,
            )
        },
        "reference_decode_attention",
    );
    Ok(())
}

/// The CUDA entry points: backend creation (a CUDA error without a driver), and calls
/// on a null backend. Never arbitrary device pointers on a real backend: those are the
/// caller's contract, not something the library can check.
/// A shape of `num_seqs` one-block sequences over a one-block pool (head_dim 64).
fn one_block_shape(num_seqs: u32) -> pagedkv_decode_shape {
    pagedkv_decode_shape {
        num_seqs,
        num_q_heads: 1,
        num_kv_heads: 1,
        head_dim: 64,
        block_size: 16,
        num_blocks: 1,
        max_blocks_per_seq: 1,
        reserved: 0,
    }
}

/// A row stride: dense (0), small, or near `u64::MAX`.
fn stride(u: &mut Unstructured) -> Result<u64> {
    Ok(match u.int_in_range(0..=3)? {
        0 => 0,
        1 => u.int_in_range(0..=4096)?,
        2 => u64::MAX - u.int_in_range(0..=4096u64)?,
        _ => u.arbitrary()?,
    })
}

pub(crate) fn cuda(u: &mut Unstructured) -> Result<()> {
    match u.int_in_range(0..=4)? {
        4 => {
            // The strided decode with any strides: without a backend (no GPU here)
            // refused as null before anything else is read; on a GPU machine, with
            // one, the strides' span is checked arithmetic (a dead device pointer
            // would be the caller's bug, so none is passed: the shape refuses first).
            let sh = one_block_shape(u.int_in_range(0..=3)?);
            let (bt, cl) = ([0i32; 3], [1i32; 3]);
            // SAFETY: a null backend is refused first.
            let r = unsafe {
                pagedkv_cuda_decode_attention_strided(
                    null_mut(),
                    &sh,
                    u.arbitrary()?,
                    u.arbitrary()?,
                    u.arbitrary()?,
                    stride(u)?,
                    u.arbitrary()?,
                    u.arbitrary()?,
                    bt.as_ptr(),
                    sh.num_seqs as u64,
                    cl.as_ptr(),
                    sh.num_seqs as u64,
                    u.arbitrary()?,
                    stride(u)?,
                )
            };
            assert_eq!(check(r, "cuda_decode_attention_strided"), PAGEDKV_ERR_NULL);
        }
        0 => {
            let mut b = null_mut();
            let ordinal: i32 = if u.ratio(1, 2)? { 0 } else { u.arbitrary()? };
            let op = if u.ratio(1, 8)? {
                null_mut()
            } else {
                &mut b as *mut *mut pagedkv_cuda_backend
            };
            // SAFETY: out null or valid for a write.
            if check(
                unsafe { pagedkv_cuda_backend_create(ordinal, op) },
                "cuda_backend_create",
            ) == PAGEDKV_OK
            {
                // SAFETY: just created; destroyed once.
                let r = unsafe { pagedkv_cuda_backend_destroy(b) };
                assert_eq!(check(r, "cuda_backend_destroy"), PAGEDKV_OK);
            }
        }
        1 => {
            let slots = [0i64; 4];
            // SAFETY: a null backend is refused first.
            let r = unsafe {
                pagedkv_cuda_kv_append(
                    null_mut(),
                    u.arbitrary()?,
                    u.arbitrary()?,
                    u.arbitrary()?,
                    u.arbitrary()?,
                    u.arbitrary()?,
                    u.arbitrary()?,
                    u.arbitrary()?,
                    4,
                    slots.as_ptr(),
                    u.arbitrary()?,
                    u.arbitrary()?,
                )
            };
            assert_eq!(check(r, "cuda_kv_append"), PAGEDKV_ERR_NULL);
        }
        2 => {
            let sh = one_block_shape(1);
            let (bt, cl) = ([0i32], [1i32]);
            // SAFETY: a null backend is refused first.
            let r = unsafe {
                pagedkv_cuda_decode_attention(
                    null_mut(),
                    &sh,
                    u.arbitrary()?,
                    u.arbitrary()?,
                    u.arbitrary()?,
                    u.arbitrary()?,
                    u.arbitrary()?,
                    bt.as_ptr(),
                    1,
                    cl.as_ptr(),
                    1,
                    u.arbitrary()?,
                )
            };
            assert_eq!(check(r, "cuda_decode_attention"), PAGEDKV_ERR_NULL);
        }
        _ => {
            // SAFETY: a null backend is refused.
            let r = unsafe { pagedkv_cuda_synchronize(null_mut()) };
            assert_eq!(check(r, "cuda_synchronize"), PAGEDKV_ERR_NULL);
            let r = unsafe { pagedkv_cuda_backend_destroy(null_mut()) };
            assert_eq!(check(r, "cuda_backend_destroy"), PAGEDKV_ERR_NULL);
        }
    }
    Ok(())
}

/// `pagedkv_merge_states` with fuzzed shapes, counts, nulls and values (lse of `-inf`
/// and NaN among them), each buffer as long as the count passed.
pub(crate) fn merge_states(u: &mut Unstructured) -> Result<()> {
    let sh = pagedkv_merge_shape {
        num_rows: pick_u32(u, &[0, 1, 2, 3, 17, 1 << 16, u32::MAX])?,
        num_states: pick_u32(u, &[0, 1, 2, 3, 1 << 20, u32::MAX])?,
        num_heads: pick_u32(u, &[0, 1, 2, 3, 8, 1 << 20, u32::MAX])?,
        head_dim: pick_u32(u, &[32, 64, 80, 96, 112, 128, 256, 0, 65])?,
    };
    let v_len = length(
        u,
        product(&[sh.num_rows, sh.num_states, sh.num_heads, sh.head_dim]),
        MAX_ELEMS,
    )?;
    let lse_len = length(
        u,
        product(&[sh.num_rows, sh.num_states, sh.num_heads]),
        MAX_Q,
    )?;
    let out_len = length(
        u,
        product(&[sh.num_rows, sh.num_heads, sh.head_dim]),
        MAX_ELEMS,
    )?;
    let lse_out_len = length(u, product(&[sh.num_rows, sh.num_heads]), MAX_Q)?;
    let sinks_len = length(u, Some(sh.num_heads as u64), MAX_TABLE)?;
    let mut v = floats(u, v_len)?;
    let mut lse: Vec<f32> = (0..lse_len)
        .map(|_| {
            Ok(match u.int_in_range(0..=4)? {
                0 => f32::NEG_INFINITY,
                1 => f32::NAN,
                _ => u.arbitrary()?,
            })
        })
        .collect::<Result<_>>()?;
    let mut sinks = floats(u, sinks_len)?;
    let mut out = vec![0f32; out_len as usize];
    let mut lse_out = vec![0f32; lse_out_len as usize];
    let shape = if u.int_in_range(0..=9)? == 0 {
        null()
    } else {
        &sh as *const _
    };
    let (vp, lp, sp) = (ptr(u, &mut v)?, ptr(u, &mut lse)?, ptr(u, &mut sinks)?);
    let (op, lop) = (ptr(u, &mut out)?, ptr(u, &mut lse_out)?);
    // SAFETY: each pointer null or valid for its length.
    check(
        unsafe {
            pagedkv_merge_states(
                shape,
                vp,
                v_len,
                lp,
                lse_len,
                sp,
                sinks_len,
                op,
                out_len,
                lop,
                lse_out_len,
            )
        },
        "merge_states",
    );
    Ok(())
}

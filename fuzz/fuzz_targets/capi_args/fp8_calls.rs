//! The fp8 entry points: the CUDA calls' type and scale checks, which run on the host
//! before the backend is looked at (so a null backend reaches every one of them and
//! must still be refused), and the CPU scale calibration on real host buffers.

use std::ptr::{null, null_mut};

use libfuzzer_sys::arbitrary::{Result, Unstructured};
use pagedkv_c::pagedkv_status::*;
use pagedkv_c::*;

use crate::check;
use crate::generate::{LAYOUT_U32, floats, pick_u32, product, ptr};

/// Most elements of one buffer the calibration call gets.
const MAX_ELEMS: u64 = 1 << 16;
/// Most KV heads a scales array or an output is allocated for.
const MAX_HEADS: u64 = 1 << 12;

/// A dtype code: every valid one (f32, f16, bf16, e4m3, e5m2), and some that are not.
fn dtype(u: &mut Unstructured) -> Result<i32> {
    Ok(match u.int_in_range(0..=7)? {
        0..=4 => u.int_in_range(0..=4)?,
        5 => -1,
        6 => 5,
        _ => u.arbitrary()?,
    })
}

/// One scale: usually valid, sometimes zero, negative, NaN or infinite.
fn scale(u: &mut Unstructured) -> Result<f32> {
    Ok(match u.int_in_range(0..=7)? {
        0 => 0.0,
        1 => -1.0,
        2 => f32::NAN,
        3 => f32::INFINITY,
        4 => u.arbitrary()?,
        _ => 0.5,
    })
}

/// The scales argument: its arrays (really `len` floats each) and the struct naming
/// them; the struct's pointers stay valid while the arrays live.
struct Scales {
    _k: Vec<f32>,
    _v: Vec<f32>,
    s: pagedkv_kv_scales,
}

fn scales(u: &mut Unstructured, heads: u32) -> Result<Scales> {
    let len = if u.ratio(3, 4)? && (heads as u64) <= MAX_HEADS {
        heads as u64
    } else {
        u.int_in_range(0..=8)?
    };
    let mut k = (0..len).map(|_| scale(u)).collect::<Result<Vec<_>>>()?;
    let mut v = (0..len).map(|_| scale(u)).collect::<Result<Vec<_>>>()?;
    let s = pagedkv_kv_scales {
        k: ptr(u, &mut k)?,
        v: ptr(u, &mut v)?,
        len,
    };
    Ok(Scales { _k: k, _v: v, s })
}

/// `&s.s`, or sometimes null.
fn scales_ptr(u: &mut Unstructured, s: &Scales) -> Result<*const pagedkv_kv_scales> {
    Ok(if u.ratio(1, 6)? { null() } else { &s.s })
}

pub(crate) fn fp8(u: &mut Unstructured) -> Result<()> {
    match u.int_in_range(0..=2)? {
        0 => {
            let heads = pick_u32(u, LAYOUT_U32)?;
            let (dt, ct) = (dtype(u)?, dtype(u)?);
            let s = scales(u, heads)?;
            let sp = scales_ptr(u, &s)?;
            let slots = [0i64; 4];
            // SAFETY: a null backend; `sp` null or a struct whose arrays hold `len`
            // floats (or are null); the device pointers are never dereferenced.
            let r = unsafe {
                pagedkv_cuda_kv_append_fp8(
                    null_mut(),
                    pick_u32(u, LAYOUT_U32)?,
                    heads,
                    pick_u32(u, &[8, 16, 32, 0, 12])?,
                    pick_u32(u, &[64, 128, 256, 0, 65])?,
                    dt,
                    ct,
                    sp,
                    u.arbitrary()?,
                    u.arbitrary()?,
                    4,
                    slots.as_ptr(),
                    u.arbitrary()?,
                    u.arbitrary()?,
                )
            };
            assert_ne!(check(r, "cuda_kv_append_fp8"), PAGEDKV_OK, "null backend");
        }
        1 => {
            let sh = pagedkv_decode_shape {
                num_seqs: 1,
                num_q_heads: pick_u32(u, &[1, 2, 4, 8, 0, 3])?,
                num_kv_heads: pick_u32(u, &[1, 2, 4, 0, 3, u32::MAX])?,
                head_dim: pick_u32(u, &[64, 128, 256, 0, 65])?,
                block_size: 16,
                num_blocks: 1,
                max_blocks_per_seq: 1,
                reserved: 0,
            };
            let (dt, ct) = (dtype(u)?, dtype(u)?);
            let s = scales(u, sh.num_kv_heads)?;
            let sp = scales_ptr(u, &s)?;
            let shp: *const pagedkv_decode_shape = if u.ratio(1, 12)? { null() } else { &sh };
            let (bt, cl) = ([0i32], [1i32]);
            // SAFETY: as above; `shp` null or a valid shape, the tables one entry each.
            let r = unsafe {
                pagedkv_cuda_decode_attention_fp8(
                    null_mut(),
                    shp,
                    dt,
                    ct,
                    sp,
                    0.125,
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
            assert_ne!(
                check(r, "cuda_decode_attention_fp8"),
                PAGEDKV_OK,
                "null backend"
            );
        }
        _ => calibrate(u)?,
    }
    Ok(())
}

/// `pagedkv_kv_scales_calibrate` on real buffers: the inputs hold exactly the
/// elements the sizes imply (or are null when those would be too many), the outputs
/// `num_kv_heads` floats (or are null). On success every output scale is finite and
/// positive.
fn calibrate(u: &mut Unstructured) -> Result<()> {
    let ct = dtype(u)?;
    let heads = pick_u32(u, &[1, 2, 8, 0, 3, 1 << 20, u32::MAX])?;
    let hd = pick_u32(u, &[64, 128, 0, 1, 3, u32::MAX])?;
    let tokens: u64 = match u.int_in_range(0..=5)? {
        0 => u.arbitrary()?,
        1 => 0,
        _ => u.int_in_range(1..=8)?,
    };
    let n = product(&[heads, hd]).and_then(|x| x.checked_mul(tokens));
    let (mut k, mut v) = match n {
        Some(n) if n <= MAX_ELEMS => (floats(u, n)?, floats(u, n)?),
        _ => (Vec::new(), Vec::new()),
    };
    if u.ratio(1, 8)?
        && let Some(x) = k.first_mut()
    {
        *x = f32::NAN;
    }
    let fits = n.is_some_and(|n| n <= MAX_ELEMS);
    let (kp, vp) = if fits {
        (ptr(u, &mut k)?, ptr(u, &mut v)?)
    } else {
        (null_mut(), null_mut())
    };
    let outs = if (heads as u64) <= MAX_HEADS {
        heads as usize
    } else {
        0
    };
    let (mut ok, mut ov) = (vec![0f32; outs], vec![0f32; outs]);
    let (okp, ovp) = if outs > 0 || heads == 0 {
        (ptr(u, &mut ok)?, ptr(u, &mut ov)?)
    } else {
        (null_mut(), null_mut())
    };
    // SAFETY: inputs null or valid for `tokens * heads * hd` reads, outputs null or
    // valid for `heads` writes.
    let r = unsafe { pagedkv_kv_scales_calibrate(ct, heads, hd, kp, vp, tokens, okp, ovp) };
    if check(r, "kv_scales_calibrate") == PAGEDKV_OK {
        for s in ok.iter().chain(&ov) {
            assert!(s.is_finite() && *s > 0.0, "calibrated scale {s}");
        }
    }
    Ok(())
}

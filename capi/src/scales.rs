//! fp8 KV caches for C: the per-KV-head scales, how the fp8 CUDA functions check them,
//! and a CPU calibration.
//!
//! An fp8 cache (`PAGEDKV_E4M3`, `PAGEDKV_E5M2`: cache types only) stores each K (V)
//! element of KV head `h` as `encode(x / k[h])` (`v[h]`); the kernels read it back as
//! `decode(b) * k[h]`. Queries, outputs and new K/V stay f16 or bf16. The scales travel
//! as a [`pagedkv_kv_scales`]: two host arrays of `len` floats, one per KV head, which
//! [`pagedkv_kv_scales_calibrate`] can compute from sample keys and values:
//!
//! ```c
//! float ks[8], vs[8]; /* 8 KV heads of head_dim 128; keys, values: [n, 8, 128] */
//! pagedkv_kv_scales_calibrate(PAGEDKV_E4M3, 8, 128, keys, values, n, ks, vs);
//! pagedkv_kv_scales sc = {.k = ks, .v = vs, .len = 8};
//! pagedkv_cuda_kv_append_fp8(gpu, num_blocks, 8, 16, 128, PAGEDKV_F16, PAGEDKV_E4M3, &sc,
//!                            k, v, num_tokens, b.slot_mapping, kc, vc);
//! ```
//!
//! [`kv_types`] is the check the fp8 CUDA functions (`cuda_ops.rs`) run on these host
//! arguments first, before they look at the backend handle: the two dtype values, a
//! scales struct exactly when the cache is fp8, its length against the KV heads (before
//! reading it), then every scale finite and positive (the crate's `check_cache_types`,
//! whose messages name `kv_scales.k` / `kv_scales.v` and the head).

use pagedkv::host::DType;
use pagedkv::host::ops::scales::{KvScales, check_cache_types};

use crate::args::{check_len, slice, token_elems};
use crate::cuda::dtype_of;
use crate::guard::guard;
use crate::pagedkv_status::{self, *};
use crate::status::{fail, from_error};

/// The per-KV-head scales of an fp8 cache: K element `b` of KV head `h` stands for
/// `decode(b) * k[h]`, V likewise with `v[h]`. Host memory, read during the call only.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct pagedkv_kv_scales {
    /// `[len]`: the K scale of each KV head (finite, > 0).
    pub k: *const f32,
    /// `[len]`: the V scale of each KV head (finite, > 0).
    pub v: *const f32,
    /// Elements of `k` and of `v`: the number of KV heads.
    pub len: u64,
}

/// The query (and output, new K/V) type, the cache type and the scales of a call, as
/// [`kv_types`] checked them.
pub(crate) struct KvTypes {
    /// Queries, outputs, new K/V.
    pub q: DType,
    /// The caches.
    pub cache: DType,
    /// For an fp8 cache, its scales; `None` for a cache of the query type.
    pub scales: Option<KvScales>,
}

impl KvTypes {
    /// One type for everything, unscaled: the functions without a cache type, where an
    /// fp8 type would be fp8 queries (`PAGEDKV_ERR_INVALID_ARGUMENT`, pointing to the
    /// `_fp8` functions).
    pub fn plain(dtype: DType) -> Result<Self, pagedkv_status> {
        if dtype.is_fp8() {
            return Err(fail(
                PAGEDKV_ERR_INVALID_ARGUMENT,
                format!(
                    "invalid argument `dtype`: {dtype} is a cache type only, and this function takes one type for queries and caches; an fp8 cache goes through pagedkv_cuda_kv_append_fp8 and pagedkv_cuda_decode_attention_fp8"
                ),
            ));
        }
        Ok(KvTypes {
            q: dtype,
            cache: dtype,
            scales: None,
        })
    }
}

/// Checks the host arguments of an fp8 CUDA call: `dtype` and `cache_dtype` are
/// [`pagedkv_dtype`](crate::pagedkv_dtype) values, `scales` is non-null exactly when
/// the cache is fp8 (null there is `PAGEDKV_ERR_NULL`), its `len` is `num_kv_heads`
/// (checked before its arrays are read), and the pair and every scale pass the crate's
/// `check_cache_types` (`PAGEDKV_ERR_INVALID_ARGUMENT` with its message otherwise).
///
/// # Safety
/// `scales` is null or valid for a read, and its `k` and `v` are null or valid for
/// `len` reads.
pub(crate) unsafe fn kv_types(
    dtype: i32,
    cache_dtype: i32,
    scales: *const pagedkv_kv_scales,
    num_kv_heads: u32,
) -> Result<KvTypes, pagedkv_status> {
    let (q, cache) = (dtype_of(dtype)?, dtype_of(cache_dtype)?);
    let scales = if scales.is_null() {
        if cache.is_fp8() {
            return Err(fail(
                PAGEDKV_ERR_NULL,
                format!("scales is null: an {cache} cache needs one K and one V scale per KV head"),
            ));
        }
        None
    } else if !cache.is_fp8() {
        // Scales for an unscaled cache: refused below without reading them.
        Some(KvScales {
            k: Vec::new(),
            v: Vec::new(),
        })
    } else {
        // SAFETY: non-null, valid for a read (the caller's contract).
        let s = unsafe { scales.read() };
        check_len("scales.len", s.len, num_kv_heads as u64)?;
        // SAFETY: the caller's contract, for `len` elements.
        let (k, v) = unsafe {
            (
                slice(s.k, s.len, "scales.k")?,
                slice(s.v, s.len, "scales.v")?,
            )
        };
        Some(KvScales {
            k: k.to_vec(),
            v: v.to_vec(),
        })
    };
    check_cache_types(q, cache, scales.as_ref(), num_kv_heads).map_err(|e| from_error(&e))?;
    Ok(KvTypes { q, cache, scales })
}

/// Calibrates an fp8 cache's scales on the CPU: for each KV head, the largest magnitude
/// of its elements in `keys` (`values`) over the `num_tokens` rows, mapped to the
/// largest finite value of `cache_dtype` (`amax / 448` for e4m3, `amax / 57344` for
/// e5m2; 1 for a head that is all zeros). `keys`, `values`: `[num_tokens, num_kv_heads,
/// head_dim]` f32; `out_k`, `out_v`: `num_kv_heads` floats each, written only on
/// success. A non-fp8 `cache_dtype`, zero heads or head size, a non-finite input, or a
/// size that overflows is `PAGEDKV_ERR_INVALID_ARGUMENT`.
///
/// # Safety
/// `keys` and `values` are null or valid for `num_tokens * num_kv_heads * head_dim`
/// reads; `out_k` and `out_v` are null or valid for `num_kv_heads` writes.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn pagedkv_kv_scales_calibrate(
    cache_dtype: i32,
    num_kv_heads: u32,
    head_dim: u32,
    keys: *const f32,
    values: *const f32,
    num_tokens: u64,
    out_k: *mut f32,
    out_v: *mut f32,
) -> pagedkv_status {
    guard(|| {
        let run = || -> Result<(), pagedkv_status> {
            let cache = dtype_of(cache_dtype)?;
            let n = token_elems(num_tokens, num_kv_heads, head_dim)?;
            for (p, what) in [(out_k, "out_k"), (out_v, "out_v")] {
                if p.is_null() {
                    return Err(fail(PAGEDKV_ERR_NULL, format!("{what} is null")));
                }
            }
            // SAFETY: the caller's contract for each pointer and length.
            let (k, v) = unsafe { (slice(keys, n, "keys")?, slice(values, n, "values")?) };
            let f64s = |x: &[f32]| x.iter().map(|&x| x as f64).collect::<Vec<_>>();
            let s = KvScales::calibrate(cache, num_kv_heads, head_dim, &f64s(k), &f64s(v))
                .map_err(|e| from_error(&e))?;
            // SAFETY: non-null (checked), valid for `num_kv_heads` writes (the caller's
            // contract); `s.k` and `s.v` hold one scale per KV head. Raw copies: no
            // `&mut` is made of caller memory that might overlap the inputs.
            unsafe {
                std::ptr::copy(s.k.as_ptr(), out_k, s.k.len());
                std::ptr::copy(s.v.as_ptr(), out_v, s.v.len());
            }
            Ok(())
        };
        run().err().unwrap_or(PAGEDKV_OK)
    })
}

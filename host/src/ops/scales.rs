//! [`KvScales`]: the per-KV-head scales of an fp8 cache, and which query type may read
//! which cache type.
//!
//! An fp8 cache ([`DType::E4m3`], [`DType::E5m2`]) stores each K (V) element of KV
//! head `h` as `encode(x / k[h])` (`v[h]`), rounding to nearest even and saturating to
//! the format's finite range; the kernels read it back as `decode(b) * k[h]`. A scale
//! per KV head keeps one head's outliers from costing every other head its precision;
//! one scale for the whole tensor is [`KvScales::per_tensor`].
//!
//! ```
//! use pagedkv_host::DType;
//! use pagedkv_host::ops::scales::KvScales;
//!
//! // Two KV heads of head_dim 4, two tokens: head 1 has an outlier of 100.
//! let k = [0.5, -1.0, 0.25, 2.0, /* head 1 */ 100.0, 1.0, -1.0, 0.5,
//!          1.0, 0.5, -0.5, 1.0, /* head 1 */ -3.0, 2.0, 1.0, 0.0];
//! let s = KvScales::calibrate(DType::E4m3, 2, 4, &k, &k).unwrap();
//! assert_eq!(s.k, vec![2.0 / 448.0, 100.0 / 448.0]);
//! ```

use crate::error::{Error, Result};
use crate::tensor::DType;

/// One K and one V scale per KV head, for an fp8 cache: a stored element `b` of head
/// `h` stands for `decode(b) * k[h]` (`v[h]` for V).
#[derive(Clone, Debug, PartialEq)]
pub struct KvScales {
    /// `[num_kv_heads]`: K scale of each KV head (finite, > 0).
    pub k: Vec<f32>,
    /// `[num_kv_heads]`: V scale of each KV head (finite, > 0).
    pub v: Vec<f32>,
}

impl KvScales {
    /// One K scale and one V scale for every KV head (per-tensor scaling).
    pub fn per_tensor(num_kv_heads: u32, k: f32, v: f32) -> Self {
        KvScales {
            k: vec![k; num_kv_heads as usize],
            v: vec![v; num_kv_heads as usize],
        }
    }

    /// Scales that map each KV head's largest magnitude in `keys` (`values`) to the
    /// largest finite value of `cache` (an fp8 type): `amax / max_finite`, or 1 for a
    /// head that is all zeros. `keys`, `values`: `[tokens, num_kv_heads, head_dim]`,
    /// finite and within f32's range (else an error naming the input and element).
    pub fn calibrate(
        cache: DType,
        num_kv_heads: u32,
        head_dim: u32,
        keys: &[f64],
        values: &[f64],
    ) -> Result<Self> {
        if !cache.is_fp8() {
            return Err(Error::invalid(
                "cache",
                format!("{cache} is not an fp8 type: only fp8 caches are scaled"),
            ));
        }
        let (h, d) = (num_kv_heads as usize, head_dim as usize);
        let amax = |xs: &[f64], arg: &'static str| -> Result<Vec<f32>> {
            if h == 0 || d == 0 || !xs.len().is_multiple_of(h * d) {
                return Err(Error::invalid(
                    arg,
                    format!(
                        "{} values is not a whole number of [{h}, {d}] rows",
                        xs.len()
                    ),
                ));
            }
            let mut m = vec![0f64; h];
            for (i, x) in xs.iter().enumerate() {
                if !x.is_finite() {
                    return Err(Error::invalid(arg, format!("element {i} is {x}")));
                }
                // No query type holds it, and its scale would not be finite in f32
                // (values near 1e300 once made infinite scales).
                if x.abs() > f32::MAX as f64 {
                    return Err(Error::invalid(
                        arg,
                        format!("element {i} is {x:e}: beyond f32, the widest query type"),
                    ));
                }
                let head = i / d % h;
                m[head] = m[head].max(x.abs());
            }
            // (At most f32::MAX / max_finite: finite.)
            Ok(m.into_iter().map(|a| scale_for(a, cache)).collect())
        };
        Ok(KvScales {
            k: amax(keys, "keys")?,
            v: amax(values, "values")?,
        })
    }

    /// As [`KvScales::calibrate`], with one scale per tensor: every head gets the
    /// largest magnitude over all heads.
    pub fn calibrate_per_tensor(
        cache: DType,
        num_kv_heads: u32,
        head_dim: u32,
        keys: &[f64],
        values: &[f64],
    ) -> Result<Self> {
        let s = Self::calibrate(cache, num_kv_heads, head_dim, keys, values)?;
        let max = |x: &[f32]| x.iter().cloned().fold(0f32, f32::max);
        Ok(KvScales::per_tensor(num_kv_heads, max(&s.k), max(&s.v)))
    }

    /// Checks there is one finite, positive K and V scale per KV head.
    pub fn validate(&self, num_kv_heads: u32) -> Result<()> {
        for (arg, xs) in [("kv_scales.k", &self.k), ("kv_scales.v", &self.v)] {
            if xs.len() != num_kv_heads as usize {
                return Err(Error::invalid(
                    arg,
                    format!("{} scales for {num_kv_heads} KV heads", xs.len()),
                ));
            }
            if let Some((h, x)) = xs
                .iter()
                .enumerate()
                .find(|(_, x)| !(x.is_finite() && **x > 0.0))
            {
                return Err(Error::invalid(
                    arg,
                    format!("KV head {h}: scale {x} (must be finite and > 0)"),
                ));
            }
        }
        Ok(())
    }
}

/// `amax / max_finite` as f32 (1 for an all-zero head), never 0 or subnormal-small
/// enough to overflow `x / scale` for the values it was calibrated on.
fn scale_for(amax: f64, cache: DType) -> f32 {
    if amax == 0.0 {
        1.0
    } else {
        ((amax / cache.max_finite() as f64) as f32).max(f32::MIN_POSITIVE)
    }
}

/// Checks that queries (and outputs, and new K/V) of type `q` may use a cache of type
/// `cache`: the cache is `q` itself, or fp8 under f16 or bf16 queries.
pub fn check_cache_pair(q: DType, cache: DType) -> Result<()> {
    if q.is_fp8() {
        return Err(Error::invalid(
            "dtype",
            format!("{q} is a cache type only: queries, outputs and new K/V are f16, bf16 or f32"),
        ));
    }
    if cache.is_fp8() && q == DType::F32 {
        return Err(Error::invalid(
            "dtype",
            format!("an fp8 cache serves f16 or bf16 queries, not {q}"),
        ));
    }
    if !cache.is_fp8() && cache != q {
        return Err(Error::invalid(
            "q",
            format!(
                "dtype {q} but the cache is {cache}: q, out and new K/V have the cache's type unless it is fp8"
            ),
        ));
    }
    Ok(())
}

/// As [`check_cache_pair`], and `scales` are there exactly for an fp8 cache, with one
/// valid K and V scale per KV head.
pub fn check_cache_types(
    q: DType,
    cache: DType,
    scales: Option<&KvScales>,
    num_kv_heads: u32,
) -> Result<()> {
    check_cache_pair(q, cache)?;
    match (cache.is_fp8(), scales) {
        (false, None) => Ok(()),
        (false, Some(_)) => Err(Error::invalid(
            "kv_scales",
            format!("given for {cache} caches: only fp8 caches are scaled"),
        )),
        (true, None) => Err(Error::invalid(
            "kv_scales",
            format!("missing: an {cache} cache needs one K and one V scale per KV head"),
        )),
        (true, Some(s)) => s.validate(num_kv_heads),
    }
}

/// Runs `$body` with `$t` bound to the kernel element type of the queries (`$q`) and
/// `$k` to the cache's (`$cache`), for the pairs [`check_cache_types`] admits; any
/// other pair returns an error from the enclosing function.
macro_rules! with_kv {
    ($q:expr, $cache:expr, $t:ident, $k:ident => $body:expr) => {{
        use $crate::tensor::DType as D;
        match ($q, $cache) {
            (D::F16, D::F16) => {
                type $t = pagedkv_kernels::F16;
                type $k = pagedkv_kernels::F16;
                $body
            }
            (D::Bf16, D::Bf16) => {
                type $t = pagedkv_kernels::Bf16;
                type $k = pagedkv_kernels::Bf16;
                $body
            }
            (D::F32, D::F32) => {
                type $t = f32;
                type $k = f32;
                $body
            }
            (D::F16, D::E4m3) => {
                type $t = pagedkv_kernels::F16;
                type $k = pagedkv_kernels::E4m3;
                $body
            }
            (D::F16, D::E5m2) => {
                type $t = pagedkv_kernels::F16;
                type $k = pagedkv_kernels::E5m2;
                $body
            }
            (D::Bf16, D::E4m3) => {
                type $t = pagedkv_kernels::Bf16;
                type $k = pagedkv_kernels::E4m3;
                $body
            }
            (D::Bf16, D::E5m2) => {
                type $t = pagedkv_kernels::Bf16;
                type $k = pagedkv_kernels::E5m2;
                $body
            }
            (q, c) => {
                return Err($crate::error::Error::invalid(
                    "dtype",
                    format!("no kernel for {q} queries over {c} caches"),
                ));
            }
        }
    }};
}
pub(crate) use with_kv;

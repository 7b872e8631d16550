//! fp8 caches for the tests: a decode case's f16/bf16 cache quantised to e4m3 / e5m2
//! with calibrated per-KV-head (or per-tensor) scales, the way `kv_append` stores it.

use pagedkv::host::ops::scales::KvScales;
use pagedkv::host::{DType, HostTensor};
use pagedkv::kernels::PagedLayout;

use super::case::Case;

/// KV head of flat element `i` of a pool of layout `l`.
pub fn head_of(l: &PagedLayout, i: usize) -> usize {
    i / (l.block_size as usize * l.head_dim as usize) % l.num_kv_heads as usize
}

/// Scales mapping each KV head's (or, with `per_head` false, the whole cache's) largest
/// finite magnitude to the format's largest finite value.
pub fn calibrate(l: &PagedLayout, c: &HostTensor, cache: DType, per_head: bool) -> Vec<f32> {
    let h = l.num_kv_heads as usize;
    let mut amax = vec![0f64; h];
    for (i, x) in c.to_f64().into_iter().enumerate() {
        if x.is_finite() {
            let head = head_of(l, i);
            amax[head] = amax[head].max(x.abs());
        }
    }
    if !per_head {
        let m = amax.iter().cloned().fold(0.0, f64::max);
        amax = vec![m; h];
    }
    amax.into_iter()
        .map(|a| {
            if a == 0.0 {
                1.0
            } else {
                (a / cache.max_finite() as f64) as f32
            }
        })
        .collect()
}

/// `c` stored as `cache` (fp8) with one scale per KV head: `encode(x / scale)` with the
/// division in f32, as `kv_append` computes it; NaN (an unused slot) stays NaN.
pub fn quantise(l: &PagedLayout, c: &HostTensor, cache: DType, scales: &[f32]) -> HostTensor {
    let mut q = HostTensor::full(cache, c.shape(), f64::NAN);
    for (i, x) in c.to_f64().into_iter().enumerate() {
        q.set(i, ((x as f32) / scales[head_of(l, i)]) as f64);
    }
    q
}

/// Turns a case's caches into `cache` (fp8) with calibrated scales, kept in the case.
pub fn quantise_case(c: &mut Case, cache: DType, per_head: bool) {
    let l = c.shape.layout();
    let ks = calibrate(&l, &c.kc, cache, per_head);
    let vs = calibrate(&l, &c.vc, cache, per_head);
    c.kc = quantise(&l, &c.kc, cache, &ks);
    c.vc = quantise(&l, &c.vc, cache, &vs);
    c.scales = Some(KvScales { k: ks, v: vs });
}

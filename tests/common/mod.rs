//! Helpers shared by the kernel tests: random data, relative L2 error, tolerances.
#![allow(dead_code)]

pub mod case;
pub mod fp8;
pub mod serve;

use pagedkv::host::DType;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// A seeded generator: every test case draws its data from its own seed.
pub fn rng(seed: u64) -> SmallRng {
    SmallRng::seed_from_u64(seed)
}

/// `n` values uniform in `[-1, 1)`.
pub fn uniform(r: &mut SmallRng, n: usize) -> Vec<f64> {
    (0..n).map(|_| r.random_range(-1.0..1.0)).collect()
}

/// `||got - want|| / ||want||`; NaN anywhere makes it NaN (and so fails any `<=`).
pub fn rel_l2(got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    let num: f64 = got.iter().zip(want).map(|(a, b)| (a - b) * (a - b)).sum();
    let den: f64 = want.iter().map(|b| b * b).sum();
    (num / den.max(f64::MIN_POSITIVE)).sqrt()
}

/// Kernel vs f64 reference: f32 arithmetic for f32, plus output rounding for 16-bit.
pub fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 1e-5,
        DType::F16 | DType::Bf16 => 1e-2,
        DType::E4m3 | DType::E5m2 => {
            panic!("{dtype} is a cache type: tolerances are by output type")
        }
    }
}

/// Kernel vs f64 reference when the emulator runs the GPU's approximate math
/// (`MathMode::Approx`): `ex2.approx` (2^-22 relative) stays far inside
/// [`tolerance`], but `tanh.approx` perturbs each soft-capped score by up to
/// `cap * TANH_APPROX_REL_ERR` (|cap * tanh(x)| <= cap); a score error of `e` moves a
/// softmax weight by a factor up to `exp(e)`, and the output by at most about
/// `e * max|v - out| / |out|`, which these cases (values in [-1, 1], outputs of the same
/// order) keep under `2 e`.
pub fn approx_tolerance(dtype: DType, softcap: Option<f32>) -> f64 {
    let e = softcap.map_or(0.0, |cap| {
        cap as f64 * pagedkv::host::emulator::TANH_APPROX_REL_ERR
    });
    tolerance(dtype) + 2.0 * e
}

/// Split-K vs unsplit: f32 rounding; for 16-bit outputs, up to one unit in the last
/// place of the output type where the two f32 results round differently.
pub fn split_tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 1e-5,
        DType::F16 => 2e-3,
        DType::Bf16 => 1e-2,
        DType::E4m3 | DType::E5m2 => {
            panic!("{dtype} is a cache type: tolerances are by output type")
        }
    }
}

/// Kernel vs f64 reference for the log-sum-exp (base 2), as an absolute error: f32
/// arithmetic of the scores (`head_dim` products each, relative ~1e-6 of their
/// magnitudes) and of the sum; with the GPU's approximate math (`approx`) also
/// `lg2.approx` (2^-22 absolute), `ex2.approx` (2^-22 relative in the sum: 2^-22 /
/// ln 2 in its log2) and `tanh.approx` (a soft-capped score off by up to `cap *
/// TANH_APPROX_REL_ERR`, so the log-sum-exp by up to that times log2 e).
pub fn lse_tolerance(softcap: Option<f32>, approx: bool) -> f64 {
    let exact = 1e-4;
    if !approx {
        return exact;
    }
    let cap = softcap.map_or(0.0, |c| {
        c as f64 * pagedkv::host::emulator::TANH_APPROX_REL_ERR * std::f64::consts::LOG2_E
    });
    exact + 2.0 * pagedkv::host::emulator::LG2_APPROX_ABS_ERR + cap
}

/// The largest absolute difference of two log-sum-exp vectors relative to `1 + |want|`
/// (`-inf` only where the reference has it: else infinite; NaN anywhere: NaN).
pub fn lse_error(got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    got.iter()
        .zip(want)
        .map(|(&g, &w)| {
            if g.is_nan() || w.is_nan() {
                f64::NAN
            } else if g == w {
                0.0
            } else {
                (g - w).abs() / (1.0 + w.abs())
            }
        })
        .fold(0.0, |a: f64, x| {
            if x.is_nan() || a.is_nan() {
                f64::NAN
            } else {
                a.max(x)
            }
        })
}

/// Proptest cases: `PROPTEST_CASES` or the given default.
pub fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

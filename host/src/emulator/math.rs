//! The fast-math operations' error model: [`MathMode::Exact`] computes `exp2` and
//! `tanh` as the Rust standard library does (with the flush to zero of `ex2`'s and
//! `lg2`'s `.ftz` forms); [`MathMode::Approx`] perturbs each
//! result by a relative error drawn uniformly from the hardware instruction's
//! documented worst case, so a test's tolerance that holds here holds on the GPU.
//!
//! The perturbations are deterministic: each thread draws from its own splitmix64
//! stream, seeded from the mode's seed and the thread's block and thread indices.

use pagedkv_kernels::Dim3;

use super::ctx::EmuCtx;

/// How the emulator computes the fast-math operations ([`Ctx::exp2`], [`Ctx::tanh`],
/// [`Ctx::log2`]).
///
/// [`Ctx::exp2`]: pagedkv_kernels::Ctx::exp2
/// [`Ctx::tanh`]: pagedkv_kernels::Ctx::tanh
/// [`Ctx::log2`]: pagedkv_kernels::Ctx::log2
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum MathMode {
    /// Correctly rounded `f32` results (the Rust standard library's), with the
    /// flush to zero of the PTX's `.ftz` forms: `exp2`'s subnormal results and
    /// `log2`'s subnormal inputs are 0, as `ex2.approx.ftz.f32` and
    /// `lg2.approx.ftz.f32` make them (so the emulator and the PTX interpreter agree
    /// bit for bit in this mode, down to the smallest weights).
    #[default]
    Exact,
    /// The GPU's error model: each result is perturbed by a relative error drawn
    /// uniformly from the instruction's documented worst case ([`EX2_APPROX_REL_ERR`]
    /// for `ex2.approx.ftz.f32`, which also flushes subnormal results to zero;
    /// [`TANH_APPROX_REL_ERR`] for `tanh.approx.f32`; an absolute error of up to
    /// [`LG2_APPROX_ABS_ERR`] for `lg2.approx.ftz.f32`), from this seed, per thread. A
    /// tolerance that holds here holds for any result the hardware may return.
    Approx {
        /// Seed of the perturbations (mixed with block and thread indices).
        seed: u64,
    },
}

/// Worst-case relative error of `ex2.approx.ftz.f32` assumed by [`MathMode::Approx`]
/// (2 ulp of `f32`: 2^-22).
pub const EX2_APPROX_REL_ERR: f64 = 1.0 / (1u64 << 22) as f64;
/// Worst-case relative error of `tanh.approx.f32` (2^-10.987, per the PTX ISA).
pub const TANH_APPROX_REL_ERR: f64 = 4.9e-4;
/// Worst-case *absolute* error of `lg2.approx.ftz.f32` assumed by
/// [`MathMode::Approx`]: 2^-22 (the PTX ISA bounds it by 2^-22.6 over the mantissa,
/// as we read it; the model takes the larger). The kernels take it once per output,
/// for the log-sum-exp.
pub const LG2_APPROX_ABS_ERR: f64 = 1.0 / (1u64 << 22) as f64;

impl MathMode {
    /// The perturbation generator's initial state for thread `t` (linear index in its
    /// block) of block `block_idx`; `None` in exact mode.
    pub(super) fn thread_state(self, block_idx: Dim3, t: usize) -> Option<u64> {
        match self {
            MathMode::Exact => None,
            MathMode::Approx { seed } => Some(
                seed ^ (block_idx.x as u64) << 40
                    ^ (block_idx.y as u64) << 20
                    ^ block_idx.z as u64
                    ^ (t as u64).wrapping_mul(0xD6E8_FEB8_6659_FD93),
            ),
        }
    }
}

impl EmuCtx {
    /// `exp2` in this thread's math mode, subnormal results flushed to zero in both
    /// (the `.ftz` of `ex2.approx.ftz.f32`, which the PTX interpreter models too: a
    /// weight of 2^-140 is 0 on the GPU, so it is here); approximate: perturbed like
    /// that instruction first.
    pub(super) fn math_exp2(&self, x: f32) -> f32 {
        let r = x.exp2();
        let r = if self.approx.get().is_none() {
            r
        } else {
            (r as f64 * (1.0 + self.perturbation(EX2_APPROX_REL_ERR))) as f32
        };
        if r.is_subnormal() { 0.0 } else { r }
    }

    /// `tanh` in this thread's math mode (approximate: perturbed like
    /// `tanh.approx.f32`).
    pub(super) fn math_tanh(&self, x: f32) -> f32 {
        let r = x.tanh();
        if self.approx.get().is_none() {
            return r;
        }
        (r as f64 * (1.0 + self.perturbation(TANH_APPROX_REL_ERR))) as f32
    }

    /// `log2` in this thread's math mode (approximate: perturbed like
    /// `lg2.approx.ftz.f32`, by an absolute error; subnormal inputs flushed to zero,
    /// so to `-inf`).
    pub(super) fn math_log2(&self, x: f32) -> f32 {
        let x = if x.is_subnormal() { 0.0 } else { x };
        let r = x.log2();
        if self.approx.get().is_none() || !r.is_finite() {
            return r;
        }
        (r as f64 + self.perturbation(LG2_APPROX_ABS_ERR)) as f32
    }

    /// A relative perturbation uniform in `[-max, max]` (approximate math), else 0.
    fn perturbation(&self, max: f64) -> f64 {
        let Some(mut s) = self.approx.get() else {
            return 0.0;
        };
        s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
        self.approx.set(Some(s));
        let mut z = s;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        let u = (z >> 11) as f64 / (1u64 << 53) as f64; // [0, 1)
        (2.0 * u - 1.0) * max
    }
}

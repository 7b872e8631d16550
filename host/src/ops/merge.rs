//! The merge of attention states: `n` partial attention outputs of the same query rows
//! over disjoint sets of keys, each normalised with its log-sum-exp (what decode and
//! prefill write with [`AttentionOut::lse`]), merged into the attention over all their
//! keys ([`MergeStates`](pagedkv_kernels::kernels::MergeStates)).
//!
//! ## What it computes
//! For each row `r` and head `h`, with parts `i` of output `v_i` and log-sum-exp
//! `lse_i` (base 2; `-inf` for a part of no keys, whose `v_i` is never read) and the
//! sink `σ_h` if given (natural units):
//!
//! `M = max(max_i lse_i, σ_h log2 e)`, `w_i = 2^(lse_i - M)`, `w_σ = 2^(σ_h log2 e - M)`;
//! `out[r, h] = Σ_i w_i v_i / (Σ_i w_i + w_σ)`, `lse_out[r, h] = M + log2(Σ_i w_i + w_σ)`.
//!
//! A part whose `lse_i` is NaN or `+inf` is not the state of any finite scores: it
//! poisons its row's head, whose `out` and `lse_out` are then NaN (a NaN `lse_out`,
//! never the `-inf` of a head of no keys, so a poisoned row does not look empty). The
//! merge propagates rather than refuses: the log-sum-exps are device data the host
//! does not read.
//!
//! This is attention over the union of the parts' keys (the parts computed without the
//! sink: it joins here, once). Split-K, cascade attention over a shared prefix and
//! speculative verification all reduce to it. The f64 reference is
//! [`crate::reference::merge_states`].
//!
//! ```
//! use pagedkv_host::{DType, HostTensor, emulator::Emulator};
//! use pagedkv_host::ops::attention::AttentionOut;
//! use pagedkv_host::ops::merge::{MergeInputs, MergeShape, merge_emulated};
//!
//! // One row, two heads of 32 dims: part 0 saw keys whose log-sum-exp is 1 (base 2),
//! // part 1 saw none for head 0 and 3 for head 1.
//! let shape = MergeShape { num_rows: 1, num_states: 2, num_heads: 2, head_dim: 32 };
//! let v = HostTensor::from_f64(DType::F32, &[1, 2, 2, 32],
//!     &(0..128).map(|i| if i < 64 { 1.0 } else { 3.0 }).collect::<Vec<_>>()).unwrap();
//! let lse = HostTensor::from_f64(DType::F32, &[1, 2, 2], &[1.0, 1.0, f64::NEG_INFINITY, 3.0]).unwrap();
//! let mut out = HostTensor::full(DType::F32, &[1, 2, 32], f64::NAN);
//! let mut lse_out = HostTensor::full(DType::F32, &[1, 2], f64::NAN);
//! let inputs = MergeInputs { shape: &shape, v: &v, lse: &lse, sinks: None };
//! merge_emulated(&Emulator::new(), inputs, AttentionOut { out: &mut out, lse: Some(&mut lse_out) }).unwrap();
//! let (o, l) = (out.to_f64(), lse_out.to_f64());
//! assert_eq!((o[0], l[0]), (1.0, 1.0)); // head 0: part 0 alone
//! // head 1: weights 2^1 and 2^3, so (2 * 1 + 8 * 3) / 10 and log2(10).
//! assert!((o[32] - 2.6).abs() < 1e-6 && (l[1] - 10f64.log2()).abs() < 1e-6);
//! ```

use pagedkv_kernels::Dim3;
use pagedkv_kernels::kernels::merge::MERGE_THREADS;

use super::attention::{AttentionOut, check_lse, check_per_head};
use super::{MAX_GRID_YZ, SUPPORTED_HEAD_DIMS, check_tensor};
use crate::emulator::{Emulator, LaunchConfig};
use crate::error::{Error, Result};
use crate::tensor::{DType, HostTensor, TensorDesc};

/// The shapes of one merge.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MergeShape {
    /// Query rows (`1..=65535`: a grid axis).
    pub num_rows: u32,
    /// Partial states per row (at least 1).
    pub num_states: u32,
    /// Heads per row.
    pub num_heads: u32,
    /// Elements per head vector (one of [`SUPPORTED_HEAD_DIMS`]).
    pub head_dim: u32,
}

impl MergeShape {
    /// Checks the shapes: rows `1..=65535`, at least one state, heads `1..=65535`, a
    /// supported head_dim, and `v`'s element count addressable.
    pub fn check(&self) -> Result<()> {
        for (what, v) in [("num_rows", self.num_rows), ("num_heads", self.num_heads)] {
            if v == 0 || v > MAX_GRID_YZ {
                return Err(Error::invalid(
                    what,
                    format!("{v} (must be 1..={MAX_GRID_YZ})"),
                ));
            }
        }
        if self.num_states == 0 {
            return Err(Error::invalid("num_states", "must be at least 1"));
        }
        if !SUPPORTED_HEAD_DIMS.contains(&self.head_dim) {
            return Err(Error::invalid(
                "head_dim",
                format!(
                    "{} is not supported (one of {SUPPORTED_HEAD_DIMS:?})",
                    self.head_dim
                ),
            ));
        }
        self.state_elems()?;
        Ok(())
    }

    /// Elements of the partial outputs `v`: `num_rows * num_states * num_heads *
    /// head_dim`, checked (at 4 bytes each, at most `isize::MAX` bytes).
    pub fn state_elems(&self) -> Result<u64> {
        (self.num_rows as u64)
            .checked_mul(self.num_states as u64)
            .and_then(|x| x.checked_mul(self.num_heads as u64))
            .and_then(|x| x.checked_mul(self.head_dim as u64))
            .filter(|&e| e.checked_mul(4).is_some_and(|b| b <= isize::MAX as u64))
            .ok_or_else(|| {
                Error::invalid("num_states", "the partial outputs are too large to address")
            })
    }

    /// Elements of the partial log-sum-exps: `num_rows * num_states * num_heads`.
    pub fn lse_elems(&self) -> u64 {
        self.num_rows as u64 * self.num_states as u64 * self.num_heads as u64
    }
}

/// The launch configuration of the merge for `num_rows` rows of `num_heads` heads of
/// `head_dim` elements of `dtype` (see
/// [`MergeStates`](pagedkv_kernels::kernels::MergeStates)).
pub fn launch_config(num_rows: u32, num_heads: u32, head_dim: u32, dtype: DType) -> LaunchConfig {
    let threads = num_heads * (head_dim / dtype.per_v4());
    LaunchConfig {
        grid: Dim3::new(threads.div_ceil(MERGE_THREADS), num_rows, 1),
        block: Dim3::new(MERGE_THREADS, 1, 1),
        shared_bytes: 0,
    }
}

/// The inputs of one merge call, by name (`T`: the backend's tensor).
#[derive(Debug)]
pub struct MergeInputs<'a, T> {
    /// The shapes.
    pub shape: &'a MergeShape,
    /// `[num_rows, num_states, num_heads, head_dim]`: the partial outputs, normalised
    /// (f16, bf16 or f32; the merged output is of the same dtype).
    pub v: &'a T,
    /// `[num_rows, num_states, num_heads]` f32: their log-sum-exp, base 2.
    pub lse: &'a T,
    /// `[num_heads]`: attention-sink logits (natural units, finite), joined once, or
    /// `None`. The parts must have been computed without them.
    pub sinks: Option<&'a [f32]>,
}

impl<T> Clone for MergeInputs<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for MergeInputs<'_, T> {}

/// Checks a merge call: the shapes, `v` of a kernel dtype with its element count,
/// `lse` f32 of `num_rows * num_states * num_heads`, the sinks, `out` of `v`'s dtype
/// and `[num_rows, num_heads, head_dim]`, the merged log-sum-exp (if any) f32 of
/// `[num_rows, num_heads]`.
pub fn validate<T: TensorDesc>(
    inputs: &MergeInputs<'_, T>,
    out: &AttentionOut<'_, T>,
) -> Result<()> {
    let s = inputs.shape;
    s.check()?;
    let dtype = inputs.v.dtype();
    if dtype.is_fp8() {
        return Err(Error::invalid(
            "v",
            format!("dtype {dtype}: partial outputs are f16, bf16 or f32"),
        ));
    }
    check_tensor("v", inputs.v, dtype, s.state_elems()?)?;
    check_tensor("lse", inputs.lse, DType::F32, s.lse_elems())?;
    if let Some(x) = inputs.sinks {
        check_per_head("sinks", x, s.num_heads)?;
    }
    let rows = s.num_rows as u64;
    check_tensor(
        "out",
        &*out.out,
        dtype,
        rows * s.num_heads as u64 * s.head_dim as u64,
    )?;
    check_lse(out.lse.as_deref(), rows, s.num_heads)
}

/// Runs the real merge kernel in the emulator, after [`validate`]: a one-shot use of
/// the step path ([`StepRunner::merge`](crate::step::StepRunner::merge) on an
/// [`EmuDevice`](crate::step::EmuDevice)). `out` is the output tensor, or an
/// [`AttentionOut`] with the merged log-sum-exp too.
pub fn merge_emulated<'o>(
    emu: &Emulator,
    inputs: MergeInputs<'_, HostTensor>,
    out: impl Into<AttentionOut<'o, HostTensor>>,
) -> Result<()> {
    crate::step::once::merge(crate::step::EmuDevice::new(emu.clone()), inputs, out)
}

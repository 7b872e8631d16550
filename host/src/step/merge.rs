//! [`StepRunner::merge`]: the merge of attention states on the runner's device, the
//! one place its parameters are built (see [`crate::ops::merge`]).

use pagedkv_kernels::kernels::{MergeParams, MergeStates};
use pagedkv_kernels::{GlobalSlice, GlobalSliceMut};

use super::device::StepDevice;
use super::runner::StepRunner;
use super::{TensorView, TensorViewMut};
use crate::error::{Error, Result};
use crate::ops::merge::{MergeShape, launch_config};
use crate::tensor::DType;

/// The tensors of one merge of attention states, for the runner's query heads,
/// head_dim and dtype ([`StepShape`](super::StepShape)).
#[derive(Debug)]
pub struct MergeIo<'a> {
    /// Partial states per row (at least 1).
    pub num_states: u32,
    /// `[num_rows, num_states, num_q_heads, head_dim]`, dense: the partial outputs,
    /// each normalised over its keys (the runner's dtype).
    pub v: TensorView<'a>,
    /// `[num_rows, num_states, num_q_heads]` f32, dense: their log-sum-exp, base 2 (as
    /// [`DecodeIo::lse`](super::DecodeIo::lse) writes it; `-inf`: a part of no keys).
    /// Its length gives `num_rows`.
    pub lse: TensorView<'a>,
    /// `[num_q_heads]` f32: attention-sink logits joined once after the merge, or
    /// `None` (the parts must have been computed without them).
    pub sinks: Option<TensorView<'a>>,
    /// `[num_rows, row_stride]`: the merged outputs (row stride: the view's, else
    /// dense).
    pub out: TensorViewMut<'a>,
    /// `[num_rows, num_q_heads]` f32, dense: the merged log-sum-exp, or `None`.
    pub lse_out: Option<TensorViewMut<'a>>,
}

impl<D: StepDevice> StepRunner<D> {
    /// Merges `io.num_states` partial attention states of every row into one: one
    /// launch of [`MergeStates`], needing no plan (see [`crate::ops::merge`] for what it
    /// computes).
    pub fn merge(&self, io: MergeIo<'_>) -> Result<()> {
        let (heads, head_dim) = (self.shape.num_q_heads, self.shape.head_dim);
        let per_row = io.num_states as u64 * heads as u64;
        let n = io.lse.elems();
        if io.num_states == 0 || !n.is_multiple_of(per_row) {
            return Err(Error::invalid(
                "lse",
                format!(
                    "{n} values are not whole rows of {} states x {heads} heads",
                    io.num_states
                ),
            ));
        }
        let shape = MergeShape {
            num_rows: u32::try_from(n / per_row).unwrap_or(u32::MAX),
            num_states: io.num_states,
            num_heads: heads,
            head_dim,
        };
        shape.check()?;
        let rows = shape.num_rows as u64;
        let v_elems = shape.state_elems()?;
        self.check_view("v", &io.v.raw, 1, v_elems, false)?;
        self.check_view_as("lse", &io.lse.raw, DType::F32, 1, n, false)?;
        let row = heads as u64 * head_dim as u64;
        let out_stride = self.check_view("out", &io.out.raw, rows, row, true)?;
        let sinks = self.sink_slice(io.sinks.as_ref())?;
        let lse_out = self.lse_slice(io.lse_out.as_ref(), rows)?;
        // SAFETY: the views checked above, as long as the shapes need.
        unsafe {
            self.launch_merge_with(&MergeLaunch {
                num_rows: shape.num_rows,
                num_states: shape.num_states,
                v: (io.v.raw.addr, v_elems),
                lse: GlobalSlice::from_raw_parts(io.lse.raw.addr as *const f32, n),
                state_rows: GlobalSlice::empty(),
                sinks,
                out: (io.out.raw.addr, io.out.raw.elems, out_stride),
                lse_out,
            })
        }
    }
}

/// Everything one merge launch reads and writes (see [`MergeParams`]): `v`'s and
/// `out`'s addresses and elements (`out`'s row stride too), the slices the runner's
/// checks made.
pub(super) struct MergeLaunch {
    pub(super) num_rows: u32,
    pub(super) num_states: u32,
    pub(super) v: (u64, u64),
    pub(super) lse: GlobalSlice<f32>,
    pub(super) state_rows: GlobalSlice<i32>,
    pub(super) sinks: GlobalSlice<f32>,
    pub(super) out: (u64, u64, u64),
    pub(super) lse_out: GlobalSliceMut<f32>,
}

impl<D: StepDevice> StepRunner<D> {
    /// Builds the merge's parameters and launches it: the one place they are made (a
    /// public merge, a cascade's last pass), for the runner's heads, head_dim and
    /// dtype.
    ///
    /// # Safety
    /// Every address and slice in `l` is of this device's space and as long as
    /// `num_rows` rows of `num_states` parts need (`v` and `lse` every row `state_rows`
    /// names, or the stacked layout's), `out` rows at its stride.
    pub(super) unsafe fn launch_merge_with(&self, l: &MergeLaunch) -> Result<()> {
        let (heads, head_dim) = (self.shape.num_q_heads, self.shape.head_dim);
        let cfg = launch_config(l.num_rows, heads, head_dim, self.shape.dtype);
        macro_rules! launch {
            ($t:ty) => {{
                // SAFETY: the caller's.
                let params = unsafe {
                    MergeParams::<$t> {
                        v: GlobalSlice::from_raw_parts(l.v.0 as *const $t, l.v.1),
                        lse: l.lse,
                        state_rows: l.state_rows,
                        sinks: l.sinks,
                        out: GlobalSliceMut::from_raw_parts(l.out.0 as *mut $t, l.out.1),
                        lse_out: l.lse_out,
                        num_states: l.num_states,
                        num_heads: heads,
                        head_dim,
                        _pad: 0,
                        out_row_stride: l.out.2,
                    }
                };
                // SAFETY: (1)-(2) the caller's; (3) the outputs borrowed mutably, the
                // inputs shared, on the device's one queue; (4) the merge's own
                // configuration.
                unsafe { self.dev.launch::<MergeStates<$t>>(cfg, params) }
            }};
        }
        match self.shape.dtype {
            DType::F16 => launch!(pagedkv_kernels::F16),
            DType::Bf16 => launch!(pagedkv_kernels::Bf16),
            DType::F32 => launch!(f32),
            d => Err(Error::invalid(
                "v",
                format!("dtype {d}: partial outputs are f16, bf16 or f32"),
            )),
        }
    }
}

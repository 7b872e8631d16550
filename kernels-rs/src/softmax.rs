//! [`SoftmaxState`]: the online-softmax state and its merge, in the exp2 form.
//!
//! Scores are kept in base-2 units (`s * log2(e)`), so every exponential is one
//! `ex2.approx`. A state `(m, l)` stands for a set of scores whose maximum is `m` and
//! whose `sum(exp2(s - m))` is `l`; an output accumulated against that state is
//! `sum(exp2(s - m) * v)`. Two states over disjoint sets merge into the state of their
//! union, with the factors that rescale each side's accumulator. The decode kernel uses
//! the merge for every tile; the split-K reduce uses the same merge across partitions.

use crate::device::Ctx;

/// `log2(e)`: converts natural-log-domain scores to base 2.
pub const LOG2_E: f32 = core::f32::consts::LOG2_E;

/// The online-softmax state of a set of scores (empty: `m = -inf`, `l = 0`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SoftmaxState {
    /// The largest score (base-2 units); `-inf` for the empty set.
    pub m: f32,
    /// `sum(exp2(s - m))`.
    pub l: f32,
}

impl SoftmaxState {
    /// The state of no scores.
    pub const EMPTY: SoftmaxState = SoftmaxState {
        m: f32::NEG_INFINITY,
        l: 0.0,
    };

    /// Merges two states. Returns the merged state and the factors `(a, b)` by which
    /// accumulators against `self` and `other` must be multiplied before they are
    /// added. Empty sides get factor 0 (never `exp2(-inf - -inf) = NaN`).
    #[inline(always)]
    pub fn merge<C: Ctx>(self, other: SoftmaxState, ctx: &C) -> (SoftmaxState, f32, f32) {
        let m = if self.m > other.m { self.m } else { other.m };
        if m == f32::NEG_INFINITY {
            return (SoftmaxState::EMPTY, 0.0, 0.0);
        }
        let a = if self.m == f32::NEG_INFINITY {
            0.0
        } else {
            ctx.exp2(self.m - m)
        };
        let b = if other.m == f32::NEG_INFINITY {
            0.0
        } else {
            ctx.exp2(other.m - m)
        };
        (
            SoftmaxState {
                m,
                l: self.l * a + other.l * b,
            },
            a,
            b,
        )
    }
}

//! [`SoftmaxState`]: the online-softmax state and its merge, in the exp2 form.
//!
//! Scores are kept in base-2 units (`s * log2(e)`), so every exponential is one
//! `ex2.approx`. A state `(m, l)` stands for a set of scores whose maximum is `m` and
//! whose `sum(exp2(s - m))` is `l`; an output accumulated against that state is
//! `sum(exp2(s - m) * v)`. Two states over disjoint sets merge into the state of their
//! union, with the factors that rescale each side's accumulator. The decode kernel uses
//! the merge for every tile; the split-K reduce uses the same merge across partitions;
//! the merge of attention states (`MergeStates`) uses it across normalised outputs and
//! their log-sum-exp ([`SoftmaxState::lse`], [`SoftmaxState::of_output`]).
//!
//! An *attention sink* (gpt-oss: one learned logit per query head) is one more score
//! whose value row is zero: it joins the denominator and nothing else. Its state is
//! [`SoftmaxState::sink`], and [`SoftmaxState::normaliser`] merges it in once, where
//! the output is normalised (never per tile or per split-K partition, which would
//! count it once per part).

use crate::device::{Ctx, GlobalSlice};

/// `log2(e)`: converts natural-log-domain scores to base 2.
pub const LOG2_E: f32 = core::f32::consts::LOG2_E;

/// The sink logit of query head `head` (natural units), or `None` when `sinks` is
/// empty (no attention sinks): the kernels' parameters hold `[num_q_heads]` of them.
#[inline(always)]
pub fn load_sink<C: Ctx>(ctx: &C, sinks: &GlobalSlice<f32>, head: u64) -> Option<f32> {
    if sinks.is_empty() {
        None
    } else {
        Some(ctx.ld(sinks, head))
    }
}

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

    /// The state of an attention sink of logit `logit` (natural units): one score,
    /// whose value row is zero.
    #[inline(always)]
    pub fn sink(logit: f32) -> SoftmaxState {
        SoftmaxState {
            m: logit * LOG2_E,
            l: 1.0,
        }
    }

    /// The factor that normalises an accumulator against this state: `1 / l`, or with
    /// an attention sink of logit `sink` (natural units), the sink merged in first
    /// (`a / l'`, where the merge rescales the accumulator by `a` and the merged sum is
    /// `l'`). Call it once per output, on the state of every score the output saw. The
    /// state of no scores (and no sink) normalises to 0: its output is 0, never NaN,
    /// and its [`lse`](Self::lse) `-inf`, so a merge gives it no weight.
    #[inline(always)]
    pub fn normaliser<C: Ctx>(self, sink: Option<f32>, ctx: &C) -> f32 {
        match sink {
            None if self.l > 0.0 => 1.0 / self.l,
            None => 0.0,
            Some(logit) => {
                let (merged, a, _) = self.merge(SoftmaxState::sink(logit), ctx);
                a / merged.l
            }
        }
    }

    /// The log-sum-exp of this state's scores in base 2, `m + log2(l)`, with the sink
    /// of logit `sink` (natural units) merged in first as in
    /// [`normaliser`](Self::normaliser); `-inf` for no scores. For natural-unit
    /// logits `x` (the scores are `x * log2(e)`) it is `log2(Σ exp(x))`: the natural
    /// log-sum-exp times `log2(e)`. An output `o` normalised against this state and
    /// this value are the pair `(o, lse)` that [`Self::of_output`] turns back into a
    /// state for a merge. A state poisoned by a NaN score, or by a merged part whose
    /// log-sum-exp was NaN or `+inf`, has a NaN sum, and its `lse` is NaN (never the
    /// `-inf` of a state of no scores: its output is NaN too, and must not look empty).
    #[inline(always)]
    pub fn lse<C: Ctx>(self, sink: Option<f32>, ctx: &C) -> f32 {
        let s = match sink {
            None => self,
            Some(logit) => self.merge(SoftmaxState::sink(logit), ctx).0,
        };
        if s.l == 0.0 {
            f32::NEG_INFINITY
        } else {
            s.m + ctx.log2(s.l)
        }
    }

    /// The state of a normalised output whose log-sum-exp (base 2) is `lse`:
    /// `(m = lse, l = 1)`, against which the output itself is the accumulator. Merging
    /// such states merges attention over disjoint sets of keys (split-K, cascade).
    #[inline(always)]
    pub fn of_output(lse: f32) -> SoftmaxState {
        if lse == f32::NEG_INFINITY {
            SoftmaxState::EMPTY
        } else {
            SoftmaxState { m: lse, l: 1.0 }
        }
    }

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

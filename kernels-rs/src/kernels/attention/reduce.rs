//! The split-K reduce: merges the partitions' partial outputs of every query head.

use core::marker::PhantomData;

use crate::device::{Ctx, Kernel};
use crate::elem::{Bf16, Elem, F16};
use crate::softmax::{SoftmaxState, load_sink};

use super::{REDUCE_LANES, REDUCE_THREADS, ReduceParams};

/// The split-K reduce: grid `(ceil(num_q_heads * chunks * REDUCE_LANES /
/// REDUCE_THREADS), num_seqs)`, [`REDUCE_THREADS`] threads. [`REDUCE_LANES`] adjacent
/// lanes of a warp own one `(query head, 16-byte chunk)` of the sequence: lane `j` folds
/// partitions `j, j + REDUCE_LANES, …` (their `(m, l)` with [`SoftmaxState::merge`] and
/// their chunk accumulators with the merge's factors), so the loads of a lane's
/// partitions overlap those of the other lanes instead of forming one serial chain over
/// every partition; `log2(REDUCE_LANES)` butterfly shuffles then merge the lanes' states
/// and the first lane stores the chunk.
#[derive(Clone, Copy, Debug)]
pub struct DecodeReduce<T>(PhantomData<T>);

/// One lane's fold of its partitions of one `(query head, chunk)`: the softmax state and
/// the chunk's unnormalised accumulator (its first `T::PER_V4` words are used).
struct LaneFold {
    state: SoftmaxState,
    acc: [f32; 8],
}

impl LaneFold {
    /// Folds partitions `first, first + REDUCE_LANES, …` of `head`'s chunk `c`.
    #[inline(always)]
    fn of<T: Elem, C: Ctx>(ctx: &C, p: &ReduceParams<T>, head: u64, c: u32, first: u32) -> Self {
        let mut fold = LaneFold {
            state: SoftmaxState::EMPTY,
            acc: [0.0f32; 8],
        };
        let mut part = first;
        while part < p.num_partitions {
            let at = head * p.num_partitions as u64 + part as u64;
            let other = SoftmaxState {
                m: ctx.ld(&p.part_ml, at * 2),
                l: ctx.ld(&p.part_ml, at * 2 + 1),
            };
            let base = at * p.head_dim as u64 + (c * T::PER_V4) as u64;
            let lo = ctx.ld_nc_v4(&p.part_out, base);
            let hi = if T::PER_V4 > 4 {
                ctx.ld_nc_v4(&p.part_out, base + 4)
            } else {
                [0; 4]
            };
            let words = [lo[0], lo[1], lo[2], lo[3], hi[0], hi[1], hi[2], hi[3]];
            fold.add::<T, C>(ctx, other, &words);
            part += REDUCE_LANES;
        }
        fold
    }

    /// Merges the state `other` and its accumulator `words` (f32 bits) into this fold.
    // Indexed loops of constant bounds: unrolled with constant indices, the arrays stay
    // in registers (an iterator chain here compiled to a 160-byte stack frame).
    #[allow(clippy::needless_range_loop)]
    #[inline(always)]
    fn add<T: Elem, C: Ctx>(&mut self, ctx: &C, other: SoftmaxState, words: &[u32; 8]) {
        let (merged, a, b) = self.state.merge(other, ctx);
        for i in 0..8 {
            if i < T::PER_V4 as usize {
                self.acc[i] = ctx.fma(f32::from_bits(words[i]), b, self.acc[i] * a);
            }
        }
        self.state = merged;
    }

    /// Merges the folds of the [`REDUCE_LANES`] lanes of this lane's group: a butterfly,
    /// so every lane of the group ends with the merge of all of them.
    #[allow(clippy::needless_range_loop)] // as in `add`
    #[inline(always)]
    fn merge_lanes<T: Elem, C: Ctx>(&mut self, ctx: &C) {
        let mut offset = REDUCE_LANES / 2;
        while offset > 0 {
            let other = SoftmaxState {
                m: ctx.shfl_xor_f32(self.state.m, offset),
                l: ctx.shfl_xor_f32(self.state.l, offset),
            };
            let mut words = [0u32; 8];
            for i in 0..8 {
                if i < T::PER_V4 as usize {
                    words[i] = ctx.shfl_xor_u32(self.acc[i].to_bits(), offset);
                }
            }
            self.add::<T, C>(ctx, other, &words);
            offset /= 2;
        }
    }
}

#[inline(always)]
fn reduce<T: Elem, C: Ctx>(ctx: &C, p: &ReduceParams<T>) {
    let chunks = p.head_dim / T::PER_V4;
    let t = ctx.block_idx().x * REDUCE_THREADS + ctx.thread_idx().x;
    let (pair, lane) = (t / REDUCE_LANES, t % REDUCE_LANES);
    let (qh, c) = (pair / chunks, pair % chunks);
    // Lanes past the last head fold nothing but still take part in the shuffles.
    let valid = qh < p.num_q_heads;
    let head = ctx.block_idx().y as u64 * p.num_q_heads as u64 + qh as u64;
    let first = if valid { lane } else { p.num_partitions };
    let mut fold = LaneFold::of(ctx, p, head, c, first);
    fold.merge_lanes::<T, C>(ctx);
    if !valid || lane != 0 {
        return;
    }
    // The sink (if any) joins once, after every partition is merged.
    let sink = load_sink(ctx, &p.sinks, qh as u64);
    let inv = fold.state.normaliser(sink, ctx);
    if c == 0 && !p.lse.is_empty() {
        ctx.st(&p.lse, head, fold.state.lse(sink, ctx));
    }
    for x in fold.acc.iter_mut() {
        *x *= inv;
    }
    let at = ctx.block_idx().y as u64 * p.out_row_stride + qh as u64 * p.head_dim as u64;
    ctx.st_v4(&p.out, at + (c * T::PER_V4) as u64, T::pack(&fold.acc));
}
macro_rules! reduce_kernel {
    ($t:ty, $name:literal) => {
        impl Kernel for DecodeReduce<$t> {
            type Params = ReduceParams<$t>;
            const NAME: &'static str = $name;
            #[inline(always)]
            fn run<C: Ctx>(ctx: &C, p: &Self::Params) {
                reduce::<$t, C>(ctx, p)
            }
        }
    };
}
reduce_kernel!(F16, "paged_decode_reduce_f16");
reduce_kernel!(Bf16, "paged_decode_reduce_bf16");
reduce_kernel!(f32, "paged_decode_reduce_f32");

//! The split-K reduce: merges the partitions' partial outputs of every query head.

use core::marker::PhantomData;

use crate::device::{Ctx, Kernel};
use crate::elem::{Bf16, Elem, F16};
use crate::softmax::SoftmaxState;

use super::{REDUCE_THREADS, ReduceParams};

/// The split-K reduce: grid `(ceil(num_q_heads * chunks / REDUCE_THREADS), num_seqs)`,
/// [`REDUCE_THREADS`] threads, one per `(query head, 16-byte chunk)` of the sequence so
/// every thread of every block but the last works. A thread folds the partitions'
/// `(m, l)` with [`SoftmaxState::merge`] and their chunk accumulators with the merge's
/// factors.
#[derive(Clone, Copy, Debug)]
pub struct DecodeReduce<T>(PhantomData<T>);

#[inline(always)]
fn reduce<T: Elem, C: Ctx>(ctx: &C, p: &ReduceParams<T>) {
    let chunks = p.head_dim / T::PER_V4;
    let pair = ctx.block_idx().x * REDUCE_THREADS + ctx.thread_idx().x;
    let (qh, c) = (pair / chunks, pair % chunks);
    if qh >= p.num_q_heads {
        return;
    }
    let head = ctx.block_idx().y as u64 * p.num_q_heads as u64 + qh as u64;
    let mut state = SoftmaxState::EMPTY;
    let mut acc = [0.0f32; 8];
    for part in 0..p.num_partitions as u64 {
        let ml = (head * p.num_partitions as u64 + part) * 2;
        let other = SoftmaxState {
            m: ctx.ld(&p.part_ml, ml),
            l: ctx.ld(&p.part_ml, ml + 1),
        };
        let (merged, a, b) = state.merge(other, ctx);
        let base =
            (head * p.num_partitions as u64 + part) * p.head_dim as u64 + (c * T::PER_V4) as u64;
        let mut w = 0;
        while w < T::PER_V4 {
            let v = ctx.ld_nc_v4(&p.part_out, base + w as u64);
            for (e, bits) in v.iter().enumerate() {
                let i = w as usize + e;
                acc[i] = ctx.fma(f32::from_bits(*bits), b, acc[i] * a);
            }
            w += 4;
        }
        state = merged;
    }
    let inv = 1.0 / state.l;
    for x in acc.iter_mut() {
        *x *= inv;
    }
    let at = ctx.block_idx().y as u64 * p.out_row_stride + qh as u64 * p.head_dim as u64;
    ctx.st_v4(&p.out, at + (c * T::PER_V4) as u64, T::pack(&acc));
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

//! The merge of attention states: [`MergeStates`] folds `n` partial attention outputs
//! of the same queries over disjoint sets of keys, each a normalised output `v` with
//! its log-sum-exp `lse` (base 2, as the decode and prefill kernels write it), into the
//! output over the union of the keys and its log-sum-exp.
//!
//! A pair `(v, lse)` is the state `(m = lse, l = 1)` with `v` its accumulator
//! ([`SoftmaxState::of_output`]); the states fold with [`SoftmaxState::merge`], the
//! merge split-K and every tile already use, so merged parts equal attention over all
//! their keys up to rounding. An attention sink joins once, after the fold, as
//! everywhere else: the parts must be computed without it. A part with `lse = -inf`
//! saw no keys: it gets no weight and its `v` is not read. A part whose `lse` is NaN
//! or `+inf` (no log-sum-exp of finite scores) poisons its head of the row: the
//! merged output and log-sum-exp are NaN, never a row that looks empty.
//!
//! Cascade attention computes a shared prefix once for every query that shares it and
//! merges that part with each query's own suffix with this kernel.

use core::marker::PhantomData;

use crate::device::{Ctx, GlobalRange, GlobalSlice, GlobalSliceMut, Kernel, KernelParams};
use crate::elem::{Bf16, Elem, F16};
use crate::softmax::{SoftmaxState, load_sink};

/// Threads per block of [`MergeStates`].
pub const MERGE_THREADS: u32 = 64;

/// Parameters of [`MergeStates`].
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct MergeParams<T> {
    /// `[num_rows, num_states, num_heads, head_dim]`: each row's partial outputs,
    /// normalised.
    pub v: GlobalSlice<T>,
    /// `[num_rows, num_states, num_heads]`: their log-sum-exp, base 2 (`-inf`: a part
    /// of no keys).
    pub lse: GlobalSlice<f32>,
    /// `[num_rows, num_states]`: where each part is, as a row of `v` and `lse` (`v`
    /// then `[rows, num_heads, head_dim]`, `lse` `[rows, num_heads]`); a negative entry
    /// is a part of no keys. Empty: the stacked layout above (part `i` of row `r` at
    /// row `r * num_states + i`). Cascade attention merges a shared prefix's part,
    /// computed once for every row that shares it, with each row's own.
    pub state_rows: GlobalSlice<i32>,
    /// `[num_heads]`: attention-sink logit per head (natural units), joined once after
    /// the merge, or empty for none.
    pub sinks: GlobalSlice<f32>,
    /// `[num_rows, out_row_stride]`: the merged output, `num_heads * head_dim` elements
    /// at the start of each row.
    pub out: GlobalSliceMut<T>,
    /// `[num_rows, num_heads]`: the merged log-sum-exp (base 2, the sink included), or
    /// empty for none.
    pub lse_out: GlobalSliceMut<f32>,
    /// Partial states per row.
    pub num_states: u32,
    /// Heads per row.
    pub num_heads: u32,
    /// Elements per head vector (a multiple of 16 bytes of `T`).
    pub head_dim: u32,
    /// Explicit padding (0), so every byte of the struct is initialised: see
    /// [`KernelParams`].
    pub _pad: u32,
    /// Elements from one row of `out` to the next (`>= num_heads * head_dim`).
    pub out_row_stride: u64,
}

// SAFETY: 6 views, 4 four-byte fields (the explicit `_pad` one), one u64: 120 bytes,
// no padding (asserted below).
const _: () = assert!(core::mem::size_of::<MergeParams<f32>>() == 6 * 16 + 4 * 4 + 8);
unsafe impl<T: 'static> KernelParams for MergeParams<T>
where
    Self: Copy,
{
    fn globals(&self, f: &mut dyn FnMut(GlobalRange)) {
        f(self.v.range("v"));
        f(self.lse.range("lse"));
        f(self.state_rows.range("state_rows"));
        f(self.sinks.range("sinks"));
        f(self.out.range("out"));
        f(self.lse_out.range("lse_out"));
    }
}

/// The merge of attention states: grid `(ceil(num_heads * chunks / MERGE_THREADS),
/// num_rows)`, [`MERGE_THREADS`] threads; thread `t` of row `y` owns one `(head,
/// 16-byte chunk)` of the row (`chunks = head_dim / T::PER_V4`) and folds its
/// `num_states` parts in order (see the [module docs](self)).
#[derive(Clone, Copy, Debug)]
pub struct MergeStates<T>(PhantomData<T>);

#[inline(always)]
fn merge<T: Elem, C: Ctx>(ctx: &C, p: &MergeParams<T>) {
    let chunks = p.head_dim / T::PER_V4;
    let t = ctx.block_idx().x * MERGE_THREADS + ctx.thread_idx().x;
    let (h, c) = (t / chunks, t % chunks);
    if h >= p.num_heads {
        return; // no barriers or shuffles in this kernel
    }
    let row = ctx.block_idx().y as u64;
    let mut state = SoftmaxState::EMPTY;
    let mut acc = [0.0f32; 8];
    let mut i = 0;
    while i < p.num_states {
        let part = row * p.num_states as u64 + i as u64;
        // (Compared as i32, widened as u32: a negative entry is no part.)
        let (none, r) = if p.state_rows.is_empty() {
            (false, part)
        } else {
            let x = ctx.ld(&p.state_rows, part);
            (x < 0, x as u32 as u64)
        };
        let at = r * p.num_heads as u64 + h as u64;
        let lse = if none {
            f32::NEG_INFINITY
        } else {
            ctx.ld(&p.lse, at)
        };
        // A part of no keys has no weight and maybe no output: never read. (A NaN
        // `lse` is read, and poisons the output, as it should.)
        if lse != f32::NEG_INFINITY {
            let v = ctx.ld_nc_v4(&p.v, at * p.head_dim as u64 + (c * T::PER_V4) as u64);
            let (merged, a, b) = state.merge(SoftmaxState::of_output(lse), ctx);
            for (e, x) in acc.iter_mut().enumerate() {
                if (e as u32) < T::PER_V4 {
                    *x = ctx.fma(T::unpack(&v, e as u32), b, *x * a);
                }
            }
            state = merged;
        }
        i += 1;
    }
    let sink = load_sink(ctx, &p.sinks, h as u64);
    let inv = state.normaliser(sink, ctx);
    for x in acc.iter_mut() {
        *x *= inv;
    }
    let at = row * p.out_row_stride + (h * p.head_dim + c * T::PER_V4) as u64;
    ctx.st_v4(&p.out, at, T::pack(&acc));
    if c == 0 && !p.lse_out.is_empty() {
        ctx.st(
            &p.lse_out,
            row * p.num_heads as u64 + h as u64,
            state.lse(sink, ctx),
        );
    }
}

macro_rules! merge_kernel {
    ($t:ty, $name:literal) => {
        impl Kernel for MergeStates<$t> {
            type Params = MergeParams<$t>;
            const NAME: &'static str = $name;
            #[inline(always)]
            fn run<C: Ctx>(ctx: &C, p: &Self::Params) {
                merge::<$t, C>(ctx, p)
            }
        }
    };
}
merge_kernel!(F16, "merge_states_f16");
merge_kernel!(Bf16, "merge_states_bf16");
merge_kernel!(f32, "merge_states_f32");

//! [`PagedPrefill`]: the tensor-core prefill kernel (f16, bf16).
//!
//! Shared memory (32-bit words, 16-bit elements): the Q tile `[16, head_dim]` at 0,
//! the K tile `[16, head_dim]` at `8 * head_dim`, one pass of the V tile `[16,
//! PASS_DIMS]` after it. The tree-mask variant (`TREE`) puts each row's mask word and
//! first masked position (4 words a row) first, and makes passes of half as many
//! columns: the fp8 kernels are at their registers, and the mask's reads spilled.
//! A prefill without a tree mask runs the plain variant, unchanged. Thread `lane` holds, per `mma` fragment, rows `g = lane / 4`
//! and `g + 8` and columns `2 * (lane % 4)` and `+ 1` (the PTX ISA's layouts, see
//! `Ctx::mma_m16n8k16_f16`).

//!
//! An fp8 cache (`K` = [`E4m3`] / [`E5m2`]) is staged through registers instead of
//! `cp.async`: each 16-byte load of 16 fp8 values is decoded to `T` (exact: every fp8
//! value is an f16 and a bf16) into the same tile layout, so the `mma` path is
//! unchanged; the K scale is folded into the score scale, the V scale into the final
//! normalisation.

use super::{
    KV_TILE, MmaElem, Of, PASS_DIMS, PrefillParams, ROWS, Row, Seq, cache_at, kv_scales, weight,
};
use crate::device::{Ctx, GlobalSlice, Kernel};
use crate::elem::{Bf16, E4m3, E5m2, F16, KvElem};
use crate::kernels::each16;
use crate::softmax::{SoftmaxState, load_sink};

/// The tensor-core prefill kernel for q / out of `T` and a cache of `K`. `HEAD_DIM =
/// 0` is the one-warp kernel for any shape (see the [module docs](super)); `HEAD_DIM`
/// in [`TILED_HEAD_DIMS`](super::TILED_HEAD_DIMS) the multi-warp kernel for that
/// head_dim at block size 16 ([`tiled`](super::tiled)). Launch the one
/// [`fixed_head_dim`](crate::kernels::attention::fixed_head_dim) names when it is in
/// `TILED_HEAD_DIMS`, else `HEAD_DIM = 0`. The one-warp kernel reads
/// [`PrefillParams::tree_mask`] only with `TREE` (launch that variant for a prefill
/// with a tree mask; it reads `q` in token order, never `q_rows`); the multi-warp
/// kernel reads it whenever it is given.
#[derive(Clone, Copy, Debug)]
pub struct PagedPrefill<T, K = T, const HEAD_DIM: u32 = 0, const TREE: bool = false>(Of<(T, K)>);

macro_rules! kernel {
    ($t:ty, $k:ty, $name:literal) => {
        impl Kernel for PagedPrefill<$t, $k> {
            type Params = PrefillParams<$t, $k>;
            const NAME: &'static str = $name;
            #[inline(always)]
            fn run<C: Ctx>(ctx: &C, p: &Self::Params) {
                prefill::<$t, $k, C, false>(ctx, p)
            }
        }
        impl Kernel for PagedPrefill<$t, $k, 0, true> {
            type Params = PrefillParams<$t, $k>;
            const NAME: &'static str = concat!($name, "_tree");
            #[inline(always)]
            fn run<C: Ctx>(ctx: &C, p: &Self::Params) {
                prefill::<$t, $k, C, true>(ctx, p)
            }
        }
        kernel!(@tiled $t, $k, 64, concat!($name, "_d64"));
        kernel!(@tiled $t, $k, 128, concat!($name, "_d128"));
    };
    (@tiled $t:ty, $k:ty, $d:literal, $name:expr) => {
        impl Kernel for PagedPrefill<$t, $k, $d> {
            type Params = PrefillParams<$t, $k>;
            const NAME: &'static str = $name;
            #[inline(always)]
            fn run<C: Ctx>(ctx: &C, p: &Self::Params) {
                super::tiled::prefill_tiled::<$t, $k, C, $d>(ctx, p)
            }
        }
    };
}
kernel!(F16, F16, "paged_prefill_attention_f16");
kernel!(Bf16, Bf16, "paged_prefill_attention_bf16");
kernel!(F16, E4m3, "paged_prefill_attention_f16_e4m3");
kernel!(F16, E5m2, "paged_prefill_attention_f16_e5m2");
kernel!(Bf16, E4m3, "paged_prefill_attention_bf16_e4m3");
kernel!(Bf16, E5m2, "paged_prefill_attention_bf16_e5m2");

/// Stages one 16-byte cache vector (element `at` of `src`) into the tile at word
/// `word` as `T`: a `cp.async` when the cache is `T`, else a load decoded to `T`
/// (`K::PER_V4 / 2` words).
#[inline(always)]
fn stage<T: MmaElem, K: KvElem, C: Ctx>(ctx: &C, word: u32, src: &GlobalSlice<K>, at: u64) {
    if K::SCALED {
        let raw = ctx.ld_nc_v4(src, at);
        each16(|w| {
            if w < K::PER_V4 / 2 {
                let pair = T::pack2(K::unpack(&raw, 2 * w), K::unpack(&raw, 2 * w + 1));
                ctx.smem_st_u32(word + w, pair);
            }
        });
    } else {
        ctx.cp_async_16(word, src, at);
    }
}

/// Shared-memory words before the Q tile of the tree-mask variant: each row's
/// tree-mask word (2 words) and first masked position (1), 4 words a row.
const TREE_WORDS: u32 = 4 * ROWS;

/// Output fragments of one pass: `PASS_DIMS / 8` column blocks of `[f32; 4]`.
const NBLK: usize = (PASS_DIMS / 8) as usize;

/// Calls `f(nd, &mut o[nd])` for every column block, each index a constant after
/// inlining (the accumulators stay in registers, not local memory).
#[inline(always)]
fn each_blk(o: &mut [[f32; 4]; NBLK], mut f: impl FnMut(u32, &mut [f32; 4])) {
    let [a, b, c, d, e, g, h, i] = o;
    f(0, a);
    f(1, b);
    f(2, c);
    f(3, d);
    f(4, e);
    f(5, g);
    f(6, h);
    f(7, i);
}

fn prefill<T: MmaElem, K: KvElem, C: Ctx, const TREE: bool>(ctx: &C, p: &PrefillParams<T, K>) {
    let b = ctx.block_idx();
    let (kvh, tile, s) = (b.x, b.y, b.z);
    let sq = Seq::load(ctx, p, s);
    let rows = sq.qo_len * sq.group;
    let row0 = tile * ROWS;
    if row0 >= rows {
        return; // the block is one warp: it leaves whole
    }
    let d = p.layout.head_dim;
    let dw = d / 2; // words per row of Q and K
    // The tree variant's words come first, and its passes are half as wide.
    let (q_at, pass_dims) = if TREE {
        (TREE_WORDS, PASS_DIMS / 2)
    } else {
        (0, PASS_DIMS)
    };
    let lane = ctx.lane();
    let (g, t) = (lane / 4, lane % 4);
    let row = [
        Row::new(ctx, p, &sq, kvh, row0 + g),
        Row::new(ctx, p, &sq, kvh, row0 + g + 8),
    ];
    // The positions any row of the block sees.
    let last = if row0 + ROWS < rows {
        row0 + ROWS
    } else {
        rows
    } - 1;
    let lo = sq.first_visible(ctx, p, row0 / sq.group);
    let hi = sq.end(ctx, p, last / sq.group);
    let v_scale = kv_scales(ctx, p, kvh).1;

    // Q tile into shared memory, 16 bytes a copy; rows past the sequence are zeros.
    let (kw, vw) = (q_at + ROWS * dw, q_at + 2 * ROWS * dw);
    let chunks = d / 8;
    let mut c = lane;
    while c < ROWS * chunks {
        let (r, k) = (c / chunks, c % chunks);
        let word = q_at + r * dw + 4 * k;
        let rr = Row::new(ctx, p, &sq, kvh, row0 + r);
        let v = if rr.valid {
            let at = if TREE {
                rr.q_at_token(p, &sq, 8 * k)
            } else {
                rr.q_at(ctx, p, &sq, 8 * k)
            };
            ctx.ld_v4(&p.q, at)
        } else {
            [0; 4]
        };
        let [v0, v1, v2, v3] = v;
        ctx.smem_st_u32(word, v0);
        ctx.smem_st_u32(word + 1, v1);
        ctx.smem_st_u32(word + 2, v2);
        ctx.smem_st_u32(word + 3, v3);
        c += 32;
    }
    if TREE && lane < ROWS {
        // This lane's row of the tile: its mask word and first masked position.
        let rr = Row::new(ctx, p, &sq, kvh, row0 + lane);
        let (mask, from) = rr.tree_word(ctx, p, &sq);
        ctx.smem_st_u32(4 * lane, mask as u32);
        ctx.smem_st_u32(4 * lane + 1, (mask >> 32) as u32);
        ctx.smem_st_u32(4 * lane + 2, from);
    }

    let mut pass = 0;
    while pass * pass_dims < d {
        let width = if d - pass * pass_dims < pass_dims {
            d - pass * pass_dims
        } else {
            pass_dims
        };
        // Cache vectors per K row and per V pass row; tile words per cache vector.
        let (kchunks, vchunks, vwords) = (d / K::PER_V4, width / K::PER_V4, K::PER_V4 / 2);
        let nblk = width / 8;
        let mut o = [[0f32; 4]; NBLK];
        let mut m = [f32::NEG_INFINITY; 2];
        let mut l = [0f32; 2];
        let mut kv = lo - lo % KV_TILE;
        while kv < hi {
            // Stage K and this pass's V columns; positions outside [lo, hi) (before
            // the window, whose blocks may be freed, or past the context) are zeros.
            let mut c = lane;
            while c < KV_TILE * (kchunks + vchunks) {
                let is_k = c < KV_TILE * kchunks;
                let (r, k, word) = if is_k {
                    let (r, k) = (c / kchunks, c % kchunks);
                    (r, K::PER_V4 * k, kw + r * dw + vwords * k)
                } else {
                    let c = c - KV_TILE * kchunks;
                    let (r, k) = (c / vchunks, c % vchunks);
                    let col = pass * pass_dims + K::PER_V4 * k;
                    (r, col, vw + r * (width / 2) + vwords * k)
                };
                let pos = kv + r;
                if pos >= lo && pos < hi {
                    let at = cache_at(ctx, p, s, kvh, pos) + k as u64;
                    let src = if is_k { &p.key_cache } else { &p.value_cache };
                    stage::<T, K, C>(ctx, word, src, at);
                } else {
                    for i in 0..vwords {
                        ctx.smem_st_u32(word + i, 0);
                    }
                }
                c += 32;
            }
            ctx.cp_async_commit();
            ctx.cp_async_wait::<0>();
            ctx.sync_threads();

            // S = Q K^T for the tile's two 8-position column blocks.
            let mut sacc = [[0f32; 4]; 2];
            let (lr, lh) = (lane % 8, (lane / 8) % 2);
            let mut ks = 0;
            while ks < d / 16 {
                let a_row = lr + 8 * lh;
                let a = ctx.ldmatrix_x4::<false>(q_at + a_row * dw + 8 * ks + 4 * (lane / 16));
                let k_tile = |nb: u32, sa: &mut [f32; 4]| {
                    let bk = ctx.ldmatrix_x2::<false>(kw + (8 * nb + lr) * dw + 8 * ks + 4 * lh);
                    *sa = T::mma(ctx, a, bk, *sa);
                };
                let [s0, s1] = &mut sacc;
                k_tile(0, s0);
                k_tile(1, s1);
                ks += 1;
            }
            // Online softmax per row (the 4 lanes of a group share a row).
            let mut sc = [[0f32; 4]; 2];
            let mut mx = [f32::NEG_INFINITY; 2];
            for nb in 0..2 {
                for i in 0..4 {
                    let kpos = kv + 8 * nb as u32 + 2 * t + (i % 2) as u32;
                    sc[nb][i] = row[i / 2].score_untreed(ctx, p, sacc[nb][i], kpos);
                }
            }
            if TREE {
                // A score is hidden from its row's first masked position on where the
                // row's bit for it (the distance back) is clear (each index a constant
                // after inlining: the scores stay in registers).
                each16(|k| {
                    if k < 8 {
                        let (nb, i) = ((k / 4) as usize, (k % 4) as usize);
                        let kpos = kv + 8 * nb as u32 + 2 * t + (i % 2) as u32;
                        let at = 4 * (g + 8 * (i / 2) as u32);
                        let dist = row[i / 2].qpos.wrapping_sub(kpos) & 63;
                        let bit = (ctx.smem_ld_u32(at + dist / 32) >> (dist % 32)) & 1;
                        if kpos >= ctx.smem_ld_u32(at + 2) && bit == 0 {
                            sc[nb][i] = f32::NEG_INFINITY;
                        }
                    }
                });
            }
            for scb in &sc {
                for (i, &x) in scb.iter().enumerate() {
                    if x > mx[i / 2] {
                        mx[i / 2] = x;
                    }
                }
            }
            let mut alpha = [0f32; 2];
            for r in 0..2 {
                let mut w = 1;
                while w < 4 {
                    let y = ctx.shfl_xor_f32(mx[r], w);
                    if y > mx[r] {
                        mx[r] = y;
                    }
                    w *= 2;
                }
                let m_new = if mx[r] > m[r] { mx[r] } else { m[r] };
                alpha[r] = weight(ctx, m[r], m_new);
                m[r] = m_new;
                l[r] *= alpha[r];
            }
            let mut pa = [0u32; 4];
            for nb in 0..2 {
                let pr: [f32; 4] = core::array::from_fn(|i| weight(ctx, sc[nb][i], m[i / 2]));
                for (i, x) in pr.iter().enumerate() {
                    l[i / 2] += x;
                }
                pa[2 * nb] = T::pack2(pr[0], pr[1]);
                pa[2 * nb + 1] = T::pack2(pr[2], pr[3]);
            }
            // O = alpha O + P V.
            each_blk(&mut o, |nd, f| {
                if nd < pass_dims / 8 && nd < nblk {
                    for (i, x) in f.iter_mut().enumerate() {
                        *x *= alpha[i / 2];
                    }
                    let bv = ctx.ldmatrix_x2::<true>(vw + (8 * lh + lr) * (width / 2) + 4 * nd);
                    *f = T::mma(ctx, pa, bv, *f);
                }
            });
            // Everyone is done with the tile before the next one is staged.
            ctx.sync_threads();
            kv += KV_TILE;
        }
        // Each lane summed its own columns: the row's total is the group's; the sink
        // (if any) and the V scale come in with the normalisation.
        let mut inv = [0f32; 2];
        for (r, x) in l.iter_mut().enumerate() {
            *x += ctx.shfl_xor_f32(*x, 1);
            *x += ctx.shfl_xor_f32(*x, 2);
            let sink = load_sink(ctx, &p.sinks, row[r].head as u64);
            let state = SoftmaxState { m: m[r], l: *x };
            inv[r] = v_scale * state.normaliser(sink, ctx);
            // Every pass sees the same scores: the first writes the log-sum-exp
            // (nothing held across passes: the fp8 kernels are at their registers).
            if pass == 0 && t == 0 && row[r].valid && !p.lse.is_empty() {
                ctx.st(&p.lse, row[r].lse_at(p, &sq), state.lse(sink, ctx));
            }
        }
        each_blk(&mut o, |nd, f| {
            if nd < pass_dims / 8 && nd < nblk {
                for (i, x) in f.iter().enumerate() {
                    let r = &row[i / 2];
                    if r.valid {
                        let dim = pass * pass_dims + 8 * nd + 2 * t + (i % 2) as u32;
                        ctx.st(&p.out, r.at(p, &sq, dim), T::from_f32(x * inv[i / 2]));
                    }
                }
            }
        });
        pass += 1;
    }
}

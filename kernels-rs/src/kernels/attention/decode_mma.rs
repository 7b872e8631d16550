//! The tensor-core decode kernel body (head_dim 64 and 128 at block size 16, q of f16
//! or bf16, a cache of q's type or fp8): the group's query heads are the M rows of
//! `mma.m16n8k16`.
//!
//! # Work decomposition
//! The grid and the parameters are the SIMT kernel's ([`super`]); a block serves one KV
//! head and up to [`MMA_MAX_HEADS`] query heads of its group (rows past them are zero
//! and never written). Its four warps split every stage of [`MMA_STAGE_TOKENS`] tokens:
//! warp `w` owns the stage's 16 rows `16w..16w + 16` (one cache block).
//!
//! # Per stage, per warp (`compute_qk`, `update_local_state`, `compute_pv`)
//! * `S = Q Kᵀ`: Q's A fragments stay in registers for the whole launch; K's B
//!   fragments come from shared memory ([`MmaCache::k_load`], [`MmaCache::k_frag`]),
//!   `HEAD_DIM / 16` `mma`s
//!   per 8 tokens.
//! * Scale, soft-cap, ALiBi and the range mask on the 8 scores a lane holds; each row's
//!   maximum over the 16 tokens with two xor-shuffles (the 4 lanes of a row); one
//!   rescale of the output fragments per stage.
//! * `O += P V`: the scores' C fragments are the A fragment of `P` (packed to `T`); V's
//!   B fragments come from shared memory ([`MmaCache::v_frags`]); `HEAD_DIM / 8`
//!   `mma`s.
//!
//! # The cache's element type ([`MmaCache`])
//! * f16 / bf16 (`K = T`): `ldmatrix.x4` (K) and `ldmatrix.x4.trans` (V) read the
//!   fragments.
//! * fp8: a lane decodes the bytes it needs into `T` pairs (`cvt.rn.f16x2.e4m3x2` /
//!   `e5m2x2` on sm_90, exact: every fp8 value is an f16 and a bf16). A dot product does
//!   not depend on the order of its terms, so the kernel orders head dims to suit the
//!   bytes: at k-step `4u + j`, lane `t`'s four K values are the 4 contiguous bytes
//!   `64u + 16t + 4j..` of its token's row (one 16-byte load per 4 k-steps), and q's A
//!   fragments take the same dims. For `P V` the output's columns are ordered likewise:
//!   lane `g` of dim tile `4u + i` serves dim `32u + 4g + i`, so one 32-bit load of a V
//!   row gives a lane its byte of 4 dim tiles and a byte permute pairs two tokens. The
//!   K scale joins the score scale, the V scale the final normalisation.
//!
//! # Shared memory
//! [`MMA_STAGES`] slots of K then V rows ([`mma_k_row_words`], [`mma_v_row_words`]:
//! padding or a chunk swizzle so a warp's loads fall in distinct banks). Rows outside
//! the attended range are zero-filled by `cp.async` (never read). At the end the warps
//! merge through the same memory: each publishes its output fragments and `(m, l)` per
//! row, and every thread folds the four for a slice of one row.

use crate::device::Ctx;
use crate::kernels::kv_tiles::{
    KvProducer, KvSource, MmaCache, compute_pv, compute_qk, each_upto, update_rows, weights,
};
use crate::kernels::prefill::MmaElem;
use crate::softmax::{LOG2_E, SoftmaxState, load_sink};

use super::{
    DecodeParams, FIXED_BLOCK_SIZE, MMA_MAX_HEADS, MMA_STAGE_TOKENS, MMA_STAGES, THREADS,
    TokenRange, mma_k_row_words, mma_v_row_words,
};

/// Warps per block.
const WARPS: u32 = THREADS / 32;
/// Rows of a stage one warp computes on (one cache block).
const WARP_ROWS: u32 = MMA_STAGE_TOKENS / WARPS;
const _: () = assert!(WARP_ROWS == FIXED_BLOCK_SIZE && WARP_ROWS == 16);

/// The tensor-core decode kernel: head_dim `D` (64 or 128), block size 16, q / out of
/// `T`, a cache of `K` (`T`, or fp8 with per-KV-head scales; see the [module
/// docs](self)).
#[inline(always)]
pub(super) fn decode_mma<T: MmaElem, K: MmaCache<T>, C: Ctx, const D: u32>(
    ctx: &C,
    p: &DecodeParams<T, K>,
) {
    let l = &p.layout;
    let split = p.num_partitions > 1;
    let (krw, vrw) = (mma_k_row_words(D, K::BYTES), mma_v_row_words(D, K::BYTES));
    let k_words = MMA_STAGE_TOKENS * krw; // words of one slot's K rows
    let slot_words = k_words + MMA_STAGE_TOKENS * vrw;
    let tid = ctx.thread_idx().x % THREADS;
    let (warp, lane) = (tid / 32, tid % 32);
    let (g, t) = (lane / 4, lane % 4);

    let b = ctx.block_idx();
    let bdy = p.heads_per_block;
    let group = p.num_q_heads / l.num_kv_heads;
    let head_chunks = group.div_ceil(bdy);
    let kv_head = b.x / head_chunks;
    let first_head = (b.x % head_chunks) * bdy;
    let nh = if group - first_head < bdy {
        group - first_head
    } else {
        bdy
    };
    let (seq, part) = (b.y, b.z);
    let qh0 = kv_head * group + first_head; // first query head of the block

    let range = TokenRange::of(ctx, p, seq, part);
    let (first, num_stages) = range.stages(MMA_STAGE_TOKENS);
    let TokenRange {
        ctx_len,
        start,
        end,
    } = range;
    let span = end.saturating_sub(start);
    let in_range = |t: u32| t.wrapping_sub(start) < span;

    // The cache's scales for this KV head: K's joins the score scale, V's the output's
    // normalisation.
    let (k_scale, v_scale) = if K::SCALED {
        (
            ctx.ld(&p.k_scales, kv_head as u64),
            ctx.ld(&p.v_scales, kv_head as u64),
        )
    } else {
        (1.0, 1.0)
    };

    // Q's A fragments: k-step ks holds rows g and g + 8, two pairs of dims each (which
    // dims: `K::q_dims`).
    let q_row = |r: u32| seq as u64 * p.q_row_stride + (qh0 + r) as u64 * D as u64;
    let q_pair = |r: u32, d: u32| -> u32 {
        if r < nh && num_stages > 0 {
            let at = q_row(r) + d as u64;
            let lo = ctx.ld(&p.q, at).to_f32();
            let hi = ctx.ld(&p.q, at + 1).to_f32();
            T::pack2(lo, hi)
        } else {
            0
        }
    };
    let mut qa = [[0u32; 4]; 8];
    each_upto(D / 16, |ks| {
        let (d0, d1) = K::q_dims(ks as u32, t);
        qa[ks] = [
            q_pair(g, d0),
            q_pair(g + 8, d0),
            q_pair(g, d1),
            q_pair(g + 8, d1),
        ];
    });
    // Scores in log2 units; the ALiBi slope of rows g and g + 8 likewise.
    let s_scale = p.scale * k_scale * LOG2_E;
    let slope = |r: u32| {
        if r < nh && num_stages > 0 && !p.alibi_slopes.is_empty() {
            ctx.ld(&p.alibi_slopes, (qh0 + r) as u64) * LOG2_E
        } else {
            0.0
        }
    };
    let slopes = [slope(g), slope(g + 8)];
    let cap = p.softcap * LOG2_E;
    let inv_cap = p.inv_softcap * (1.0 / LOG2_E);
    let pos0 = -((ctx_len - 1) as f32);

    // produce_kv: the prologue's stages in flight, a stage's blocks looked up one
    // stage ahead.
    let mut phys = [0u32; 4];
    let producer = KvProducer::<K, D>::start::<T, C>(
        ctx,
        tid,
        KvSource {
            start,
            end,
            block_tables: p.block_tables,
            table_row: seq as u64 * p.max_blocks_per_seq as u64,
            key_cache: p.key_cache,
            value_cache: p.value_cache,
            num_kv_heads: l.num_kv_heads,
            kv_head,
        },
        &mut phys,
    );

    let mut state = [SoftmaxState::EMPTY; 2]; // rows g, g + 8 (l: this lane's share)
    let mut o = [[0.0f32; 4]; 16]; // D / 8 dim tiles
    let mut slot = 0;
    let mut i = 0;
    while i < num_stages {
        // Stage i has landed once at most MMA_STAGES - 2 younger groups are pending;
        // after the barrier the slot of stage i - 1 is free for stage i + STAGES - 1.
        ctx.cp_async_wait::<{ MMA_STAGES - 2 }>();
        ctx.sync_threads();
        let fill = if slot == 0 { MMA_STAGES - 1 } else { slot - 1 };
        producer.issue::<T, C>(ctx, &phys, i + MMA_STAGES - 1, fill);
        producer.lookup(ctx, &mut phys, i + MMA_STAGES);

        let kbase = slot * slot_words + warp * WARP_ROWS * krw;
        let vbase = slot * slot_words + k_words + warp * WARP_ROWS * vrw;
        let tok0 = first + i * MMA_STAGE_TOKENS + warp * WARP_ROWS;

        // compute_qk: S[nt] for the 8-token tiles nt = 0, 1; 64 dims a unit.
        let mut sc = [[0.0f32; 4]; 2];
        compute_qk::<T, K, C>(ctx, kbase, krw, lane, 0, &qa, &mut sc);
        if D > 64 {
            compute_qk::<T, K, C>(ctx, kbase, krw, lane, 1, &qa, &mut sc);
        }
        // update_local_state: scale, cap, ALiBi, mask; row maxima; one rescale.
        let mut mx = [f32::NEG_INFINITY; 2];
        each_upto(2, |nt| {
            each_upto(4, |e| {
                let h = e / 2;
                let col = 8 * nt as u32 + 2 * t + (e as u32 % 2);
                let pos = tok0 + col;
                let mut x = sc[nt][e] * s_scale;
                if cap > 0.0 {
                    x = cap * ctx.tanh(x * inv_cap);
                }
                x = ctx.fma(slopes[h], pos0 + pos as f32, x);
                let x = if in_range(pos) { x } else { f32::NEG_INFINITY };
                sc[nt][e] = x;
                if x > mx[h] {
                    mx[h] = x;
                }
            });
        });
        let m_use = update_rows(ctx, &mx, &mut state, &mut o, D / 8);
        let pa = weights::<T, C>(ctx, &sc, &m_use, &mut state);
        // compute_pv: four dim tiles (32 dims) a unit.
        compute_pv::<T, K, C>(ctx, vbase, vrw, lane, 0, &pa, &mut o);
        compute_pv::<T, K, C>(ctx, vbase, vrw, lane, 1, &pa, &mut o);
        if D > 64 {
            compute_pv::<T, K, C>(ctx, vbase, vrw, lane, 2, &pa, &mut o);
            compute_pv::<T, K, C>(ctx, vbase, vrw, lane, 3, &pa, &mut o);
        }
        slot = if slot + 1 == MMA_STAGES { 0 } else { slot + 1 };
        i += 1;
    }
    // Each row's l over its 4 lanes.
    each_upto(2, |h| {
        let a = state[h].l + ctx.shfl_xor_f32(state[h].l, 1);
        state[h].l = a + ctx.shfl_xor_f32(a, 2);
    });
    // Every warp is done with the stages (the groups still open are empty) before the
    // merge reuses their memory.
    ctx.sync_threads();

    // Merge the warps: O of warp w at w * 16 * D words, then (m, l) per (warp, row).
    let ml = WARPS * MMA_MAX_HEADS * D;
    let obase = warp * MMA_MAX_HEADS * D;
    each_upto(D / 8, |j| {
        each_upto(4, |e| {
            let row = g + 8 * (e as u32 / 2);
            let col = K::o_dim(j as u32, t, e as u32);
            ctx.smem_st_f32(obase + row * D + col, o[j][e]);
        });
    });
    if t == 0 {
        each_upto(2, |h| {
            let row = g + 8 * h as u32;
            ctx.smem_st_f32(ml + 2 * (warp * MMA_MAX_HEADS + row), state[h].m);
            ctx.smem_st_f32(ml + 2 * (warp * MMA_MAX_HEADS + row) + 1, state[h].l);
        });
    }
    ctx.sync_threads();

    // Thread tid folds row tid / 8's dims (tid % 8) * D / 8 .. + D / 8.
    let row = tid / 8;
    if row >= nh {
        return;
    }
    let per = D / 8;
    let d0 = (tid % 8) * per;
    let mut merged = SoftmaxState::EMPTY;
    let mut f = [0.0f32; 4];
    let mut acc = [0.0f32; 16];
    each_upto(WARPS, |w| {
        let other = SoftmaxState {
            m: ctx.smem_ld_f32(ml + 2 * (w as u32 * MMA_MAX_HEADS + row)),
            l: ctx.smem_ld_f32(ml + 2 * (w as u32 * MMA_MAX_HEADS + row) + 1),
        };
        let (m, fa, fb) = merged.merge(other, ctx);
        each_upto(w as u32, |v| f[v] *= fa);
        f[w] = fb;
        merged = m;
    });
    each_upto(WARPS, |w| {
        let base = w as u32 * MMA_MAX_HEADS * D + row * D + d0;
        each_upto(per, |e| {
            acc[e] = ctx.fma(ctx.smem_ld_f32(base + e as u32), f[w], acc[e]);
        });
    });
    let head = seq as u64 * p.num_q_heads as u64 + (qh0 + row) as u64;
    if split {
        let at = (head * p.num_partitions as u64 + part as u64) * D as u64 + d0 as u64;
        each_upto(per / 4, |w| {
            let bits = [
                (acc[4 * w] * v_scale).to_bits(),
                (acc[4 * w + 1] * v_scale).to_bits(),
                (acc[4 * w + 2] * v_scale).to_bits(),
                (acc[4 * w + 3] * v_scale).to_bits(),
            ];
            ctx.st_v4(&p.part_out, at + 4 * w as u64, bits);
        });
        if tid.is_multiple_of(8) {
            let mlat = (head * p.num_partitions as u64 + part as u64) * 2;
            ctx.st(&p.part_ml, mlat, merged.m);
            ctx.st(&p.part_ml, mlat + 1, merged.l);
        }
    } else {
        let sink = load_sink(ctx, &p.sinks, (qh0 + row) as u64);
        let inv = v_scale * merged.normaliser(sink, ctx);
        if tid.is_multiple_of(8) && !p.lse.is_empty() {
            ctx.st(&p.lse, head, merged.lse(sink, ctx));
        }
        let at = seq as u64 * p.out_row_stride + (qh0 + row) as u64 * D as u64 + d0 as u64;
        each_upto(per / 8, |w| {
            let vals: [f32; 8] = core::array::from_fn(|e| acc[8 * w + e] * inv);
            ctx.st_v4(&p.out, at + 8 * w as u64, T::pack(&vals));
        });
    }
}

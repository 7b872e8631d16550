//! The multi-warp tensor-core prefill kernel (head_dim 64 and 128 at block size 16,
//! q of f16 or bf16, a cache of q's type or fp8): FlashAttention-2's decomposition over
//! the paged cache.
//!
//! # Work decomposition
//! Grid `(num_kv_heads, ceil(rows / TILE_ROWS), num_seqs)`, [`TILED_THREADS`] threads
//! (four warps). A block serves [`TILE_ROWS`] consecutive query rows of one sequence and
//! KV head (rows are `(token, query head)` pairs, token-major, see [`super`]); warp `w`
//! owns rows `16w..16w + 16` of them, the `M` of its `mma.m16n8k16`s, for the whole
//! launch. Every warp consumes every staged K/V tile, so K and V are read from the
//! cache once per block.
//!
//! # Per stage, per warp
//! The block's attended positions (the union of its rows' causal and window ranges)
//! are staged [`MMA_STAGE_TOKENS`] at a time through the decode kernel's `cp.async`
//! pipeline (`kv_tiles::KvProducer`: [`MMA_STAGES`] slots, one page lookup per cache block one
//! stage ahead, positions outside the range zero-filled, one barrier per stage). A warp:
//! * `compute_qk`: `S = Q Kᵀ` for the stage's four 16-token groups, over the whole
//!   head_dim at once (Q's A fragments stay in registers for the launch; K's B
//!   fragments as the cache type reads them, see `kv_tiles::MmaCache`);
//! * `update_local_state`: scale, soft-cap, ALiBi and the causal / window mask on the
//!   32 scores a lane holds (rows `g` and `g + 8`), each row's maximum over the stage
//!   with two xor-shuffles, one rescale of the output fragments per stage. A *plain*
//!   stage (no soft-cap, no ALiBi, the warp's 16 rows all exist and the stage lies
//!   inside every one of their ranges: all but the stages on the diagonal and the
//!   window's edge) only scales: one `FMUL` a score, no per-score tests;
//! * `compute_pv`: `O += P V`, `P` repacked from the score fragments.
//!
//! The output fragments stay in registers; at the end each lane normalises its rows
//! (the V scale joins the normalisation) and stores them.

use super::{MmaElem, PrefillParams, Row, Seq};
use crate::device::Ctx;
use crate::kernels::attention::{
    MMA_STAGE_TOKENS, MMA_STAGES, THREADS, mma_k_row_words, mma_v_row_words,
};
use crate::kernels::kv_tiles::{
    KvProducer, KvSource, MmaCache, compute_pv, compute_qk, each_upto, update_rows, weights,
};
use crate::softmax::{SoftmaxState, load_sink};

/// Query rows one block of the multi-warp kernel serves (16 per warp).
pub const TILE_ROWS: u32 = 64;
/// Threads per block of the multi-warp kernel (the decode kernel's four warps).
pub const TILED_THREADS: u32 = THREADS;
const _: () = assert!(TILE_ROWS == 16 * (TILED_THREADS / 32));

/// Scores of one warp's rows against a stage: `[16-token group][8-token tile][c
/// fragment]`.
type Scores = [[[f32; 4]; 2]; 4];

/// `compute_qk` for the 16-token group at word `kbase`: every head dim, into `sc`.
#[inline(always)]
fn qk_group<T: MmaElem, K: MmaCache<T>, C: Ctx, const D: u32>(
    ctx: &C,
    kbase: u32,
    krw: u32,
    lane: u32,
    qa: &[[u32; 4]; 8],
    sc: &mut [[f32; 4]; 2],
) {
    compute_qk::<T, K, C>(ctx, kbase, krw, lane, 0, qa, sc);
    if D > 64 {
        compute_qk::<T, K, C>(ctx, kbase, krw, lane, 1, qa, sc);
    }
}

/// `compute_pv` for the 16-token group at word `vbase` with its weights `pa`: every
/// dim tile of the output.
#[inline(always)]
fn pv_group<T: MmaElem, K: MmaCache<T>, C: Ctx, const D: u32>(
    ctx: &C,
    vbase: u32,
    vrw: u32,
    lane: u32,
    pa: &[u32; 4],
    o: &mut [[f32; 4]; 16],
) {
    compute_pv::<T, K, C>(ctx, vbase, vrw, lane, 0, pa, o);
    compute_pv::<T, K, C>(ctx, vbase, vrw, lane, 1, pa, o);
    if D > 64 {
        compute_pv::<T, K, C>(ctx, vbase, vrw, lane, 2, pa, o);
        compute_pv::<T, K, C>(ctx, vbase, vrw, lane, 3, pa, o);
    }
}

/// The multi-warp tensor-core prefill kernel: head_dim `D` (64 or 128), block size 16,
/// q / out of `T`, a cache of `K` (see the [module docs](self)).
#[inline(always)]
pub(super) fn prefill_tiled<T: MmaElem, K: MmaCache<T>, C: Ctx, const D: u32>(
    ctx: &C,
    p: &PrefillParams<T, K>,
) {
    let b = ctx.block_idx();
    let (kvh, tile, s) = (b.x, b.y, b.z);
    let sq = Seq::load(ctx, p, s);
    let rows = sq.qo_len * sq.group;
    let row0 = tile * TILE_ROWS;
    if row0 >= rows {
        return; // the whole block leaves: no barrier is reached
    }
    let (krw, vrw) = (mma_k_row_words(D, K::BYTES), mma_v_row_words(D, K::BYTES));
    let k_words = MMA_STAGE_TOKENS * krw;
    let slot_words = k_words + MMA_STAGE_TOKENS * vrw;
    let tid = ctx.thread_idx().x % TILED_THREADS;
    let (warp, lane) = (tid / 32, tid % 32);
    let (g, t) = (lane / 4, lane % 4);

    // This lane's rows g and g + 8 of its warp.
    let wrow0 = row0 + 16 * warp;
    let row = [
        Row::new(ctx, p, &sq, kvh, wrow0 + g),
        Row::new(ctx, p, &sq, kvh, wrow0 + g + 8),
    ];
    // The positions any row of the block sees.
    let last = if row0 + TILE_ROWS < rows {
        row0 + TILE_ROWS
    } else {
        rows
    } - 1;
    let start = sq.first_visible(ctx, p, row0 / sq.group);
    let end = sq.end(ctx, p, last / sq.group);
    let v_scale = if K::SCALED {
        ctx.ld(&p.v_scales, kvh as u64)
    } else {
        1.0
    };

    // Q's A fragments: k-step ks holds rows g and g + 8, two pairs of dims each (which
    // dims: `K::q_dims`); rows past the sequence are zeros.
    let q_pair = |r: &Row, d: u32| -> u32 {
        if r.valid {
            let at = r.q_at(ctx, p, &sq, d);
            T::pack2(ctx.ld(&p.q, at).to_f32(), ctx.ld(&p.q, at + 1).to_f32())
        } else {
            0
        }
    };
    let mut qa = [[0u32; 4]; 8];
    each_upto(D / 16, |ks| {
        let (d0, d1) = K::q_dims(ks as u32, t);
        qa[ks] = [
            q_pair(&row[0], d0),
            q_pair(&row[1], d0),
            q_pair(&row[0], d1),
            q_pair(&row[1], d1),
        ];
    });

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
            table_row: s as u64 * p.max_blocks_per_seq as u64,
            key_cache: p.key_cache,
            value_cache: p.value_cache,
            num_kv_heads: p.layout.num_kv_heads,
            kv_head: kvh,
        },
        &mut phys,
    );
    let (first, num_stages) = (producer.first, producer.num_stages);

    // Plain stages `plain.0..plain.1`: every score of this warp's rows is just
    // `dot * scale * log2(e)` (no soft-cap, no ALiBi, all 16 rows exist, and the stage
    // lies inside every row's window and causal range), so they skip the per-score
    // masks and terms; the stages that cross a row's range take the general path.
    let plain = if p.softcap == 0.0 && p.alibi_slopes.is_empty() && wrow0 + 16 <= rows {
        // The warp's latest first visible position and earliest query position.
        let lo = sq.first_visible(ctx, p, (wrow0 + 15) / sq.group);
        let hi = sq.end(ctx, p, wrow0 / sq.group);
        // A tree mask may hide any new token: only the cached positions are plain.
        let hi = if p.tree_mask.is_empty() || hi < sq.ctx_len - sq.qo_len {
            hi
        } else {
            sq.ctx_len - sq.qo_len
        };
        (
            (lo - first).div_ceil(MMA_STAGE_TOKENS),
            hi.saturating_sub(first) / MMA_STAGE_TOKENS,
        )
    } else {
        (1, 0)
    };
    // (One rounding fewer than the masked path's `dot * scale`, then `* log2 e`: the
    // two may differ in the last place, well inside every tolerance.)
    let plain_scale = row[0].scale * crate::softmax::LOG2_E;

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

        let kbase = slot * slot_words;
        let vbase = kbase + k_words;
        let tok0 = first + i * MMA_STAGE_TOKENS;

        // compute_qk: the stage's four 16-token groups.
        let mut sc: Scores = [[[0.0f32; 4]; 2]; 4];
        qk_group::<T, K, C, D>(ctx, kbase, krw, lane, &qa, &mut sc[0]);
        qk_group::<T, K, C, D>(ctx, kbase + 16 * krw, krw, lane, &qa, &mut sc[1]);
        qk_group::<T, K, C, D>(ctx, kbase + 32 * krw, krw, lane, &qa, &mut sc[2]);
        qk_group::<T, K, C, D>(ctx, kbase + 48 * krw, krw, lane, &qa, &mut sc[3]);

        // update_local_state: scores and masks, row maxima, one rescale.
        let mut mx = [f32::NEG_INFINITY; 2];
        if i >= plain.0 && i < plain.1 {
            each_upto(4, |j| {
                each_upto(2, |nt| {
                    each_upto(4, |e| {
                        let x = sc[j][nt][e] * plain_scale;
                        sc[j][nt][e] = x;
                        if x > mx[e / 2] {
                            mx[e / 2] = x;
                        }
                    });
                });
            });
        } else {
            each_upto(4, |j| {
                each_upto(2, |nt| {
                    each_upto(4, |e| {
                        let h = e / 2;
                        let kpos = tok0 + 16 * j as u32 + 8 * nt as u32 + 2 * t + e as u32 % 2;
                        let x = row[h].score(ctx, p, &sq, sc[j][nt][e], kpos);
                        sc[j][nt][e] = x;
                        if x > mx[h] {
                            mx[h] = x;
                        }
                    });
                });
            });
        }
        let m_use = update_rows(ctx, &mx, &mut state, &mut o, D / 8);
        // compute_pv: each 16-token group's weights, then its P V (a group's weights
        // are made just before their use: fewer registers live at once).
        let pa = weights::<T, C>(ctx, &sc[0], &m_use, &mut state);
        pv_group::<T, K, C, D>(ctx, vbase, vrw, lane, &pa, &mut o);
        let pa = weights::<T, C>(ctx, &sc[1], &m_use, &mut state);
        pv_group::<T, K, C, D>(ctx, vbase + 16 * vrw, vrw, lane, &pa, &mut o);
        let pa = weights::<T, C>(ctx, &sc[2], &m_use, &mut state);
        pv_group::<T, K, C, D>(ctx, vbase + 32 * vrw, vrw, lane, &pa, &mut o);
        let pa = weights::<T, C>(ctx, &sc[3], &m_use, &mut state);
        pv_group::<T, K, C, D>(ctx, vbase + 48 * vrw, vrw, lane, &pa, &mut o);

        slot = if slot + 1 == MMA_STAGES { 0 } else { slot + 1 };
        i += 1;
    }

    // Each row's sum over its 4 lanes; the sink (if any) and the V scale join the
    // normalisation.
    let mut inv = [0.0f32; 2];
    each_upto(2, |h| {
        let a = state[h].l + ctx.shfl_xor_f32(state[h].l, 1);
        let total = a + ctx.shfl_xor_f32(a, 2);
        let sink = load_sink(ctx, &p.sinks, row[h].head as u64);
        let merged = SoftmaxState {
            m: state[h].m,
            l: total,
        };
        inv[h] = v_scale * merged.normaliser(sink, ctx);
        if t == 0 && row[h].valid && !p.lse.is_empty() {
            ctx.st(&p.lse, row[h].lse_at(p, &sq), merged.lse(sink, ctx));
        }
    });
    each_upto(D / 8, |j| {
        each_upto(4, |e| {
            let r = &row[e / 2];
            if r.valid {
                let dim = K::o_dim(j as u32, t, e as u32);
                ctx.st(&p.out, r.at(p, &sq, dim), T::from_f32(o[j][e] * inv[e / 2]));
            }
        });
    });
}

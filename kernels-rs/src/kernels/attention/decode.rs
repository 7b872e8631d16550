//! The decode kernel body: a `cp.async` pipeline over the partition's tokens (see the
//! module docs of [`super`]).

use crate::device::{Ctx, Kernel};
use crate::elem::{Bf16, E4m3, E5m2, Elem, F16, KvElem};
use crate::kernels::each16;
use crate::softmax::{LOG2_E, SoftmaxState};

use super::{
    ACC_WORDS, DecodeGeometry, DecodeParams, PIECES_PER_THREAD, PagedDecode, STAGES, THREADS,
    max_vec,
};

/// Per-thread registers (q, or the accumulator): chunk `v`'s element `e` at `v *
/// K::PER_V4 + e`.
type Vecs = [f32; ACC_WORDS as usize];

/// One of the thread's 16-byte copies per stage: where it lands and what it reads.
#[derive(Clone, Copy)]
struct Piece {
    /// Whether the piece exists (`2 * stage_tokens * chunks` pieces per stage).
    live: bool,
    /// V (else K).
    is_v: bool,
    /// Token within the stage.
    tok: u32,
    /// Element offset within the token's row (`chunk * per_v4`).
    col: u32,
    /// Shared-memory word within the stage.
    word: u32,
    /// Physical block of this piece's token in the stage being issued next.
    phys: u32,
}

/// Calls `f` on each of the [`PIECES_PER_THREAD`] pieces, written out so every index
/// is a constant after inlining (the pieces live in registers, not local memory).
#[inline(always)]
fn each_piece(p: &mut [Piece; PIECES_PER_THREAD as usize], mut f: impl FnMut(&mut Piece)) {
    let [a, b, c, d] = p;
    f(a);
    f(b);
    f(c);
    f(d);
}

/// Calls `f(v)` for each chunk `v < max_vec(K::PER_V4)` a thread holds, each a
/// constant after inlining (so the registers it indexes stay registers).
#[inline(always)]
fn each_vec<K: KvElem>(mut f: impl FnMut(u32)) {
    f(0);
    if max_vec(K::PER_V4) > 1 {
        f(1);
    }
}

/// Calls `f(j)` for each of the `sub = K::PER_V4 / T::PER_V4` (1 or 2) q / out vectors
/// of one cache chunk, each a constant after inlining.
#[inline(always)]
fn each_sub<T: Elem, K: KvElem>(mut f: impl FnMut(u32)) {
    f(0);
    if K::PER_V4 / T::PER_V4 > 1 {
        f(1);
    }
}

#[inline(always)]
pub(super) fn decode<T: Elem, K: KvElem, C: Ctx, const SPLIT: bool>(
    ctx: &C,
    p: &DecodeParams<T, K>,
) {
    let l = &p.layout;
    let geo = DecodeGeometry::new(l.head_dim, K::PER_V4);
    // Elements of a chunk (a 16-byte cache vector), and q / out vectors per chunk.
    let kp = K::PER_V4;
    let (chunks, bdx, st) = (geo.chunks, geo.bdx, geo.stage_tokens);
    let bdy = p.heads_per_block;
    let bdz = geo.token_groups(bdy);
    let tid = ctx.thread_idx().x;
    let tx = tid % bdx;
    let ty = (tid / bdx) % bdy;
    let tz = tid / bdx / bdy;

    let b = ctx.block_idx();
    let group = p.num_q_heads / l.num_kv_heads;
    let head_chunks = group.div_ceil(bdy);
    let kv_head = b.x / head_chunks;
    let first = (b.x % head_chunks) * bdy;
    let nh = if group - first < bdy {
        group - first
    } else {
        bdy
    };
    let (seq, part) = (b.y, b.z);
    let active = ty < nh && tz < bdz;
    // This thread's query head: its index in the batch (for the partials), and its
    // element offsets in the (strided) q and out rows.
    let qh = (kv_head * group + first + ty) as u64;
    let head = seq as u64 * p.num_q_heads as u64 + qh;
    let q_at = seq as u64 * p.q_row_stride + qh * l.head_dim as u64;
    let out_at = seq as u64 * p.out_row_stride + qh * l.head_dim as u64;

    // The token range of this partition, clipped to the window.
    let ctx_len = ctx.ld(&p.context_lens, seq as u64) as u32;
    let win_start = if p.window > 0 && ctx_len > p.window {
        ctx_len - p.window
    } else {
        0
    };
    let part_lo = part * p.partition_tokens;
    let start = if part_lo > win_start {
        part_lo
    } else {
        win_start
    };
    let end = if part_lo + p.partition_tokens < ctx_len {
        part_lo + p.partition_tokens
    } else {
        ctx_len
    };
    let num_stages = if end > start {
        (end - start).div_ceil(st)
    } else {
        0
    };

    // This thread's copies: piece `tid + k * THREADS` of every stage.
    let bs_shift = l.block_size.trailing_zeros();
    let table_row = seq as u64 * p.max_blocks_per_seq as u64;
    let half = st * chunks;
    let mut pieces = [Piece {
        live: false,
        is_v: false,
        tok: 0,
        col: 0,
        word: 0,
        phys: 0,
    }; PIECES_PER_THREAD as usize];
    let mut k = 0;
    each_piece(&mut pieces, |pc| {
        let i = tid + k * THREADS;
        k += 1;
        pc.live = i < 2 * half;
        pc.is_v = i >= half;
        let r = if pc.is_v { i - half } else { i };
        pc.tok = r / chunks;
        pc.col = (r - pc.tok * chunks) * kp;
        pc.word = 4 * i;
    });
    // Loads the block ids of stage `s`'s tokens (ahead of its copies).
    let lookup = |pieces: &mut [Piece; PIECES_PER_THREAD as usize], s: u32| {
        each_piece(pieces, |pc| {
            let t = start + s * st + pc.tok;
            if pc.live && s < num_stages && t < end {
                pc.phys = ctx.ld(&p.block_tables, table_row + (t >> bs_shift) as u64) as u32;
            }
        });
    };
    // Issues stage `s`'s copies into its slot, then commits (an empty group past the end).
    let issue = |pieces: &[Piece; PIECES_PER_THREAD as usize], s: u32| {
        let base = (s & (STAGES - 1)) * geo.stage_words();
        let mut ps = *pieces;
        each_piece(&mut ps, |pc| {
            let t = start + s * st + pc.tok;
            if pc.live && s < num_stages && t < end {
                let src = l.offset(pc.phys, kv_head, t & (l.block_size - 1)) + pc.col as u64;
                if pc.is_v {
                    ctx.cp_async_16(base + pc.word, &p.value_cache, src);
                } else {
                    ctx.cp_async_16(base + pc.word, &p.key_cache, src);
                }
            }
        });
        ctx.cp_async_commit();
    };

    // The cache's scales for this KV head: K's folded into q, V's into the output.
    let (k_scale, v_scale) = if K::SCALED {
        (
            ctx.ld(&p.k_scales, kv_head as u64),
            ctx.ld(&p.v_scales, kv_head as u64),
        )
    } else {
        (1.0, 1.0)
    };
    let q_scale = p.scale * k_scale;
    // q of this thread's head and chunks, scaled, in registers (not loaded for a
    // partition past the context: its token loop never runs).
    let mut q: Vecs = [0.0; ACC_WORDS as usize];
    let reads = active && num_stages > 0;
    each_vec::<K>(|v| {
        let c = tx + v * bdx;
        if reads && c < chunks {
            each_sub::<T, K>(|j| {
                let raw = ctx.ld_v4(&p.q, q_at + (c * kp + j * T::PER_V4) as u64);
                for e in 0..T::PER_V4 {
                    q[(v * kp + j * T::PER_V4 + e) as usize] = T::unpack(&raw, e) * q_scale;
                }
            });
        }
    });
    let slope = if reads && !p.alibi_slopes.is_empty() {
        ctx.ld(&p.alibi_slopes, qh)
    } else {
        0.0
    };

    // Prologue: STAGES - 1 stages in flight.
    lookup(&mut pieces, 0);
    let mut s = 0;
    while s < STAGES - 1 {
        issue(&pieces, s);
        lookup(&mut pieces, s + 1);
        s += 1;
    }

    let mut state = SoftmaxState::EMPTY;
    let mut acc: Vecs = [0.0; ACC_WORDS as usize];
    let per_group = st.div_ceil(bdz);
    let mut i = 0;
    while i < num_stages {
        issue(&pieces, i + STAGES - 1);
        lookup(&mut pieces, i + STAGES);
        ctx.cp_async_wait::<{ STAGES - 1 }>();
        ctx.sync_threads();

        let base = (i & (STAGES - 1)) * geo.stage_words();
        let stage_start = start + i * st;
        let mut r = 0;
        while r < per_group {
            let tok = tz + r * bdz;
            let t = stage_start + tok;
            let valid = active && tok < st && t < end;
            let row = if tok < st { tok } else { 0 };
            // Every lane shuffles (the warp must), valid or not.
            let mut dot = 0.0f32;
            each_vec::<K>(|v| {
                let c = tx + v * bdx;
                if c < chunks {
                    let kk = ctx.smem_ld_v4(base + 4 * (row * chunks + c));
                    each16(|e| {
                        if e < kp {
                            dot = ctx.fma(q[(v * kp + e) as usize], K::unpack(&kk, e), dot);
                        }
                    });
                }
            });
            let mut m = bdx / 2;
            while m >= 1 {
                dot += ctx.shfl_xor_f32(dot, m);
                m /= 2;
            }
            if valid {
                let mut sc = dot;
                if p.softcap > 0.0 {
                    sc = p.softcap * ctx.tanh(sc * p.inv_softcap);
                }
                sc = ctx.fma(slope, t as f32 - (ctx_len - 1) as f32, sc) * LOG2_E;
                let m_new = if sc > state.m { sc } else { state.m };
                let alpha = ctx.exp2(state.m - m_new);
                let pe = ctx.exp2(sc - m_new);
                state = SoftmaxState {
                    m: m_new,
                    l: ctx.fma(state.l, alpha, pe),
                };
                each_vec::<K>(|v| {
                    let c = tx + v * bdx;
                    if c < chunks {
                        let vv = ctx.smem_ld_v4(base + 4 * (half + row * chunks + c));
                        each16(|e| {
                            if e < kp {
                                let x = &mut acc[(v * kp + e) as usize];
                                *x = ctx.fma(pe, K::unpack(&vv, e), *x * alpha);
                            }
                        });
                    }
                });
            }
            r += 1;
        }
        // Every thread is done with this slot before it is refilled.
        ctx.sync_threads();
        i += 1;
    }
    // The groups still open are the empty ones past the last stage: no copy is in
    // flight, so the merge below may reuse the stage memory.

    // Merge the token groups: groups tz > 0 publish, group 0 folds them in.
    let ml_s = THREADS * ACC_WORDS;
    let slot = ty + bdy * tz;
    if active && tz > 0 {
        each_vec::<K>(|v| {
            for e in 0..kp {
                let w = v * kp + e;
                ctx.smem_st_f32(tid * ACC_WORDS + w, acc[w as usize]);
            }
        });
        if tx == 0 {
            ctx.smem_st_f32(ml_s + 2 * slot, state.m);
            ctx.smem_st_f32(ml_s + 2 * slot + 1, state.l);
        }
    }
    ctx.sync_threads();
    if !(active && tz == 0) {
        return;
    }
    let mut z = 1;
    while z < bdz {
        let other_slot = ty + bdy * z;
        let other = SoftmaxState {
            m: ctx.smem_ld_f32(ml_s + 2 * other_slot),
            l: ctx.smem_ld_f32(ml_s + 2 * other_slot + 1),
        };
        let (merged, fa, fb) = state.merge(other, ctx);
        let other_tid = tx + bdx * other_slot;
        each_vec::<K>(|v| {
            for e in 0..kp {
                let w = v * kp + e;
                let o = ctx.smem_ld_f32(other_tid * ACC_WORDS + w);
                let x = &mut acc[w as usize];
                *x = ctx.fma(o, fb, *x * fa);
            }
        });
        state = merged;
        z += 1;
    }

    // Epilogue: one 16-byte store per chunk (non-split), or the partials.
    let d = l.head_dim as u64;
    let inv = if SPLIT { v_scale } else { v_scale / state.l };
    each_vec::<K>(|v| {
        let c = tx + v * bdx;
        if c >= chunks {
            return;
        }
        if SPLIT {
            let base = (head * p.num_partitions as u64 + part as u64) * d + (c * kp) as u64;
            for w in 0..4 {
                if w * 4 < kp {
                    let i = (v * kp + 4 * w) as usize;
                    let bits = [
                        (acc[i] * inv).to_bits(),
                        (acc[i + 1] * inv).to_bits(),
                        (acc[i + 2] * inv).to_bits(),
                        (acc[i + 3] * inv).to_bits(),
                    ];
                    ctx.st_v4(&p.part_out, base + (4 * w) as u64, bits);
                }
            }
        } else {
            each_sub::<T, K>(|j| {
                let first = (v * kp + j * T::PER_V4) as usize;
                let vals: [f32; 8] = core::array::from_fn(|e| {
                    if (e as u32) < T::PER_V4 {
                        acc[first + e] * inv
                    } else {
                        0.0
                    }
                });
                let at = out_at + (c * kp + j * T::PER_V4) as u64;
                ctx.st_v4(&p.out, at, T::pack(&vals));
            });
        }
    });
    if SPLIT && tx == 0 {
        let base = (head * p.num_partitions as u64 + part as u64) * 2;
        ctx.st(&p.part_ml, base, state.m);
        ctx.st(&p.part_ml, base + 1, state.l);
    }
}

macro_rules! decode_kernels {
    ($t:ty, $k:ty, $decode:literal, $split:literal) => {
        impl Kernel for PagedDecode<$t, false, $k> {
            type Params = DecodeParams<$t, $k>;
            const NAME: &'static str = $decode;
            #[inline(always)]
            fn run<C: Ctx>(ctx: &C, p: &Self::Params) {
                decode::<$t, $k, C, false>(ctx, p)
            }
        }
        impl Kernel for PagedDecode<$t, true, $k> {
            type Params = DecodeParams<$t, $k>;
            const NAME: &'static str = $split;
            #[inline(always)]
            fn run<C: Ctx>(ctx: &C, p: &Self::Params) {
                decode::<$t, $k, C, true>(ctx, p)
            }
        }
    };
}
decode_kernels!(
    F16,
    F16,
    "paged_decode_attention_f16",
    "paged_decode_attention_split_f16"
);
decode_kernels!(
    Bf16,
    Bf16,
    "paged_decode_attention_bf16",
    "paged_decode_attention_split_bf16"
);
decode_kernels!(
    f32,
    f32,
    "paged_decode_attention_f32",
    "paged_decode_attention_split_f32"
);
decode_kernels!(
    F16,
    E4m3,
    "paged_decode_attention_f16_e4m3",
    "paged_decode_attention_split_f16_e4m3"
);
decode_kernels!(
    F16,
    E5m2,
    "paged_decode_attention_f16_e5m2",
    "paged_decode_attention_split_f16_e5m2"
);
decode_kernels!(
    Bf16,
    E4m3,
    "paged_decode_attention_bf16_e4m3",
    "paged_decode_attention_split_bf16_e4m3"
);
decode_kernels!(
    Bf16,
    E5m2,
    "paged_decode_attention_bf16_e5m2",
    "paged_decode_attention_split_bf16_e5m2"
);

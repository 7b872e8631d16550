//! The decode kernel body: a `cp.async` pipeline over the partition's tokens (see the
//! module docs of [`super`]).

use crate::device::{Ctx, Kernel};
use crate::elem::{Bf16, Elem, F16};
use crate::softmax::{LOG2_E, SoftmaxState};

use super::{
    DecodeGeometry, DecodeParams, PIECES_PER_THREAD, PagedDecode, STAGES, THREADS, max_vec,
};

/// Per-thread registers of `max_vec` chunks of 8 `f32` (q, or the accumulator).
type Vecs = [[f32; 8]; 2];

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

/// Calls `f(v, &mut x[v])` for `v < max_vec::<T>()`, each index a constant.
#[inline(always)]
fn each_vec<T: Elem>(x: &mut Vecs, mut f: impl FnMut(u32, &mut [f32; 8])) {
    let [a, b] = x;
    f(0, a);
    if max_vec(T::PER_V4) > 1 {
        f(1, b);
    }
}

#[inline(always)]
pub(super) fn decode<T: Elem, C: Ctx, const SPLIT: bool>(ctx: &C, p: &DecodeParams<T>) {
    let l = &p.layout;
    let geo = DecodeGeometry::new(l.head_dim, T::PER_V4);
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
        pc.col = (r - pc.tok * chunks) * T::PER_V4;
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

    // q of this thread's head and chunks, scaled, in registers.
    let mut q: Vecs = [[0.0; 8]; 2];
    each_vec::<T>(&mut q, |v, qv| {
        let c = tx + v * bdx;
        if active && c < chunks {
            let raw = ctx.ld_v4(&p.q, q_at + (c * T::PER_V4) as u64);
            for e in 0..T::PER_V4 {
                qv[e as usize] = T::unpack(&raw, e) * p.scale;
            }
        }
    });
    let slope = if active && !p.alibi_slopes.is_empty() {
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
    let mut acc: Vecs = [[0.0; 8]; 2];
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
            each_vec::<T>(&mut q, |v, qv| {
                let c = tx + v * bdx;
                if c < chunks {
                    let kk = ctx.smem_ld_v4(base + 4 * (row * chunks + c));
                    for e in 0..T::PER_V4 {
                        dot = ctx.fma(qv[e as usize], T::unpack(&kk, e), dot);
                    }
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
                each_vec::<T>(&mut acc, |v, av| {
                    let c = tx + v * bdx;
                    if c < chunks {
                        let vv = ctx.smem_ld_v4(base + 4 * (half + row * chunks + c));
                        for e in 0..T::PER_V4 {
                            let x = &mut av[e as usize];
                            *x = ctx.fma(pe, T::unpack(&vv, e), *x * alpha);
                        }
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
    let ml_s = THREADS * 8;
    let slot = ty + bdy * tz;
    if active && tz > 0 {
        each_vec::<T>(&mut acc, |v, av| {
            for e in 0..T::PER_V4 {
                ctx.smem_st_f32(tid * 8 + v * T::PER_V4 + e, av[e as usize]);
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
        each_vec::<T>(&mut acc, |v, av| {
            for e in 0..T::PER_V4 {
                let o = ctx.smem_ld_f32(other_tid * 8 + v * T::PER_V4 + e);
                let x = &mut av[e as usize];
                *x = ctx.fma(o, fb, *x * fa);
            }
        });
        state = merged;
        z += 1;
    }

    // Epilogue: one 16-byte store per chunk (non-split), or the partials.
    let d = l.head_dim as u64;
    let inv = if SPLIT { 1.0 } else { 1.0 / state.l };
    each_vec::<T>(&mut acc, |v, av| {
        let c = tx + v * bdx;
        if c >= chunks {
            return;
        }
        if SPLIT {
            let base = (head * p.num_partitions as u64 + part as u64) * d + (c * T::PER_V4) as u64;
            let mut w = 0;
            while w < T::PER_V4 {
                let i = w as usize;
                let bits = [
                    av[i].to_bits(),
                    av[i + 1].to_bits(),
                    av[i + 2].to_bits(),
                    av[i + 3].to_bits(),
                ];
                ctx.st_v4(&p.part_out, base + w as u64, bits);
                w += 4;
            }
        } else {
            let mut vals = [0.0f32; 8];
            for (o, x) in vals.iter_mut().zip(av.iter()) {
                *o = *x * inv;
            }
            ctx.st_v4(&p.out, out_at + (c * T::PER_V4) as u64, T::pack(&vals));
        }
    });
    if SPLIT && tx == 0 {
        let base = (head * p.num_partitions as u64 + part as u64) * 2;
        ctx.st(&p.part_ml, base, state.m);
        ctx.st(&p.part_ml, base + 1, state.l);
    }
}

macro_rules! decode_kernels {
    ($t:ty, $decode:literal, $split:literal) => {
        impl Kernel for PagedDecode<$t, false> {
            type Params = DecodeParams<$t>;
            const NAME: &'static str = $decode;
            #[inline(always)]
            fn run<C: Ctx>(ctx: &C, p: &Self::Params) {
                decode::<$t, C, false>(ctx, p)
            }
        }
        impl Kernel for PagedDecode<$t, true> {
            type Params = DecodeParams<$t>;
            const NAME: &'static str = $split;
            #[inline(always)]
            fn run<C: Ctx>(ctx: &C, p: &Self::Params) {
                decode::<$t, C, true>(ctx, p)
            }
        }
    };
}
decode_kernels!(
    F16,
    "paged_decode_attention_f16",
    "paged_decode_attention_split_f16"
);
decode_kernels!(
    Bf16,
    "paged_decode_attention_bf16",
    "paged_decode_attention_split_bf16"
);
decode_kernels!(
    f32,
    "paged_decode_attention_f32",
    "paged_decode_attention_split_f32"
);

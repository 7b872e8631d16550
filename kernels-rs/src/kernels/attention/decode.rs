//! The decode kernel body: a `cp.async` pipeline over the partition's tokens (see the
//! module docs of [`super`]).

use crate::device::{Ctx, Kernel};
use crate::elem::{Bf16, E4m3, E5m2, Elem, F16, KvElem};
use crate::kernels::each16;
use crate::softmax::{LOG2_E, SoftmaxState, load_sink};

use super::{
    ACC_WORDS, DecodeGeometry, DecodeParams, FIXED_BLOCK_SIZE, PIECES_PER_THREAD, PagedDecode,
    STAGES, THREADS, TokenRange, max_vec,
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
    /// Element offset of the piece's token row within its block:
    /// `kv_head * block_size * head_dim + chunk * per_v4`.
    off: u32,
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

/// Calls `f(j)` for `j` in `0..N` (`N <= 8`), each a constant after inlining: the
/// tile's scores stay in registers.
#[inline(always)]
fn each_tok<const N: usize>(mut f: impl FnMut(usize)) {
    f(0);
    if N > 1 {
        f(1);
    }
    if N > 2 {
        f(2);
        f(3);
    }
    if N > 4 {
        f(4);
        f(5);
        f(6);
        f(7);
    }
}

/// What every stage of one thread block needs: its geometry, its token range and the
/// thread's place in it. Built once by [`decode`]; [`Block::stream`] runs the pipeline.
struct Block<'a, T, K> {
    p: &'a DecodeParams<T, K>,
    geo: DecodeGeometry,
    /// Tokens per block of the cache (a compile-time constant for a fixed geometry).
    block_size: u32,
    tid: u32,
    tx: u32,
    tz: u32,
    /// Token groups (`bdz`).
    bdz: u32,
    /// Whether this thread serves a query head.
    active: bool,
    /// The KV head of this thread block.
    kv_head: u32,
    /// First token attended, and one past the last.
    start: u32,
    end: u32,
    /// First token of stage 0: `start` rounded down to a multiple of the stage size,
    /// so every stage covers whole blocks (or part of one); its tokens before `start`
    /// are neither copied nor attended.
    first: u32,
    num_stages: u32,
    /// Row of this sequence's block table.
    table_row: u64,
    /// `scale * k_scale * log2(e)`-scaled q of this thread's head and chunks.
    q: Vecs,
    /// ALiBi slope of this thread's head times `log2(e)` (0 without ALiBi).
    slope: f32,
    /// Position of token 0 relative to the new token: `-(ctx_len - 1)`, as f32.
    pos0: f32,
    /// The soft-cap in log2 units (`softcap * log2(e)`, 0: none) and the factor of
    /// its `tanh` argument (`inv_softcap / log2(e)`).
    cap: f32,
    inv_cap: f32,
}

impl<T: Elem, K: KvElem> Block<'_, T, K> {
    /// Streams the partition's stages through the pipeline and returns this thread's
    /// online-softmax state and unnormalised accumulator over its token group. A token
    /// group owns `per_group = stage_tokens / bdz` consecutive rows of every stage and
    /// scores them `N` at a time (a *tile*, `N` dividing `per_group`, or a tile of 2
    /// over a group of one row, the second row masked): one maximum and one rescale of
    /// the accumulator per tile.
    #[inline(always)]
    fn stream<C: Ctx, const N: usize>(&self, ctx: &C) -> (SoftmaxState, Vecs) {
        let p = self.p;
        let geo = self.geo;
        let (chunks, bdx, st) = (geo.chunks, geo.bdx, geo.stage_tokens);
        let kp = K::PER_V4;
        let half = st * chunks;
        let bs_shift = self.block_size.trailing_zeros();
        let head_dim = chunks * kp;
        let kv_off = self.kv_head * self.block_size * head_dim;
        // This thread's copies: piece `tid + k * THREADS` of every stage.
        let mut pieces = [Piece {
            live: false,
            is_v: false,
            tok: 0,
            off: 0,
            word: 0,
            phys: 0,
        }; PIECES_PER_THREAD as usize];
        let mut k = 0;
        each_piece(&mut pieces, |pc| {
            let i = self.tid + k * THREADS;
            pc.live = i < 2 * half;
            // V pieces are those past the stage's `half` K pieces. As constants where
            // the geometry fixes them (no branch side that no launch can take): `half
            // <= 2 * THREADS` (a stage is at most STAGE_BYTES), so pieces 2 and 3 are V
            // whenever they exist; piece 0 is K whenever a head vector has at least 4
            // chunks (then `half >= THREADS`): at every supported head_dim (>= 32) for
            // 16-bit and f32 elements, not for fp8 at head_dim 32.
            pc.is_v = match k {
                0 => K::PER_V4 > 8 && i >= half,
                1 => i >= half,
                _ => true,
            };
            k += 1;
            let r = if pc.is_v { i - half } else { i };
            pc.tok = r / chunks;
            let col = (r - pc.tok * chunks) * kp;
            pc.off = kv_off + col;
            pc.word = 4 * i;
        });
        let span = self.end.saturating_sub(self.start);
        // Whether token `t` is attended (and so read): `start <= t < end`.
        let in_range = |t: u32| t.wrapping_sub(self.start) < span;
        // Loads the block ids of stage `s`'s tokens (ahead of its copies).
        let lookup = |pieces: &mut [Piece; PIECES_PER_THREAD as usize], s: u32| {
            each_piece(pieces, |pc| {
                let t = self.first + s * st + pc.tok;
                if pc.live && s < self.num_stages && in_range(t) {
                    pc.phys =
                        ctx.ld(&p.block_tables, self.table_row + (t >> bs_shift) as u64) as u32;
                }
            });
        };
        let block_stride = p.layout.num_kv_heads as u64 * (self.block_size * head_dim) as u64;
        // Issues stage `s`'s copies into its slot, then commits (an empty group past the
        // end). A row outside `start..end` is zero-filled, never read: every row of a
        // stage is then finite, and the token loop needs no branch per row.
        let issue = |pieces: &[Piece; PIECES_PER_THREAD as usize], s: u32| {
            let base = (s & (STAGES - 1)) * geo.stage_words();
            if s < self.num_stages {
                let mut ps = *pieces;
                each_piece(&mut ps, |pc| {
                    let t = self.first + s * st + pc.tok;
                    if pc.live {
                        // (A stage of a fixed geometry covers whole blocks: the in-block
                        // offset folds to a constant per piece.)
                        let in_block = (t & (self.block_size - 1)) * head_dim;
                        let src = pc.phys as u64 * block_stride + (pc.off + in_block) as u64;
                        let read = in_range(t);
                        if pc.is_v {
                            ctx.cp_async_16_or_zero(base + pc.word, &p.value_cache, src, read);
                        } else {
                            ctx.cp_async_16_or_zero(base + pc.word, &p.key_cache, src, read);
                        }
                    }
                });
            }
            ctx.cp_async_commit();
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
        let per_group = st / self.bdz;
        // Rows a tile scores: N, or the group's one row when a tile of 2 serves a group
        // of one (the runtime geometry over fp8); a row past them reads the tile's
        // first row (finite, never the next group's) and is masked.
        let rows = if per_group < N as u32 {
            per_group
        } else {
            N as u32
        };
        let row_of = |j: usize| if (j as u32) < rows { j as u32 } else { 0 };
        // A thread without a token group (or a head) runs the loop too, for the
        // shuffles, on row 0 with nothing valid.
        let row_first = if self.tz < self.bdz {
            self.tz * per_group
        } else {
            0
        };
        let mut i = 0;
        while i < self.num_stages {
            // Stage i has landed once at most STAGES - 2 younger groups are pending;
            // after the barrier every thread is done with stage i - 1, whose slot the
            // copies of stage i + STAGES - 1 refill: one barrier per stage.
            ctx.cp_async_wait::<{ STAGES - 2 }>();
            ctx.sync_threads();
            issue(&pieces, i + STAGES - 1);
            lookup(&mut pieces, i + STAGES);

            let base = (i & (STAGES - 1)) * geo.stage_words();
            let stage_first = self.first + i * st;
            let mut r = 0;
            while r < per_group {
                // The tile: rows t0..t0 + N of the stage, tokens a..a + N.
                let t0 = row_first + r;
                let a = stage_first + t0;
                // Which of them are attended, as bits: lo..hi.
                let lo = self.start.saturating_sub(a);
                let hi = self.end.saturating_sub(a);
                let hi = if hi < rows { hi } else { rows };
                let mask = if self.active && lo < hi {
                    ((1u32 << hi) - 1) & !((1u32 << lo) - 1)
                } else {
                    0
                };
                let pos = self.pos0 + a as f32;
                let k_word = base + 4 * (t0 * chunks + self.tx);
                let mut sc = [f32::NEG_INFINITY; N];
                // compute_qk: every lane shuffles (the warp must), valid or not.
                each_tok::<N>(|j| {
                    let mut dot = 0.0f32;
                    each_vec::<K>(|v| {
                        let c = self.tx + v * bdx;
                        if c < chunks {
                            let kk = ctx.smem_ld_v4(k_word + 4 * (row_of(j) * chunks + v * bdx));
                            each16(|e| {
                                if e < kp {
                                    dot = ctx.fma(
                                        self.q[(v * kp + e) as usize],
                                        K::unpack(&kk, e),
                                        dot,
                                    );
                                }
                            });
                        }
                    });
                    let mut m = bdx / 2;
                    while m >= 1 {
                        dot += ctx.shfl_xor_f32(dot, m);
                        m /= 2;
                    }
                    if self.cap > 0.0 {
                        dot = self.cap * ctx.tanh(dot * self.inv_cap);
                    }
                    let x = ctx.fma(self.slope, pos + j as f32, dot);
                    sc[j] = if mask & (1 << j) != 0 {
                        x
                    } else {
                        f32::NEG_INFINITY
                    };
                });
                // update_local_state: one maximum and one rescale per tile.
                let mut m_tile = state.m;
                each_tok::<N>(|j| {
                    if sc[j] > m_tile {
                        m_tile = sc[j];
                    }
                });
                // An empty state meets an all-masked tile: nothing to rescale.
                let m_use = if m_tile == f32::NEG_INFINITY {
                    0.0
                } else {
                    m_tile
                };
                let alpha = ctx.exp2(state.m - m_use);
                let mut l_new = state.l * alpha;
                each_vec::<K>(|v| {
                    for e in 0..kp {
                        acc[(v * kp + e) as usize] *= alpha;
                    }
                });
                // Every row is finite (zero-filled outside the range) and a masked
                // one's weight is 0: no branch per row.
                each_tok::<N>(|j| {
                    let pe = ctx.exp2(sc[j] - m_use);
                    l_new += pe;
                    each_vec::<K>(|v| {
                        let c = self.tx + v * bdx;
                        if c < chunks {
                            let vv =
                                ctx.smem_ld_v4(k_word + 4 * (half + row_of(j) * chunks + v * bdx));
                            each16(|e| {
                                if e < kp {
                                    let x = &mut acc[(v * kp + e) as usize];
                                    *x = ctx.fma(pe, K::unpack(&vv, e), *x);
                                }
                            });
                        }
                    });
                });
                state = SoftmaxState {
                    m: m_tile,
                    l: l_new,
                };
                r += N as u32;
            }
            i += 1;
        }
        // Every thread is done with the last stage before the merge reuses its memory;
        // the groups still open are empty (past the last stage).
        ctx.sync_threads();
        (state, acc)
    }
}

/// The decode kernel: the runtime geometry of `p.layout` for `D = 0`, else head_dim `D`
/// and block size [`FIXED_BLOCK_SIZE`] as compile-time constants (the host launches
/// that kernel only for such a layout, see [`super::fixed_head_dim`]).
#[inline(always)]
pub(super) fn decode<T: Elem, K: KvElem, C: Ctx, const D: u32>(ctx: &C, p: &DecodeParams<T, K>) {
    let l = &p.layout;
    // Split-K: partials for `DecodeReduce` (a runtime choice: only the epilogue differs).
    let split = p.num_partitions > 1;
    let (head_dim, block_size) = if D == 0 {
        (l.head_dim, l.block_size)
    } else {
        (D, FIXED_BLOCK_SIZE)
    };
    let geo = DecodeGeometry::new(head_dim, K::PER_V4);
    // Elements of a chunk (a 16-byte cache vector), and q / out vectors per chunk.
    let kp = K::PER_V4;
    let (chunks, bdx, st) = (geo.chunks, geo.bdx, geo.stage_tokens);
    let bdy = p.heads_per_block;
    let bdz = geo.token_groups(bdy);
    // (Reduced mod THREADS, the block size the host launches: the compiler then knows
    // which of a thread's copy pieces are K and which V.)
    let tid = ctx.thread_idx().x % THREADS;
    let tx = tid % bdx;
    let ty = (tid / bdx) % bdy;
    let tz = tid / bdx / bdy;

    let b = ctx.block_idx();
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
    let active = ty < nh && tz < bdz;
    // This thread's query head: its index in the batch (for the partials), and its
    // element offsets in the (strided) q and out rows.
    let qh = (kv_head * group + first_head + ty) as u64;
    let head = seq as u64 * p.num_q_heads as u64 + qh;
    let q_at = seq as u64 * p.q_row_stride + qh * head_dim as u64;
    let out_at = seq as u64 * p.out_row_stride + qh * head_dim as u64;

    let range = TokenRange::of(ctx, p, seq, part);
    let (first, num_stages) = range.stages(st);
    let TokenRange {
        ctx_len,
        start,
        end,
    } = range;

    // The cache's scales for this KV head: K's folded into q, V's into the output.
    let (k_scale, v_scale) = if K::SCALED {
        (
            ctx.ld(&p.k_scales, kv_head as u64),
            ctx.ld(&p.v_scales, kv_head as u64),
        )
    } else {
        (1.0, 1.0)
    };
    // Scores are kept in log2 units: log2(e) is folded into q, the slope and the cap.
    let q_scale = p.scale * k_scale * LOG2_E;
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
        ctx.ld(&p.alibi_slopes, qh) * LOG2_E
    } else {
        0.0
    };

    let blk = Block {
        p,
        geo,
        block_size,
        tid,
        tx,
        tz,
        bdz,
        active,
        kv_head,
        start,
        end,
        first,
        num_stages,
        table_row: seq as u64 * p.max_blocks_per_seq as u64,
        q,
        slope,
        pos0: -((ctx_len - 1) as f32),
        cap: p.softcap * LOG2_E,
        inv_cap: p.inv_softcap * (1.0 / LOG2_E),
    };
    // Tiles of 8 tokens when a token group's rows of a stage fill one (one tile or
    // several), else of 2 or 1 (`per_group` and `N` are powers of two). A tile costs
    // one rescale of the accumulator (an FMUL an element) against two FFMAs an element
    // a token. The runtime geometry over fp8 caches takes tiles of 2 (8 spills
    // registers), a group of one row included (its second row masked: one loop, so
    // every geometry runs the same blocks); over 16-bit caches (2 spills two words on
    // sm_80) and f32 ones (already more FFMA than FMUL) tiles of 1.
    let per_group = st / bdz;
    let tiles = D > 0 || K::PER_V4 == 16;
    let (mut state, mut acc) = if !tiles || (D > 0 && per_group == 1) {
        blk.stream::<C, 1>(ctx)
    } else if D > 0 && per_group >= 8 {
        blk.stream::<C, 8>(ctx)
    } else {
        blk.stream::<C, 2>(ctx)
    };

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
    let d = head_dim as u64;
    // The sink (if any) joins here without split, in the reduce with it.
    let sink = if split {
        None
    } else {
        load_sink(ctx, &p.sinks, qh)
    };
    let inv = if split {
        v_scale
    } else {
        v_scale * state.normaliser(sink, ctx)
    };
    if !split && tx == 0 && !p.lse.is_empty() {
        ctx.st(&p.lse, head, state.lse(sink, ctx));
    }
    each_vec::<K>(|v| {
        let c = tx + v * bdx;
        if c >= chunks {
            return;
        }
        if split {
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
    if split && tx == 0 {
        let base = (head * p.num_partitions as u64 + part as u64) * 2;
        ctx.st(&p.part_ml, base, state.m);
        ctx.st(&p.part_ml, base + 1, state.l);
    }
}

/// The kernels of one (q / out, cache) type pair: the runtime geometry and each
/// compile-time head_dim; `mma` marks a pair whose head_dims in `MMA_HEAD_DIMS` run on
/// tensor cores.
macro_rules! decode_kernels {
    ($t:ty, $k:ty, $name:literal) => {
        decode_kernels!(@one $t, $k, 0, concat!("paged_decode_attention_", $name));
        decode_kernels!(@one $t, $k, 64, concat!("paged_decode_attention_", $name, "_d64"));
        decode_kernels!(@one $t, $k, 128, concat!("paged_decode_attention_", $name, "_d128"));
        decode_kernels!(@one $t, $k, 256, concat!("paged_decode_attention_", $name, "_d256"));
    };
    (mma $t:ty, $k:ty, $name:literal) => {
        decode_kernels!(@one $t, $k, 0, concat!("paged_decode_attention_", $name));
        decode_kernels!(@mma $t, $k, 64, concat!("paged_decode_attention_", $name, "_d64"));
        decode_kernels!(@mma $t, $k, 128, concat!("paged_decode_attention_", $name, "_d128"));
        decode_kernels!(@one $t, $k, 256, concat!("paged_decode_attention_", $name, "_d256"));
    };
    (@one $t:ty, $k:ty, $d:literal, $name:expr) => {
        impl Kernel for PagedDecode<$t, $k, $d> {
            type Params = DecodeParams<$t, $k>;
            const NAME: &'static str = $name;
            #[inline(always)]
            fn run<C: Ctx>(ctx: &C, p: &Self::Params) {
                decode::<$t, $k, C, $d>(ctx, p)
            }
        }
    };
    (@mma $t:ty, $k:ty, $d:literal, $name:expr) => {
        impl Kernel for PagedDecode<$t, $k, $d> {
            type Params = DecodeParams<$t, $k>;
            const NAME: &'static str = $name;
            #[inline(always)]
            fn run<C: Ctx>(ctx: &C, p: &Self::Params) {
                super::decode_mma::decode_mma::<$t, $k, C, $d>(ctx, p)
            }
        }
    };
}
decode_kernels!(mma F16, F16, "f16");
decode_kernels!(mma Bf16, Bf16, "bf16");
decode_kernels!(f32, f32, "f32");
decode_kernels!(mma F16, E4m3, "f16_e4m3");
decode_kernels!(mma F16, E5m2, "f16_e5m2");
decode_kernels!(mma Bf16, E4m3, "bf16_e4m3");
decode_kernels!(mma Bf16, E5m2, "bf16_e5m2");

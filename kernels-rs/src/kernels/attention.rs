//! Paged decode attention: one query token per sequence, attending over every cached
//! token of that sequence through its block table; and the split-K reduce.
//!
//! # Work decomposition
//! Grid `(num_kv_heads * head_chunks, num_seqs, num_partitions)`, [`THREADS`] threads.
//! Thread block `(x, seq, part)` serves KV head `x / head_chunks` and the query heads of
//! its group in chunk `x % head_chunks` (`heads_per_block` heads; the host plans
//! `head_chunks = ceil(group / heads_per_block)`, which is 1 unless a group is too large
//! for one block's registers: each K/V byte is then read once per group), over the
//! tokens of partition `part` (`partition_tokens` each).
//!
//! The partition is walked in tiles of [`TILE_TOKENS`] tokens, three phases each:
//! 1. **QK**: a token's K row is read by `lanes_per_token` lanes, 16 bytes each
//!    (consecutive lanes, consecutive bytes: in the HND layout a warp reads contiguous
//!    rows), dotted with every query head of the block (queries in shared memory, scaled),
//!    and reduced with xor-shuffles. Soft-cap and ALiBi apply here; scores go to shared
//!    memory in base-2 units.
//! 2. **softmax**: one warp per query head takes the tile's max, turns scores into
//!    `exp2(s - m)` and merges the tile into the running [`SoftmaxState`], which yields
//!    the factor that rescales the accumulators.
//! 3. **PV**: each thread owns up to [`PAIRS_PER_THREAD`] `(query head, 16-byte chunk
//!    of head_dim)` pairs, accumulating `p * v` in `f32` registers; V rows are read with
//!    16-byte loads.
//!
//! Without split (`PagedDecode<T, false>`) the block normalises and writes `out`. With
//! split (`PagedDecode<T, true>`) it writes its unnormalised accumulator and its
//! `(m, l)` per query head, and [`DecodeReduce`] merges the partitions with the same
//! [`SoftmaxState::merge`].
//!
//! # Bytes moved (the benchmark's count)
//! `num_seqs * num_kv_heads * ctx * head_dim * size_of::<T>() * 2` of K and V (once per
//! group), plus `q` and `out` (`num_seqs * num_q_heads * head_dim * size_of::<T>()` each),
//! plus the block tables actually read (`4 * ceil(ctx / block_size)` per sequence and
//! KV head chunk). With split, the partials add `num_seqs * num_q_heads * parts *
//! (head_dim + 2) * 4` bytes written and read once more.

use core::marker::PhantomData;

use crate::device::{Ctx, GlobalSlice, GlobalSliceMut, Kernel, WARP_SIZE};
use crate::elem::{Bf16, Elem, F16};
use crate::layout::PagedLayout;
use crate::softmax::{LOG2_E, SoftmaxState};

/// Threads per block of the decode kernel.
pub const THREADS: u32 = 128;
/// Warps per block of the decode kernel.
pub const WARPS: u32 = THREADS / WARP_SIZE;
/// Tokens per tile: the unit of the QK / softmax / PV pipeline and of partitions.
pub const TILE_TOKENS: u32 = 64;
/// `(query head, chunk)` accumulator pairs one thread owns in the PV phase.
pub const PAIRS_PER_THREAD: u32 = 4;
/// Most `(query head, chunk)` pairs a block can accumulate: bounds `heads_per_block`.
pub const MAX_PAIRS: u32 = THREADS * PAIRS_PER_THREAD;
/// Threads per block of the reduce kernel (one per 16-byte chunk of head_dim, at most 64).
pub const REDUCE_THREADS: u32 = 64;

/// Dynamic shared memory of the decode kernel, in bytes, for `heads_per_block` query
/// heads of `head_dim`: queries, tile scores, tile block ids, and `(m, l, alpha)` per head.
pub const fn decode_shared_bytes(heads_per_block: u32, head_dim: u32) -> u32 {
    4 * (heads_per_block * head_dim
        + heads_per_block * TILE_TOKENS
        + TILE_TOKENS
        + 3 * heads_per_block)
}

/// Parameters of [`PagedDecode`].
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct DecodeParams<T> {
    /// `[num_seqs, num_q_heads, head_dim]`: one query token per sequence.
    pub q: GlobalSlice<T>,
    /// `[num_blocks, num_kv_heads, block_size, head_dim]`: this layer's key cache.
    pub key_cache: GlobalSlice<T>,
    /// `[num_blocks, num_kv_heads, block_size, head_dim]`: this layer's value cache.
    pub value_cache: GlobalSlice<T>,
    /// `[num_seqs, max_blocks_per_seq]`: physical block of each logical block.
    pub block_tables: GlobalSlice<i32>,
    /// `[num_seqs]`: tokens in each sequence's cache, the new one included (>= 1).
    pub context_lens: GlobalSlice<i32>,
    /// `[num_q_heads]`: ALiBi slope per query head, or empty for no ALiBi.
    pub alibi_slopes: GlobalSlice<f32>,
    /// `[num_seqs, num_q_heads, head_dim]`: the output (written without split).
    pub out: GlobalSliceMut<T>,
    /// `[num_seqs, num_q_heads, num_partitions, head_dim]`: unnormalised partial
    /// outputs (written with split).
    pub part_out: GlobalSliceMut<f32>,
    /// `[num_seqs, num_q_heads, num_partitions, 2]`: `(m, l)` of each partial (split).
    pub part_ml: GlobalSliceMut<f32>,
    /// The cache's shape.
    pub layout: PagedLayout,
    /// Query heads (a multiple of `layout.num_kv_heads`).
    pub num_q_heads: u32,
    /// Row length of `block_tables`.
    pub max_blocks_per_seq: u32,
    /// Query heads one block serves (`<= group`, `* head_dim / chunk <= MAX_PAIRS`).
    pub heads_per_block: u32,
    /// Tokens per partition, a multiple of [`TILE_TOKENS`].
    pub partition_tokens: u32,
    /// Partitions per sequence (`grid.z`).
    pub num_partitions: u32,
    /// Score scale (usually `1 / sqrt(head_dim)`).
    pub scale: f32,
    /// Logit soft-cap: `s = cap * tanh(s / cap)`; 0 disables it.
    pub softcap: f32,
    /// Sliding window: attend to the last `window` tokens only; 0 disables it.
    pub window: u32,
}

/// The decode kernel; `SPLIT` selects partial outputs for [`DecodeReduce`].
#[derive(Clone, Copy, Debug)]
pub struct PagedDecode<T, const SPLIT: bool>(PhantomData<T>);

/// The PV accumulators of one thread: `PAIRS_PER_THREAD` pairs of up to 8 `f32`.
type Acc = [[f32; 8]; PAIRS_PER_THREAD as usize];

/// Calls `f(k, &mut acc[k])` for every pair `k`, written out so every index is a
/// constant after inlining: the accumulators then live in registers, not local memory.
#[inline(always)]
fn each_pair(acc: &mut Acc, mut f: impl FnMut(u32, &mut [f32; 8])) {
    let [a0, a1, a2, a3] = acc;
    f(0, a0);
    f(1, a1);
    f(2, a2);
    f(3, a3);
}

#[inline(always)]
fn decode<T: Elem, C: Ctx, const SPLIT: bool>(ctx: &C, p: &DecodeParams<T>) {
    let l = &p.layout;
    let tid = ctx.thread_idx().x;
    let (lane, warp) = (tid % WARP_SIZE, tid / WARP_SIZE);
    let b = ctx.block_idx();
    let group = p.num_q_heads / l.num_kv_heads;
    let head_chunks = group.div_ceil(p.heads_per_block);
    let kv_head = b.x / head_chunks;
    let first = (b.x % head_chunks) * p.heads_per_block;
    let h0 = kv_head * group + first;
    let nh = if group - first < p.heads_per_block {
        group - first
    } else {
        p.heads_per_block
    };
    let seq = b.y;
    let part = b.z;

    let d = l.head_dim;
    let chunks = d / T::PER_V4;
    let lpt = if chunks >= WARP_SIZE {
        WARP_SIZE
    } else {
        chunks.next_power_of_two()
    };
    let tpw = WARP_SIZE / lpt;
    let (tok_in_warp, sub) = (lane / lpt, lane % lpt);

    // Shared memory, in 32-bit words.
    let q_s = 0;
    let s_s = q_s + p.heads_per_block * d;
    let phys_s = s_s + p.heads_per_block * TILE_TOKENS;
    let m_s = phys_s + TILE_TOKENS;
    let l_s = m_s + p.heads_per_block;
    let alpha_s = l_s + p.heads_per_block;

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

    // Queries of the block's heads, scaled, into shared memory.
    let q_base = (seq as u64 * p.num_q_heads as u64 + h0 as u64) * d as u64;
    let mut i = tid;
    while i < nh * d {
        let qv = ctx.ld(&p.q, q_base + i as u64).to_f32();
        ctx.smem_st_f32(q_s + i, qv * p.scale);
        i += THREADS;
    }
    if tid < nh {
        ctx.smem_st_f32(m_s + tid, SoftmaxState::EMPTY.m);
        ctx.smem_st_f32(l_s + tid, SoftmaxState::EMPTY.l);
    }
    ctx.sync_threads();

    let table_row = seq as u64 * p.max_blocks_per_seq as u64;
    let has_alibi = !p.alibi_slopes.is_empty();
    let mut acc: Acc = [[0.0f32; 8]; PAIRS_PER_THREAD as usize];

    let mut tile_start = start;
    while tile_start < end {
        let tile_n = if end - tile_start < TILE_TOKENS {
            end - tile_start
        } else {
            TILE_TOKENS
        };

        // Phase 1: QK. Every lane runs the same trip count (shuffles need the warp).
        let mut j0 = 0;
        while j0 < TILE_TOKENS {
            let j = j0 + warp * tpw + tok_in_warp;
            let valid = j < tile_n;
            let mut kv = [[0u32; 4]; 2];
            if valid {
                let t = tile_start + j;
                let (lb, off) = l.logical(t);
                let phys = ctx.ld(&p.block_tables, table_row + lb as u64) as u32;
                if sub == 0 {
                    ctx.smem_st_u32(phys_s + j, phys);
                }
                let row = l.offset(phys, kv_head, off);
                for (r, kr) in kv.iter_mut().enumerate() {
                    let c = sub + r as u32 * lpt;
                    if c < chunks {
                        *kr = ctx.ld_nc_v4(&p.key_cache, row + (c * T::PER_V4) as u64);
                    }
                }
            }
            let mut g = 0;
            while g < nh {
                let mut part_dot = 0.0f32;
                if valid {
                    for (r, kr) in kv.iter().enumerate() {
                        let c = sub + r as u32 * lpt;
                        if c < chunks {
                            let qo = q_s + g * d + c * T::PER_V4;
                            for e in 0..T::PER_V4 {
                                part_dot += ctx.smem_ld_f32(qo + e) * T::unpack(kr, e);
                            }
                        }
                    }
                }
                let mut m = lpt / 2;
                while m >= 1 {
                    part_dot += ctx.shfl_xor_f32(part_dot, m);
                    m /= 2;
                }
                if valid && sub == 0 {
                    let mut s = part_dot;
                    if p.softcap > 0.0 {
                        s = p.softcap * ctx.tanh(s / p.softcap);
                    }
                    if has_alibi {
                        let slope = ctx.ld(&p.alibi_slopes, (h0 + g) as u64);
                        s += slope * ((tile_start + j) as f32 - (ctx_len - 1) as f32);
                    }
                    ctx.smem_st_f32(s_s + g * TILE_TOKENS + j, s * LOG2_E);
                }
                g += 1;
            }
            j0 += WARPS * tpw;
        }
        ctx.sync_threads();

        // Phase 2: softmax, one warp per query head.
        let mut g = warp;
        while g < nh {
            let row = s_s + g * TILE_TOKENS;
            let mut mx = f32::NEG_INFINITY;
            let mut j = lane;
            while j < tile_n {
                let s = ctx.smem_ld_f32(row + j);
                mx = if s > mx { s } else { mx };
                j += WARP_SIZE;
            }
            let mut m = WARP_SIZE / 2;
            while m >= 1 {
                let o = ctx.shfl_xor_f32(mx, m);
                mx = if o > mx { o } else { mx };
                m /= 2;
            }
            let running = SoftmaxState {
                m: ctx.smem_ld_f32(m_s + g),
                l: ctx.smem_ld_f32(l_s + g),
            };
            let m_new = if running.m > mx { running.m } else { mx };
            let mut sum = 0.0f32;
            let mut j = lane;
            while j < tile_n {
                let e = ctx.exp2(ctx.smem_ld_f32(row + j) - m_new);
                ctx.smem_st_f32(row + j, e);
                sum += e;
                j += WARP_SIZE;
            }
            let mut m = WARP_SIZE / 2;
            while m >= 1 {
                sum += ctx.shfl_xor_f32(sum, m);
                m /= 2;
            }
            if lane == 0 {
                let tile = SoftmaxState { m: m_new, l: sum };
                let (merged, a, _one) = running.merge(tile, ctx);
                ctx.smem_st_f32(m_s + g, merged.m);
                ctx.smem_st_f32(l_s + g, merged.l);
                ctx.smem_st_f32(alpha_s + g, a);
            }
            g += WARPS;
        }
        ctx.sync_threads();

        // Phase 3: PV into the owned (head, chunk) accumulators.
        each_pair(&mut acc, |k, a| {
            let pr = tid + k * THREADS;
            if pr < nh * chunks {
                let alpha = ctx.smem_ld_f32(alpha_s + pr / chunks);
                for x in a.iter_mut() {
                    *x *= alpha;
                }
            }
        });
        for j in 0..tile_n {
            let t = tile_start + j;
            let row = l.offset(ctx.smem_ld_u32(phys_s + j), kv_head, t % l.block_size);
            each_pair(&mut acc, |k, a| {
                let pr = tid + k * THREADS;
                if pr < nh * chunks {
                    let (g, c) = (pr / chunks, pr % chunks);
                    let pj = ctx.smem_ld_f32(s_s + g * TILE_TOKENS + j);
                    let v = ctx.ld_nc_v4(&p.value_cache, row + (c * T::PER_V4) as u64);
                    for e in 0..T::PER_V4 {
                        a[e as usize] += pj * T::unpack(&v, e);
                    }
                }
            });
        }
        ctx.sync_threads();
        tile_start += TILE_TOKENS;
    }

    // Epilogue.
    each_pair(&mut acc, |k, a| {
        let pr = tid + k * THREADS;
        if pr >= nh * chunks {
            return;
        }
        let (g, c) = (pr / chunks, pr % chunks);
        let head = seq as u64 * p.num_q_heads as u64 + (h0 + g) as u64;
        if SPLIT {
            let base =
                (head * p.num_partitions as u64 + part as u64) * d as u64 + (c * T::PER_V4) as u64;
            let mut w = 0;
            while w < T::PER_V4 {
                let i = w as usize;
                let bits = [
                    a[i].to_bits(),
                    a[i + 1].to_bits(),
                    a[i + 2].to_bits(),
                    a[i + 3].to_bits(),
                ];
                ctx.st_v4(&p.part_out, base + w as u64, bits);
                w += 4;
            }
        } else {
            let inv = 1.0 / ctx.smem_ld_f32(l_s + g);
            let mut vals = [0.0f32; 8];
            for (o, x) in vals.iter_mut().zip(a.iter()) {
                *o = *x * inv;
            }
            let idx = head * d as u64 + (c * T::PER_V4) as u64;
            ctx.st_v4(&p.out, idx, T::pack(&vals));
        }
    });
    if SPLIT && tid < nh {
        let head = seq as u64 * p.num_q_heads as u64 + (h0 + tid) as u64;
        let base = (head * p.num_partitions as u64 + part as u64) * 2;
        ctx.st(&p.part_ml, base, ctx.smem_ld_f32(m_s + tid));
        ctx.st(&p.part_ml, base + 1, ctx.smem_ld_f32(l_s + tid));
    }
}

/// Parameters of [`DecodeReduce`].
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ReduceParams<T> {
    /// `[num_seqs, num_q_heads, num_partitions, head_dim]`: partial outputs.
    pub part_out: GlobalSlice<f32>,
    /// `[num_seqs, num_q_heads, num_partitions, 2]`: `(m, l)` of each partial.
    pub part_ml: GlobalSlice<f32>,
    /// `[num_seqs, num_q_heads, head_dim]`: the output.
    pub out: GlobalSliceMut<T>,
    /// Query heads.
    pub num_q_heads: u32,
    /// Elements per head vector.
    pub head_dim: u32,
    /// Partitions per sequence.
    pub num_partitions: u32,
}

/// The split-K reduce: grid `(num_q_heads, num_seqs)`, [`REDUCE_THREADS`] threads; the
/// thread of chunk `c` folds the partitions' `(m, l)` with [`SoftmaxState::merge`] and
/// their chunk-`c` accumulators with the merge's factors.
#[derive(Clone, Copy, Debug)]
pub struct DecodeReduce<T>(PhantomData<T>);

#[inline(always)]
fn reduce<T: Elem, C: Ctx>(ctx: &C, p: &ReduceParams<T>) {
    let chunks = p.head_dim / T::PER_V4;
    let c = ctx.thread_idx().x;
    if c >= chunks {
        return;
    }
    let head = ctx.block_idx().y as u64 * p.num_q_heads as u64 + ctx.block_idx().x as u64;
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
                acc[i] = acc[i] * a + f32::from_bits(*bits) * b;
            }
            w += 4;
        }
        state = merged;
    }
    let inv = 1.0 / state.l;
    for x in acc.iter_mut() {
        *x *= inv;
    }
    ctx.st_v4(
        &p.out,
        head * p.head_dim as u64 + (c * T::PER_V4) as u64,
        T::pack(&acc),
    );
}

macro_rules! attention_kernels {
    ($t:ty, $decode:literal, $split:literal, $reduce:literal) => {
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
        impl Kernel for DecodeReduce<$t> {
            type Params = ReduceParams<$t>;
            const NAME: &'static str = $reduce;
            #[inline(always)]
            fn run<C: Ctx>(ctx: &C, p: &Self::Params) {
                reduce::<$t, C>(ctx, p)
            }
        }
    };
}
attention_kernels!(
    F16,
    "paged_decode_attention_f16",
    "paged_decode_attention_split_f16",
    "paged_decode_reduce_f16"
);
attention_kernels!(
    Bf16,
    "paged_decode_attention_bf16",
    "paged_decode_attention_split_bf16",
    "paged_decode_reduce_bf16"
);
attention_kernels!(
    f32,
    "paged_decode_attention_f32",
    "paged_decode_attention_split_f32",
    "paged_decode_reduce_f32"
);

//! Paged decode attention: one query token per sequence, attending over every cached
//! token of that sequence through its block table; and the split-K reduce.
//!
//! # Work decomposition
//! Grid `(num_kv_heads * head_chunks, num_seqs, num_partitions)`, [`THREADS`] threads.
//! Thread block `(x, seq, part)` serves KV head `x / head_chunks` and the query heads of
//! its group in chunk `x % head_chunks` (`heads_per_block` heads; `head_chunks =
//! ceil(group / heads_per_block)`, 1 unless the group has more heads than a block has
//! thread slots, see [`DecodeGeometry::max_heads`]), over the tokens of partition
//! `part` (`partition_tokens` each, a multiple of [`TILE_TOKENS`]).
//!
//! The block's threads form a `bdx x bdy x bdz` grid ([`DecodeGeometry`]): `bdx` lanes
//! split a head vector into 16-byte chunks, `bdy` query heads of the group, `bdz` token
//! groups. Thread `(tx, ty, tz)` keeps query head `ty`'s chunks `tx, tx + bdx` in
//! registers and its own online-softmax state over the tokens of group `tz`.
//!
//! # The pipeline (`decode`)
//! K and V move from the paged cache into shared memory in *stages* of
//! [`DecodeGeometry::stage_tokens`] tokens (at most [`STAGE_BYTES`] of K and V), through
//! `cp.async` with [`STAGES`] stages in flight: every thread issues its
//! [`PIECES_PER_THREAD`] 16-byte copies of the stage `STAGES - 1` ahead, commits, waits
//! for the oldest stage, and after a barrier every query head of the group computes on
//! it, so each K/V byte is read from DRAM once per group. The block-table entries a
//! stage needs are loaded one stage before its copies are issued.
//!
//! Per token, the `bdx` lanes of a head dot their chunks of q and K (`fma`), reduce
//! with xor-shuffles, and fold `exp2(s - m)` and the V row into their running state. At
//! the end the `bdz` token groups merge through shared memory with
//! [`SoftmaxState::merge`](crate::SoftmaxState::merge).
//!
//! Without split (`PagedDecode<T, false>`) the block normalises and writes `out`. With
//! split (`PagedDecode<T, true>`) it writes its unnormalised accumulator and its
//! `(m, l)` per query head, and [`DecodeReduce`] merges the partitions with the same
//! merge.
//!
//! # fp8 caches
//! With `K` = [`E4m3`](crate::E4m3) or [`E5m2`](crate::E5m2) the same pipeline moves
//! 16 fp8 elements per 16-byte copy (a stage holds twice the tokens of f16 for the
//! same bytes); a thread's chunk is 16 elements, so it keeps 16 q and 16 accumulator
//! registers. The K scale of the block's KV head is folded into q once (`q * scale *
//! k_scale`), the V scale into the final normalisation (`acc * v_scale / l`), so the
//! inner loop only decodes.
//!
//! # Bytes moved (the benchmark's count)
//! `num_seqs * num_kv_heads * ctx * head_dim * size_of::<K>() * 2` of K and V (once per
//! group), plus `q` and `out` (`num_seqs * num_q_heads * head_dim * size_of::<T>()` each),
//! plus the block tables actually read (`4 * ceil(ctx / block_size)` per sequence and
//! KV head chunk). With split, the partials add `num_seqs * num_q_heads * parts *
//! (head_dim + 2) * 4` bytes written and read once more.

mod decode;
mod decode_mma;
mod reduce;

use core::marker::PhantomData;

use crate::device::{Ctx, GlobalRange, GlobalSlice, GlobalSliceMut, KernelParams, WARP_SIZE};
use crate::layout::PagedLayout;

pub use reduce::DecodeReduce;

/// Threads per block of the decode kernel.
pub const THREADS: u32 = 128;
/// Tokens per partition unit: `partition_tokens` is a multiple of it (and of every
/// stage size).
pub const TILE_TOKENS: u32 = 64;
/// Stages of the `cp.async` pipeline (a power of two): `STAGES - 1` are in flight
/// while the block computes on one.
pub const STAGES: u32 = 4;
/// Most bytes of K and V in one stage.
pub const STAGE_BYTES: u32 = 8192;
/// 16-byte copies one thread issues per stage (`STAGE_BYTES / 16 / THREADS`).
pub const PIECES_PER_THREAD: u32 = STAGE_BYTES / 16 / THREADS;
// The decode kernel's pieces 0..4, K then V: a stage's K half is at most two pieces of
// every thread (its K/V choice per piece relies on it).
const _: () = assert!(PIECES_PER_THREAD == 4 && STAGE_BYTES / 2 / 16 <= 2 * THREADS);
/// Threads per block of the reduce kernel (a multiple of [`REDUCE_LANES`]).
pub const REDUCE_THREADS: u32 = 64;
/// Adjacent lanes of the reduce that share one `(query head, 16-byte chunk)`, each
/// folding every `REDUCE_LANES`-th partition (a power of two, at most the warp).
pub const REDUCE_LANES: u32 = 8;
// A lane group is whole inside a warp and a block: its shuffles never cross either.
const _: () = assert!(
    REDUCE_LANES.is_power_of_two()
        && REDUCE_LANES <= WARP_SIZE
        && REDUCE_THREADS.is_multiple_of(REDUCE_LANES)
);
/// Most 16-byte chunks of one head vector a thread holds (`head_dim <= 256`).
pub const fn max_vec(per_v4: u32) -> u32 {
    let v = 256 / (per_v4 * WARP_SIZE);
    if v == 0 { 1 } else { v }
}
/// `f32` registers a thread keeps for its chunks of q (and as many for its accumulator):
/// `max_vec(per_v4) * per_v4`, at most 16 (fp8 caches: one chunk of 16 elements).
pub const ACC_WORDS: u32 = 16;

/// How a decode block's threads and shared memory are laid out for one head_dim and
/// element type. The kernel and the host compute it from the same function.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodeGeometry {
    /// 16-byte chunks per head vector (`head_dim / per_v4`).
    pub chunks: u32,
    /// Lanes per head vector (`bdx`): `chunks` rounded up to a power of two, at most 32.
    pub bdx: u32,
    /// `(head, token group)` slots of the block: `THREADS / bdx`.
    pub slots: u32,
    /// Tokens per pipeline stage: the largest power of two whose K and V fit
    /// [`STAGE_BYTES`].
    pub stage_tokens: u32,
}

impl DecodeGeometry {
    /// The geometry for `head_dim` elements of `per_v4` elements per 16 bytes
    /// (`head_dim` a multiple of `per_v4`, at most 256).
    #[inline(always)]
    pub const fn new(head_dim: u32, per_v4: u32) -> Self {
        let chunks = head_dim / per_v4;
        let bdx = if chunks >= WARP_SIZE {
            WARP_SIZE
        } else {
            chunks.next_power_of_two()
        };
        let mut stage_tokens = 32;
        while stage_tokens > 1 && 2 * stage_tokens * chunks * 16 > STAGE_BYTES {
            stage_tokens /= 2;
        }
        Self {
            chunks,
            bdx,
            slots: THREADS / bdx,
            stage_tokens,
        }
    }

    /// The most query heads one block can serve (one per `(head, token group)` slot).
    #[inline(always)]
    pub const fn max_heads(&self) -> u32 {
        self.slots
    }

    /// Token groups of a block serving `heads` query heads (`bdz`): the largest power
    /// of two of them that fits the slots, at most `stage_tokens`, so every group owns
    /// `stage_tokens / bdz` whole rows of a stage (for a group size that is not a power
    /// of two, or a head vector of few chunks, some slots stay idle).
    #[inline(always)]
    pub const fn token_groups(&self, heads: u32) -> u32 {
        let fit = self.slots / heads;
        let pow2 = if fit == 0 {
            1
        } else {
            1 << (31 - fit.leading_zeros())
        };
        if pow2 > self.stage_tokens {
            self.stage_tokens
        } else {
            pow2
        }
    }

    /// 32-bit words of one stage: K then V, `[stage_tokens, chunks, 16 bytes]` each.
    #[inline(always)]
    pub const fn stage_words(&self) -> u32 {
        2 * self.stage_tokens * self.chunks * 4
    }

    /// Dynamic shared memory of the decode kernel, in bytes: the stages, which the final
    /// merge of the token groups reuses (`THREADS * ACC_WORDS` accumulator words and two
    /// words per slot).
    #[inline(always)]
    pub const fn shared_bytes(&self) -> u32 {
        let stages = STAGES * self.stage_words();
        let merge = THREADS * ACC_WORDS + 2 * self.slots;
        4 * if stages > merge { stages } else { merge }
    }
}

/// Parameters of [`PagedDecode`]: q and out of element type `T`, a cache of `K` (`T`
/// itself, or fp8 with per-KV-head scales, see [`KvElem`](crate::KvElem)).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct DecodeParams<T, K = T> {
    /// `[num_seqs, q_row_stride]`: one query token per sequence, its `num_q_heads *
    /// head_dim` elements at the start of each row (an engine's q is often a view into
    /// a fused QKV projection).
    pub q: GlobalSlice<T>,
    /// `[num_blocks, num_kv_heads, block_size, head_dim]`: this layer's key cache.
    pub key_cache: GlobalSlice<K>,
    /// `[num_blocks, num_kv_heads, block_size, head_dim]`: this layer's value cache.
    pub value_cache: GlobalSlice<K>,
    /// `[num_kv_heads]`: K scale of each KV head (`K::SCALED` only; else empty).
    pub k_scales: GlobalSlice<f32>,
    /// `[num_kv_heads]`: V scale of each KV head (`K::SCALED` only; else empty).
    pub v_scales: GlobalSlice<f32>,
    /// `[num_seqs, max_blocks_per_seq]`: physical block of each logical block.
    pub block_tables: GlobalSlice<i32>,
    /// `[num_seqs]`: tokens in each sequence's cache, the new one included (>= 1).
    pub context_lens: GlobalSlice<i32>,
    /// `[num_seqs]`: the first token each sequence attends (`< context_lens`), or
    /// empty: 0. Cascade attention's suffix pass: the shared prefix before it is
    /// attended once for all its sequences and merged.
    pub kv_start: GlobalSlice<i32>,
    /// `[num_q_heads]`: ALiBi slope per query head, or empty for no ALiBi.
    pub alibi_slopes: GlobalSlice<f32>,
    /// `[num_q_heads]`: attention-sink logit per query head, or empty for none (read
    /// without split only: with split the reduce joins them, once).
    pub sinks: GlobalSlice<f32>,
    /// `[num_seqs, out_row_stride]`: the output, `num_q_heads * head_dim` elements at
    /// the start of each row (written without split).
    pub out: GlobalSliceMut<T>,
    /// `[num_seqs, num_q_heads]`: the log-sum-exp of each output, base 2
    /// ([`SoftmaxState::lse`](crate::SoftmaxState::lse), the sink included), or empty
    /// for none (written without split; with split the reduce writes it).
    pub lse: GlobalSliceMut<f32>,
    /// `[num_seqs, num_q_heads, num_partitions, head_dim]`: unnormalised partial
    /// outputs (written with split).
    pub part_out: GlobalSliceMut<f32>,
    /// `[num_seqs, num_q_heads, num_partitions, 2]`: `(m, l)` of each partial (split).
    pub part_ml: GlobalSliceMut<f32>,
    /// The cache's shape (`block_size` a power of two).
    pub layout: PagedLayout,
    /// Query heads (a multiple of `layout.num_kv_heads`).
    pub num_q_heads: u32,
    /// Row length of `block_tables`.
    pub max_blocks_per_seq: u32,
    /// Query heads one block serves (`1..=DecodeGeometry::max_heads`, `<= group`).
    pub heads_per_block: u32,
    /// Tokens per partition, a multiple of [`TILE_TOKENS`].
    pub partition_tokens: u32,
    /// Partitions per sequence (`grid.z`).
    pub num_partitions: u32,
    /// Score scale (usually `1 / sqrt(head_dim)`).
    pub scale: f32,
    /// Logit soft-cap: `s = cap * tanh(s * inv_softcap)`; 0 disables it.
    pub softcap: f32,
    /// `1 / softcap`, computed on the host (a multiply on the GPU, not a division).
    pub inv_softcap: f32,
    /// Sliding window: attend to the last `window` tokens only; 0 disables it.
    pub window: u32,
    /// Explicit padding (0), so every byte of the struct is initialised: see
    /// [`KernelParams`].
    pub _pad: u32,
    /// Elements from one sequence's q row to the next (`>= num_q_heads * head_dim`, a
    /// multiple of 16 bytes).
    pub q_row_stride: u64,
    /// Elements from one sequence's out row to the next (as `q_row_stride`).
    pub out_row_stride: u64,
}

// SAFETY: 14 views (16 bytes each), the 16-byte layout, four-byte fields with the
// explicit `_pad` (10), two u64 strides: 296 bytes, no padding (asserted below).
const _: () = assert!(core::mem::size_of::<DecodeParams<f32>>() == 14 * 16 + 16 + 10 * 4 + 16);
unsafe impl<T: 'static, K: 'static> KernelParams for DecodeParams<T, K>
where
    Self: Copy,
{
    fn globals(&self, f: &mut dyn FnMut(GlobalRange)) {
        f(self.q.range("q"));
        f(self.key_cache.range("key_cache"));
        f(self.value_cache.range("value_cache"));
        f(self.k_scales.range("k_scales"));
        f(self.v_scales.range("v_scales"));
        f(self.block_tables.range("block_tables"));
        f(self.context_lens.range("context_lens"));
        f(self.kv_start.range("kv_start"));
        f(self.alibi_slopes.range("alibi_slopes"));
        f(self.sinks.range("sinks"));
        f(self.out.range("out"));
        f(self.lse.range("lse"));
        f(self.part_out.range("part_out"));
        f(self.part_ml.range("part_ml"));
    }
}

/// The decode kernel for q / out of `T` and a cache of `K`; with `num_partitions > 1`
/// it writes partial outputs for [`DecodeReduce`]. `HEAD_DIM = 0` is the kernel for any geometry (read
/// from `layout` at run time); `HEAD_DIM` in [`FIXED_HEAD_DIMS`] is the kernel for that
/// head_dim and block size [`FIXED_BLOCK_SIZE`], its geometry compile-time constants
/// (unrolled shuffle reductions, constant page addressing). Launch the one
/// [`fixed_head_dim`] names. With `HEAD_DIM` in [`MMA_HEAD_DIMS`] and q of f16 or bf16
/// the kernel runs on tensor cores for every cache type (`decode_mma`: its grid and
/// parameters are the same; up to [`MMA_MAX_HEADS`] query heads a block and
/// [`mma_shared_bytes`] of shared memory).
#[derive(Clone, Copy, Debug)]
pub struct PagedDecode<T, K = T, const HEAD_DIM: u32 = 0>(PhantomData<(T, K)>);

/// The tokens `start..end` one decode block attends: partition `part`'s share of its
/// sequence's context, clipped to the sliding window (empty for a partition past the
/// context or before the window).
#[derive(Clone, Copy)]
pub(crate) struct TokenRange {
    /// The sequence's context length.
    pub ctx_len: u32,
    pub start: u32,
    pub end: u32,
}

impl TokenRange {
    /// Sequence `seq`'s range for partition `part` (reads its context length).
    #[inline(always)]
    pub(crate) fn of<T, K, C: Ctx>(ctx: &C, p: &DecodeParams<T, K>, seq: u32, part: u32) -> Self {
        let ctx_len = ctx.ld(&p.context_lens, seq as u64) as u32;
        let win_start = if p.window > 0 && ctx_len > p.window {
            ctx_len - p.window
        } else {
            0
        };
        let win_start = if p.kv_start.is_empty() {
            win_start
        } else {
            let k = ctx.ld(&p.kv_start, seq as u64) as u32;
            if k > win_start { k } else { win_start }
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
        Self {
            ctx_len,
            start,
            end,
        }
    }

    /// `(first, count)`: the first token of the stage holding `start` and the stages
    /// of `stage_tokens` (a power of two) that cover the range; none when it is empty.
    #[inline(always)]
    pub(crate) fn stages(&self, stage_tokens: u32) -> (u32, u32) {
        stage_span(self.start, self.end, stage_tokens)
    }
}

/// `(first, count)`: the first token of the stage of `stage_tokens` (a power of two)
/// holding `start`, and the stages that cover `start..end`; none when it is empty.
#[inline(always)]
pub(crate) const fn stage_span(start: u32, end: u32, stage_tokens: u32) -> (u32, u32) {
    let first = start & !(stage_tokens - 1);
    let n = if end > start {
        (end - first).div_ceil(stage_tokens)
    } else {
        0
    };
    (first, n)
}

/// Block size of the compile-time-geometry decode kernels.
pub const FIXED_BLOCK_SIZE: u32 = 16;
/// head_dims with a compile-time-geometry decode kernel: the sizes engines run
/// (Llama, Mistral and Qwen at 128; Gemma 2 at 256; small models at 64).
pub const FIXED_HEAD_DIMS: [u32; 3] = [64, 128, 256];

/// head_dims whose compile-time decode kernel runs on tensor cores (see `decode_mma`):
/// the group's query heads are the M rows of `mma.m16n8k16`. Every cache type has one:
/// f16 and bf16 are read with `ldmatrix`, fp8 (`e4m3`, `e5m2`) is decoded to q's type
/// on its way from shared memory into the B fragments. head_dim 256 keeps the CUDA-core
/// body (its stages would not fit an sm_80 SM's shared memory at this depth).
pub const MMA_HEAD_DIMS: [u32; 2] = [64, 128];
/// Most query heads one tensor-core decode block serves (the 16 rows of an `mma`).
pub const MMA_MAX_HEADS: u32 = 16;
/// Tokens per stage of the tensor-core decode kernel: 16 rows (one block) per warp.
pub const MMA_STAGE_TOKENS: u32 = 64;
/// Stages of the tensor-core decode kernel's pipeline (`MMA_STAGES - 1` in flight).
pub const MMA_STAGES: u32 = 3;

/// 32-bit words per K row of the tensor-core decode kernel's stages, for a cache of
/// `elem_bytes`-byte elements: `head_dim` elements, no padding (16-bit rows swizzle
/// their 16-byte chunks by row so the 8 rows an `ldmatrix` reads fall in distinct
/// banks; fp8 rows, read 16 bytes a lane, swap their halves' chunks on odd rows).
pub const fn mma_k_row_words(head_dim: u32, elem_bytes: u32) -> u32 {
    head_dim * elem_bytes / 4
}

/// 32-bit words per V row of the tensor-core decode kernel's stages: 16-bit rows
/// unpadded and swizzled as K's (for `ldmatrix.trans`); fp8 rows with 16 bytes of
/// padding (the 4 rows `2t, 2t + 2, ..` the lanes `t` of one word column read fall in
/// distinct banks).
pub const fn mma_v_row_words(head_dim: u32, elem_bytes: u32) -> u32 {
    if elem_bytes == 2 {
        head_dim / 2
    } else {
        head_dim / 4 + 4
    }
}

/// Dynamic shared memory of the tensor-core decode kernel, in bytes, for a cache of
/// `elem_bytes`-byte elements: the stages, which the final merge of its warps reuses
/// (`4 x 16 x head_dim` output words and two words per warp and row).
pub const fn mma_shared_bytes(head_dim: u32, elem_bytes: u32) -> u32 {
    let row = mma_k_row_words(head_dim, elem_bytes) + mma_v_row_words(head_dim, elem_bytes);
    let stages = MMA_STAGES * MMA_STAGE_TOKENS * row;
    let merge = (THREADS / 32) * MMA_MAX_HEADS * (head_dim + 2);
    4 * if stages > merge { stages } else { merge }
}

/// The `HEAD_DIM` of the decode kernel to launch for `layout`: its head_dim when that
/// has a compile-time kernel (`FIXED_HEAD_DIMS`, block size [`FIXED_BLOCK_SIZE`], and a
/// block of one layer's K fits 2^32 elements so in-block offsets are 32-bit), else 0,
/// the runtime-geometry kernel.
pub const fn fixed_head_dim(layout: &PagedLayout) -> u32 {
    let d = layout.head_dim;
    let fits =
        (layout.num_kv_heads as u64) * (FIXED_BLOCK_SIZE as u64) * (d as u64) <= u32::MAX as u64;
    if layout.block_size == FIXED_BLOCK_SIZE && fits && (d == 64 || d == 128 || d == 256) {
        d
    } else {
        0
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
    /// `[num_q_heads]`: attention-sink logit per query head, or empty for none: joined
    /// here, once, after the partitions' merge.
    pub sinks: GlobalSlice<f32>,
    /// `[num_seqs, out_row_stride]`: the output (`num_q_heads * head_dim` per row).
    pub out: GlobalSliceMut<T>,
    /// `[num_seqs, num_q_heads]`: the log-sum-exp of each output (base 2, the sink
    /// included), or empty for none.
    pub lse: GlobalSliceMut<f32>,
    /// Query heads.
    pub num_q_heads: u32,
    /// Elements per head vector.
    pub head_dim: u32,
    /// Partitions per sequence.
    pub num_partitions: u32,
    /// Explicit padding (0), so every byte of the struct is initialised: see
    /// [`KernelParams`].
    pub _pad: u32,
    /// Elements from one sequence's out row to the next.
    pub out_row_stride: u64,
}

// SAFETY: 5 views, 4 four-byte fields (the explicit `_pad` one), one u64: 104 bytes,
// no padding (asserted below).
const _: () = assert!(core::mem::size_of::<ReduceParams<f32>>() == 5 * 16 + 4 * 4 + 8);
unsafe impl<T: 'static> KernelParams for ReduceParams<T>
where
    Self: Copy,
{
    fn globals(&self, f: &mut dyn FnMut(GlobalRange)) {
        f(self.part_out.range("part_out"));
        f(self.part_ml.range("part_ml"));
        f(self.sinks.range("sinks"));
        f(self.out.range("out"));
        f(self.lse.range("lse"));
    }
}

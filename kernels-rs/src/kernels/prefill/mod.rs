//! Paged prefill attention: many query tokens per sequence (a prompt, or a chunk of
//! one), each attending causally to its sequence's cached tokens (through the block
//! table) and to the new tokens up to itself.
//!
//! # The batch
//! A ragged batch: sequence `s` has the query tokens `qo_indptr[s]..qo_indptr[s + 1]`
//! (rows of `q` and `out`) and `context_lens[s]` tokens in its cache, the new ones
//! included (`kv_append` wrote their K and V first). New token `i` of `s` sits at
//! position `context_lens[s] - qo_len + i` and attends to the positions up to it (the
//! last `window` of them with a window), with the same score definition as decode:
//! `x = scale * q.k`, then soft-cap, then ALiBi `slope * (kpos - qpos)`. A chunk of one
//! token is exactly decode's question.
//!
//! # Work decomposition
//! A sequence's query rows are its `(token, query head)` pairs of one KV head's group,
//! token-major: row `r` is token `r / group`, head `kv_head * group + r % group`, so
//! the K/V a block stages serves the whole group.
//! * f16 / bf16 ([`PagedPrefill`], tensor cores): grid `(num_kv_heads, ceil(rows /
//!   16), num_seqs)`, one warp per block serving 16 rows. The block walks the KV
//!   positions its rows may see in tiles of 16 tokens, staged into shared memory with
//!   `cp.async` (positions past the context are zero-filled, never read); `S = Q K^T`
//!   and `O += P V` are `mma.m16n8k16` with `ldmatrix` fragments, the online softmax in
//!   registers. The output columns are done in passes of [`PASS_DIMS`] (each pass
//!   recomputes `S`), which bounds the accumulator registers for every head_dim.
//! * f16 / bf16 at head_dim 64 or 128, block size 16 ([`PagedPrefill`] with a
//!   `HEAD_DIM`, tensor cores, [`tiled`]): FlashAttention-2's decomposition, grid
//!   `(num_kv_heads, ceil(rows / TILE_ROWS), num_seqs)`, four warps of 16 rows each
//!   consuming every staged 64-token K/V tile of a 3-stage `cp.async` pipeline, `S`
//!   once per tile over the whole head_dim, Q and O in registers.
//! * f32 ([`PagedPrefillSimt`], CUDA cores): one thread per row and pass, over the
//!   same positions, from global memory.

mod mma;
mod simt;
pub mod tiled;

use core::marker::PhantomData;

use crate::device::{Ctx, GlobalRange, GlobalSlice, GlobalSliceMut, KernelParams};
use crate::elem::{Bf16, Elem, F16, KvElem};
use crate::layout::PagedLayout;

pub use mma::PagedPrefill;
pub use simt::PagedPrefillSimt;
pub use tiled::{TILE_ROWS, TILED_THREADS};

/// head_dims with a multi-warp tensor-core prefill kernel (block size
/// [`FIXED_BLOCK_SIZE`](crate::kernels::attention::FIXED_BLOCK_SIZE), q of f16 or bf16,
/// every cache type; see [`tiled`]): the decode kernel's tensor-core sizes, whose K/V
/// tiles and B-fragment readers it shares. Other shapes run the one-warp kernel.
pub const TILED_HEAD_DIMS: [u32; 2] = crate::kernels::attention::MMA_HEAD_DIMS;

/// Query rows one tensor-core block serves (the `M` of `mma.m16n8k16`).
pub const ROWS: u32 = 16;
/// KV positions per tile (the `K` of the `P V` product).
pub const KV_TILE: u32 = 16;
/// Output columns per pass (accumulators: `PASS_DIMS / 8` fragments of 4 `f32`).
pub const PASS_DIMS: u32 = 64;
/// Threads per block of the tensor-core kernel (one warp).
pub const MMA_THREADS: u32 = 32;
/// Threads per block of the f32 kernel (one row each).
pub const SIMT_THREADS: u32 = 128;

/// Shared memory of the tensor-core kernel for `head_dim`, bytes: the Q and K tiles
/// (`16 x head_dim`) and one pass of the V tile (`16 x PASS_DIMS`), 16-bit elements,
/// then each row's tree-mask words (4 words a row).
pub const fn mma_shared_bytes(head_dim: u32) -> u32 {
    (2 * ROWS * head_dim + KV_TILE * PASS_DIMS) * 2 + 16 * ROWS
}

/// Parameters of [`PagedPrefill`] and [`PagedPrefillSimt`]: q and out of `T`, a cache
/// of `K` (`T` itself, or fp8 with per-KV-head scales, see [`KvElem`]).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct PrefillParams<T, K = T> {
    /// `[q rows, q_row_stride]`: the new tokens' queries (`num_q_heads * head_dim`
    /// elements at the start of each row), sequence by sequence, or the rows `q_rows`
    /// names.
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
    /// `[num_seqs + 1]`: sequence `s`'s query rows are `qo_indptr[s]..qo_indptr[s + 1]`.
    pub qo_indptr: GlobalSlice<i32>,
    /// `[num_seqs]`: tokens in each sequence's cache, the new ones included.
    pub context_lens: GlobalSlice<i32>,
    /// `[num_q_heads]`: ALiBi slope per query head, or empty for no ALiBi.
    pub alibi_slopes: GlobalSlice<f32>,
    /// `[num_q_heads]`: attention-sink logit per query head, or empty for none.
    pub sinks: GlobalSlice<f32>,
    /// `[total_tokens, num_q_heads, head_dim]`: the output.
    pub out: GlobalSliceMut<T>,
    /// `[total_tokens, num_q_heads]`: the log-sum-exp of each output, base 2
    /// ([`SoftmaxState::lse`](crate::SoftmaxState::lse), the sink included), or empty
    /// for none.
    pub lse: GlobalSliceMut<f32>,
    /// `[total_tokens]`: the row of `q` each new token reads, or empty: token `t` reads
    /// row `t` (cascade attention gathers the query rows of the decodes that share a
    /// prefix).
    pub q_rows: GlobalSlice<i32>,
    /// `[total_tokens]`: the position of each new token, non-decreasing within a
    /// sequence, or empty: new token `i` of `s` at `context_lens[s] - qo_len + i`. A
    /// token attends to the cached positions up to its own (at most the context): a
    /// cascade's shared pass puts each decode's query at its own position, past every
    /// shared token, for ALiBi and the window.
    pub q_pos: GlobalSlice<i32>,
    /// `[total_tokens]`: each new token's tree mask (speculative decoding: verifying a
    /// tree of draft tokens), or empty for none. Bit `d` of token `i`'s word says
    /// whether it attends to its sequence's new token `i - d` (bit 0: itself); new
    /// tokens 64 or more before it, and the cached positions before the sequence's
    /// first new token, are attended as without a mask. A plain prefill's tokens have
    /// every bit set; a chain of drafts too. Not with `q_pos`, a window or ALiBi (the
    /// host refuses them: a tree node's position is its depth, not its slot).
    pub tree_mask: GlobalSlice<u64>,
    /// The cache's shape.
    pub layout: PagedLayout,
    /// Query heads (a multiple of `layout.num_kv_heads`).
    pub num_q_heads: u32,
    /// Row length of `block_tables`.
    pub max_blocks_per_seq: u32,
    /// Score scale (usually `1 / sqrt(head_dim)`).
    pub scale: f32,
    /// Logit soft-cap: `s = cap * tanh(s * inv_softcap)`; 0 disables it.
    pub softcap: f32,
    /// `1 / softcap`.
    pub inv_softcap: f32,
    /// Sliding window: attend to the last `window` positions only; 0 disables it.
    pub window: u32,
    /// Elements from one row of `q` to the next (`>= num_q_heads * head_dim`).
    pub q_row_stride: u64,
}

// SAFETY: 15 views, the 16-byte layout, 6 four-byte fields, one u64: 288 bytes, no
// padding (asserted below).
const _: () = assert!(core::mem::size_of::<PrefillParams<f32>>() == 15 * 16 + 16 + 6 * 4 + 8);
unsafe impl<T: 'static, K: 'static> KernelParams for PrefillParams<T, K>
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
        f(self.qo_indptr.range("qo_indptr"));
        f(self.context_lens.range("context_lens"));
        f(self.alibi_slopes.range("alibi_slopes"));
        f(self.sinks.range("sinks"));
        f(self.out.range("out"));
        f(self.lse.range("lse"));
        f(self.q_rows.range("q_rows"));
        f(self.q_pos.range("q_pos"));
        f(self.tree_mask.range("tree_mask"));
    }
}

/// Where one sequence's rows are, as a block computes them.
#[derive(Clone, Copy)]
struct Seq {
    /// First query row of the sequence in `q` / `out`.
    q0: u32,
    /// New tokens.
    qo_len: u32,
    /// Tokens in the cache, the new ones included.
    ctx_len: u32,
    /// Query heads per KV head.
    group: u32,
}

impl Seq {
    #[inline(always)]
    fn load<T, K, C: Ctx>(ctx: &C, p: &PrefillParams<T, K>, s: u32) -> Self {
        let q0 = ctx.ld(&p.qo_indptr, s as u64) as u32;
        let q1 = ctx.ld(&p.qo_indptr, s as u64 + 1) as u32;
        Seq {
            q0,
            qo_len: q1 - q0,
            ctx_len: ctx.ld(&p.context_lens, s as u64) as u32,
            group: p.num_q_heads / p.layout.num_kv_heads,
        }
    }

    /// The position of new token `i`: `q_pos`'s entry, or after the cached tokens.
    #[inline(always)]
    fn pos<T, K, C: Ctx>(&self, ctx: &C, p: &PrefillParams<T, K>, i: u32) -> u32 {
        if p.q_pos.is_empty() {
            self.ctx_len - self.qo_len + i
        } else {
            ctx.ld(&p.q_pos, (self.q0 + i) as u64) as u32
        }
    }

    /// One past the last cached position new token `i` attends to: its own position
    /// plus one, at most the context.
    #[inline(always)]
    fn end<T, K, C: Ctx>(&self, ctx: &C, p: &PrefillParams<T, K>, i: u32) -> u32 {
        let e = self.pos(ctx, p, i) + 1;
        if e < self.ctx_len { e } else { self.ctx_len }
    }

    /// The first position new token `i` attends to.
    #[inline(always)]
    fn first_visible<T, K, C: Ctx>(&self, ctx: &C, p: &PrefillParams<T, K>, i: u32) -> u32 {
        let q = self.pos(ctx, p, i);
        if p.window > 0 && q + 1 > p.window {
            q + 1 - p.window
        } else {
            0
        }
    }
}

/// The element index of position `pos`'s `(kv_head, dim 0)` in the cache of sequence
/// `s` (its block looked up in the block table).
#[inline(always)]
fn cache_at<T, K, C: Ctx>(ctx: &C, p: &PrefillParams<T, K>, s: u32, kvh: u32, pos: u32) -> u64 {
    let l = &p.layout;
    let lb = pos / l.block_size;
    let block = ctx.ld(
        &p.block_tables,
        s as u64 * p.max_blocks_per_seq as u64 + lb as u64,
    ) as u32;
    l.offset(block, kvh, pos % l.block_size)
}

/// The score of query position `qpos` (head `h`) against key position `kpos`, from
/// `dot = q.k` (`scale` is the score scale times the cache's K scale), in base-2
/// units: decode's definition.
#[inline(always)]
fn score<T, K, C: Ctx>(ctx: &C, p: &PrefillParams<T, K>, dot: f32, row: &Row, kpos: u32) -> f32 {
    let (slope, qpos) = (row.slope, row.qpos);
    let mut sc = dot * row.scale;
    if p.softcap > 0.0 {
        sc = p.softcap * ctx.tanh(sc * p.inv_softcap);
    }
    ctx.fma(slope, kpos as f32 - qpos as f32, sc) * crate::softmax::LOG2_E
}

/// What a block's rows are: for each of a thread's rows, whether it exists, its token,
/// query head, position, first visible position, ALiBi slope and score scale (the
/// cache's K scale folded in).
#[derive(Clone, Copy)]
struct Row {
    valid: bool,
    token: u32,
    head: u32,
    qpos: u32,
    first: u32,
    /// The last cached position it attends to (`qpos`, clipped to the context).
    last: u32,
    slope: f32,
    scale: f32,
}

/// The K and V scales of KV head `kvh` (1 for an unscaled cache).
#[inline(always)]
fn kv_scales<T, K: KvElem, C: Ctx>(ctx: &C, p: &PrefillParams<T, K>, kvh: u32) -> (f32, f32) {
    if K::SCALED {
        (
            ctx.ld(&p.k_scales, kvh as u64),
            ctx.ld(&p.v_scales, kvh as u64),
        )
    } else {
        (1.0, 1.0)
    }
}

impl Row {
    #[inline(always)]
    fn new<T, K: KvElem, C: Ctx>(
        ctx: &C,
        p: &PrefillParams<T, K>,
        sq: &Seq,
        kvh: u32,
        r: u32,
    ) -> Self {
        let rows = sq.qo_len * sq.group;
        let valid = r < rows;
        let r = if valid { r } else { rows - 1 };
        let (token, head) = (r / sq.group, kvh * sq.group + r % sq.group);
        Row {
            valid,
            token,
            head,
            qpos: sq.pos(ctx, p, token),
            first: sq.first_visible(ctx, p, token),
            last: sq.end(ctx, p, token) - 1,
            slope: if p.alibi_slopes.is_empty() {
                0.0
            } else {
                ctx.ld(&p.alibi_slopes, head as u64)
            },
            scale: p.scale * kv_scales(ctx, p, kvh).0,
        }
    }

    /// The score against `kpos` from `dot`, or `-inf` where this row may not look.
    #[inline(always)]
    fn score<T, K, C: Ctx>(
        &self,
        ctx: &C,
        p: &PrefillParams<T, K>,
        sq: &Seq,
        dot: f32,
        kpos: u32,
    ) -> f32 {
        if self.valid && kpos >= self.first && kpos <= self.last && self.sees(ctx, p, sq, kpos) {
            score(ctx, p, dot, self, kpos)
        } else {
            f32::NEG_INFINITY
        }
    }

    /// [`score`](Self::score) without the tree mask (the caller applies it).
    #[inline(always)]
    fn score_untreed<T, K, C: Ctx>(
        &self,
        ctx: &C,
        p: &PrefillParams<T, K>,
        dot: f32,
        kpos: u32,
    ) -> f32 {
        if self.valid && kpos >= self.first && kpos <= self.last {
            score(ctx, p, dot, self, kpos)
        } else {
            f32::NEG_INFINITY
        }
    }

    /// This row's tree-mask word and the first position it applies to (`qpos -
    /// min(token, 63)`: the positions before are cached ones or new ones 64 or more
    /// back, always seen): what [`sees`](Self::sees) reads, for a kernel that keeps
    /// them in shared memory.
    #[inline(always)]
    fn tree_word<T, K, C: Ctx>(&self, ctx: &C, p: &PrefillParams<T, K>, sq: &Seq) -> (u64, u32) {
        let back = if self.token < 63 { self.token } else { 63 };
        (
            ctx.ld(&p.tree_mask, (sq.q0 + self.token) as u64),
            self.qpos - back,
        )
    }

    /// Whether the tree mask lets this row see `kpos` (at most its own position):
    /// always without a mask, for a cached position, and for a new token 64 or more
    /// before it; else bit `qpos - kpos` of its token's mask.
    #[inline(always)]
    fn sees<T, K, C: Ctx>(&self, ctx: &C, p: &PrefillParams<T, K>, sq: &Seq, kpos: u32) -> bool {
        if p.tree_mask.is_empty() {
            return true;
        }
        let d = self.qpos - kpos;
        d > self.token
            || d >= 64
            || (ctx.ld(&p.tree_mask, (sq.q0 + self.token) as u64) >> d) & 1 != 0
    }

    /// Index of this row's `(token, head)` in `lse`.
    #[inline(always)]
    fn lse_at<T, K>(&self, p: &PrefillParams<T, K>, sq: &Seq) -> u64 {
        (sq.q0 + self.token) as u64 * p.num_q_heads as u64 + self.head as u64
    }

    /// Element index of this row's `(token, head, dim)` in `q`: its row `q_rows`'
    /// entry (or its token's), `q_row_stride` elements a row.
    #[inline(always)]
    fn q_at<T, K, C: Ctx>(&self, ctx: &C, p: &PrefillParams<T, K>, sq: &Seq, dim: u32) -> u64 {
        let t = sq.q0 + self.token;
        let r = if p.q_rows.is_empty() {
            t as u64
        } else {
            // (Widened as u32: rows are non-negative.)
            ctx.ld(&p.q_rows, t as u64) as u32 as u64
        };
        r * p.q_row_stride + (self.head * p.layout.head_dim + dim) as u64
    }

    /// [`q_at`](Self::q_at) in token order, `q_rows` not read (the tree variant of
    /// the one-warp kernel: the cascade's gathered rows run the plain one).
    #[inline(always)]
    fn q_at_token<T, K>(&self, p: &PrefillParams<T, K>, sq: &Seq, dim: u32) -> u64 {
        (sq.q0 + self.token) as u64 * p.q_row_stride + (self.head * p.layout.head_dim + dim) as u64
    }

    /// Element index of this row's `(token, head, dim)` in `out`.
    #[inline(always)]
    fn at<T, K>(&self, p: &PrefillParams<T, K>, sq: &Seq, dim: u32) -> u64 {
        ((sq.q0 + self.token) as u64 * p.num_q_heads as u64 + self.head as u64)
            * p.layout.head_dim as u64
            + dim as u64
    }
}

/// The 16-bit element types the tensor-core kernel runs on.
pub trait MmaElem: Elem {
    /// `mma.m16n8k16` with this element type's A and B.
    fn mma<C: Ctx>(ctx: &C, a: [u32; 4], b: [u32; 2], c: [f32; 4]) -> [f32; 4];
    /// Two `f32`s as this type, packed low first.
    fn pack2(lo: f32, hi: f32) -> u32;
    /// Two f16s (packed low first) as this type, for values this type holds exactly
    /// (every fp8 value does: the tensor-core decode over an fp8 cache).
    fn from_f16x2(bits: u32) -> u32;
}

/// `exp2(sc - m)`, 0 for a masked score (never `exp2(-inf - -inf)`).
#[inline(always)]
fn weight<C: Ctx>(ctx: &C, sc: f32, m: f32) -> f32 {
    if sc == f32::NEG_INFINITY {
        0.0
    } else {
        ctx.exp2(sc - m)
    }
}

impl MmaElem for F16 {
    #[inline(always)]
    fn mma<C: Ctx>(ctx: &C, a: [u32; 4], b: [u32; 2], c: [f32; 4]) -> [f32; 4] {
        ctx.mma_m16n8k16_f16(a, b, c)
    }
    #[inline(always)]
    fn pack2(lo: f32, hi: f32) -> u32 {
        F16::from_f32(lo).0 as u32 | (F16::from_f32(hi).0 as u32) << 16
    }
    #[inline(always)]
    fn from_f16x2(bits: u32) -> u32 {
        bits
    }
}

impl MmaElem for Bf16 {
    #[inline(always)]
    fn mma<C: Ctx>(ctx: &C, a: [u32; 4], b: [u32; 2], c: [f32; 4]) -> [f32; 4] {
        ctx.mma_m16n8k16_bf16(a, b, c)
    }
    #[inline(always)]
    fn pack2(lo: f32, hi: f32) -> u32 {
        Bf16::from_f32(lo).0 as u32 | (Bf16::from_f32(hi).0 as u32) << 16
    }
    #[inline(always)]
    fn from_f16x2(bits: u32) -> u32 {
        use crate::device::f16_to_f32;
        Self::pack2(f16_to_f32(bits as u16), f16_to_f32((bits >> 16) as u16))
    }
}

/// A marker tying the kernels to their element type.
type Of<T> = PhantomData<T>;

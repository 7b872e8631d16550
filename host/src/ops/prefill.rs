//! Paged prefill attention: the new tokens of a ragged batch, each attending causally
//! to its sequence's cache through the block table (see `pagedkv_kernels::kernels::
//! prefill`). Shapes, validation, launch configuration, and the emulator entry point.
//!
//! The score is decode's ([`crate::ops::attention`]): scale, then soft-cap, then ALiBi
//! `slope * (kpos - qpos)`; new token `i` of sequence `s` sits at position
//! `context_lens[s] - qo_len + i` and sees positions up to its own (the last `window`
//! with a window). A chunk of one token gives decode's answer.
//!
//! ```
//! use pagedkv_host::{DType, HostTensor, emulator::Emulator};
//! use pagedkv_host::ops::attention::{AttentionOptions, DecodeShape};
//! use pagedkv_host::ops::prefill::{PrefillInputs, prefill_emulated};
//!
//! // One sequence: 3 new tokens after 2 cached ones, all in block 1 of 2.
//! let shape = DecodeShape { num_seqs: 1, num_q_heads: 2, num_kv_heads: 1, head_dim: 64,
//!                           block_size: 8, num_blocks: 2, max_blocks_per_seq: 1 };
//! let pool = [2 * 8 * 64];
//! let kc = HostTensor::full(DType::F16, &pool, 0.5);
//! let vc = HostTensor::full(DType::F16, &pool, 3.0);
//! let q = HostTensor::full(DType::F16, &[3, 2, 64], 1.0);
//! let mut out = HostTensor::full(DType::F16, &[3, 2, 64], f64::NAN);
//! let opts = AttentionOptions::new(64);
//! prefill_emulated(&Emulator::new(), PrefillInputs { shape: &shape, opts: &opts, q: &q,
//!     key_cache: &kc, value_cache: &vc, block_tables: &[1], qo_indptr: &[0, 3],
//!     context_lens: &[5], kv_scales: None, sinks: None, tree_mask: None }, &mut out)?;
//! assert!(out.to_f64().iter().all(|&x| x == 3.0));
//! # Ok::<(), pagedkv_host::Error>(())
//! ```

use pagedkv_kernels::Dim3;
use pagedkv_kernels::kernels::attention::fixed_head_dim;
use pagedkv_kernels::kernels::prefill::{
    MMA_THREADS, ROWS, SIMT_THREADS, TILE_ROWS, TILED_HEAD_DIMS, TILED_THREADS, mma_shared_bytes,
};

use super::attention::{AttentionOptions, DecodeShape, validate_options};
use super::scales::{KvScales, check_cache_types};
use super::{MAX_GRID_YZ, check_tensor};
use crate::emulator::{Emulator, LaunchConfig};
use crate::error::{Error, Result};
use crate::tensor::{DType, HostTensor, TensorDesc};

/// The inputs of one prefill call, by name (`T`: the backend's tensor). `shape.num_seqs`
/// sequences; `q` and the output are `[qo_indptr[num_seqs], num_q_heads, head_dim]`.
#[derive(Debug)]
pub struct PrefillInputs<'a, T> {
    /// The shapes (as for decode; `num_seqs` sequences).
    pub shape: &'a DecodeShape,
    /// Scale, window, soft-cap, ALiBi.
    pub opts: &'a AttentionOptions,
    /// `[total_tokens, num_q_heads, head_dim]`: the new tokens, sequence by sequence.
    pub q: &'a T,
    /// `[num_blocks, num_kv_heads, block_size, head_dim]`, the new tokens appended.
    pub key_cache: &'a T,
    /// `[num_blocks, num_kv_heads, block_size, head_dim]`, the new tokens appended.
    pub value_cache: &'a T,
    /// `[num_seqs, max_blocks_per_seq]`.
    pub block_tables: &'a [i32],
    /// `[num_seqs + 1]`: sequence `s`'s rows of `q` are `qo_indptr[s]..qo_indptr[s + 1]`;
    /// `qo_indptr[0] = 0`, non-decreasing.
    pub qo_indptr: &'a [i32],
    /// `[num_seqs]`: tokens in each sequence's cache, its new ones included.
    pub context_lens: &'a [i32],
    /// The per-KV-head scales of an fp8 cache, as
    /// [`DecodeInputs::kv_scales`](super::attention::DecodeInputs::kv_scales).
    pub kv_scales: Option<&'a KvScales>,
    /// `[num_q_heads]`: attention-sink logits, as
    /// [`DecodeInputs::sinks`](super::attention::DecodeInputs::sinks).
    pub sinks: Option<&'a [f32]>,
    /// `[qo_indptr[num_seqs]]`: each new token's tree mask (verifying a tree of
    /// draft tokens, built by [`tree_mask`]), or `None`: causal. Not with a window or
    /// ALiBi.
    pub tree_mask: Option<&'a [u64]>,
}

impl<T> Clone for PrefillInputs<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for PrefillInputs<'_, T> {}

/// Checks every input of a prefill launch and returns the most query rows of one
/// sequence's KV head (`qo_len * group`), which sizes the grid.
pub fn validate<T: TensorDesc>(inputs: &PrefillInputs<'_, T>, out: &T) -> Result<u32> {
    let sh = inputs.shape;
    let l = sh.layout();
    sh.check()?;
    validate_options(inputs.opts, sh.num_q_heads)?;
    let max_rows = validate_metadata(
        sh,
        inputs.opts.window,
        inputs.block_tables,
        inputs.qo_indptr,
        inputs.context_lens,
    )?;
    let n = sh.num_seqs as usize;
    let total = inputs.qo_indptr[n] as u64;
    let qn = total * sh.row_elems();
    let (dtype, qd) = (inputs.key_cache.dtype(), inputs.q.dtype());
    let pool = super::checked_pool_elems(&l)?;
    check_tensor("key_cache", inputs.key_cache, dtype, pool)?;
    check_tensor("value_cache", inputs.value_cache, dtype, pool)?;
    check_cache_types(qd, dtype, inputs.kv_scales, sh.num_kv_heads)?;
    if let Some(s) = inputs.sinks {
        crate::ops::attention::check_per_head("sinks", s, sh.num_q_heads)?;
    }
    check_tensor("q", inputs.q, qd, qn)?;
    check_tensor("out", out, qd, qn)?;
    if let Some(m) = inputs.tree_mask {
        check_tree_mask(m, total as u32, [inputs.opts.window])?;
        check_tree_options(inputs.opts)?;
    }
    Ok(max_rows)
}

/// The most tokens a tree mask covers: a verify row's query tokens, the token
/// sampled last step and [`MAX_LOOKAHEAD`](crate::scheduler::MAX_LOOKAHEAD) drafts.
pub const MAX_TREE_TOKENS: usize = 64;

/// The tree masks of a prefill batch (the kernels' `tree_mask`, `[qo_indptr[n]]`):
/// sequence `s` with `parents[s] = Some(p)` is a verify row whose `qo_len <= 64`
/// query tokens form a tree, or a forest, `p[i]` the parent of token `i` (`p[0] =
/// -1`: the first root, the token sampled last step; after it `0 <= p[i] < i`, so the
/// nodes are in topological order, as EAGLE and SpecInfer number them, or `-1`: a
/// further root, a first-level draft whose parent is the cached context). Token `i`
/// attends to the cached positions and to its ancestors and itself among the new
/// tokens. Sequences with `None` are causal (every bit set). Errors name the sequence
/// and node.
///
/// A root after the first does not see token 0: its scores condition on the cached
/// context alone. Make a draft that follows the token sampled last step a child of
/// node 0; a further root is for drafts of the same position as token 0 (alternatives
/// to it, as a drafter that proposes several first tokens), or for an engine whose
/// row starts with a draft. Acceptance is the engine's, as for any tree: it copies the
/// accepted path's K/V into the row's first positions before it passes the path's
/// tokens to `on_step_done_accepted`.
///
/// The tree is given as a parent array because that is what a drafter produces and
/// it cannot describe a mask that is not a tree; the kernels read each token's 64-bit
/// word of ancestors, relative to itself (bit `d`: the token `d` before it), one
/// load and one shift a score, and a plain prefill's tokens are all ones, so one
/// batch mixes prefills, chains and trees.
///
/// ```
/// use pagedkv_host::ops::prefill::tree_mask;
/// // Sequence 0: a prompt chunk of 3 (causal); sequence 1: root 0, children 1 and 2
/// // of the root, 3 a child of 2.
/// let m = tree_mask(&[0, 3, 7], &[None, Some(&[-1, 0, 0, 2])])?;
/// assert_eq!(m[..3], [u64::MAX; 3]);
/// // Token 3 of the tree sees itself (bit 0), its parent 2 (bit 1) and the root (bit 3).
/// assert_eq!(m[3..], [0b1, 0b11, 0b101, 0b1011]);
/// // A forest: roots 0 and 1 (1 sees the cached context and itself), 2 a child of 1.
/// let f = tree_mask(&[0, 3], &[Some(&[-1, -1, 1])])?;
/// assert_eq!(f, [0b1, 0b1, 0b11]);
/// # Ok::<(), pagedkv_host::Error>(())
/// ```
pub fn tree_mask(qo_indptr: &[i32], parents: &[Option<&[i32]>]) -> Result<Vec<u64>> {
    if qo_indptr.len() != parents.len() + 1 || qo_indptr.first() != Some(&0) {
        return Err(Error::invalid(
            "qo_indptr",
            format!(
                "{} entries from 0 for {} sequences",
                qo_indptr.len(),
                parents.len()
            ),
        ));
    }
    let mut out = Vec::new();
    for (s, p) in parents.iter().enumerate() {
        let (q0, q1) = (qo_indptr[s], qo_indptr[s + 1]);
        if q1 < q0 {
            return Err(Error::invalid(
                "qo_indptr",
                format!("decreases at sequence {s}"),
            ));
        }
        let n = (q1 - q0) as usize;
        let Some(p) = p else {
            out.try_reserve(n)
                .map_err(|_| Error::invalid("qo_indptr", "too many tokens"))?;
            out.extend(std::iter::repeat_n(u64::MAX, n));
            continue;
        };
        if p.len() != n || n > MAX_TREE_TOKENS {
            return Err(Error::invalid(
                "parents",
                format!(
                    "sequence {s}: {} parents for {n} query tokens (one each, at most {MAX_TREE_TOKENS})",
                    p.len()
                ),
            ));
        }
        // Each node's ancestors and itself, by absolute index, then relative.
        let mut abs = [0u64; MAX_TREE_TOKENS];
        for (i, &pi) in p.iter().enumerate() {
            // -1: a root (node 0 always); else an earlier node.
            if pi < -1 || pi >= i as i32 {
                return Err(Error::invalid(
                    "parents",
                    format!(
                        "sequence {s}, node {i}: parent {pi} (a root's is -1, node 0 is one; every other node's is -1 or an earlier node)"
                    ),
                ));
            }
            abs[i] = (1 << i) | if pi == -1 { 0 } else { abs[pi as usize] };
            out.push(
                (0..=i)
                    .filter(|&j| abs[i] >> j & 1 != 0)
                    .fold(0, |m, j| m | 1 << (i - j)),
            );
        }
    }
    Ok(out)
}

/// Checks a tree mask against a prefill of `num_tokens` new tokens whose layer
/// groups have the windows `windows`: one word a token, and no window.
pub(crate) fn check_tree_mask(
    mask: &[u64],
    num_tokens: u32,
    windows: impl IntoIterator<Item = Option<u32>>,
) -> Result<()> {
    if mask.len() != num_tokens as usize {
        return Err(Error::invalid(
            "tree_mask",
            format!(
                "{} words for {num_tokens} new tokens (one each)",
                mask.len()
            ),
        ));
    }
    if windows.into_iter().any(|w| w.is_some()) {
        return Err(Error::invalid(
            "tree_mask",
            "with a sliding window (a tree node's position is its depth, not its slot)",
        ));
    }
    Ok(())
}

/// Refuses the options a tree mask does not take: a window and ALiBi (a tree node's
/// position is its depth, not its slot, and the kernels know slots).
pub(crate) fn check_tree_options(opts: &AttentionOptions) -> Result<()> {
    if opts.window.is_some() || opts.alibi_slopes.is_some() {
        return Err(Error::invalid(
            "tree_mask",
            "with a sliding window or ALiBi (a tree node's position is its depth, not its slot)",
        ));
    }
    Ok(())
}

/// Checks a prefill's metadata against the shapes and returns the most query rows of
/// one sequence's KV head (`qo_len * group`): `qo_indptr` is `[num_seqs + 1]` from 0,
/// non-decreasing; each context holds at least its new tokens (and one token) and fits
/// its table row; every block a sequence reads (from its first new token's `window`
/// start, or from 0) is inside the pool.
pub fn validate_metadata(
    sh: &DecodeShape,
    window: Option<u32>,
    block_tables: &[i32],
    qo_indptr: &[i32],
    context_lens: &[i32],
) -> Result<u32> {
    let n = sh.num_seqs as usize;
    let width = sh.max_blocks_per_seq as usize;
    if qo_indptr.len() != n + 1 || qo_indptr[0] != 0 {
        return Err(Error::invalid(
            "qo_indptr",
            format!(
                "{} entries (expected {}), starting at 0",
                qo_indptr.len(),
                n + 1
            ),
        ));
    }
    if context_lens.len() != n || block_tables.len() != n * width {
        return Err(Error::invalid(
            "context_lens",
            format!(
                "{} lengths and {} table entries for {n} sequences of {width} blocks",
                context_lens.len(),
                block_tables.len()
            ),
        ));
    }
    let capacity = width as u64 * sh.block_size as u64;
    let group = sh.num_q_heads / sh.num_kv_heads;
    let mut max_rows = 0u64;
    for s in 0..n {
        let qo = qo_indptr[s + 1] as i64 - qo_indptr[s] as i64;
        let ctx = context_lens[s] as i64;
        if qo < 0 {
            return Err(Error::invalid(
                "qo_indptr",
                format!("sequence {s}: decreases"),
            ));
        }
        if ctx < qo.max(1) || ctx as u64 > capacity {
            return Err(Error::invalid(
                "context_lens",
                format!(
                    "sequence {s}: {ctx} tokens for {qo} new ones (must be {}..={capacity})",
                    qo.max(1)
                ),
            ));
        }
        max_rows = max_rows.max(qo as u64 * group as u64);
        if qo == 0 {
            continue;
        }
        // The positions the first new token sees start the blocks read.
        let first = (ctx - qo + 1) as u64;
        let first = match window {
            Some(w) if first > w as u64 => first - w as u64,
            _ => 0,
        };
        let row = &block_tables[s * width..(s + 1) * width];
        for lb in first / sh.block_size as u64..(ctx as u64).div_ceil(sh.block_size as u64) {
            let id = row[lb as usize];
            if id < 0 || id as u32 >= sh.num_blocks {
                return Err(Error::invalid(
                    "block_tables",
                    format!(
                        "sequence {s}, logical block {lb}: block id {id} is outside the pool of {} blocks",
                        sh.num_blocks
                    ),
                ));
            }
        }
    }
    if max_rows.div_ceil(ROWS as u64) > MAX_GRID_YZ as u64 {
        return Err(Error::invalid(
            "qo_indptr",
            format!("{max_rows} query rows in one sequence's KV head: too many for one launch"),
        ));
    }
    Ok(max_rows as u32)
}

/// The prefill kernel a step launches, which the planner picks per step
/// ([`PrefillKernel::choose`], in
/// [`StepRunner::plan_prefill`](crate::step::StepRunner::plan_prefill)): the query
/// tile (rows a block), the warps sharing each staged K/V tile, and whether the head
/// dim is fixed at compile time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrefillKernel {
    /// CUDA cores, one query row a thread, [`SIMT_THREADS`] rows a block: f32 queries.
    Simt,
    /// Tensor cores, one warp of [`ROWS`] query rows a block, any head dim (`S`
    /// recomputed per 64 output columns past 64): 16-bit queries the multi-warp kernel
    /// does not serve.
    OneWarp,
    /// Tensor cores, [`TILE_ROWS`] query rows a block in [`TILED_THREADS`] / 32 warps
    /// sharing each staged K/V tile, `S` once over the whole head dim, `head_dim` fixed
    /// at compile time (one of [`TILED_HEAD_DIMS`]).
    MultiWarp {
        /// The kernel's compile-time head dim.
        head_dim: u32,
    },
}

impl PrefillKernel {
    /// The kernel for `shape`, queries of `q_dtype` and a cache of `kv_dtype` on a
    /// device allowing `max_shared_bytes` of shared memory a block: the multi-warp
    /// kernel for 16-bit queries, any cache type, block size 16, head_dim in
    /// [`TILED_HEAD_DIMS`] and 32-bit in-block offsets (decode's [`fixed_head_dim`])
    /// when its stages fit the device (96 KiB at head_dim 128 over a 16-bit cache:
    /// within every supported GPU's opt-in limit, sm_86 / sm_89's 99 KiB the least; the
    /// check keeps a smaller device on the one-warp kernel); else the one-warp kernel
    /// for 16-bit queries, [`Simt`](Self::Simt) for f32.
    pub fn choose(
        shape: &DecodeShape,
        q_dtype: DType,
        kv_dtype: DType,
        max_shared_bytes: u32,
    ) -> Self {
        if !matches!(q_dtype, DType::F16 | DType::Bf16) {
            return Self::Simt;
        }
        let d = fixed_head_dim(&shape.layout());
        if TILED_HEAD_DIMS.contains(&d) && tiled_shared_bytes(d, kv_dtype) <= max_shared_bytes {
            Self::MultiWarp { head_dim: d }
        } else {
            Self::OneWarp
        }
    }

    /// Query rows (tokens × the group's query heads) a block computes.
    pub fn rows_per_block(self) -> u32 {
        match self {
            Self::Simt => SIMT_THREADS,
            Self::OneWarp => ROWS,
            Self::MultiWarp { .. } => TILE_ROWS,
        }
    }

    /// Launch configuration for `shape` over a cache of `kv_dtype` when one sequence's
    /// KV head has at most `max_rows` query rows: a block per (KV head, tile of
    /// [`rows_per_block`](Self::rows_per_block) rows, sequence).
    pub fn launch_config(
        self,
        shape: &DecodeShape,
        kv_dtype: DType,
        max_rows: u32,
    ) -> LaunchConfig {
        let grid = Dim3::new(
            shape.num_kv_heads,
            max_rows.div_ceil(self.rows_per_block()).max(1),
            shape.num_seqs,
        );
        let (threads, shared_bytes) = match self {
            Self::Simt => (SIMT_THREADS, 0),
            Self::OneWarp => (MMA_THREADS, mma_shared_bytes(shape.head_dim)),
            Self::MultiWarp { head_dim } => (TILED_THREADS, tiled_shared_bytes(head_dim, kv_dtype)),
        };
        LaunchConfig {
            grid,
            block: Dim3::new(threads, 1, 1),
            shared_bytes,
        }
    }
}

/// Shared memory of the multi-warp kernel at head_dim `d` over a cache of `kv_dtype`.
fn tiled_shared_bytes(d: u32, kv_dtype: DType) -> u32 {
    pagedkv_kernels::kernels::attention::mma_shared_bytes(d, kv_dtype.size() as u32)
}

/// Runs the real prefill kernel in the emulator, after [`validate`]: a one-shot use
/// of the step path ([`StepRunner::prefill`](crate::step::StepRunner::prefill) on an
/// [`EmuDevice`](crate::step::EmuDevice)), so this is the launch engines run. `out` is
/// the output tensor, or an
/// [`AttentionOut`](crate::ops::attention::AttentionOut) with a log-sum-exp tensor too
/// (`[qo_indptr[num_seqs], num_q_heads]` f32).
pub fn prefill_emulated<'o>(
    emu: &Emulator,
    inputs: PrefillInputs<'_, HostTensor>,
    out: impl Into<crate::ops::attention::AttentionOut<'o, HostTensor>>,
) -> Result<()> {
    crate::step::once::prefill(crate::step::EmuDevice::new(emu.clone()), inputs, out)
}

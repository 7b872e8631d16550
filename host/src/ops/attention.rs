//! Paged decode attention: shapes, options, validation, the split-K plan, and the
//! emulator entry point.
//!
//! ```
//! use pagedkv_host::{DType, HostTensor, emulator::Emulator};
//! use pagedkv_host::ops::attention::{DecodeOptions, DecodeShape, decode_emulated, plan};
//! use pagedkv_host::reference::paged_decode_attention;
//!
//! // 2 sequences, GQA 4/2, head_dim 64, blocks of 8 tokens.
//! let shape = DecodeShape { num_seqs: 2, num_q_heads: 4, num_kv_heads: 2, head_dim: 64,
//!                           block_size: 8, num_blocks: 6, max_blocks_per_seq: 3 };
//! let pool = [6 * 2 * 8 * 64];
//! let f = |n: usize, s: f64| (0..n).map(|i| ((i as f64 * s).sin())).collect::<Vec<_>>();
//! let kc = HostTensor::from_f64(DType::F32, &pool, &f(pool[0], 0.37)).unwrap();
//! let vc = HostTensor::from_f64(DType::F32, &pool, &f(pool[0], 0.11)).unwrap();
//! let q = HostTensor::from_f64(DType::F32, &[2, 4, 64], &f(512, 0.5)).unwrap();
//! let tables = [0, 4, 2, /* seq 1: */ 5, 1, 3];
//! let lens = [19, 9];
//! let opts = DecodeOptions::new(64);
//! let mut out = HostTensor::full(DType::F32, &[2, 4, 64], f64::NAN);
//! let p = plan(&shape, DType::F32, 19, 132);
//! decode_emulated(&Emulator::new(), &shape, &opts, &p, &q, &kc, &vc, &tables, &lens, &mut out).unwrap();
//! let want = paged_decode_attention(&shape, &opts, &q, &kc, &vc, &tables, &lens);
//! let err = out.to_f64().iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
//! assert!(err < 1e-5);
//! ```

use pagedkv_kernels::kernels::attention::{
    DecodeGeometry, REDUCE_THREADS, STAGE_BYTES, STAGES, THREADS, TILE_TOKENS,
};
use pagedkv_kernels::kernels::{DecodeParams, DecodeReduce, PagedDecode, ReduceParams};
use pagedkv_kernels::{Dim3, GlobalSlice, GlobalSliceMut, PagedLayout};

use super::{MAX_GRID_YZ, check_layout, check_tensor, slice_view, view, view_mut, with_elem};
use crate::emulator::{Emulator, LaunchConfig};
use crate::error::{Error, Result};
use crate::tensor::{DType, HostTensor, TensorDesc};

/// The shapes of one decode-attention launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodeShape {
    /// Sequences in the batch (one query token each).
    pub num_seqs: u32,
    /// Query heads; a multiple of `num_kv_heads` (the group size is the quotient).
    pub num_q_heads: u32,
    /// KV heads.
    pub num_kv_heads: u32,
    /// Elements per head vector.
    pub head_dim: u32,
    /// Tokens per cache block.
    pub block_size: u32,
    /// Blocks in the cache pool.
    pub num_blocks: u32,
    /// Row length of the block tables.
    pub max_blocks_per_seq: u32,
}

impl DecodeShape {
    /// The cache layout these shapes imply.
    pub fn layout(&self) -> PagedLayout {
        PagedLayout {
            num_blocks: self.num_blocks,
            num_kv_heads: self.num_kv_heads,
            block_size: self.block_size,
            head_dim: self.head_dim,
        }
    }

    /// Elements of one sequence's dense q (or out) row: `num_q_heads * head_dim`.
    pub fn row_elems(&self) -> u64 {
        self.num_q_heads as u64 * self.head_dim as u64
    }

    /// Query heads per KV head.
    pub fn group(&self) -> u32 {
        self.num_q_heads / self.num_kv_heads.max(1)
    }
}

/// Options of decode attention.
#[derive(Clone, Debug, PartialEq)]
pub struct DecodeOptions {
    /// Score scale, usually `1 / sqrt(head_dim)`.
    pub scale: f32,
    /// Logit soft-capping: `s = cap * tanh(s / cap)`.
    pub softcap: Option<f32>,
    /// Sliding window: attend only to the last `window` tokens.
    pub window: Option<u32>,
    /// ALiBi: one slope per query head; the bias is `slope * (t - (ctx - 1))`.
    pub alibi_slopes: Option<Vec<f32>>,
}

impl DecodeOptions {
    /// Plain attention with scale `1 / sqrt(head_dim)`.
    pub fn new(head_dim: u32) -> Self {
        DecodeOptions {
            scale: 1.0 / (head_dim as f32).sqrt(),
            softcap: None,
            window: None,
            alibi_slopes: None,
        }
    }
}

/// How a launch is cut up: query heads per block and partitions per sequence.
///
/// Made by [`plan`] from the shapes and the device's SM count; a caller may build one
/// (for tests, or to tune), and [`validate_plan`] checks it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SplitPlan {
    /// Query heads one thread block serves (at most the group size).
    pub heads_per_block: u32,
    /// Tokens per partition, a multiple of [`TILE_TOKENS`].
    pub partition_tokens: u32,
    /// Partitions per sequence: 1 means no split-K (one kernel, no reduce).
    pub num_partitions: u32,
}

impl SplitPlan {
    /// Whether the plan uses split-K (partials and a reduce).
    pub fn is_split(&self) -> bool {
        self.num_partitions > 1
    }

    /// Thread blocks per KV head: `ceil(group / heads_per_block)`.
    pub fn head_chunks(&self, shape: &DecodeShape) -> u32 {
        shape.group().div_ceil(self.heads_per_block.max(1))
    }
}

/// Shortest partition the planner makes: long enough that a block's fixed costs
/// (queries into shared memory, partial writes) stay small against its KV reads.
pub const MIN_PARTITION_TOKENS: u32 = 4 * TILE_TOKENS;

/// The decode kernel's thread and shared-memory layout for this head_dim and dtype.
pub fn geometry(head_dim: u32, dtype: DType) -> DecodeGeometry {
    DecodeGeometry::new(head_dim, dtype.per_v4())
}

/// The most query heads one block can serve for this head_dim and dtype.
pub fn max_heads_per_block(head_dim: u32, dtype: DType) -> u32 {
    geometry(head_dim, dtype).max_heads().max(1)
}

/// Registers per thread the decode kernels may use: at least what ptxas reports for
/// every decode entry point on every architecture (`ptx/resources.md`; a test in
/// `tests/ptx.rs` fails if a kernel outgrows it), so occupancy computed from it is
/// never optimistic.
pub const DECODE_REGISTERS: u32 = 80;

/// What bounds how many blocks an SM runs at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SmLimits {
    /// 32-bit registers per SM.
    pub registers: u32,
    /// Resident threads per SM.
    pub threads: u32,
    /// Resident blocks per SM.
    pub blocks: u32,
    /// Shared memory per SM usable by blocks, bytes.
    pub shared_bytes: u32,
    /// Shared memory the driver reserves per block, bytes.
    pub reserved_shared_per_block: u32,
}

impl SmLimits {
    /// sm_80 (A100): 164 KiB of shared memory for blocks.
    pub const SM_80: SmLimits = SmLimits {
        registers: 65_536,
        threads: 2048,
        blocks: 32,
        shared_bytes: 164 * 1024,
        reserved_shared_per_block: 1024,
    };
    /// sm_90 (H100, H200): 228 KiB of shared memory for blocks.
    pub const SM_90: SmLimits = SmLimits {
        shared_bytes: 228 * 1024,
        ..SmLimits::SM_80
    };
}

/// Blocks of the decode kernel one SM runs at once (the least of what registers,
/// threads, shared memory and the block limit allow), with [`DECODE_REGISTERS`].
pub fn decode_blocks_per_sm(head_dim: u32, dtype: DType, sm: &SmLimits) -> u32 {
    decode_blocks_per_sm_at(DECODE_REGISTERS, head_dim, dtype, sm)
}

/// [`decode_blocks_per_sm`] for a kernel of `registers` registers per thread (what
/// ptxas reports for one entry point).
pub fn decode_blocks_per_sm_at(registers: u32, head_dim: u32, dtype: DType, sm: &SmLimits) -> u32 {
    // Registers are allocated per warp in units of 256.
    let warp_regs = (registers.max(1) * 32).next_multiple_of(256);
    let by_regs = sm.registers / warp_regs / (THREADS / 32);
    let by_threads = sm.threads / THREADS;
    let smem = geometry(head_dim, dtype).shared_bytes() + sm.reserved_shared_per_block;
    let by_smem = sm.shared_bytes / smem;
    by_regs.min(by_threads).min(by_smem).min(sm.blocks).max(1)
}

/// Bytes of K and V in flight per SM when every resident block has its `STAGES - 1`
/// stages in flight: `blocks_per_sm * (STAGES - 1) * stage bytes`. A model of the
/// pipeline's memory-level parallelism, not a measurement.
pub fn decode_bytes_in_flight_per_sm(head_dim: u32, dtype: DType, sm: &SmLimits) -> u32 {
    decode_bytes_in_flight(decode_blocks_per_sm(head_dim, dtype, sm), head_dim, dtype)
}

/// Bytes of K and V in flight on an SM running `blocks` decode blocks (a model).
pub fn decode_bytes_in_flight(blocks: u32, head_dim: u32, dtype: DType) -> u32 {
    let stage = 4 * geometry(head_dim, dtype).stage_words();
    debug_assert!(stage <= STAGE_BYTES);
    blocks * (STAGES - 1) * stage
}

/// Bytes in flight per SM the planner aims for: by Little's law, bandwidth x latency /
/// SMs is about 20-40 KiB on an A100 or H100 (a model, to be checked on a GPU).
pub const TARGET_BYTES_IN_FLIGHT_PER_SM: u32 = 40 * 1024;

/// Decode blocks each SM should run for the pipeline to keep
/// [`TARGET_BYTES_IN_FLIGHT_PER_SM`] in flight (at most what fits, with sm_80's limits,
/// the smallest of the supported architectures).
pub fn decode_blocks_wanted_per_sm(head_dim: u32, dtype: DType) -> u32 {
    let per_block = (STAGES - 1) * 4 * geometry(head_dim, dtype).stage_words();
    TARGET_BYTES_IN_FLIGHT_PER_SM
        .div_ceil(per_block)
        .min(decode_blocks_per_sm(head_dim, dtype, &SmLimits::SM_80))
}

/// Plans a launch: as many query heads per block as fit (so K/V is read once per
/// group), then split-K only when `num_seqs * num_kv_heads * head_chunks` blocks are
/// fewer than `sm_count` SMs times [`decode_blocks_wanted_per_sm`]: partitions are then
/// sized so the grid reaches that count, and never shorter than
/// [`MIN_PARTITION_TOKENS`].
pub fn plan(shape: &DecodeShape, dtype: DType, max_context_len: u32, sm_count: u32) -> SplitPlan {
    let hpb = shape
        .group()
        .clamp(1, max_heads_per_block(shape.head_dim, dtype));
    let mut p = SplitPlan {
        heads_per_block: hpb,
        partition_tokens: max_context_len.max(1).next_multiple_of(TILE_TOKENS),
        num_partitions: 1,
    };
    let blocks = shape.num_seqs as u64 * shape.num_kv_heads as u64 * p.head_chunks(shape) as u64;
    let per_sm = decode_blocks_wanted_per_sm(shape.head_dim, dtype);
    let target = per_sm as u64 * sm_count.max(1) as u64;
    if blocks >= target {
        return p;
    }
    let want = target.div_ceil(blocks.max(1)) as u32;
    let part = max_context_len
        .div_ceil(want)
        .next_multiple_of(TILE_TOKENS)
        .max(MIN_PARTITION_TOKENS);
    let n = max_context_len.div_ceil(part).min(MAX_GRID_YZ);
    if n > 1 {
        p.partition_tokens = part.max(max_context_len.div_ceil(n).next_multiple_of(TILE_TOKENS));
        p.num_partitions = max_context_len.div_ceil(p.partition_tokens);
    }
    p
}

/// Checks a plan against the shapes and the longest context.
pub fn validate_plan(
    shape: &DecodeShape,
    dtype: DType,
    p: &SplitPlan,
    max_context_len: u32,
) -> Result<()> {
    let max_hpb = max_heads_per_block(shape.head_dim, dtype).min(shape.group());
    if p.heads_per_block == 0 || p.heads_per_block > max_hpb {
        return Err(Error::invalid(
            "plan.heads_per_block",
            format!("{} (must be 1..={max_hpb})", p.heads_per_block),
        ));
    }
    if p.partition_tokens == 0 || !p.partition_tokens.is_multiple_of(TILE_TOKENS) {
        return Err(Error::invalid(
            "plan.partition_tokens",
            format!(
                "{} is not a positive multiple of {TILE_TOKENS}",
                p.partition_tokens
            ),
        ));
    }
    if p.num_partitions == 0
        || p.num_partitions > MAX_GRID_YZ
        || (p.num_partitions as u64) * (p.partition_tokens as u64) < max_context_len as u64
    {
        return Err(Error::invalid(
            "plan.num_partitions",
            format!(
                "{} partitions of {} tokens do not cover {max_context_len} tokens (or exceed {MAX_GRID_YZ})",
                p.num_partitions, p.partition_tokens
            ),
        ));
    }
    Ok(())
}

/// Checks every argument of a decode-attention launch and returns the longest context.
///
/// `q`, `out`: `[num_seqs, num_q_heads, head_dim]`; caches: `[num_blocks, num_kv_heads,
/// block_size, head_dim]`, one dtype for all; `block_tables`: `[num_seqs,
/// max_blocks_per_seq]`; `context_lens`: `[num_seqs]`, each in `1..=max_blocks_per_seq *
/// block_size`. Every block id a sequence reads (those covering its window) must be
/// inside the pool.
#[allow(clippy::too_many_arguments)]
pub fn validate(
    shape: &DecodeShape,
    opts: &DecodeOptions,
    q: &impl TensorDesc,
    key_cache: &impl TensorDesc,
    value_cache: &impl TensorDesc,
    block_tables: &[i32],
    context_lens: &[i32],
    out: &impl TensorDesc,
) -> Result<u32> {
    let l = shape.layout();
    check_layout(&l)?;
    if shape.num_seqs == 0 || shape.num_seqs > MAX_GRID_YZ {
        return Err(Error::invalid(
            "num_seqs",
            format!("{} (must be 1..={MAX_GRID_YZ})", shape.num_seqs),
        ));
    }
    if shape.num_q_heads == 0 || !shape.num_q_heads.is_multiple_of(shape.num_kv_heads) {
        return Err(Error::invalid(
            "num_q_heads",
            format!(
                "{} is not a positive multiple of num_kv_heads {}",
                shape.num_q_heads, shape.num_kv_heads
            ),
        ));
    }
    if shape.max_blocks_per_seq == 0 {
        return Err(Error::invalid("max_blocks_per_seq", "must be at least 1"));
    }
    let dtype = key_cache.dtype();
    let qn = shape.num_seqs as u64 * shape.num_q_heads as u64 * shape.head_dim as u64;
    check_tensor("key_cache", key_cache, dtype, l.pool_elems())?;
    check_tensor("value_cache", value_cache, dtype, l.pool_elems())?;
    check_tensor("q", q, dtype, qn)?;
    check_tensor("out", out, dtype, qn)?;
    validate_options(opts, shape.num_q_heads)?;
    validate_metadata(shape, opts.window, block_tables, context_lens)
}

/// Checks decode options: a finite non-zero scale, a finite positive soft-cap, a window
/// of at least one token, one finite ALiBi slope per query head.
pub fn validate_options(opts: &DecodeOptions, num_q_heads: u32) -> Result<()> {
    if !(opts.scale.is_finite() && opts.scale != 0.0) {
        return Err(Error::invalid(
            "scale",
            format!("{} is not finite and non-zero", opts.scale),
        ));
    }
    if let Some(cap) = opts.softcap
        && !(cap.is_finite() && cap > 0.0)
    {
        return Err(Error::invalid(
            "softcap",
            format!("{cap} is not finite and positive"),
        ));
    }
    if opts.window == Some(0) {
        return Err(Error::invalid("window", "must be at least 1 token"));
    }
    if let Some(s) = &opts.alibi_slopes {
        if s.len() != num_q_heads as usize {
            return Err(Error::invalid(
                "alibi_slopes",
                format!("{} slopes for {} query heads", s.len(), num_q_heads),
            ));
        }
        if let Some(x) = s.iter().find(|x| !x.is_finite()) {
            return Err(Error::invalid(
                "alibi_slopes",
                format!("slope {x} is not finite"),
            ));
        }
    }
    Ok(())
}

/// Checks a step's decode metadata against the shapes and returns the longest context:
/// `block_tables` is `[num_seqs, max_blocks_per_seq]`, `context_lens` `[num_seqs]` with
/// each length in `1..=max_blocks_per_seq * block_size`, and every block id a sequence
/// reads (those covering its `window`, or all of its blocks without one) inside the pool.
pub fn validate_metadata(
    shape: &DecodeShape,
    window: Option<u32>,
    block_tables: &[i32],
    context_lens: &[i32],
) -> Result<u32> {
    let rows = shape.num_seqs as usize;
    let width = shape.max_blocks_per_seq as usize;
    if block_tables.len() != rows * width {
        return Err(Error::invalid(
            "block_tables",
            format!("{} entries, expected {rows} x {width}", block_tables.len()),
        ));
    }
    if context_lens.len() != rows {
        return Err(Error::invalid(
            "context_lens",
            format!("{} entries for {rows} sequences", context_lens.len()),
        ));
    }
    let capacity = width as u64 * shape.block_size as u64;
    let mut max_len = 0;
    for (seq, &len) in context_lens.iter().enumerate() {
        if len < 1 || len as u64 > capacity {
            return Err(Error::invalid(
                "context_lens",
                format!("sequence {seq}: {len} tokens (must be 1..={capacity})"),
            ));
        }
        let len = len as u32;
        max_len = max_len.max(len);
        let first = match window {
            Some(w) if w < len => len - w,
            _ => 0,
        };
        let row = &block_tables[seq * width..(seq + 1) * width];
        for lb in first / shape.block_size..len.div_ceil(shape.block_size) {
            let id = row[lb as usize];
            if id < 0 || id as u32 >= shape.num_blocks {
                return Err(Error::invalid(
                    "block_tables",
                    format!(
                        "sequence {seq}, logical block {lb}: block id {id} is outside the pool of {} blocks",
                        shape.num_blocks
                    ),
                ));
            }
        }
    }
    Ok(max_len)
}

/// The bytes a decode launch must move through device memory, the benchmarks' count:
/// K and V of every attended token once per KV head (`2 * Σ ctx * num_kv_heads *
/// head_dim * size`), the queries and outputs (`2 * num_seqs * num_q_heads * head_dim *
/// size`), the block-table entries each thread block reads (`4 * Σ ceil(ctx /
/// block_size)` per KV head chunk), and with split-K the partials written and read back
/// (`2 * num_seqs * num_q_heads * partitions * (head_dim + 2) * 4`).
pub fn decode_bytes(shape: &DecodeShape, dtype: DType, context_lens: &[i32], p: &SplitPlan) -> u64 {
    let size = dtype.size() as u64;
    let d = shape.head_dim as u64;
    let tokens: u64 = context_lens.iter().map(|&c| c.max(0) as u64).sum();
    let blocks: u64 = context_lens
        .iter()
        .map(|&c| (c.max(0) as u64).div_ceil(shape.block_size as u64))
        .sum();
    let qo = 2 * shape.num_seqs as u64 * shape.num_q_heads as u64 * d * size;
    let chunks = shape.num_kv_heads as u64 * p.head_chunks(shape) as u64;
    let partials = if p.is_split() {
        2 * shape.num_seqs as u64 * shape.num_q_heads as u64 * p.num_partitions as u64 * (d + 2) * 4
    } else {
        0
    };
    2 * tokens * shape.num_kv_heads as u64 * d * size + qo + 4 * blocks * chunks + partials
}

/// Everything a backend checks before a decode launch: [`validate`] the inputs, take
/// `plan` or make one with [`plan`] for `sm_count` SMs, then [`validate_plan`] it.
/// Returns the plan to launch with.
#[allow(clippy::too_many_arguments)]
pub fn validate_launch(
    shape: &DecodeShape,
    opts: &DecodeOptions,
    q: &impl TensorDesc,
    key_cache: &impl TensorDesc,
    value_cache: &impl TensorDesc,
    block_tables: &[i32],
    context_lens: &[i32],
    out: &impl TensorDesc,
    plan_hint: Option<SplitPlan>,
    sm_count: u32,
) -> Result<SplitPlan> {
    let max_len = validate(
        shape,
        opts,
        q,
        key_cache,
        value_cache,
        block_tables,
        context_lens,
        out,
    )?;
    let dtype = key_cache.dtype();
    let p = plan_hint.unwrap_or_else(|| plan(shape, dtype, max_len, sm_count));
    validate_plan(shape, dtype, &p, max_len)?;
    Ok(p)
}

/// Launch configuration of the decode kernel for a plan.
pub fn decode_launch_config(shape: &DecodeShape, dtype: DType, p: &SplitPlan) -> LaunchConfig {
    LaunchConfig {
        grid: Dim3::new(
            shape.num_kv_heads * p.head_chunks(shape),
            shape.num_seqs,
            p.num_partitions,
        ),
        block: Dim3::new(THREADS, 1, 1),
        shared_bytes: geometry(shape.head_dim, dtype).shared_bytes(),
    }
}

/// Launch configuration of the split-K reduce: one thread per `(query head, 16-byte
/// chunk)` of a sequence.
pub fn reduce_launch_config(shape: &DecodeShape, dtype: DType) -> LaunchConfig {
    let pairs = shape.num_q_heads * (shape.head_dim / dtype.per_v4());
    LaunchConfig {
        grid: Dim3::new(pairs.div_ceil(REDUCE_THREADS), shape.num_seqs, 1),
        block: Dim3::new(REDUCE_THREADS, 1, 1),
        shared_bytes: 0,
    }
}

/// Runs the real decode kernel (and, for a split plan, the reduce kernel) in the
/// emulator, after [`validate`] and [`validate_plan`].
#[allow(clippy::too_many_arguments)]
pub fn decode_emulated(
    emu: &Emulator,
    shape: &DecodeShape,
    opts: &DecodeOptions,
    plan: &SplitPlan,
    q: &HostTensor,
    key_cache: &HostTensor,
    value_cache: &HostTensor,
    block_tables: &[i32],
    context_lens: &[i32],
    out: &mut HostTensor,
) -> Result<()> {
    validate_launch(
        shape,
        opts,
        q,
        key_cache,
        value_cache,
        block_tables,
        context_lens,
        out,
        Some(*plan),
        1,
    )?;
    let dtype = key_cache.dtype();
    let parts = plan.num_partitions as usize;
    let per_head = shape.num_seqs as usize * shape.num_q_heads as usize;
    let (mut part_out, mut part_ml) = if plan.is_split() {
        (
            vec![f32::NAN; per_head * parts * shape.head_dim as usize],
            vec![f32::NAN; per_head * parts * 2],
        )
    } else {
        (Vec::new(), Vec::new())
    };
    let slopes: &[f32] = opts.alibi_slopes.as_deref().unwrap_or(&[]);
    with_elem!(dtype, T => {
        // SAFETY: every view covers a tensor, slice or vector that lives (borrowed or
        // owned here) until this function returns, of the element type its dtype names.
        let params = unsafe {
            DecodeParams::<T> {
                q: view(q),
                key_cache: view(key_cache),
                value_cache: view(value_cache),
                block_tables: slice_view(block_tables),
                context_lens: slice_view(context_lens),
                alibi_slopes: slice_view(slopes),
                out: if plan.is_split() { GlobalSliceMut::empty() } else { view_mut(out) },
                part_out: GlobalSliceMut::from_raw_parts(part_out.as_mut_ptr(), part_out.len() as u64),
                part_ml: GlobalSliceMut::from_raw_parts(part_ml.as_mut_ptr(), part_ml.len() as u64),
                layout: shape.layout(),
                num_q_heads: shape.num_q_heads,
                max_blocks_per_seq: shape.max_blocks_per_seq,
                heads_per_block: plan.heads_per_block,
                partition_tokens: plan.partition_tokens,
                num_partitions: plan.num_partitions,
                scale: opts.scale,
                softcap: opts.softcap.unwrap_or(0.0),
                inv_softcap: opts.softcap.map_or(0.0, |c| 1.0 / c),
                window: opts.window.unwrap_or(0),
                q_row_stride: shape.row_elems(),
                out_row_stride: shape.row_elems(),
            }
        };
        let cfg = decode_launch_config(shape, dtype, plan);
        // SAFETY: (1) views valid for the launch (above); (2) `out` is borrowed mutably
        // and the partials are owned here; (3) each (sequence, query head, chunk) output
        // element and each partial is written by one thread (validated shapes and plan).
        if plan.is_split() {
            unsafe { emu.launch::<PagedDecode<T, true>>(cfg, params)? };
            // SAFETY: as above; the partials are now only read.
            let rp = unsafe {
                ReduceParams::<T> {
                    part_out: GlobalSlice::from_raw_parts(part_out.as_ptr(), part_out.len() as u64),
                    part_ml: GlobalSlice::from_raw_parts(part_ml.as_ptr(), part_ml.len() as u64),
                    out: view_mut(out),
                    num_q_heads: shape.num_q_heads,
                    head_dim: shape.head_dim,
                    num_partitions: plan.num_partitions,
                    out_row_stride: shape.row_elems(),
                }
            };
            // SAFETY: as above: one thread per output chunk.
            unsafe { emu.launch::<DecodeReduce<T>>(reduce_launch_config(shape, dtype), rp)? };
        } else {
            unsafe { emu.launch::<PagedDecode<T, false>>(cfg, params)? };
        }
    });
    Ok(())
}

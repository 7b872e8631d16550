//! Paged decode attention: shapes, options, validation, the split-K plan, and the
//! emulator entry point.
//!
//! ## What it computes
//! For each sequence `s` with `n = context_lens[s]` cached tokens (the new one
//! included) and each query head `h` (served by KV head `h / (num_q_heads /
//! num_kv_heads)`), over the attended tokens `t` (all `0..n`, or the last `window`):
//!
//! 1. `x = scale * dot(q[s, h], k[t])`;
//! 2. soft-cap, if set: `x = softcap * tanh(x / softcap)`;
//! 3. then ALiBi, if set: `x += alibi_slopes[h] * (t - (n - 1))` (the bias is added
//!    after the cap, so it is never capped);
//! 4. `out[s, h] = Σ_t softmax(x)_t * v[t]`; with an attention sink `σ_h`
//!    ([`DecodeInputs::sinks`]) the softmax's denominator gains `exp(σ_h)`:
//!    `out[s, h] = Σ_t exp(x_t) v[t] / (exp(σ_h) + Σ_t exp(x_t))`.
//!
//! The same definitions hold for every backend and for the f64 reference
//! ([`crate::reference`]).
//!
//! ```
//! use pagedkv_host::{DType, HostTensor, emulator::Emulator};
//! use pagedkv_host::ops::attention::{DecodeInputs, AttentionOptions, DecodeShape, decode_emulated};
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
//! let opts = AttentionOptions::new(64);
//! let mut out = HostTensor::full(DType::F32, &[2, 4, 64], f64::NAN);
//! let inputs = DecodeInputs { shape: &shape, opts: &opts, q: &q, key_cache: &kc,
//!     value_cache: &vc, block_tables: &tables, context_lens: &lens, kv_scales: None,
//!     sinks: None, plan: None };
//! decode_emulated(&Emulator::new(), inputs, &mut out).unwrap();
//! let want = paged_decode_attention(&inputs);
//! let err = out.to_f64().iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
//! assert!(err < 1e-5);
//! ```

mod emulated;
mod plan;

pub use emulated::decode_emulated;
pub use pagedkv_kernels::kernels::attention::TILE_TOKENS;
pub use plan::{
    Arch, DECODE_REGISTERS, DECODE_REGISTERS_FP8, DECODE_REGISTERS_MMA, DECODE_REGISTERS_MMA_FP8,
    DECODE_REGISTERS_MMA_FP8_SM90, DECODE_REGISTERS_MMA_SM90, DecodeKernel,
    MAX_BALANCING_PARTITIONS, MIN_PARTITION_TOKENS, SmLimits, SplitPlan, SplitTarget,
    decode_blocks_per_sm, decode_blocks_per_sm_at, decode_bytes_in_flight,
    decode_bytes_in_flight_per_sm, decode_kernel, decode_launch_config, decode_registers, geometry,
    max_heads_per_block, plan, plan_unsplit, reduce_launch_config, validate_plan,
};

use pagedkv_kernels::PagedLayout;

use super::scales::{KvScales, check_cache_types};
use super::{MAX_GRID_YZ, check_layout, check_tensor};
use crate::error::{Error, Result};
use crate::tensor::{DType, TensorDesc};

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

    /// The step shape of these sequences' geometry with q of `dtype` over caches of
    /// `kv_dtype` (the inverse of [`StepShape::batch`](crate::step::StepShape::batch)).
    pub fn with_dtypes(&self, dtype: DType, kv_dtype: DType) -> crate::step::StepShape {
        crate::step::StepShape {
            num_q_heads: self.num_q_heads,
            num_kv_heads: self.num_kv_heads,
            head_dim: self.head_dim,
            block_size: self.block_size,
            num_blocks: self.num_blocks,
            dtype,
            kv_dtype,
        }
    }

    /// Query heads per KV head.
    pub fn group(&self) -> u32 {
        self.num_q_heads / self.num_kv_heads.max(1)
    }

    /// Checks what every launch over these shapes needs (decode and prefill alike): a
    /// valid cache layout, `1..=65535` sequences (a grid axis), and query heads a
    /// positive multiple of the KV heads.
    pub fn check(&self) -> Result<()> {
        check_layout(&self.layout())?;
        if self.num_seqs == 0 || self.num_seqs > MAX_GRID_YZ {
            return Err(Error::invalid(
                "num_seqs",
                format!("{} (must be 1..={MAX_GRID_YZ})", self.num_seqs),
            ));
        }
        check_heads(self.num_q_heads, self.num_kv_heads)
    }
}

/// Query heads must be a positive multiple of the KV heads (each KV head serves a
/// group of them), at most [`MAX_GRID_YZ`] (so every launch's thread count over them,
/// up to `num_q_heads * 512` in the reduce, fits a `u32`): the one check of it, for
/// every shape type.
pub(crate) fn check_heads(num_q_heads: u32, num_kv_heads: u32) -> Result<()> {
    if num_q_heads == 0 || !num_q_heads.is_multiple_of(num_kv_heads) {
        return Err(Error::invalid(
            "num_q_heads",
            format!("{num_q_heads} is not a positive multiple of num_kv_heads {num_kv_heads}"),
        ));
    }
    if num_q_heads > MAX_GRID_YZ {
        return Err(Error::invalid(
            "num_q_heads",
            format!("{num_q_heads} (at most {MAX_GRID_YZ})"),
        ));
    }
    Ok(())
}

/// One finite value per query head: ALiBi slopes, attention-sink logits (`arg` names
/// them). The one check, for the options, the per-call inputs and the step runner's
/// upload.
pub(crate) fn check_per_head(arg: &'static str, values: &[f32], num_q_heads: u32) -> Result<()> {
    if values.len() != num_q_heads as usize {
        return Err(Error::invalid(
            arg,
            format!("{} values for {} query heads", values.len(), num_q_heads),
        ));
    }
    if let Some(x) = values.iter().find(|x| !x.is_finite()) {
        return Err(Error::invalid(arg, format!("{x} is not finite")));
    }
    Ok(())
}

/// Options of decode attention.
#[derive(Clone, Debug, PartialEq)]
pub struct AttentionOptions {
    /// Score scale, usually `1 / sqrt(head_dim)`.
    pub scale: f32,
    /// Logit soft-capping: `s = cap * tanh(s / cap)`.
    pub softcap: Option<f32>,
    /// Sliding window: attend only to the last `window` tokens.
    pub window: Option<u32>,
    /// ALiBi: one slope per query head; the bias is `slope * (t - (ctx - 1))`.
    pub alibi_slopes: Option<Vec<f32>>,
}

impl AttentionOptions {
    /// Plain attention with scale `1 / sqrt(head_dim)`.
    pub fn new(head_dim: u32) -> Self {
        AttentionOptions {
            scale: 1.0 / (head_dim as f32).sqrt(),
            softcap: None,
            window: None,
            alibi_slopes: None,
        }
    }
}

/// The inputs of one decode-attention call, by name, for every backend (`T` is the
/// backend's tensor: [`HostTensor`](crate::HostTensor) for the emulator, a device
/// tensor on CUDA). Named fields, so the block tables and the context lengths (both
/// `&[i32]`) cannot be swapped by position.
#[derive(Debug)]
pub struct DecodeInputs<'a, T> {
    /// The launch's shapes.
    pub shape: &'a DecodeShape,
    /// Scale, window, soft-cap, ALiBi.
    pub opts: &'a AttentionOptions,
    /// `[num_seqs, num_q_heads, head_dim]`: one query token per sequence.
    pub q: &'a T,
    /// `[num_blocks, num_kv_heads, block_size, head_dim]`.
    pub key_cache: &'a T,
    /// `[num_blocks, num_kv_heads, block_size, head_dim]`.
    pub value_cache: &'a T,
    /// `[num_seqs, max_blocks_per_seq]`: the physical block of each logical block.
    pub block_tables: &'a [i32],
    /// `[num_seqs]`: tokens in each sequence's cache, the new one included.
    pub context_lens: &'a [i32],
    /// The per-KV-head scales of an fp8 cache (required for one, refused otherwise):
    /// the kernels read K as `decode(b) * kv_scales.k[h]`, V likewise. The step path
    /// takes the same scales as a `[2, num_kv_heads]` f32 tensor of the layer
    /// ([`DecodeIo::kv_scales`](crate::step::DecodeIo::kv_scales)).
    pub kv_scales: Option<&'a KvScales>,
    /// `[num_q_heads]`: attention-sink logits (natural units, finite), one per query
    /// head, or `None`. A sink is one more score of its head whose value row is zero
    /// (gpt-oss): it joins the softmax denominator once (with split-K, in the reduce,
    /// not once per partition). The step path takes them as the layer's tensor
    /// ([`DecodeIo::sinks`](crate::step::DecodeIo::sinks)).
    pub sinks: Option<&'a [f32]>,
    /// How to cut the launch up; `None`: the backend decides (the emulator never
    /// splits, the CUDA device plans for its GPU's SMs with [`plan`]).
    pub plan: Option<SplitPlan>,
}

/// Where one attention call writes: the outputs and, optionally, each output's
/// log-sum-exp (`[rows, num_q_heads]` f32, base 2: `log2(Σ exp(x))` over the scores
/// `x` the output attended, the attention sink included; see
/// [`SoftmaxState::lse`](pagedkv_kernels::SoftmaxState::lse)), for a later merge
/// with other parts of the same attention ([`crate::ops::merge`]). A plain `&mut T`
/// converts into one without the log-sum-exp.
#[derive(Debug)]
pub struct AttentionOut<'a, T> {
    /// The outputs.
    pub out: &'a mut T,
    /// `[rows, num_q_heads]` f32: written when given.
    pub lse: Option<&'a mut T>,
}

impl<'a, T> From<&'a mut T> for AttentionOut<'a, T> {
    fn from(out: &'a mut T) -> Self {
        AttentionOut { out, lse: None }
    }
}

/// Checks a log-sum-exp output, when there is one: f32, `rows * num_q_heads` elements.
pub(crate) fn check_lse<T: TensorDesc>(lse: Option<&T>, rows: u64, num_q_heads: u32) -> Result<()> {
    match lse {
        Some(l) => check_tensor("lse", l, DType::F32, rows * num_q_heads as u64),
        None => Ok(()),
    }
}

impl<T> Clone for DecodeInputs<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for DecodeInputs<'_, T> {}

///
/// `q`, `out`: `[num_seqs, num_q_heads, head_dim]`, one dtype; caches: `[num_blocks,
/// num_kv_heads, block_size, head_dim]`, of q's dtype or fp8 with `kv_scales` (see
/// [`check_cache_types`]); `block_tables`: `[num_seqs,
/// max_blocks_per_seq]`; `context_lens`: `[num_seqs]`, each in `1..=max_blocks_per_seq *
/// block_size`. Every block id a sequence reads (those covering its window) must be
/// inside the pool.
pub fn validate<T: TensorDesc>(inputs: &DecodeInputs<'_, T>, out: &T) -> Result<u32> {
    let DecodeInputs {
        shape,
        opts,
        q,
        key_cache,
        value_cache,
        block_tables,
        context_lens,
        kv_scales,
        sinks,
        plan: _,
    } = *inputs;
    let l = shape.layout();
    shape.check()?;
    if shape.max_blocks_per_seq == 0 {
        return Err(Error::invalid("max_blocks_per_seq", "must be at least 1"));
    }
    let dtype = key_cache.dtype();
    let qn = shape.num_seqs as u64 * shape.num_q_heads as u64 * shape.head_dim as u64;
    let pool = crate::ops::checked_pool_elems(&l)?;
    check_tensor("key_cache", key_cache, dtype, pool)?;
    check_tensor("value_cache", value_cache, dtype, pool)?;
    check_cache_types(q.dtype(), dtype, kv_scales, shape.num_kv_heads)?;
    check_tensor("q", q, q.dtype(), qn)?;
    check_tensor("out", out, q.dtype(), qn)?;
    validate_options(opts, shape.num_q_heads)?;
    if let Some(s) = sinks {
        check_per_head("sinks", s, shape.num_q_heads)?;
    }
    validate_metadata(shape, opts.window, block_tables, context_lens)
}

/// Checks decode options: a finite non-zero scale, a finite positive soft-cap, a window
/// of at least one token, one finite ALiBi slope per query head.
pub fn validate_options(opts: &AttentionOptions, num_q_heads: u32) -> Result<()> {
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
        check_per_head("alibi_slopes", s, num_q_heads)?;
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
/// head_dim * size(kv_dtype)`), the queries and outputs (`2 * num_seqs * num_q_heads *
/// head_dim * size(dtype)`), the block-table entries each thread block reads (`4 * Σ
/// ceil(ctx / block_size)` per KV head chunk), an fp8 cache's scales (`8 *
/// num_kv_heads` per block, ignored: they are cached), and with split-K the partials
/// written and read back (`2 * num_seqs * num_q_heads * partitions * (head_dim + 2) *
/// 4`).
pub fn decode_bytes(
    shape: &DecodeShape,
    (dtype, kv_dtype): (DType, DType),
    context_lens: &[i32],
    p: &SplitPlan,
) -> u64 {
    let (size, kv_size) = (dtype.size() as u64, kv_dtype.size() as u64);
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
    2 * tokens * shape.num_kv_heads as u64 * d * kv_size + qo + 4 * blocks * chunks + partials
}

/// Everything a backend checks before a decode launch: [`validate`] the inputs, take
/// `inputs.plan` or make one (with [`plan`] for `target`, or [`plan_unsplit`] when
/// `target` is `None`), then [`validate_plan`] it. Returns the plan to launch with.
pub fn validate_launch<T: TensorDesc>(
    inputs: &DecodeInputs<'_, T>,
    out: &T,
    target: Option<SplitTarget>,
) -> Result<SplitPlan> {
    let max_len = validate(inputs, out)?;
    let (shape, dtype) = (inputs.shape, inputs.key_cache.dtype());
    let p = inputs.plan.unwrap_or_else(|| match target {
        Some(t) => plan(shape, dtype, max_len, t),
        None => plan_unsplit(shape, dtype, max_len),
    });
    validate_plan(shape, dtype, &p, max_len)?;
    Ok(p)
}

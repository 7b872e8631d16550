//! The split-K plan and the launch geometry of the decode kernels: how many query heads
//! a block serves, how a long context is cut into partitions, and the occupancy model
//! the planner uses.

use pagedkv_kernels::Dim3;
use pagedkv_kernels::kernels::attention::{
    DecodeGeometry, MMA_HEAD_DIMS, MMA_MAX_HEADS, MMA_STAGE_TOKENS, MMA_STAGES, REDUCE_LANES,
    REDUCE_THREADS, STAGE_BYTES, STAGES, THREADS, TILE_TOKENS, fixed_head_dim, mma_shared_bytes,
};

use super::DecodeShape;
use crate::emulator::LaunchConfig;
use crate::error::{Error, Result};
use crate::ops::MAX_GRID_YZ;
use crate::tensor::DType;

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

/// What the host needs to know of the decode kernel it launches for a shape and a
/// cache of `dtype` (the CUDA-core kernel, or the tensor-core one for an f16, bf16 or
/// fp8 cache at head_dim 64 or 128, block size 16: see `PagedDecode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodeKernel {
    /// Whether it runs on tensor cores.
    pub tensor_cores: bool,
    /// The most query heads one block serves.
    pub max_heads: u32,
    /// Dynamic shared memory per block, bytes.
    pub shared_bytes: u32,
    /// Tokens of one pipeline stage.
    pub stage_tokens: u32,
    /// Bytes of K and V one pipeline stage holds.
    pub stage_bytes: u32,
    /// Stages in flight while the block computes on one.
    pub stages_in_flight: u32,
    /// Registers per thread on every architecture (at least ptxas's count for every
    /// such entry point, checked by `tests/ops/ptx.rs`); the planner takes the
    /// architecture's own, [`Arch::decode_registers`].
    pub registers: u32,
}

/// The decode kernel the host launches for `shape` and a cache of `dtype`.
pub fn decode_kernel(shape: &DecodeShape, dtype: DType) -> DecodeKernel {
    let d = fixed_head_dim(&shape.layout());
    if dtype != DType::F32 && MMA_HEAD_DIMS.contains(&d) {
        let bytes = dtype.size() as u32;
        return DecodeKernel {
            tensor_cores: true,
            max_heads: MMA_MAX_HEADS,
            shared_bytes: mma_shared_bytes(d, bytes),
            stage_tokens: MMA_STAGE_TOKENS,
            stage_bytes: 2 * MMA_STAGE_TOKENS * d * bytes,
            stages_in_flight: MMA_STAGES - 1,
            registers: if dtype.is_fp8() {
                DECODE_REGISTERS_MMA_FP8
            } else {
                DECODE_REGISTERS_MMA
            },
        };
    }
    let g = geometry(shape.head_dim, dtype);
    DecodeKernel {
        tensor_cores: false,
        max_heads: g.max_heads().max(1),
        shared_bytes: g.shared_bytes(),
        stage_tokens: g.stage_tokens,
        stage_bytes: 4 * g.stage_words(),
        stages_in_flight: STAGES - 1,
        registers: decode_registers(dtype),
    }
}

/// The most query heads one block can serve for this shape and cache type.
pub fn max_heads_per_block(shape: &DecodeShape, dtype: DType) -> u32 {
    decode_kernel(shape, dtype).max_heads
}

/// Registers per thread the CUDA-core decode kernels may use: at least what ptxas
/// reports for every such entry point on every architecture (`ptx/resources.md`; a test
/// in `tests/ops/ptx.rs` fails if a kernel outgrows it), so occupancy computed from it is
/// never optimistic.
pub const DECODE_REGISTERS: u32 = 96;
/// As [`DECODE_REGISTERS`], for the decode kernels over an fp8 cache (16 q and 16
/// accumulator registers a thread, and the conversions).
pub const DECODE_REGISTERS_FP8: u32 = 128;
/// As [`DECODE_REGISTERS`], for the tensor-core decode kernels (Q's A fragments and
/// the output fragments stay in registers: 96 of them at head_dim 128).
pub const DECODE_REGISTERS_MMA: u32 = 224;
/// As [`DECODE_REGISTERS_MMA`], for the tensor-core decode kernels over an fp8 cache
/// (sm_80 decodes fp8 in software: up to 230 registers at head_dim 128; sm_90's
/// `cvt` needs 168).
pub const DECODE_REGISTERS_MMA_FP8: u32 = 248;
/// [`DECODE_REGISTERS_MMA`] on sm_90 alone: ptxas's most for any such entry point there
/// (212, the bf16 head_dim 128 kernel). The same residency as sm_80's bound (2 blocks).
pub const DECODE_REGISTERS_MMA_SM90: u32 = 212;
/// [`DECODE_REGISTERS_MMA_FP8`] on sm_90 alone (168 at head_dim 128: `cvt` decodes fp8
/// in one instruction a pair). Exactly ptxas's count: 168 registers let an SM hold 3
/// blocks, 170 would hold 2.
pub const DECODE_REGISTERS_MMA_FP8_SM90: u32 = 168;

/// The register bound of the CUDA-core decode kernel over a cache of `dtype` (the same
/// on every architecture).
pub const fn decode_registers(dtype: DType) -> u32 {
    if dtype.is_fp8() {
        DECODE_REGISTERS_FP8
    } else {
        DECODE_REGISTERS
    }
}

/// An architecture pagedkv ships PTX for: what bounds residency there.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Arch {
    /// sm_80 (A100); also the conservative choice for a GPU of unknown architecture
    /// (its bounds are never below another's).
    Sm80,
    /// sm_90 (H100, H200).
    Sm90,
}

impl Arch {
    /// The architecture of a PTX target name (`"sm_80"`, `"sm_90"`, `"sm_90a"`); `None`
    /// for one pagedkv does not ship.
    pub fn from_name(name: &str) -> Option<Arch> {
        match name {
            "sm_80" => Some(Arch::Sm80),
            "sm_90" | "sm_90a" => Some(Arch::Sm90),
            _ => None,
        }
    }

    /// The SM's limits on this architecture.
    pub const fn limits(self) -> SmLimits {
        match self {
            Arch::Sm80 => SmLimits::SM_80,
            Arch::Sm90 => SmLimits::SM_90,
        }
    }

    /// Registers per thread the planner assumes for a decode kernel here: at least
    /// ptxas's count for every such entry point of this architecture (checked by
    /// `tests/ops/ptx.rs`).
    pub const fn decode_registers(self, tensor_cores: bool, fp8: bool) -> u32 {
        match (self, tensor_cores, fp8) {
            (Arch::Sm90, true, true) => DECODE_REGISTERS_MMA_FP8_SM90,
            (Arch::Sm90, true, false) => DECODE_REGISTERS_MMA_SM90,
            (_, true, true) => DECODE_REGISTERS_MMA_FP8,
            (_, true, false) => DECODE_REGISTERS_MMA,
            (_, false, true) => DECODE_REGISTERS_FP8,
            (_, false, false) => DECODE_REGISTERS,
        }
    }
}

/// The GPU a plan is made for: its SM count and architecture.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SplitTarget {
    /// Streaming multiprocessors.
    pub sm_count: u32,
    /// Its architecture (residency: registers, shared memory).
    pub arch: Arch,
}

/// A bare SM count: [`SplitTarget::conservative`].
impl From<u32> for SplitTarget {
    fn from(sm_count: u32) -> SplitTarget {
        SplitTarget::conservative(sm_count)
    }
}

impl SplitTarget {
    /// `sm_count` SMs of sm_80's bounds (never optimistic about residency on a newer
    /// architecture).
    pub const fn conservative(sm_count: u32) -> SplitTarget {
        SplitTarget {
            sm_count,
            arch: Arch::Sm80,
        }
    }
}

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

/// Blocks of the decode kernel one SM of `arch` runs at once (the least of what
/// registers, threads, shared memory and the block limit allow), with the
/// architecture's register bound ([`Arch::decode_registers`]).
pub fn decode_blocks_per_sm(shape: &DecodeShape, dtype: DType, arch: Arch) -> u32 {
    let k = decode_kernel(shape, dtype);
    let registers = arch.decode_registers(k.tensor_cores, dtype.is_fp8());
    decode_blocks_per_sm_at(registers, &k, &arch.limits())
}

/// Blocks of kernel `k` an SM of limits `sm` runs at once at `registers` registers per
/// thread (what ptxas reports for one entry point).
pub fn decode_blocks_per_sm_at(registers: u32, k: &DecodeKernel, sm: &SmLimits) -> u32 {
    // Registers are allocated per warp in units of 256.
    let warp_regs = (registers.max(1) * 32).next_multiple_of(256);
    let by_regs = sm.registers / warp_regs / (THREADS / 32);
    let by_threads = sm.threads / THREADS;
    let by_smem = sm.shared_bytes / (k.shared_bytes + sm.reserved_shared_per_block);
    by_regs.min(by_threads).min(by_smem).min(sm.blocks).max(1)
}

/// Bytes of K and V in flight per SM of `arch` when every resident block has its stages
/// in flight: `blocks_per_sm * stages_in_flight * stage bytes`. A model of the
/// pipeline's memory-level parallelism, not a measurement.
pub fn decode_bytes_in_flight_per_sm(shape: &DecodeShape, dtype: DType, arch: Arch) -> u32 {
    decode_bytes_in_flight(
        decode_blocks_per_sm(shape, dtype, arch),
        &decode_kernel(shape, dtype),
    )
}

/// Bytes of K and V in flight on an SM running `blocks` blocks of kernel `k` (a model).
pub fn decode_bytes_in_flight(blocks: u32, k: &DecodeKernel) -> u32 {
    debug_assert!(k.tensor_cores || k.stage_bytes <= STAGE_BYTES);
    blocks * k.stages_in_flight * k.stage_bytes
}

/// The most partitions [`plan`] cuts a sequence into to even out the waves of a grid
/// that already fills the GPU (more would add partials and reduce work for little).
pub const MAX_BALANCING_PARTITIONS: u32 = 4;

/// Plans a launch for `target` (a [`SplitTarget`], or a bare SM count for sm_80's
/// conservative bounds): as many query heads per block as fit (so K/V is read
/// once per group), then partitions so the grid fills the GPU's resident slots (`S` =
/// SMs x [`decode_blocks_per_sm`]) in whole waves:
///
/// * fewer than `S` blocks (`num_seqs * num_kv_heads * head_chunks`): as many
///   partitions as keep the grid within one wave, `floor(S / blocks)` (one more would
///   start a second wave that a few SMs run alone);
/// * more: split only when a last partial wave costs a fifth of the time or more, by
///   `cost(n) = ceil(blocks * n / S) / n` (the time in unsplit blocks' lengths, for `n`
///   partitions up to [`MAX_BALANCING_PARTITIONS`]): then the fewest partitions whose
///   cost is within 10% of the least. So 1.3 waves of fp8 blocks on an H100 become 3.9
///   (3 partitions) rather than a second wave at a third of the slots, while 4.7 waves
///   of f16 on an A100 stay unsplit. The two thresholds were chosen on the speed model
///   (`ptx/resources.md`; FlashAttention-2's split heuristic likewise keeps the fewest
///   splits within 85% of the best wave efficiency) and wait for a GPU to confirm them.
///
/// Partitions are multiples of [`TILE_TOKENS`] and never shorter than
/// [`MIN_PARTITION_TOKENS`].
pub fn plan(
    shape: &DecodeShape,
    dtype: DType,
    max_context_len: u32,
    target: impl Into<SplitTarget>,
) -> SplitPlan {
    let target = target.into();
    let mut p = plan_unsplit(shape, dtype, max_context_len);
    let blocks = shape.num_seqs as u64 * shape.num_kv_heads as u64 * p.head_chunks(shape) as u64;
    let slots =
        decode_blocks_per_sm(shape, dtype, target.arch) as u64 * target.sm_count.max(1) as u64;
    let blocks = blocks.max(1);
    let want = if blocks < slots {
        slots / blocks
    } else {
        // cost(n) = waves(n) / n, compared in integers.
        let waves = |n: u64| (blocks * n).div_ceil(slots);
        let ns = 1..=MAX_BALANCING_PARTITIONS as u64;
        let best = ns.clone().fold(1, |best, n| {
            if waves(n) * best < waves(best) * n {
                n
            } else {
                best
            }
        });
        // Worth the partials, the reduce and every block's fixed costs only when the
        // last wave idled a fifth of the time or more; then the fewest partitions
        // within 10% of the least cost.
        if 5 * waves(best) > 4 * waves(1) * best {
            1
        } else {
            ns.into_iter()
                .find(|&n| 10 * waves(n) * best <= 11 * waves(best) * n)
                .unwrap_or(best)
        }
    };
    let want = want.min(MAX_GRID_YZ as u64) as u32;
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

/// The plan without split-K: as many query heads per block as fit, one partition
/// covering `max_context_len` tokens (what the CPU backends run unless asked).
pub fn plan_unsplit(shape: &DecodeShape, dtype: DType, max_context_len: u32) -> SplitPlan {
    SplitPlan {
        heads_per_block: shape.group().clamp(1, max_heads_per_block(shape, dtype)),
        partition_tokens: max_context_len.max(1).next_multiple_of(TILE_TOKENS),
        num_partitions: 1,
    }
}

/// Checks a plan against the shapes and the longest context.
pub fn validate_plan(
    shape: &DecodeShape,
    dtype: DType,
    p: &SplitPlan,
    max_context_len: u32,
) -> Result<()> {
    let max_hpb = max_heads_per_block(shape, dtype).min(shape.group());
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

/// Launch configuration of the decode kernel for a plan.
pub fn decode_launch_config(shape: &DecodeShape, dtype: DType, p: &SplitPlan) -> LaunchConfig {
    LaunchConfig {
        grid: Dim3::new(
            shape.num_kv_heads * p.head_chunks(shape),
            shape.num_seqs,
            p.num_partitions,
        ),
        block: Dim3::new(THREADS, 1, 1),
        shared_bytes: decode_kernel(shape, dtype).shared_bytes,
    }
}

/// Launch configuration of the split-K reduce: [`REDUCE_LANES`] threads per `(query head,
/// 16-byte chunk)` of a sequence.
pub fn reduce_launch_config(shape: &DecodeShape, dtype: DType) -> LaunchConfig {
    let lanes = shape.num_q_heads * (shape.head_dim / dtype.per_v4()) * REDUCE_LANES;
    LaunchConfig {
        grid: Dim3::new(lanes.div_ceil(REDUCE_THREADS), shape.num_seqs, 1),
        block: Dim3::new(REDUCE_THREADS, 1, 1),
        shared_bytes: 0,
    }
}

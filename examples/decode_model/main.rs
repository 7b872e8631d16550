//! The attention kernels' performance model, from their SASS: for decode, occupancy,
//! bytes in flight and the modelled fraction of peak DRAM bandwidth at the flagship
//! shapes; for the multi-warp prefill, the modelled fraction of the tensor cores'
//! `mma.sync` ceiling; as Markdown.
//! `scripts/validate-ptx.sh` runs it and appends its tables to `ptx/resources.md`.
//!
//! ```sh
//! cargo run -q --release --example decode_model -- REPORT LOOPS [--enforce]
//! ```
//! `REPORT` is the resource report so far (its ptxas table gives each kernel's
//! registers); `LOOPS` holds the `key=value` lines `scripts/decode-model.py` printed for
//! every architecture (each decode kernel's steady-state loop: issued warp-instructions,
//! pipe counts and dependent chain per stage).
//!
//! Everything here is a model, not a measurement (no GPU has run these kernels). Per
//! shape, GPU and cache type it takes the split plan the library makes for that GPU, the
//! kernel the host launches (`decode_kernel`: the tensor-core head_dim 128 kernel for an
//! f16, bf16 or fp8 cache under 16-bit q), that kernel's stage loop (for the
//! CUDA-core kernel, the loop of the plan's tile size), and bounds the time of the
//! launch by the slowest of:
//!
//! * DRAM: bytes moved ÷ peak bandwidth;
//! * issue: on the busiest SM (`n = ceil(CTAs / SMs)` CTAs), `n × stages × warps ×
//!   instructions per warp-stage ÷ 4` cycles (4 schedulers issue one warp-instruction a
//!   cycle each);
//! * pipes: MUFU 16 lanes/cycle/SM (0.5 warp-instructions), SHFL 32 lanes (1), shared
//!   loads 128 B/cycle (an LDS.128 is 512 B: broadcasts are not credited);
//! * dependent chain: a resident CTA finishes a stage no faster than its loop's
//!   longest dependent chain, so `n × stages × chain ÷ r` cycles with `r = min(n,
//!   resident capacity)` CTAs resident;
//! * memory latency: each resident CTA keeps `f` stages in flight (the kernel's
//!   `stages_in_flight`), so a stage per `800 ns ÷ f` per CTA: `n × stages × 800 ns ÷
//!   (f × r)`.
//!
//! With split-K the reduce follows: [`REDUCE_LANES`] lanes share one `(query head,
//! chunk)`, each folding every `REDUCE_LANES`-th partition, so a lane's partition loop
//! runs `ceil(partitions / REDUCE_LANES)` times, a dependent chain of `iter_chain`
//! cycles each (global loads at 300 cycles, an L2 hit: the partials were just
//! written), after the chain before the loop (`pre_chain`) and before the lanes'
//! butterfly merge and store (`post_chain`); launch overhead is not added (a CUDA
//! graph or programmatic dependent launch hides most of it).
//! The fraction of peak = bytes moved ÷ (decode + reduce time) ÷ peak.
//!
//! The multi-warp prefill kernel (`prefill_report`, issue #30) is modelled from its
//! stage loop the same way (its table's text gives the rules): per warp-stage the
//! loop's issued instructions and pipe use give a CTA-stage's cost on an SM, CTAs are
//! list-scheduled in launch order onto the resident slots (causal tail and last wave
//! in), and useful FLOPs over that time are compared with the `mma.sync` ceiling
//! (SMs × sustained clock × [`MMA_FLOP_PER_CLK_SM80`] / [`MMA_FLOP_PER_CLK_SM90`]).
//!
//! With `--enforce` it exits with status 1 when a bar of issue #29 is missed (at batch
//! 64 / ctx 4096: f16 and bf16 ≥ 85% on H100 and H200, e4m3 ≥ 80% on H100 and ≥ 70% on
//! H200; at batch 1 / ctx 32768, f16 ≥ 75% on H100 and H200; the reduce ≤ 3 µs) or of
//! issue #30 (prefill at 8 × 2048 new tokens, f16 and bf16 on H100: ≥ 40% of the
//! `mma.sync` ceiling, ≥ 95% of the HMMA useful).

use std::collections::HashMap;
use std::process::ExitCode;

use pagedkv::host::DType;
use pagedkv::host::ops::attention::{
    DecodeShape, SmLimits, decode_blocks_per_sm_at, decode_bytes, decode_kernel, geometry, plan,
};
use pagedkv::kernels::kernels::attention::{
    MMA_STAGES, REDUCE_LANES, STAGES, THREADS, mma_shared_bytes,
};
use pagedkv::kernels::kernels::prefill::{TILE_ROWS, TILED_THREADS};

/// A GPU of the model: name, architecture, SMs, sustained and boost clocks, DRAM peak.
struct Gpu {
    name: &'static str,
    arch: &'static str,
    sms: u32,
    clock_ghz: f64,
    boost_ghz: f64,
    peak_tb_s: f64,
    limits: SmLimits,
    /// Dense f16 `mma.sync` FLOP per clock per SM (the prefill model's ceiling).
    mma_flop_per_clk: f64,
}

const GPUS: [Gpu; 3] = [
    Gpu {
        name: "A100 80GB SXM",
        arch: "sm_80",
        sms: 108,
        clock_ghz: 1.41,
        boost_ghz: 1.41,
        peak_tb_s: 2.04,
        limits: SmLimits::SM_80,
        mma_flop_per_clk: MMA_FLOP_PER_CLK_SM80,
    },
    Gpu {
        name: "H100 SXM",
        arch: "sm_90",
        sms: 132,
        clock_ghz: 1.755,
        boost_ghz: 1.98,
        peak_tb_s: 3.35,
        limits: SmLimits::SM_90,
        mma_flop_per_clk: MMA_FLOP_PER_CLK_SM90,
    },
    Gpu {
        name: "H200",
        arch: "sm_90",
        sms: 132,
        clock_ghz: 1.755,
        boost_ghz: 1.98,
        peak_tb_s: 4.8,
        limits: SmLimits::SM_90,
        mma_flop_per_clk: MMA_FLOP_PER_CLK_SM90,
    },
];

/// sm_80's dense f16 tensor rate, FLOP per clock per SM: A100's 312 TFLOP/s at 1.41 GHz
/// on 108 SMs; `mma.sync` reaches it there.
const MMA_FLOP_PER_CLK_SM80: f64 = 2048.0;
/// sm_90's dense f16 rate through `mma.sync` (not `wgmma`), FLOP per clock per SM:
/// two thirds of the 4096 that `wgmma` reaches (H100 SXM's 989 TFLOP/s at 1.83 GHz on
/// 132 SMs), the share microbenchmarks of `mma.sync` on Hopper report: about 650
/// TFLOP/s at the 1.755 GHz sustained clock.
const MMA_FLOP_PER_CLK_SM90: f64 = 4096.0 * 2.0 / 3.0;

/// DRAM latency of the memory-latency bound.
const DRAM_LATENCY_NS: f64 = 800.0;

/// One `key=value` line of `decode-model.py`.
type Loop = HashMap<String, String>;

fn num(l: &Loop, k: &str) -> f64 {
    l.get(k).and_then(|v| v.parse().ok()).unwrap_or(0.0)
}

/// A modelled launch: the bounds in seconds and what limits it.
struct Modelled {
    plan: String,
    resident: u32,
    per_sm: u32,
    instr_per_byte: f64,
    bounds: Vec<(&'static str, f64)>,
    reduce_s: f64,
    bytes: u64,
}

impl Modelled {
    fn decode_s(&self) -> f64 {
        self.bounds.iter().map(|b| b.1).fold(0.0, f64::max)
    }
    fn limit(&self) -> &'static str {
        self.bounds
            .iter()
            .max_by(|a, b| a.1.total_cmp(&b.1))
            .map_or("?", |b| b.0)
    }
    fn fraction(&self, gpu: &Gpu) -> f64 {
        self.bytes as f64 / (self.decode_s() + self.reduce_s) / (gpu.peak_tb_s * 1e12)
    }
}

fn kernel_name(kv: DType) -> String {
    match kv {
        DType::F16 => "paged_decode_attention_f16_d128".into(),
        DType::Bf16 => "paged_decode_attention_bf16_d128".into(),
        k => format!("paged_decode_attention_f16_{k}_d128"),
    }
}

fn model(
    gpu: &Gpu,
    kv: DType,
    num_seqs: u32,
    ctx: u32,
    regs: &HashMap<(String, String), u32>,
    loops: &[Loop],
) -> Result<Modelled, String> {
    let dtype = if kv == DType::Bf16 {
        DType::Bf16
    } else {
        DType::F16
    };
    let shape = DecodeShape {
        num_seqs,
        num_q_heads: 32,
        num_kv_heads: 8,
        head_dim: 128,
        block_size: 16,
        num_blocks: 1 << 16,
        max_blocks_per_seq: ctx.div_ceil(16),
    };
    let p = plan(&shape, kv, ctx, gpu.sms);
    let name = kernel_name(kv);
    let r = *regs
        .get(&(gpu.arch.to_string(), name.clone()))
        .ok_or_else(|| format!("no ptxas registers for {} {name}", gpu.arch))?;
    let k = decode_kernel(&shape, kv);
    // The loop a block runs: the tensor-core kernel's one stage loop (each warp a quarter
    // of every stage), or the CUDA-core kernel's loop for the plan's tile size.
    let (kind, tile, per_group) = if k.tensor_cores {
        ("mma", 0, k.stage_tokens)
    } else {
        let g = geometry(128, kv);
        let per_group = g.stage_tokens / g.token_groups(p.heads_per_block);
        let tile = if per_group == 1 {
            1
        } else if per_group >= 8 {
            8
        } else {
            2
        };
        ("simt", tile, per_group)
    };
    let lp = loops
        .iter()
        .find(|l| {
            l.get("arch").map(String::as_str) == Some(gpu.arch)
                && l.get("kernel") == Some(&name)
                && l.get("modelled").map(String::as_str) == Some("yes")
                && l.get("kind").map(String::as_str) == Some(kind)
                && num(l, "tile") as u32 == tile
        })
        .ok_or_else(|| {
            format!(
                "no modelled {kind} stage loop of tile {tile} in {} {name}",
                gpu.arch
            )
        })?;
    // Per warp per stage; an inner tile loop runs per_group / tile times.
    let trips = if lp.get("tile_loop").map(String::as_str) == Some("yes") {
        (per_group / tile) as f64
    } else {
        1.0
    };
    let per = |k: &str| num(lp, &format!("stage_{k}")) + trips * num(lp, &format!("tile_{k}"));
    let chain = num(lp, "stage_chain") + trips * num(lp, "tile_chain");
    let warps = (THREADS / 32) as f64;
    let stage_bytes = k.stage_bytes as f64;

    let ctas = shape.num_kv_heads * p.head_chunks(&shape) * num_seqs * p.num_partitions;
    let n = ctas.div_ceil(gpu.sms);
    let cap = decode_blocks_per_sm_at(r, &k, &gpu.limits);
    let resident = n.min(cap).max(1);
    let tokens = ctx.min(p.partition_tokens);
    let stages = tokens.div_ceil(k.stage_tokens) as f64;
    let hz = gpu.clock_ghz * 1e9;
    let work = n as f64 * stages; // CTA-stages on the busiest SM
    let lens = vec![ctx as i32; num_seqs as usize];
    let bytes = decode_bytes(&shape, (dtype, kv), &lens, &p);
    let bounds = vec![
        ("DRAM", bytes as f64 / (gpu.peak_tb_s * 1e12)),
        ("issue", work * warps * per("instr") / 4.0 / hz),
        ("MUFU", work * warps * per("mufu") / 0.5 / hz),
        ("SHFL", work * warps * per("shfl") / hz),
        ("LDS", work * warps * per("lds_bytes") / 128.0 / hz),
        ("chain", work * chain / resident as f64 / hz),
        (
            "latency",
            work * DRAM_LATENCY_NS * 1e-9 / (k.stages_in_flight as f64 * resident as f64),
        ),
    ];
    let reduce_s = if p.is_split() {
        let rname = format!("paged_decode_reduce_{dtype}");
        let rl = loops
            .iter()
            .find(|l| {
                l.get("arch").map(String::as_str) == Some(gpu.arch)
                    && l.get("kernel") == Some(&rname)
            })
            .ok_or_else(|| format!("no reduce loop for {} {rname}", gpu.arch))?;
        // REDUCE_LANES lanes fold every REDUCE_LANES-th partition each, in parallel;
        // the code before the loop and the lanes' shuffle merge after it run once.
        let per_lane = p.num_partitions.div_ceil(REDUCE_LANES) as f64;
        (num(rl, "pre_chain") + per_lane * num(rl, "iter_chain") + num(rl, "post_chain")) / hz
    } else {
        0.0
    };
    Ok(Modelled {
        plan: format!(
            "{} heads/CTA, {} partition(s) of {}",
            p.heads_per_block, p.num_partitions, p.partition_tokens
        ),
        resident,
        per_sm: n,
        instr_per_byte: warps * per("instr") / stage_bytes,
        bounds,
        reduce_s,
        bytes,
    })
}

/// A modelled prefill launch of the multi-warp kernel.
struct PrefillModelled {
    resident: u32,
    /// Issued instructions a warp-stage: plain, masked.
    instr_per_stage: (f64, f64),
    /// The fraction of CTA-stages that are plain.
    plain_fraction: f64,
    useful_hmma: f64,
    tflops: f64,
    ceiling_tflops: f64,
    limit: &'static str,
}

/// The multi-warp prefill kernel (`paged_prefill_attention_{t}_d128`) at `seqs`
/// sequences of `new` new tokens after `prefix` cached ones (causal, 32:8 heads,
/// head_dim 128, block 16): see the module docs.
fn prefill_model(
    gpu: &Gpu,
    dtype: DType,
    seqs: u32,
    new: u32,
    prefix: u32,
    regs: &HashMap<(String, String), u32>,
    loops: &[Loop],
) -> Result<PrefillModelled, String> {
    const D: u64 = 128;
    let (q_heads, kv_heads, group) = (32u64, 8u64, 4u64);
    let name = format!("paged_prefill_attention_{dtype}_d128");
    let r = *regs
        .get(&(gpu.arch.to_string(), name.clone()))
        .ok_or_else(|| format!("no ptxas registers for {} {name}", gpu.arch))?;
    let lp = loops
        .iter()
        .find(|l| {
            l.get("arch").map(String::as_str) == Some(gpu.arch)
                && l.get("kernel") == Some(&name)
                && l.get("modelled").map(String::as_str) == Some("yes")
        })
        .ok_or_else(|| format!("no modelled stage loop in {} {name}", gpu.arch))?;
    let warps = (TILED_THREADS / 32) as f64;
    // A path's count: `stage_*` the masked stages' (the longest path), `plain_*` the
    // plain stages' (every score of every warp's rows unmasked, no soft-cap or ALiBi).
    let count = |path: &str, k: &str| num(lp, &format!("{path}_{k}"));
    if count("plain", "instr") == 0.0 {
        return Err(format!("no plain stage path in {} {name}", gpu.arch));
    }
    // Resident CTAs per SM: registers (per warp, in units of 256), threads, shared
    // memory (the stages; the driver's reserve per block), the block limit.
    let l = &gpu.limits;
    let warp_regs = (r * 32).next_multiple_of(256);
    let smem = mma_shared_bytes(D as u32, dtype.size() as u32) + l.reserved_shared_per_block;
    let resident = (l.registers / warp_regs / (TILED_THREADS / 32))
        .min(l.threads / TILED_THREADS)
        .min(l.shared_bytes / smem)
        .min(l.blocks)
        .max(1);
    // One CTA-stage's cost in SM cycles by each pipe (4 schedulers; MUFU 16 lanes a
    // cycle; SHFL one warp-instruction a cycle; shared loads 128 B a cycle; the tensor
    // pipe at the architecture's mma.sync rate); a CTA's time a stage on its slot is
    // that at 1 / resident of the SM's throughput, and no less than the path's
    // dependent chain. Returns (what limits it, cycles).
    let stage_cost = |path: &str| -> (&'static str, f64) {
        let c = |k: &str| count(path, k);
        let pipes = [
            ("issue", warps * c("instr") / 4.0),
            ("tensor", warps * c("hmma") * 4096.0 / gpu.mma_flop_per_clk),
            ("MUFU", warps * c("mufu") * 2.0),
            ("SHFL", warps * c("shfl")),
            ("LDS", warps * c("lds_bytes") / 128.0),
        ];
        let (limit, c_sm) = pipes
            .iter()
            .copied()
            .fold(("issue", 0.0), |a, b| if b.1 > a.1 { b } else { a });
        if c("chain") > resident as f64 * c_sm {
            ("chain", c("chain"))
        } else {
            (limit, resident as f64 * c_sm)
        }
    };
    let (limit, plain_cost) = stage_cost("plain");
    let (_, masked_cost) = stage_cost("stage");
    // CTAs in launch order (x: KV head, y: 64-row tile, z: sequence), each to the
    // slot that frees first (list scheduling: the causal tail and the last wave are in).
    // A CTA's stages are plain while all four warps' are (the kernel's test per warp:
    // all 16 rows exist and the stage ends at or before the warp's first row's
    // position + 1; no window, so every range starts at 0), else masked.
    let rows = new as u64 * group;
    let tiles = rows.div_ceil(TILE_ROWS as u64);
    let mut slots = std::collections::BinaryHeap::new();
    for _ in 0..gpu.sms * resident {
        slots.push(std::cmp::Reverse(0u64));
    }
    let (mut end, mut plain_stages, mut all_stages) = (0u64, 0u64, 0u64);
    for _seq in 0..seqs {
        for tile in 0..tiles {
            let row0 = tile * TILE_ROWS as u64;
            // Its last token's position + 1: the positions it stages, in 64-token stages.
            let last_tok = (row0 + TILE_ROWS as u64).min(rows) / group;
            let stages = (prefix as u64 + last_tok).div_ceil(64);
            let plain = (0..TILED_THREADS as u64 / 32)
                .map(|w| {
                    let wrow0 = row0 + 16 * w;
                    if wrow0 + 16 > rows {
                        0
                    } else {
                        ((prefix as u64 + wrow0 / group + 1) / 64).min(stages)
                    }
                })
                .min()
                .unwrap_or(0);
            let cycles = plain as f64 * plain_cost + (stages - plain) as f64 * masked_cost;
            for _kv in 0..kv_heads {
                plain_stages += plain;
                all_stages += stages;
                let std::cmp::Reverse(free) = slots.pop().unwrap();
                let done = free + cycles.ceil() as u64;
                end = end.max(done);
                slots.push(std::cmp::Reverse(done));
            }
        }
    }
    let seconds = end as f64 / (gpu.clock_ghz * 1e9);
    // Useful FLOPs: 4 x head_dim x query heads x the attended (query, key) pairs.
    let pairs: u64 = (0..new as u64).map(|i| prefix as u64 + i + 1).sum::<u64>() * seqs as u64;
    let flops = 4.0 * D as f64 * q_heads as f64 * pairs as f64;
    // The least HMMA a warp-stage needs: S and P V over 16 rows x 64 tokens x D.
    let min_hmma = (2 * 16 * 64 * D * 2) as f64 / 4096.0;
    Ok(PrefillModelled {
        resident,
        instr_per_stage: (count("plain", "instr"), count("stage", "instr")),
        plain_fraction: plain_stages as f64 / all_stages.max(1) as f64,
        useful_hmma: min_hmma / count("stage", "hmma").max(count("plain", "hmma")),
        tflops: flops / seconds / 1e12,
        ceiling_tflops: gpu.sms as f64 * gpu.clock_ghz * 1e9 * gpu.mma_flop_per_clk / 1e12,
        limit,
    })
}

/// Prints the prefill model's table and returns the missed bars of issue #30 (H100, f16
/// and bf16, at (a): >= 40% of the mma.sync ceiling, >= 95% useful HMMA).
fn prefill_report(regs: &HashMap<(String, String), u32>, loops: &[Loop]) -> Vec<String> {
    println!(
        "\n## Prefill: modelled fraction of the mma.sync ceiling (a model from the SASS, not a measurement)\n\n\
         The multi-warp kernel (`paged_prefill_attention_{{f16,bf16}}_d128`), 32:8 heads, head_dim 128, \
         block 16, causal. (a) 8 sequences x 2048 new tokens (FlashAttention-2's benchmark size); (b) 8 \
         sequences x a 512-token chunk over a 4096-token cached prefix. Per stage (64 tokens) of a warp the \
         SASS loop's issued instructions, HMMA, MUFU, SHFL and shared-load bytes give one CTA-stage's cost \
         on an SM by each pipe (the slowest is `limit`, given for plain stages; `chain` when the path's \
         dependent chain is longer than the resident CTAs' share of the SM), for each of the loop's two \
         paths: plain stages (every score of all four warps' rows unmasked; no soft-cap or ALiBi, as \
         here) and masked ones (the longest path: per-score masks, soft-cap and ALiBi terms), a CTA's \
         stages counted as the kernel's per-warp test splits them (`plain`: their share of all \
         CTA-stages); CTAs are list-scheduled in launch order onto every \
         SM's resident slots (the causal tail and the last wave are in), each at 1 / resident of its SM. \
         Useful FLOPs are 4 x head_dim x query heads x attended pairs (masked positions inside a diagonal \
         tile are computed but not counted). Ceiling: SMs x sustained clock x mma.sync FLOP per clock \
         per SM (sm_80 2048: A100's dense f16 peak; sm_90 2731: two thirds of `wgmma`'s 4096, about 650 \
         TFLOP/s on H100 SXM). `useful HMMA`: the least a warp-stage needs (S and P V) / what the loop \
         issues. The prologue (Q fragments, the first stages) and the epilogue are not counted.\n"
    );
    println!(
        "| shape | q | GPU | CTAs/SM resident | instr/warp-stage plain / masked | plain | useful HMMA | limit | TFLOP/s | ceiling TFLOP/s | % of ceiling |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    let mut failures = Vec::new();
    for (label, seqs, new, prefix) in [
        ("(a) 8 x 2048 new", 8u32, 2048u32, 0u32),
        ("(b) 8 x 512 after 4096", 8, 512, 4096),
    ] {
        for dtype in [DType::F16, DType::Bf16] {
            for gpu in &GPUS {
                match prefill_model(gpu, dtype, seqs, new, prefix, regs, loops) {
                    Ok(m) => {
                        let frac = m.tflops / m.ceiling_tflops;
                        println!(
                            "| {label} | {dtype} | {} | {} | {:.0} / {:.0} | {:.0}% | {:.0}% | {} | {:.0} | {:.0} | {:.0}% |",
                            gpu.name,
                            m.resident,
                            m.instr_per_stage.0,
                            m.instr_per_stage.1,
                            100.0 * m.plain_fraction,
                            100.0 * m.useful_hmma,
                            m.limit,
                            m.tflops,
                            m.ceiling_tflops,
                            100.0 * frac
                        );
                        if gpu.name == "H100 SXM" && prefix == 0 {
                            if frac < 0.40 {
                                failures.push(format!(
                                    "prefill {dtype} (a) on H100 SXM: {:.0}% < 40% of the mma.sync ceiling",
                                    100.0 * frac
                                ));
                            }
                            if m.useful_hmma < 0.95 {
                                failures.push(format!(
                                    "prefill {dtype} on H100 SXM: {:.0}% < 95% useful HMMA",
                                    100.0 * m.useful_hmma
                                ));
                            }
                        }
                    }
                    Err(e) => {
                        println!(
                            "| {label} | {dtype} | {} | not modelled: {e} ||||||||",
                            gpu.name
                        );
                        failures.push(format!("prefill {dtype} {}: {e}", gpu.name));
                    }
                }
            }
        }
    }
    failures
}

/// Prints `all_hold` when `failures` is empty, else the list of issue `issue`'s missed
/// bars.
fn print_bars(failures: &[String], all_hold: &str, issue: u32) {
    if failures.is_empty() {
        println!("{all_hold}");
    } else {
        println!("Bars of issue #{issue} this model misses:");
        println!();
        for f in failures {
            println!("- {f}");
        }
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let enforce = args.iter().any(|a| a == "--enforce");
    let files: Vec<&String> = args.iter().filter(|a| !a.starts_with("--")).collect();
    let [report, loops_file] = files[..] else {
        eprintln!("usage: decode_model REPORT LOOPS [--enforce]");
        return ExitCode::from(2);
    };
    let read = |f: &str| std::fs::read_to_string(f).map_err(|e| format!("{f}: {e}"));
    let (report, loops_text) = match (read(report), read(loops_file)) {
        (Ok(a), Ok(b)) => (a, b),
        (Err(e), _) | (_, Err(e)) => {
            eprintln!("decode_model: {e}");
            return ExitCode::from(2);
        }
    };
    // The ptxas table: | arch | kernel | registers | ...
    let mut regs = HashMap::new();
    for line in report.lines() {
        let cols: Vec<&str> = line.split('|').map(str::trim).collect();
        if cols.len() > 4
            && cols[1].starts_with("sm_")
            && let Ok(r) = cols[3].parse::<u32>()
        {
            regs.insert((cols[1].to_string(), cols[2].to_string()), r);
        }
    }
    let loops: Vec<Loop> = loops_text
        .lines()
        .map(|l| {
            l.split_whitespace()
                .filter_map(|kv| kv.split_once('='))
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        })
        .collect();

    println!(
        "\n## Decode: modelled fraction of peak DRAM bandwidth (a model from the SASS, not a measurement)\n\n\
         Written by `scripts/validate-ptx.sh` (`scripts/decode-model.py` reads each decode kernel's \
         steady-state loop from the SASS; `examples/decode_model.rs` applies the bounds its docs \
         define). Shapes: 32:8 heads, head_dim 128, block 16, q f16 (bf16 for the bf16 cache); \
         the split plan is the library's for each GPU. Clocks: sustained {:.3} GHz on H100/H200, \
         {:.2} GHz on A100; the boost column rescales the clock-bound time to {:.2} GHz. \
         `instr/B`: issued warp-instructions per K/V byte in the loop; `limit`: the slowest bound. \
         Bounds assume warp-uniform branches, 800 ns DRAM latency, {} stages in flight on CUDA \
         cores and {} on tensor cores.\n",
        GPUS[1].clock_ghz,
        GPUS[0].clock_ghz,
        GPUS[1].boost_ghz,
        STAGES - 1,
        MMA_STAGES - 1
    );
    println!(
        "| shape | cache | GPU | plan | CTAs/SM (busiest, resident) | instr/B | DRAM µs | issue µs | chain µs | latency µs | MUFU/SHFL/LDS µs | reduce µs | limit | % of peak | % at boost |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    let mut failures = Vec::new();
    for (num_seqs, ctx) in [(64u32, 4096u32), (1, 32768)] {
        for kv in [DType::F16, DType::Bf16, DType::E4m3] {
            for gpu in &GPUS {
                let m = match model(gpu, kv, num_seqs, ctx, &regs, &loops) {
                    Ok(m) => m,
                    Err(e) => {
                        println!(
                            "| batch {num_seqs}, ctx {ctx} | {kv} | {} | not modelled: {e} |||||||||||",
                            gpu.name
                        );
                        if gpu.arch == "sm_90" {
                            failures.push(format!("{} {kv} batch {num_seqs}: {e}", gpu.name));
                        }
                        continue;
                    }
                };
                let us = |s: f64| s * 1e6;
                let b = |k: &str| m.bounds.iter().find(|b| b.0 == k).map_or(0.0, |b| b.1);
                let frac = m.fraction(gpu);
                // At boost, every clock-bound term shrinks; DRAM and latency do not.
                let boost = {
                    let f = gpu.clock_ghz / gpu.boost_ghz;
                    let t = m
                        .bounds
                        .iter()
                        .map(|(k, t)| {
                            if matches!(*k, "DRAM" | "latency") {
                                *t
                            } else {
                                t * f
                            }
                        })
                        .fold(0.0, f64::max);
                    m.bytes as f64 / (t + m.reduce_s * f) / (gpu.peak_tb_s * 1e12)
                };
                println!(
                    "| batch {num_seqs}, ctx {ctx} | {kv} | {} | {} | {}, {} | {:.3} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1}/{:.1}/{:.1} | {:.1} | {} | {:.0}% | {:.0}% |",
                    gpu.name,
                    m.plan,
                    m.per_sm,
                    m.resident,
                    m.instr_per_byte,
                    us(b("DRAM")),
                    us(b("issue")),
                    us(b("chain")),
                    us(b("latency")),
                    us(b("MUFU")),
                    us(b("SHFL")),
                    us(b("LDS")),
                    us(m.reduce_s),
                    m.limit(),
                    100.0 * frac,
                    100.0 * boost
                );
                let bar = match (num_seqs, kv, gpu.name) {
                    (64, DType::F16 | DType::Bf16, "H100 SXM" | "H200") => Some(0.85),
                    (64, DType::E4m3, "H100 SXM") => Some(0.80),
                    (64, DType::E4m3, "H200") => Some(0.70),
                    (1, DType::F16, "H100 SXM" | "H200") => Some(0.75),
                    _ => None,
                };
                if let Some(bar) = bar
                    && frac < bar
                {
                    failures.push(format!(
                        "{} {kv} batch {num_seqs} ctx {ctx}: {:.0}% < {:.0}%",
                        gpu.name,
                        100.0 * frac,
                        100.0 * bar
                    ));
                }
                if m.reduce_s > 3e-6 && gpu.arch == "sm_90" {
                    failures.push(format!(
                        "{} {kv} batch {num_seqs}: reduce {:.1} µs > 3 µs",
                        gpu.name,
                        us(m.reduce_s)
                    ));
                }
            }
        }
    }
    println!(
        "\n`reduce µs` is the reduce kernel's own time. Its launch (a second kernel after \
         decode) is reported apart and not added: the gap between the two kernels (wider \
         launched one by one than inside a CUDA graph) is the driver's and the GPU's, \
         which this model does not know; the kernels benchmark (`scripts/gpu-check.sh`) \
         times a decode call, its reduce included, on a GPU."
    );
    println!();
    print_bars(&failures, "Every bar of issue #29 holds in this model.", 29);
    let prefill_failures = prefill_report(&regs, &loops);
    println!();
    print_bars(
        &prefill_failures,
        "Every bar of issue #30 this model checks holds.",
        30,
    );
    let missed = failures.len() + prefill_failures.len();
    if enforce && missed > 0 {
        eprintln!("decode_model: {missed} bar(s) missed (see ptx/resources.md)");
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}

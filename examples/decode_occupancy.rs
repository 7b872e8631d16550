//! The decode kernel's occupancy and bytes-in-flight model at the flagship shapes, as a
//! Markdown table: `scripts/validate-ptx.sh` runs it with the register counts ptxas
//! reported and appends the table to `ptx/resources.md`.
//!
//! ```sh
//! cargo run -q --example decode_occupancy -- sm_80=78 sm_90=74
//! ```
//! Exits with status 1 when the model keeps fewer than 32 KiB in flight per SM at
//! batch 64 / context 4096 / 32:8 heads / head_dim 128 / f16 / block 16 on an H100.

use std::process::ExitCode;

use pagedkv::host::DType;
use pagedkv::host::ops::attention::{
    DecodeShape, SmLimits, decode_blocks_per_sm_at, decode_bytes_in_flight, geometry, plan,
};

/// A GPU of the table: name, architecture, SM count, limits.
struct Gpu {
    name: &'static str,
    arch: &'static str,
    sms: u32,
    limits: SmLimits,
}

const GPUS: [Gpu; 3] = [
    Gpu {
        name: "A100",
        arch: "sm_80",
        sms: 108,
        limits: SmLimits::SM_80,
    },
    Gpu {
        name: "H100",
        arch: "sm_90",
        sms: 132,
        limits: SmLimits::SM_90,
    },
    Gpu {
        name: "H200",
        arch: "sm_90",
        sms: 132,
        limits: SmLimits::SM_90,
    },
];

/// Least bytes in flight per SM the flagship shape must keep (the issue's bar).
const MIN_IN_FLIGHT: u32 = 32 * 1024;

fn main() -> ExitCode {
    let mut regs: Vec<(String, u32)> = Vec::new();
    for a in std::env::args().skip(1) {
        match a
            .split_once('=')
            .map(|(k, v)| (k.to_string(), v.parse::<u32>()))
        {
            Some((k, Ok(v))) => regs.push((k, v)),
            _ => {
                eprintln!("decode_occupancy: expected ARCH=REGISTERS, got `{a}`");
                return ExitCode::from(2);
            }
        }
    }
    let shape = |num_seqs| DecodeShape {
        num_seqs,
        num_q_heads: 32,
        num_kv_heads: 8,
        head_dim: 128,
        block_size: 16,
        num_blocks: 1 << 16,
        max_blocks_per_seq: 2048,
    };
    let dtype = DType::F16;
    let g = geometry(128, dtype);
    println!(
        "\n## Decode occupancy and bytes in flight (a model, not a measurement)\n\n\
         Written by `scripts/validate-ptx.sh` (`examples/decode_occupancy.rs`) for 32:8 heads, \
         head_dim 128, f16, block 16: {} threads, {} stages of {} tokens ({} B of K and V \
         each, all but one in flight), {} B of shared memory per block. blocks/SM = min(registers, threads, \
         shared memory, 32); in flight per SM = blocks/SM x (stages - 1) x stage bytes.\n",
        pagedkv::kernels::kernels::attention::THREADS,
        pagedkv::kernels::kernels::attention::STAGES,
        g.stage_tokens,
        4 * g.stage_words(),
        g.shared_bytes()
    );
    println!(
        "| GPU | arch | registers | blocks/SM | warps/SM | KiB in flight/SM | batch 64, ctx 4096: partitions | batch 1, ctx 32768: partitions |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    let mut ok = true;
    for gpu in &GPUS {
        let Some(&(_, r)) = regs.iter().find(|(a, _)| a == gpu.arch) else {
            eprintln!("decode_occupancy: no register count for {}", gpu.arch);
            return ExitCode::from(2);
        };
        let blocks = decode_blocks_per_sm_at(r, 128, dtype, &gpu.limits);
        let bytes = decode_bytes_in_flight(blocks, 128, dtype);
        let p64 = plan(&shape(64), dtype, 4096, gpu.sms);
        let p1 = plan(&shape(1), dtype, 32768, gpu.sms);
        println!(
            "| {} | {} | {r} | {blocks} | {} | {:.0} | {} | {} |",
            gpu.name,
            gpu.arch,
            blocks * 4,
            bytes as f64 / 1024.0,
            p64.num_partitions,
            p1.num_partitions
        );
        if gpu.name == "H100" && bytes < MIN_IN_FLIGHT {
            eprintln!(
                "decode_occupancy: {} KiB in flight per SM on an H100 at the flagship shape (< 32 KiB)",
                bytes / 1024
            );
            ok = false;
        }
    }
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

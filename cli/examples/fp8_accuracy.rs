//! End-to-end decode error of fp8 KV caches (e4m3, e5m2; per-KV-head and per-tensor
//! scales) vs f16 and bf16 caches, against exact f64 attention over the original K/V:
//! docs/fp8.md's accuracy table.
//!
//! ```sh
//! cargo run --release --example fp8_accuracy [-- --seed N] [-- --json PATH]
//! ```
//! Runs the real `kv_append` and decode kernels in the emulator (exact math) at head_dim
//! 128, 8 KV heads, GQA group 4, block 16, 4 sequences of 900–1100 tokens over a
//! shuffled pool, on three data sets (see [`pagedkv_cli::accuracy`]): standard normal
//! q/K/V, and the same with channel 0 of KV head 0's K and V 100x, and 10^4x, the rest. Prints progress to
//! stderr and a Markdown table to stdout; `--json PATH` also writes the numbers.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use clap::Parser;
use pagedkv::host::emulator::Emulator;
use pagedkv_cli::accuracy::{CONFIGS, Config, Data, Errors, Problem, Setup, measure};
use serde::Serialize;

/// Command line.
#[derive(Parser)]
#[command(about = "End-to-end decode error of fp8 vs 16-bit KV caches (emulator)")]
struct Args {
    /// Seed of the data and of the pool's shuffle.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// One row of the table.
#[derive(Serialize)]
struct Row {
    data: Data,
    config: Config,
    errors: Errors,
}

/// The JSON report.
#[derive(Serialize)]
struct Report<'a> {
    setup: &'a Setup,
    rows: &'a [Row],
}

/// The data sets: random, the issue's 100x outlier channel, and a 10^4x one, past
/// e4m3's dynamic range (2^-6..448 at full precision) for the heads without outliers
/// under one per-tensor scale.
const DATA: [Data; 3] = [
    Data::Random,
    Data::Outliers { factor: 100.0 },
    Data::Outliers { factor: 1e4 },
];

fn main() -> ExitCode {
    let args = Args::parse();
    let setup = Setup::readme(args.seed);
    let emu = Emulator::new();
    let mut rows = Vec::new();
    for data in DATA {
        let problem = Problem::generate(&setup, data);
        for config in CONFIGS {
            let start = Instant::now();
            let errors = match measure(&emu, &problem, config) {
                Ok(e) => e,
                Err(e) => {
                    eprintln!("fp8_accuracy: {data}, {config}: {e}");
                    return ExitCode::FAILURE;
                }
            };
            eprintln!(
                "{data}, {config}: rel L2 {:.3e} ({:.1} s)",
                errors.rel_l2,
                start.elapsed().as_secs_f64()
            );
            rows.push(Row {
                data,
                config,
                errors,
            });
        }
    }

    println!(
        "head_dim {}, {} KV heads, GQA group {}, block {}, contexts {:?}, seed {}\n",
        setup.head_dim,
        setup.num_kv_heads,
        setup.group,
        setup.block_size,
        setup.context_lens,
        setup.seed
    );
    println!(
        "| data | cache | q | scales | rel L2 | rel L2, KV head 0 | rel L2, KV heads 1-{} | max abs | kernel vs stored cache |",
        setup.num_kv_heads - 1
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for Row {
        data,
        config,
        errors: e,
    } in &rows
    {
        println!(
            "| {data} | {} | {} | {} | {:.2e} | {:.2e} | {:.2e} | {:.2e} | {:.1e} |",
            config.cache,
            config.q,
            config.scaling.label(),
            e.rel_l2,
            e.rel_l2_head0,
            e.rel_l2_other_heads,
            e.max_abs,
            e.kernel_rel_l2
        );
    }

    if let Some(path) = args.json {
        let json = serde_json::to_vec_pretty(&Report {
            setup: &setup,
            rows: &rows,
        })
        .expect("the report serialises");
        if let Err(e) = pagedkv_cli::output::write_all(&[(path, json)]) {
            eprintln!("fp8_accuracy: {e}");
            return ExitCode::FAILURE;
        }
    }
    ExitCode::SUCCESS
}

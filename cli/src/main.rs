//! `pagedkv`: simulate LLM serving under paged and contiguous KV memory
//! (`pagedkv simulate`, the default), or run real decode over the paged cache
//! (`pagedkv run`).

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};

use pagedkv_cli::sim::{
    GpuSpec, KvDtype, ModelSpec, Policy, PrefillModel, ScenarioReport, SimConfig, SimError,
    SweepConfig, SweepReport, Workload, WorkloadKind, check_range, limits, run_scenario_kv_dtypes,
    sweep,
};
use pagedkv_cli::tiny::{Backend, RunConfig};

/// Writes to stdout, returning the error instead of panicking as `print!` does: a reader that stops early (`pagedkv simulate | head -3`) closes
/// the pipe, and the run then ends quietly (see `main`).
macro_rules! out {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        write!(std::io::stdout().lock(), $($t)*)?
    }};
}

/// [`out!`] with a newline.
macro_rules! outln {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        writeln!(std::io::stdout().lock(), $($t)*)?
    }};
}

#[derive(Parser)]
#[command(
    name = "pagedkv",
    version,
    about = "Paged KV-cache backend for LLM serving: simulate serving, or run decode over the paged cache"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Option<Cmd>,
}

#[derive(Subcommand)]
enum Cmd {
    /// Simulate a server under paged and contiguous KV memory (the default command).
    Simulate(Box<SimArgs>),
    /// Decode a small random transformer through pagedkv's kernels over the paged cache.
    Run(RunArgs),
}

#[derive(Args, Default)]
struct SimArgs {
    /// GPU preset: a100-40gb, h100, h200 (default: a100-40gb, or h100 for the models
    /// whose weights need it: llama-3-70b, gemma-3-27b, gpt-oss-120b).
    #[arg(long)]
    gpu: Option<String>,
    /// Override the GPU's memory bandwidth, GB/s.
    #[arg(long)]
    bandwidth_gbs: Option<f64>,
    /// Override the GPU's memory, GiB.
    #[arg(long)]
    memory_gib: Option<f64>,
    /// Model preset (opt-13b, llama-3-8b, llama-3-70b; hybrid window + full models:
    /// gemma-3-27b, gemma-3-1b, gpt-oss-120b) or a JSON config file.
    #[arg(long, default_value = "opt-13b")]
    model: String,
    /// Synthetic workload: sharegpt or alpaca (default: both of the paper's scenarios).
    #[arg(long, conflicts_with = "trace")]
    workload: Option<String>,
    /// Arrival rate, requests/s (default: 2 for sharegpt, 30 for alpaca).
    #[arg(long, conflicts_with_all = ["trace", "sweep"])]
    rate: Option<f64>,
    /// Requests to simulate (synthetic workloads; 1 to 1000000; with --sweep, at each
    /// rate; default 2000 for sharegpt, 6000 for alpaca with --sweep, else 1000 with
    /// --workload).
    #[arg(long, conflicts_with = "trace")]
    num_requests: Option<usize>,
    /// A JSONL trace: {"arrival_s": …, "prompt_len": …, "output_len": …} per line.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Random seed of the synthetic workload.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// KV-cache budget, GiB (default: 90% of GPU memory minus the weights).
    #[arg(long)]
    kv_budget_gib: Option<f64>,
    /// Draw the KV memory split per policy (the vLLM paper's Fig. 2 form) and the batch
    /// size over time to this SVG file; with --sweep, normalised latency against request
    /// rate per policy (the Fig. 12 form).
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Write the report as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// KV-cache dtype: f16 (the model's own, default) or fp8 (1 byte per element; e4m3
    /// and e5m2 are aliases). fp8 runs every scenario twice, the cache at f16 and at fp8 on
    /// the same GPU and budget, and reports token slots, batch sizes and throughput side
    /// by side.
    #[arg(long, default_value = "f16")]
    kv_dtype: String,
    /// Tokens of a system prompt every request begins with (default 0: none): every
    /// policy serves the longer prompts, the paged ones cache the shared blocks, and the
    /// report adds the K/V bytes a decode step reads with and without cascade
    /// attention (a model).
    #[arg(long)]
    system_prompt: Option<u32>,
    /// How a step with prompt tokens is priced: separate (default: a prefill pass, then
    /// the decodes, which wait, as the paper's 2023 systems ran) or mixed (one pass over
    /// prompt and decode tokens, as chunked prefill batches them).
    #[arg(long, default_value = "separate")]
    prefill: String,
    /// The paper's Fig. 12: serve the workload (default: sharegpt and alpaca) at a range
    /// of request rates under contiguous Max, Pow2, Oracle and paged (block 16), report
    /// each rate's mean normalised latency (latency / output tokens), throughput, batch
    /// and preemptions, each policy's highest rate within the latency bound, and the
    /// ratios paged / Oracle and paged / Max next to the paper's.
    #[arg(long, conflicts_with = "trace")]
    sweep: bool,
    /// With --sweep: the request rates, req/s, comma-separated (default: chosen around
    /// the paged policy's saturated throughput to bracket every policy's knee).
    #[arg(long, requires = "sweep", value_delimiter = ',')]
    rates: Option<Vec<f64>>,
    /// With --sweep: the bound on mean normalised latency, s/token (default: twice the
    /// paged policy's at the lowest rate).
    #[arg(long, requires = "sweep")]
    latency_bound: Option<f64>,
}

#[derive(Args)]
struct RunArgs {
    /// cpu (kernels in the SIMT emulator) or cuda.
    #[arg(long, default_value = "cpu")]
    backend: String,
    /// Requests to decode (1 to 4096).
    #[arg(long, default_value_t = 12)]
    requests: usize,
    /// Tokens to generate per request (1 to 217: the first comes from the prefill, and
    /// prompts of up to 39 tokens plus the output must fit the model's 256).
    #[arg(long, default_value_t = 24)]
    max_tokens: u32,
    /// Random seed (weights and prompts).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Tokens the scheduler may put in one step (at least --requests); a prompt longer
    /// than what a step has left is prefilled in chunks.
    #[arg(long, default_value_t = 2048)]
    step_tokens: u32,
    /// Also serve the same requests without a KV cache (every step recomputes every
    /// token's K/V: the O(n²) way) and print both times and their ratio.
    #[arg(long)]
    no_cache: bool,
    /// With --no-cache: write an SVG of time per step against sequence length, both ways.
    #[arg(long, requires = "no_cache")]
    plot: Option<PathBuf>,
    /// Speculative decoding: every decoding sequence verifies up to K draft tokens a
    /// step from a toy draft (the model with perturbed weights). Prints the acceptance
    /// rate and tokens per step, then serves the same requests without drafts and
    /// checks the outputs are the same greedy tokens wherever the logit margin exceeds
    /// the numerical error bound (1 to 16).
    #[arg(long, conflicts_with = "no_cache")]
    spec: Option<u32>,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.cmd {
        None => simulate(SimArgs {
            model: "opt-13b".into(),
            kv_dtype: "f16".into(),
            prefill: "separate".into(),
            ..SimArgs::default()
        }),
        Some(Cmd::Simulate(a)) => simulate(*a),
        Some(Cmd::Run(a)) => run(a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        // The reader closed stdout (`| head`): what it wanted was written.
        Err(e)
            if e.downcast_ref::<std::io::Error>()
                .is_some_and(|e| e.kind() == std::io::ErrorKind::BrokenPipe) =>
        {
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("pagedkv: error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(a: RunArgs) -> Result<(), Box<dyn std::error::Error>> {
    // Before the run: a bad output path is an error now, not after it.
    pagedkv_cli::output::check_paths(&a.plot.iter().cloned().collect::<Vec<_>>())?;
    let backend = match a.backend.as_str() {
        "cpu" => Backend::Cpu,
        "cuda" => Backend::Cuda,
        other => return Err(format!("--backend: unknown backend `{other}` (cpu or cuda)").into()),
    };
    let cfg = RunConfig {
        backend,
        num_requests: a.requests,
        max_tokens: a.max_tokens,
        seed: a.seed,
        step_tokens: a.step_tokens,
        spec: match a.spec {
            Some(0) => return Err("--spec: 0 draft tokens (1 to 16; leave it out for none)".into()),
            Some(k) => k,
            None => 0,
        },
        ..RunConfig::default()
    };
    let report = pagedkv_cli::tiny::run(&cfg, &mut |line| eprintln!("{line}"))?;
    outln!("{report}");
    if !report.verified() {
        return Err("verification against dense attention failed".into());
    }
    if cfg.spec > 0 {
        eprintln!("the same requests without drafts (plain greedy decoding):");
        let plain_cfg = RunConfig {
            spec: 0,
            ..cfg.clone()
        };
        let plain = pagedkv_cli::tiny::run(&plain_cfg, &mut |line| eprintln!("{line}"))?;
        if !plain.verified() {
            return Err("verification of the run without drafts failed".into());
        }
        let m = pagedkv_cli::tiny::compare_greedy(&report, &plain);
        outln!(
            "without drafts: {} tokens in {} steps, {:.3} s; with --spec {}: {} steps ({:.2}x fewer)",
            plain.tokens,
            plain.steps,
            plain.seconds,
            cfg.spec,
            report.steps,
            plain.steps as f64 / report.steps.max(1) as f64
        );
        outln!(
            "greedy outputs: {} of {} requests identical; {} diverge where the relative logit margin is within the error bound {:.1e} (4x the worst measured attention error): {:?}",
            m.identical,
            m.requests,
            m.explained.len(),
            m.bound,
            m.explained
        );
        if !m.holds() {
            return Err(format!(
                "speculative decoding changed greedy tokens beyond the error bound: {:?}",
                m.unexplained
            )
            .into());
        }
    }
    if a.no_cache {
        eprintln!("the same requests without a KV cache (every step recomputes every token):");
        let slow = pagedkv_cli::tiny::run_without_cache(&cfg, &mut |line| eprintln!("{line}"))?;
        outln!("without a cache: {slow}");
        if !slow.verified() {
            return Err("verification of the run without a cache failed".into());
        }
        let same = report
            .outputs
            .iter()
            .filter(|(id, t)| slow.outputs.get(id) == Some(t))
            .count();
        outln!(
            "with the cache {:.3} s, without {:.3} s: {:.1}x faster with the cache; {same} of {} requests generated the same tokens both ways",
            report.seconds,
            slow.seconds,
            slow.seconds / report.seconds.max(1e-9),
            report.outputs.len()
        );
        if let Some(p) = &a.plot {
            let svg = pagedkv_cli::tiny::render_step_times(&report, &slow)?;
            pagedkv_cli::output::write_all(&[(p.clone(), svg.into_bytes())])?;
            outln!("wrote {}", p.display());
        }
    }
    Ok(())
}

/// `pagedkv simulate --sweep`: the Fig. 12 sweep of each workload.
fn simulate_sweep(a: &SimArgs, cfg: &SimConfig) -> Result<(), Box<dyn std::error::Error>> {
    let kinds = match &a.workload {
        Some(w) => vec![WorkloadKind::parse(w)?],
        None => vec![WorkloadKind::ShareGpt, WorkloadKind::Alpaca],
    };
    let bar = if std::io::stderr().is_terminal() {
        let b = ProgressBar::new_spinner();
        b.set_style(
            ProgressStyle::with_template("{spinner} {pos} runs: {msg} ({elapsed})")
                .expect("template"),
        );
        b
    } else {
        ProgressBar::hidden()
    };
    let started = std::time::Instant::now();
    let mut reports: Vec<SweepReport> = Vec::new();
    for kind in kinds {
        let mut sc = SweepConfig::new(kind);
        sc.seed = a.seed;
        sc.num_requests = a.num_requests.unwrap_or(sc.num_requests);
        sc.rates = a.rates.clone();
        sc.latency_bound = a.latency_bound;
        let r = sweep(cfg, &sc, &mut |what| {
            bar.set_message(what.to_string());
            bar.inc(1);
        })?;
        reports.push(r);
    }
    let runs = bar.position();
    bar.finish_and_clear();
    for r in &reports {
        out!("{}", r.to_table());
    }
    outln!(
        "\n{runs} simulations in {:.1} s. Normalised latency: mean over requests of end-to-end latency / output tokens (the paper's). Step time: roofline (weights + KV read at 80% of {:.0} GB/s, 50% of {:.0} TFLOP/s, +5 ms/step), prefill {}.",
        started.elapsed().as_secs_f64(),
        cfg.gpu.bandwidth_gbs,
        cfg.gpu.tflops,
        cfg.prefill.name()
    );
    write_outputs(a, &reports, || {
        pagedkv_cli::plot::render_sweep_svg(&reports)
    })
}

/// Writes `--json` (`reports`) and `--plot` (`svg()`), last: every output is produced
/// and staged before any is committed (a plot that fails leaves no JSON behind).
fn write_outputs(
    a: &SimArgs,
    reports: &impl serde::Serialize,
    svg: impl FnOnce() -> Result<String, Box<dyn std::error::Error>>,
) -> Result<(), Box<dyn std::error::Error>> {
    let mut outputs = Vec::new();
    if let Some(p) = &a.json {
        outputs.push((
            p.clone(),
            serde_json::to_string_pretty(reports)?.into_bytes(),
        ));
    }
    if let Some(p) = &a.plot {
        outputs.push((p.clone(), svg()?.into_bytes()));
    }
    for p in pagedkv_cli::output::write_all(&outputs)? {
        outln!("wrote {}", p.display());
    }
    Ok(())
}

fn simulate(a: SimArgs) -> Result<(), Box<dyn std::error::Error>> {
    // Before the run: a folder, a path named twice or a missing folder is an error now,
    // not after the whole simulation.
    let outputs: Vec<PathBuf> = a.json.iter().chain(&a.plot).cloned().collect();
    pagedkv_cli::output::check_paths(&outputs)?;
    let model = if a.model.ends_with(".json") || Path::new(&a.model).is_file() {
        ModelSpec::from_json_file(Path::new(&a.model))?
    } else {
        ModelSpec::preset(&a.model)?
    };
    let mut gpu = GpuSpec::preset(a.gpu.as_deref().unwrap_or(model.default_gpu()))?;
    if let Some(b) = a.bandwidth_gbs {
        gpu.bandwidth_gbs = check_range("--bandwidth-gbs", b, limits::BANDWIDTH_GBS)?;
        gpu.name = format!("{} ({b} GB/s)", gpu.name);
    }
    if let Some(m) = a.memory_gib {
        gpu.memory_gib = check_range("--memory-gib", m, limits::MEMORY_GIB)?;
        gpu.name = format!("{} ({m} GiB)", gpu.name);
    }
    if let Some(r) = a.rate {
        check_range("--rate", r, limits::RATE)?;
    }
    let kv_dtype = KvDtype::parse(&a.kv_dtype)?;
    let mut cfg = SimConfig::new(gpu, model);
    cfg.prefill = PrefillModel::parse(&a.prefill)?;
    if let Some(g) = a.kv_budget_gib {
        cfg.kv_budget_gib = Some(check_range("--kv-budget-gib", g, limits::KV_BUDGET_GIB)?);
    }
    cfg.capacity_tokens()?;
    if let Some(n) = a.system_prompt {
        if n >= cfg.model.max_model_len {
            return Err(SimError(format!(
                "--system-prompt: {n} tokens leave no room in the model's {} (at most {})",
                cfg.model.max_model_len,
                cfg.model.max_model_len - 1
            ))
            .into());
        }
        cfg.system_prompt = n;
    }
    // The compared dtype's slots must fit the simulator too (fp8: twice as many).
    let mut compared = cfg.clone();
    compared.kv_dtype = kv_dtype;
    compared.capacity_tokens()?;
    if a.sweep {
        // A sweep serves the cache at the dtype asked for.
        return simulate_sweep(&a, &compared);
    }
    let runs = if kv_dtype == KvDtype::F16 { 1 } else { 2 };
    let max_len = cfg.model.max_model_len;

    // The scenarios: a trace, one synthetic workload, or the paper's two.
    let mut scenarios: Vec<(Workload, Option<(WorkloadKind, f64)>)> = Vec::new();
    if let Some(t) = &a.trace {
        scenarios.push((Workload::from_trace(t, max_len)?, None));
    } else if let Some(w) = &a.workload {
        let kind = WorkloadKind::parse(w)?;
        let rate = a.rate.unwrap_or(match kind {
            WorkloadKind::ShareGpt => 2.0,
            WorkloadKind::Alpaca => 30.0,
        });
        let n = a.num_requests.unwrap_or(1000);
        scenarios.push((
            Workload::synthetic(kind, rate, n, max_len, a.seed)?,
            Some((kind, rate)),
        ));
    } else {
        if a.rate.is_some() || a.num_requests.is_some() {
            return Err(SimError("--rate and --num-requests need --workload".into()).into());
        }
        for (kind, rate, n) in [
            (WorkloadKind::ShareGpt, 2.0, 2000),
            (WorkloadKind::Alpaca, 30.0, 6000),
        ] {
            scenarios.push((
                Workload::synthetic(kind, rate, n, max_len, a.seed)?,
                Some((kind, rate)),
            ));
        }
    }

    // (A hybrid model runs its paged policies a second time, every layer full.)
    let paged = Policy::ALL
        .iter()
        .filter(|p| matches!(p, Policy::Paged(_)))
        .count();
    let per_run = Policy::ALL.len() + if cfg.model.is_hybrid() { paged } else { 0 };
    let total: u64 = scenarios
        .iter()
        .map(|(w, _)| (w.requests.len() * per_run * runs) as u64)
        .sum();
    let bar = if std::io::stderr().is_terminal() {
        let b = ProgressBar::new(total);
        b.set_style(
            ProgressStyle::with_template("{msg:>20} [{bar:40}] {pos}/{len} requests ({eta})")
                .expect("template")
                .progress_chars("=> "),
        );
        b
    } else {
        ProgressBar::hidden()
    };
    if cfg.system_prompt > 0 {
        for (w, _) in &mut scenarios {
            *w = w.with_system_prompt(cfg.system_prompt, max_len);
        }
    }
    let mut reports: Vec<ScenarioReport> = Vec::new();
    for (w, kr) in &scenarios {
        bar.set_message(kr.map_or("trace".to_string(), |(k, _)| k.name().to_string()));
        let r = run_scenario_kv_dtypes(w, *kr, &cfg, &Policy::ALL, kv_dtype, &mut || bar.inc(1))?;
        reports.push(r);
    }
    bar.finish_and_clear();

    for r in &reports {
        out!("{}", r.to_table());
    }
    outln!(
        "\ncolumns: tokens/future/intfrag/ext+free = share of the KV pool holding token states, reserved for future tokens, internally fragmented, unreserved (time-weighted);\n\
         tok/rsv = token states / slots held by requests; paper = Fig. 2 token states (vLLM bar for paged: share of held memory; Orca bars for contiguous: share of the pool), ratio = ours/paper;\n\
         paperB = Fig. 13 mean batch (OPT-13B, A100, same scenario), ratioB = ours/paper. Step time: roofline (weights + KV read at 80% of {:.0} GB/s, 50% of {:.0} TFLOP/s, +5 ms/step), prefill {}.",
        cfg.gpu.bandwidth_gbs,
        cfg.gpu.tflops,
        cfg.prefill.name()
    );
    if let Some(c) = reports.first().and_then(|r| r.kv_dtype_comparison.as_ref()) {
        outln!(
            "{d} vs {b}: the same scenario with the KV cache at {d} ({} byte{} per element) and at {b}; same budget, so more token slots; \
             a step reads {d}'s fewer KV bytes, the weights unchanged (modelled: step-time roofline and admission, not measured).\n\
             Where arrivals, not memory, bound a policy, {d}'s shorter steps finish requests sooner and its mean batch can be smaller at the same req/s.",
            c.kv_footprint.dtype_bytes,
            if c.kv_footprint.dtype_bytes == 1 {
                ""
            } else {
                "s"
            },
            d = c.kv_dtype,
            b = c.baseline_dtype,
        );
    }

    write_outputs(&a, &reports, || pagedkv_cli::plot::render_svg(&reports))
}

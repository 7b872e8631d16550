//! The `pagedkv` binary, run as a user would: the default report, `run`, and every kind
//! of bad input (a clear error naming the line or flag, a non-zero exit, no partial
//! output file).

use std::path::PathBuf;
use std::process::{Command, Output};

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_pagedkv"))
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("pagedkv-cli-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d.join(name)
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn fails_with(args: &[&str], want: &str) {
    let o = bin().args(args).output().unwrap();
    assert!(!o.status.success(), "{args:?} succeeded");
    let e = stderr(&o);
    assert!(
        e.contains(want),
        "{args:?}: stderr does not mention `{want}`:\n{e}"
    );
}

#[test]
fn no_arguments_prints_the_simulate_report_for_both_paper_scenarios() {
    let o = bin().output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    for want in [
        "ShareGPT",
        "Alpaca",
        "contiguous Max",
        "contiguous Pow2",
        "contiguous Oracle",
        "paged (block 8)",
        "paged (block 16)",
        "paged (block 32)",
        "Fig. 13",
    ] {
        assert!(out.contains(want), "missing `{want}` in:\n{out}");
    }
}

/// `--sweep` prints the Fig. 12 table with the ratios next to the paper's and writes
/// every point as JSON and the Fig. 12 figure as SVG.
#[test]
fn a_sweep_prints_its_table_and_writes_json_and_svg() {
    let (json, svg) = (tmp("sweep.json"), tmp("sweep.svg"));
    let o = bin()
        .args([
            "simulate",
            "--sweep",
            "--workload",
            "sharegpt",
            "--num-requests",
            "200",
            "--json",
        ])
        .arg(&json)
        .arg("--plot")
        .arg(&svg)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    for want in [
        "Fig. 12 sweep",
        "latency bound",
        "paged / Oracle",
        "paged / Max",
        "paper, Fig. 12(a)",
        "prefill separate",
    ] {
        assert!(out.contains(want), "missing `{want}` in:\n{out}");
    }
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let reports = v.as_array().unwrap();
    assert_eq!(reports.len(), 1);
    assert_eq!(reports[0]["policies"].as_array().unwrap().len(), 4);
    assert!(reports[0]["paged_over_oracle"].as_f64().unwrap() > 1.0);
    let figure = std::fs::read_to_string(&svg).unwrap();
    assert!(
        figure.starts_with("<svg"),
        "{}",
        &figure[..figure.len().min(80)]
    );
    assert!(figure.contains("normalised latency (s/token)"));
}

#[test]
fn a_trace_run_writes_json_and_svg() {
    let trace = small_trace("ok.jsonl");
    let (json, svg) = (tmp("ok.json"), tmp("ok.svg"));
    let o = bin()
        .args(["simulate", "--trace"])
        .arg(&trace)
        .arg("--json")
        .arg(&json)
        .arg("--plot")
        .arg(&svg)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let policies = v[0]["policies"].as_array().unwrap();
    assert_eq!(policies.len(), 6);
    for p in policies {
        assert_eq!(p["completed"], 60, "{p}");
    }
    // The figure: Fig. 2's stacked bars and the batch over time, per policy.
    let svg = std::fs::read_to_string(&svg).unwrap();
    assert!(svg.contains("<svg"));
    for want in [
        "where the KV memory goes",
        "token states",
        "reserved for future tokens",
        "internal fragmentation",
        "external fragmentation + free",
        "token-state share (Fig. 2)",
        "paper 20.4%",
        "paper 96.3%",
        "batch size over time",
        "contiguous Max",
        "contiguous Pow2",
        "contiguous Oracle",
        "paged (block 8)",
        "paged (block 16)",
        "paged (block 32)",
    ] {
        assert!(svg.contains(want), "no `{want}` in the SVG");
    }
    assert!(
        !svg.contains("KV memory held"),
        "the old memory panel is back"
    );
}

/// A 60-request trace that simulates in a blink.
fn small_trace(name: &str) -> PathBuf {
    let trace = tmp(name);
    let lines: Vec<String> = (0..60)
        .map(|i| {
            format!(
                "{{\"arrival_s\": {}, \"prompt_len\": {}, \"output_len\": {}}}",
                i as f64 * 0.1,
                20 + i,
                10 + i % 7
            )
        })
        .collect();
    std::fs::write(&trace, lines.join("\n")).unwrap();
    trace
}

#[test]
fn the_report_prices_kv_per_token_and_per_request_in_the_table_and_json() {
    // The models' published shapes (layers, KV heads, head dim; 16-bit cache), and the
    // report's rounding of 2048 and 8192 tokens' bytes.
    let cases = [
        ("opt-13b", 40u64, 40u64, "1.56 GiB", "6.25 GiB", true),
        ("llama-3-8b", 32, 8, "256 MiB", "1.00 GiB", false),
        ("llama-3-70b", 80, 8, "640 MiB", "2.50 GiB", false),
    ];
    let trace = small_trace("kv.jsonl");
    for (model, layers, kv_heads, at_2k, at_8k, beyond) in cases {
        let per_token = 2 * layers * kv_heads * 128 * 2;
        let json = tmp(&format!("kv-{model}.json"));
        let o = bin()
            .args(["simulate", "--model", model, "--kv-budget-gib", "4"])
            .arg("--trace")
            .arg(&trace)
            .arg("--json")
            .arg(&json)
            .output()
            .unwrap();
        assert!(o.status.success(), "{model}: {}", stderr(&o));
        let out = String::from_utf8_lossy(&o.stdout);
        let line = out
            .lines()
            .find(|l| l.starts_with("KV per token: "))
            .unwrap_or_else(|| panic!("{model}: no KV per token line in:\n{out}"));
        let want = format!(
            "KV per token: {per_token} bytes = {} KiB (2 x {layers} layers x {kv_heads} KV heads x 128 x 2 bytes); one request: {at_2k} at 2048 tokens, {at_8k} at 8192 tokens",
            per_token / 1024
        );
        assert!(line.starts_with(&want), "{model}:\n{line}\nwanted\n{want}");
        assert_eq!(
            line.contains("(8192 beyond the model's 2048-token maximum)"),
            beyond,
            "{model}: {line}"
        );
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        let k = &v[0]["kv_footprint"];
        assert_eq!(k["bytes_per_token"], per_token, "{model}: {k}");
        assert_eq!(k["num_layers"], layers, "{model}: {k}");
        assert_eq!(k["num_kv_heads"], kv_heads, "{model}: {k}");
        let per_request = k["per_request"].as_array().unwrap();
        assert_eq!(per_request.len(), 2, "{model}: {k}");
        for (r, tokens) in per_request.iter().zip([2048u64, 8192]) {
            assert_eq!(r["tokens"], tokens, "{model}: {k}");
            assert_eq!(r["bytes"], per_token * tokens, "{model}: {k}");
        }
    }
}

#[test]
fn bad_trace_lines_are_named() {
    let cases = [
        (
            "{\"arrival_s\": 0, \"prompt_len\": 5, \"output_len\": 5}\nnot json\n",
            "trace line 2",
        ),
        (
            "{\"arrival_s\": 0, \"prompt_len\": -5, \"output_len\": 5}\n",
            "trace line 1: prompt_len -5 must be positive",
        ),
        (
            "{\"arrival_s\": 0, \"prompt_len\": 5, \"output_len\": 0}\n",
            "trace line 1: output_len 0 must be positive",
        ),
        (
            "\n{\"arrival_s\": 0, \"prompt_len\": 2000, \"output_len\": 100}\n",
            "trace line 2: 2000 + 100 tokens exceed the model's maximum length 2048",
        ),
        (
            "{\"arrival_s\": -1, \"prompt_len\": 5, \"output_len\": 5}\n",
            "trace line 1: arrival_s -1",
        ),
    ];
    for (i, (text, want)) in cases.iter().enumerate() {
        let trace = tmp(&format!("bad{i}.jsonl"));
        std::fs::write(&trace, text).unwrap();
        let json = tmp(&format!("bad{i}.json"));
        let o = bin()
            .args(["simulate", "--trace"])
            .arg(&trace)
            .arg("--json")
            .arg(&json)
            .output()
            .unwrap();
        assert!(!o.status.success());
        assert!(stderr(&o).contains(want), "{want}: {}", stderr(&o));
        assert!(!json.exists(), "a partial output file was left behind");
    }
}

#[test]
fn bad_flags_are_named() {
    fails_with(
        &["simulate", "--gpu", "v100"],
        "--gpu: unknown preset `v100`",
    );
    fails_with(
        &["simulate", "--model", "gpt-5"],
        "--model: unknown preset `gpt-5`",
    );
    fails_with(
        &["simulate", "--workload", "wiki"],
        "--workload: unknown workload `wiki`",
    );
    fails_with(
        &["simulate", "--workload", "alpaca", "--rate", "0"],
        "--rate: 0 is outside the range",
    );
    fails_with(
        &["simulate", "--workload", "alpaca", "--num-requests", "0"],
        "--num-requests",
    );
    fails_with(
        &["simulate", "--kv-budget-gib", "0.5"],
        "memory budget too small",
    );
    // Weights that do not fit the GPU are named as such, not as a negative budget.
    fails_with(
        &["simulate", "--model", "llama-3-70b", "--gpu", "h100"],
        "the weights of llama-3-70b",
    );
    fails_with(
        &["simulate", "--bandwidth-gbs=-3"],
        "--bandwidth-gbs: -3 is outside the range",
    );
    fails_with(
        &["simulate", "--trace", "/nonexistent/trace.jsonl"],
        "--trace /nonexistent/trace.jsonl",
    );
    fails_with(
        &["run", "--backend", "tpu"],
        "--backend: unknown backend `tpu`",
    );
    fails_with(&["run", "--requests", "0"], "--requests");
    let json = tmp("never.json");
    let o = bin()
        .args(["simulate", "--gpu", "v100", "--json"])
        .arg(&json)
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(!json.exists());
}

#[test]
fn a_bad_model_file_is_named() {
    let m = tmp("model.json");
    std::fs::write(&m, "{\"name\": \"x\", \"num_layers\": 0}").unwrap();
    let o = bin()
        .args(["simulate", "--model"])
        .arg(&m)
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(stderr(&o).contains("model.json"), "{}", stderr(&o));
}

#[test]
fn run_on_the_cpu_backend_completes_and_verifies() {
    let o = bin()
        .args(["run", "--requests", "5", "--max-tokens", "6"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("generated 30 tokens"), "{out}");
    assert!(out.contains("PASS"), "{out}");
}

/// `run --spec 4`: drafts are verified, some rejected, and the greedy outputs are the
/// plain run's; bad values are named.
#[test]
fn run_with_speculative_decoding_matches_plain_greedy_decoding() {
    let o = bin()
        .args([
            "run",
            "--requests",
            "4",
            "--max-tokens",
            "20",
            "--spec",
            "4",
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("generated 80 tokens"), "{out}");
    assert!(out.contains("drafts accepted"), "{out}");
    assert!(out.contains("4 of 4 requests identical"), "{out}");
    fails_with(&["run", "--spec", "0"], "--spec: 0 draft tokens");
    fails_with(&["run", "--spec", "17"], "--spec: 17 draft tokens");
    fails_with(&["run", "--spec", "2", "--no-cache"], "--no-cache");
}

/// max_tokens = 1 (scoring, classification, prefill-only requests) is served: each
/// request's one token comes from its prefill, which is verified; no decode runs.
#[test]
fn run_serves_requests_of_one_token() {
    let o = bin()
        .args(["run", "--requests", "5", "--max-tokens", "1"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("generated 5 tokens"), "{out}");
    assert!(out.contains("PASS"), "{out}");
}

#[test]
fn run_on_cuda_either_verifies_or_says_there_is_no_gpu() {
    let o = bin()
        .args([
            "run",
            "--backend",
            "cuda",
            "--requests",
            "3",
            "--max-tokens",
            "4",
        ])
        .output()
        .unwrap();
    if o.status.success() {
        assert!(String::from_utf8_lossy(&o.stdout).contains("PASS"));
    } else {
        let e = stderr(&o);
        assert!(
            e.contains("no CUDA driver found") || e.contains("no CUDA device"),
            "{e}"
        );
    }
}

#[test]
fn run_without_a_cache_generates_the_same_tokens_and_plots_both() {
    let dir = tempfile::tempdir().unwrap();
    let svg = dir.path().join("steps.svg");
    let out = bin()
        .args([
            "run",
            "--requests",
            "3",
            "--max-tokens",
            "5",
            "--no-cache",
            "--plot",
        ])
        .arg(&svg)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("without a cache: generated 15 tokens"),
        "{text}"
    );
    assert!(
        text.contains("faster with the cache; 3 of 3 requests generated the same tokens"),
        "{text}"
    );
    let svg = std::fs::read_to_string(&svg).unwrap();
    assert!(svg.contains("with the paged KV cache") && svg.contains("without a cache"));
    // --plot needs --no-cache.
    let out = bin().args(["run", "--plot", "x.svg"]).output().unwrap();
    assert!(!out.status.success());
}

#[test]
fn kv_dtype_fp8_prints_and_writes_the_comparison_and_bad_values_are_named() {
    let json = tmp("fp8.json");
    let o = bin()
        .args([
            "simulate",
            "--workload",
            "sharegpt",
            "--num-requests",
            "300",
        ])
        .args(["--kv-dtype", "fp8", "--json"])
        .arg(&json)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    for want in [
        "KV cache fp8 vs f16 (same GPU, same 11.79 GiB KV budget",
        "token slots: f16 15447, fp8 30895 (2.00x)",
        "fp8 409600 bytes = 400 KiB",
        "mean batch",
    ] {
        assert!(out.contains(want), "missing `{want}` in:\n{out}");
    }
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let c = &v[0]["kv_dtype_comparison"];
    assert_eq!(c["kv_dtype"], "fp8");
    assert_eq!(c["baseline_dtype"], "f16");
    assert_eq!(c["kv_capacity_tokens"], 30895);
    assert_eq!(v[0]["kv_capacity_tokens"], 15447);
    assert_eq!(c["rows"].as_array().unwrap().len(), 6);
    assert!(c["rows"][0]["batch_ratio"].as_f64().unwrap() > 1.9);
    // Without the flag: no comparison in the table or the JSON.
    let plain = tmp("f16.json");
    let o = bin()
        .args([
            "simulate",
            "--workload",
            "sharegpt",
            "--num-requests",
            "300",
            "--json",
        ])
        .arg(&plain)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!String::from_utf8_lossy(&o.stdout).contains("fp8"));
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&plain).unwrap()).unwrap();
    assert!(v[0].get("kv_dtype_comparison").is_none());
    fails_with(
        &["simulate", "--kv-dtype", "int4"],
        "--kv-dtype: unknown KV-cache dtype `int4`",
    );
}

#[test]
fn run_with_a_small_step_budget_prefills_in_chunks_and_hits_the_prefix_cache() {
    let o = bin()
        .args([
            "run",
            "--requests",
            "6",
            "--max-tokens",
            "4",
            "--step-tokens",
            "8",
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("generated 24 tokens"), "{out}");
    assert!(out.contains("PASS"), "{out}");
    // The shared 16-token system prompt is one block: later prompts find it cached.
    let served: u64 = out
        .split(" prompt tokens served from the prefix cache")
        .next()
        .and_then(|s| s.rsplit(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap();
    assert!(served >= 16, "{out}");
    let o = bin()
        .args(["run", "--requests", "6", "--step-tokens", "5"])
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(stderr(&o).contains("--step-tokens"), "{}", stderr(&o));
}

//! Hostile input to the `pagedkv` command, as a new user (or an attacker planting files)
//! would try it: each case once hung, panicked, printed NaN, or overwrote what it should
//! not. Each is now an error naming the flag or line with exit status 1, and output
//! files are written whole, through an unpredictable temporary, or not at all.

use std::fs;
use std::os::unix::fs::{FileTypeExt as _, PermissionsExt as _, symlink};
use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_pagedkv"))
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Runs `pagedkv ARGS`, killing it after `limit` (a hang is a failure, not a stuck CI).
fn run_within(args: &[&str], limit: Duration) -> Output {
    let mut child = bin()
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > limit {
            child.kill().unwrap();
            panic!("pagedkv {args:?} still running after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

/// Exit status 1 (an error, not a panic's 101 or an abort) and stderr naming `want`.
fn fails_with(args: &[&str], want: &str) -> String {
    let o = run_within(args, Duration::from_secs(60));
    let e = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{args:?}: {e}");
    assert!(e.contains(want), "{args:?}: stderr lacks `{want}`:\n{e}");
    assert!(!e.contains("panicked"), "{args:?}: {e}");
    e
}

/// A small trace that simulates in a blink.
fn small_trace(dir: &Path) -> String {
    let p = dir.join("t.jsonl");
    let lines: Vec<String> = (0..10)
        .map(|i| format!("{{\"arrival_s\": {i}, \"prompt_len\": 20, \"output_len\": 5}}"))
        .collect();
    fs::write(&p, lines.join("\n")).unwrap();
    p.to_str().unwrap().to_string()
}

fn simulate_json(trace: &str, json: &Path) -> Output {
    bin()
        .args(["simulate", "--trace", trace, "--json"])
        .arg(json)
        .output()
        .unwrap()
}

fn leftovers(dir: &Path) -> Vec<String> {
    fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".tmp"))
        .collect()
}

#[test]
fn a_symlink_planted_at_the_old_temporary_name_is_not_followed() {
    let d = tempfile::tempdir().unwrap();
    let trace = small_trace(d.path());
    let victim = d.path().join("victim");
    fs::write(&victim, "precious").unwrap();
    symlink(&victim, d.path().join(".out.json.tmp")).unwrap();
    let o = simulate_json(&trace, &d.path().join("out.json"));
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(fs::read_to_string(&victim).unwrap(), "precious");
    assert!(
        fs::read_to_string(d.path().join("out.json"))
            .unwrap()
            .contains("policies")
    );
}

#[test]
fn an_output_symlink_is_written_through_and_stays_a_symlink() {
    let d = tempfile::tempdir().unwrap();
    let trace = small_trace(d.path());
    let real = d.path().join("real.json");
    fs::write(&real, "old").unwrap();
    let link = d.path().join("link.json");
    symlink(&real, &link).unwrap();
    let o = simulate_json(&trace, &link);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        fs::symlink_metadata(&link)
            .unwrap()
            .file_type()
            .is_symlink()
    );
    assert!(fs::read_to_string(&real).unwrap().contains("policies"));
}

#[test]
fn an_existing_files_mode_is_kept() {
    let d = tempfile::tempdir().unwrap();
    let trace = small_trace(d.path());
    let out = d.path().join("private.json");
    fs::write(&out, "old").unwrap();
    fs::set_permissions(&out, fs::Permissions::from_mode(0o600)).unwrap();
    let o = simulate_json(&trace, &out);
    assert!(o.status.success(), "{}", stderr(&o));
    let m = fs::metadata(&out).unwrap();
    assert_eq!(m.permissions().mode() & 0o777, 0o600);
    assert!(fs::read_to_string(&out).unwrap().contains("policies"));
}

#[test]
fn device_nodes_and_fifos_are_written_through_never_replaced() {
    let d = tempfile::tempdir().unwrap();
    let trace = small_trace(d.path());
    // A null device of our own (never /dev/null itself: a regression run as root would
    // replace the machine's). Only root may make one; the FIFO below needs no rights.
    let null = d.path().join("null");
    if Command::new("mknod")
        .args(["-m", "666"])
        .arg(&null)
        .args(["c", "1", "3"])
        .status()
        .is_ok_and(|s| s.success())
    {
        let o = simulate_json(&trace, &null);
        assert!(o.status.success(), "{}", stderr(&o));
        assert!(fs::metadata(&null).unwrap().file_type().is_char_device());
    }

    let fifo = d.path().join("fifo");
    assert!(
        Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap()
            .success()
    );
    let reader = {
        let fifo = fifo.clone();
        std::thread::spawn(move || fs::read_to_string(fifo).unwrap())
    };
    let o = simulate_json(&trace, &fifo);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(reader.join().unwrap().contains("policies"));
    assert!(fs::symlink_metadata(&fifo).unwrap().file_type().is_fifo());
    assert!(leftovers(d.path()).is_empty());
}

#[test]
fn a_folder_as_output_is_refused() {
    let d = tempfile::tempdir().unwrap();
    let trace = small_trace(d.path());
    let e = fails_with(
        &[
            "simulate",
            "--trace",
            &trace,
            "--json",
            d.path().to_str().unwrap(),
        ],
        "is a folder",
    );
    assert!(e.contains(d.path().to_str().unwrap()), "{e}");
}

#[test]
fn a_failing_plot_leaves_no_json_and_no_temporary() {
    let d = tempfile::tempdir().unwrap();
    let trace = small_trace(d.path());
    let json = d.path().join("out.json");
    let plot = d.path().join("missing-folder").join("out.svg");
    fails_with(
        &[
            "simulate",
            "--trace",
            &trace,
            "--json",
            json.to_str().unwrap(),
            "--plot",
            plot.to_str().unwrap(),
        ],
        "missing-folder",
    );
    assert!(
        !json.exists(),
        "the JSON was committed before the plot failed"
    );
    assert!(leftovers(d.path()).is_empty(), "{:?}", leftovers(d.path()));
}

#[test]
fn absurd_rates_and_bandwidths_are_errors_not_nan_or_a_hung_plot() {
    let d = tempfile::tempdir().unwrap();
    let svg = d.path().join("p.svg");
    let svg = svg.to_str().unwrap();
    fails_with(
        &[
            "simulate",
            "--workload",
            "alpaca",
            "--rate",
            "1e-306",
            "--plot",
            svg,
        ],
        "--rate: 1e-306 is outside the range",
    );
    fails_with(
        &["simulate", "--bandwidth-gbs", "1e-320", "--plot", svg],
        "--bandwidth-gbs",
    );
    fails_with(&["simulate", "--rate", "inf"], "--rate");
    fails_with(&["simulate", "--memory-gib", "NaN"], "--memory-gib");
    // A system prompt as long as the model's longest sequence leaves no room.
    fails_with(&["simulate", "--system-prompt", "2048"], "--system-prompt");
    assert!(!Path::new(svg).exists());
}

#[test]
fn pools_beyond_what_can_be_simulated_name_the_flag() {
    fails_with(
        &["simulate", "--kv-budget-gib", "104857624.4140625"],
        "--kv-budget-gib",
    );
    fails_with(&["simulate", "--kv-budget-gib", "1e9"], "--kv-budget-gib");
    fails_with(&["simulate", "--memory-gib", "1e100"], "--memory-gib");
    // Large but in range: the pool is more than the simulator holds, said as such.
    let e = fails_with(
        &["simulate", "--kv-budget-gib", "100000"],
        "--kv-budget-gib",
    );
    assert!(e.contains("limit"), "{e}");
    assert!(!e.contains("inf"), "{e}");
}

#[test]
fn a_tiny_model_that_makes_a_huge_pool_is_refused() {
    let d = tempfile::tempdir().unwrap();
    let m = d.path().join("tiny.json");
    fs::write(
        &m,
        r#"{"name":"tiny","num_layers":1,"num_kv_heads":1,"head_dim":1,"num_params":1000,"dtype_bytes":1,"max_model_len":64}"#,
    )
    .unwrap();
    fails_with(&["simulate", "--model", m.to_str().unwrap()], "limit");
}

#[test]
fn trace_lengths_that_overflow_name_the_line() {
    let d = tempfile::tempdir().unwrap();
    for (text, want) in [
        (
            "{\"arrival_s\": 0, \"prompt_len\": 5, \"output_len\": 5}\n{\"arrival_s\": 0, \"prompt_len\": 9223372036854775807, \"output_len\": 9223372036854775807}\n",
            "trace line 2",
        ),
        (
            "{\"arrival_s\": 0, \"prompt_len\": 4294967297, \"output_len\": 1}\n",
            "trace line 1: prompt_len 4294967297 exceeds",
        ),
        (
            "{\"arrival_s\": 1e300, \"prompt_len\": 5, \"output_len\": 5}\n",
            "trace line 1: arrival_s",
        ),
        (
            "{\"arrival_s\": 0, \"prompt_len\": 5, \"output_len\": 5, \"extra\": 1}\n",
            "trace line 1: unknown field",
        ),
    ] {
        let t = d.path().join("t.jsonl");
        fs::write(&t, text).unwrap();
        fails_with(&["simulate", "--trace", t.to_str().unwrap()], want);
    }
}

#[test]
fn an_endless_trace_is_refused_at_the_line_limit() {
    let e = fails_with(
        &["simulate", "--trace", "/dev/zero"],
        "trace line 1: longer than",
    );
    assert!(e.contains("/dev/zero"), "{e}");
}

#[test]
fn model_json_that_overflows_or_has_unknown_fields_names_the_field() {
    let d = tempfile::tempdir().unwrap();
    let m = d.path().join("m.json");
    fs::write(
        &m,
        r#"{"name":"x","num_layers":2147483648,"num_kv_heads":2147483648,"head_dim":128,"num_params":1e9,"dtype_bytes":2,"max_model_len":2048}"#,
    )
    .unwrap();
    fails_with(
        &["simulate", "--model", m.to_str().unwrap()],
        "overflows 64 bits",
    );
    fs::write(
        &m,
        r#"{"name":"x","num_layers":2,"num_kv_heads":2,"head_dim":128,"num_params":1e9,"dtype_bytes":2,"max_model_len":2048,"layers":3}"#,
    )
    .unwrap();
    fails_with(
        &["simulate", "--model", m.to_str().unwrap()],
        "unknown field `layers`",
    );
}

/// A model name with an ANSI escape or a NUL, from a model JSON, was printed raw to
/// the terminal: it is refused, and the error shows it escaped.
#[test]
fn a_model_name_with_control_characters_is_refused_and_never_printed_raw() {
    let d = tempfile::tempdir().unwrap();
    let m = d.path().join("m.json");
    for name in [
        r"\u001b[31mred",
        r"nul\u0000here",
        r"del\u007f",
        r"bell\u0007",
    ] {
        fs::write(
            &m,
            format!(
                r#"{{"name":"{name}","num_layers":2,"num_kv_heads":2,"head_dim":128,"num_params":1e9,"dtype_bytes":2,"max_model_len":2048}}"#
            ),
        )
        .unwrap();
        let e = fails_with(&["simulate", "--model", m.to_str().unwrap()], "name: ");
        assert!(e.contains("control character"), "{e}");
        assert!(
            !e.chars().any(|c| c.is_control() && c != '\n'),
            "a control character reached stderr: {e:?}"
        );
    }
}

/// Weights larger than the GPU's memory were reported as "memory budget too small:
/// -0.32 GiB of KV cache"; the error says the weights do not fit.
#[test]
fn weights_that_do_not_fit_the_gpu_are_named_as_such() {
    let e = fails_with(
        &["simulate", "--model", "llama-3-70b", "--gpu", "a100-40gb"],
        "do not fit in 90% of",
    );
    assert!(!e.contains("-0.") && !e.contains("GiB of KV cache"), "{e}");
    fails_with(
        &["simulate", "--memory-gib", "20"],
        "the weights of opt-13b",
    );
}

#[test]
fn unbounded_counts_name_the_flag() {
    fails_with(
        &[
            "simulate",
            "--workload",
            "alpaca",
            "--num-requests",
            "18446744073709551615",
        ],
        "--num-requests",
    );
    fails_with(
        &[
            "simulate",
            "--workload",
            "alpaca",
            "--num-requests",
            "1000000000000",
        ],
        "--num-requests",
    );
    fails_with(&["run", "--requests", "18446744073709551615"], "--requests");
}

#[test]
fn run_max_tokens_outside_its_range_names_the_flag_and_help_gives_it() {
    fails_with(
        &["run", "--max-tokens", "0"],
        "--max-tokens: 0 is outside 1 to 217",
    );
    fails_with(
        &["run", "--max-tokens", "300"],
        "--max-tokens: 300 is outside 1 to 217",
    );
    let help = bin().args(["run", "--help"]).output().unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    let want = format!(
        "{} to {}",
        pagedkv_cli::tiny::MIN_TOKENS,
        pagedkv_cli::tiny::MAX_TOKENS
    );
    assert!(help.contains(&want), "--help lacks `{want}`:\n{help}");
    assert!(
        help.contains(&pagedkv_cli::tiny::MAX_REQUESTS.to_string()),
        "{help}"
    );
}

#[test]
fn a_budget_that_fits_exactly_one_maximal_request_runs_every_request() {
    // OPT-13B: 800 KiB per token x 2048 tokens = 1.5625 GiB, one maximal request. The
    // paged scheduler's watermark once kept that request out forever ("stalled").
    let d = tempfile::tempdir().unwrap();
    let t = d.path().join("t.jsonl");
    fs::write(
        &t,
        "{\"arrival_s\": 0, \"prompt_len\": 2047, \"output_len\": 1}\n{\"arrival_s\": 0.5, \"prompt_len\": 1000, \"output_len\": 1048}\n",
    )
    .unwrap();
    let json = d.path().join("r.json");
    let o = bin()
        .args(["simulate", "--kv-budget-gib", "1.5625", "--trace"])
        .arg(&t)
        .arg("--json")
        .arg(&json)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(&fs::read_to_string(&json).unwrap()).unwrap();
    for p in v[0]["policies"].as_array().unwrap() {
        assert_eq!(p["completed"], 2, "{p}");
    }
}

/// `--trace` on a folder once said "trace line 1: Is a directory".
#[test]
fn a_folder_as_trace_is_refused_as_a_folder() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().to_str().unwrap();
    let e = fails_with(
        &["simulate", "--trace", dir],
        "is a directory, not a trace file",
    );
    assert!(!e.contains("trace line"), "{e}");
}

/// The sweep's flags: each bad value is an error naming its flag, before any output is
/// written; flags that make no sense together are refused by the parser (status 2).
#[test]
fn bad_sweep_flags_name_the_flag_and_write_nothing() {
    let d = tempfile::tempdir().unwrap();
    let json = d.path().join("s.json");
    let json = json.to_str().unwrap();
    let sweep = ["simulate", "--sweep", "--workload", "sharegpt"];
    for (extra, want) in [
        (&["--latency-bound", "0"][..], "--latency-bound"),
        (&["--latency-bound", "NaN"][..], "--latency-bound"),
        (&["--latency-bound=-1"][..], "--latency-bound"),
        (&["--rates", "1,inf"][..], "--rates"),
        (&["--rates", "1e-300"][..], "--rates"),
        (&["--num-requests", "0"][..], "--num-requests"),
        (&["--prefill", "interleaved"][..], "--prefill"),
        (&["--workload", "chat"][..], "--workload"),
    ] {
        let mut args: Vec<&str> = sweep.to_vec();
        if extra[0] == "--workload" {
            args.truncate(2);
        }
        args.extend_from_slice(extra);
        args.extend_from_slice(&["--json", json]);
        fails_with(&args, want);
        assert!(!Path::new(json).exists(), "{args:?} wrote the JSON");
    }
    for args in [
        &["simulate", "--rates", "1,2"][..],
        &["simulate", "--latency-bound", "0.1"][..],
        &["simulate", "--sweep", "--rate", "2"][..],
        &["simulate", "--sweep", "--trace", "t.jsonl"][..],
        &["simulate", "--sweep", "--rates", "one"][..],
    ] {
        let o = run_within(args, Duration::from_secs(60));
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
        assert!(!stderr(&o).contains("panicked"), "{args:?}");
    }
}

/// A bad output path (a folder, one path for both outputs, a missing folder) was
/// reported only after the whole run, its report already printed: it is an error before
/// anything runs, with nothing on stdout.
#[test]
fn bad_output_paths_are_refused_before_the_run() {
    let d = tempfile::tempdir().unwrap();
    let trace = small_trace(d.path());
    let dir = d.path().to_str().unwrap().to_string();
    let same = d.path().join("same.out");
    let same = same.to_str().unwrap();
    let missing = d.path().join("missing-folder").join("r.json");
    let missing = missing.to_str().unwrap();
    let file = d.path().join("file");
    fs::write(&file, "x").unwrap();
    let under_file = file.join("r.json");
    let under_file = under_file.to_str().unwrap();
    for (outputs, want) in [
        (vec!["--json", dir.as_str()], "is a folder"),
        (vec!["--plot", dir.as_str()], "is a folder"),
        (vec!["--json", same, "--plot", same], "named by two outputs"),
        (vec!["--json", missing], "missing-folder does not exist"),
        (vec!["--plot", under_file], "is not a folder"),
    ] {
        let mut args = vec!["simulate", "--trace", &trace];
        args.extend(&outputs);
        let o = run_within(&args, Duration::from_secs(60));
        let e = stderr(&o);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {e}");
        assert!(e.contains(want), "{args:?}: stderr lacks `{want}`:\n{e}");
        assert!(
            o.stdout.is_empty(),
            "{args:?}: the run went ahead:\n{}",
            String::from_utf8_lossy(&o.stdout)
        );
    }
    // `pagedkv run --no-cache --plot` too.
    let o = run_within(
        &[
            "run",
            "--requests",
            "1",
            "--max-tokens",
            "2",
            "--no-cache",
            "--plot",
            missing,
        ],
        Duration::from_secs(120),
    );
    let e = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{e}");
    assert!(e.contains("missing-folder does not exist"), "{e}");
    assert!(
        o.stdout.is_empty(),
        "{}",
        String::from_utf8_lossy(&o.stdout)
    );
    assert!(!Path::new(same).exists() && leftovers(d.path()).is_empty());
}

/// gemma-3-1b's paged pool (pages of 4 layers) on an H200, or at fp8 on the default
/// A100, is more token slots than the simulator holds: the refusal once said "3811645
/// blocks of 8 is more than the simulator's limit of 16777216 token slots", in two
/// units and with no way out. It counts token slots throughout and names the largest
/// --kv-budget-gib that fits, which then runs.
#[test]
fn a_pool_past_the_slot_limit_is_said_in_token_slots_with_the_budget_that_fits() {
    for args in [
        &["simulate", "--model", "gemma-3-1b", "--gpu", "h200"][..],
        &["simulate", "--model", "gemma-3-1b", "--kv-dtype", "fp8"][..],
    ] {
        let e = fails_with(
            args,
            "more than the simulator's limit of 16777216 token slots",
        );
        assert!(!e.contains("blocks"), "{args:?}: {e}");
        let fit = e
            .split("use --kv-budget-gib ")
            .nth(1)
            .and_then(|r| r.split(' ').next())
            .unwrap_or_else(|| panic!("{args:?}: no budget to use: {e}"));
        let mut ok: Vec<&str> = args.to_vec();
        ok.extend([
            "--kv-budget-gib",
            fit,
            "--workload",
            "alpaca",
            "--num-requests",
            "20",
        ]);
        let o = run_within(&ok, Duration::from_secs(60));
        assert!(o.status.success(), "{ok:?}: {}", stderr(&o));
    }
}

/// `--system-prompt` shortened the requests it pushed past the model's maximum without a
/// word: the report (its first line, and the JSON's `workload`) counts them. OPT-13B
/// takes 2048 tokens; after 100 more, 2000 + 40 and 1000 + 1000 no longer fit.
#[test]
fn requests_a_system_prompt_shortens_are_counted_in_the_report() {
    let d = tempfile::tempdir().unwrap();
    let t = d.path().join("t.jsonl");
    fs::write(
        &t,
        "{\"arrival_s\": 0, \"prompt_len\": 2000, \"output_len\": 40}\n\
         {\"arrival_s\": 1, \"prompt_len\": 10, \"output_len\": 10}\n\
         {\"arrival_s\": 2, \"prompt_len\": 1000, \"output_len\": 1000}\n",
    )
    .unwrap();
    let json = d.path().join("r.json");
    let want = "2 of 3 requests shortened to fit the model's 2048 tokens";
    let o = bin()
        .args(["simulate", "--system-prompt", "100", "--trace"])
        .arg(&t)
        .arg("--json")
        .arg(&json)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains(want), "{out}");
    let v: serde_json::Value = serde_json::from_str(&fs::read_to_string(&json).unwrap()).unwrap();
    assert!(v[0]["workload"].as_str().unwrap().contains(want), "{v}");
}

/// A reader that stops early (`pagedkv simulate | head -3`) closes stdout before the
/// report is written: the run ends quietly with status 0, never the panic of a
/// `println!` on a closed pipe (status 101 and "failed printing to stdout").
#[test]
fn a_closed_stdout_ends_the_run_quietly() {
    for args in [
        &["simulate", "--workload", "alpaca", "--num-requests", "20"][..],
        &["run", "--requests", "2"][..],
    ] {
        let mut child = bin()
            .args(args)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        drop(child.stdout.take()); // the reader is gone before anything is written
        let o = child.wait_with_output().unwrap();
        let err = stderr(&o);
        assert!(!err.contains("panicked"), "pagedkv {args:?}: {err}");
        assert_eq!(o.status.code(), Some(0), "pagedkv {args:?}: {err}");
    }
}

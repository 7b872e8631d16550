//! C programs linked against `libpagedkv_c.a`, compiled with the `cc` crate's compiler
//! discovery: the minimal example of docs/c.md, a driver that exercises the scheduler,
//! the prefix cache, the CPU reference attention (compared here with values computed in
//! Rust) and the error paths with their messages, and a hostile program (threads that
//! destroy a scheduler while others call it, wrong counts, a panic inside a call, a
//! layout whose size overflows). `scripts/sanitize-c.sh` runs the same programs under
//! AddressSanitizer and UndefinedBehaviorSanitizer.

use std::path::{Path, PathBuf};
use std::process::Command;

use pagedkv::host::ops::attention::{AttentionOptions, DecodeInputs, DecodeShape};
use pagedkv::host::reference::paged_decode_attention;
use pagedkv::host::{DType, HostTensor};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).to_path_buf()
}

/// The `libpagedkv_c.a` this test run built, with the test-only entry points: cargo
/// builds every crate type of the library this test depends on into the test's own
/// `deps` folder, and the crate's dev-dependency on itself turns on `testing`. (A
/// nested `cargo build` with its own target folder used to build the whole graph a
/// second time: 414 s of a cold `cargo test --workspace` on a loaded 2-core machine.)
fn static_lib() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let lib = exe.parent().unwrap().join("libpagedkv_c.a");
    assert!(
        lib.exists(),
        "{} is missing: cargo builds it with the library for this test",
        lib.display()
    );
    lib
}

/// Compiles and links `src` against the static library; returns the executable.
fn build(src: &Path, name: &str) -> PathBuf {
    let out = std::env::temp_dir().join(format!("pagedkv-c-{}-{name}", std::process::id()));
    let compiler = cc::Build::new()
        .target(env!("PAGEDKV_BUILD_TARGET"))
        .host(env!("PAGEDKV_BUILD_HOST"))
        .opt_level(1)
        .cargo_metadata(false)
        .warnings(true)
        .get_compiler();
    let mut cmd = compiler.to_command();
    cmd.arg("-std=c11")
        .arg("-Wall")
        .arg("-Werror")
        .arg("-I")
        .arg(root().join("include"))
        .arg(src)
        .arg(static_lib())
        .args(["-pthread", "-lpthread", "-ldl", "-lm", "-o"])
        .arg(&out);
    let o = cmd.output().expect("run the C compiler");
    assert!(
        o.status.success(),
        "compiling {}:\n{}",
        src.display(),
        String::from_utf8_lossy(&o.stderr)
    );
    out
}

/// Runs `exe`; returns its stdout and stderr, after checking it succeeded.
fn run_both(exe: &Path) -> (String, String) {
    let o = Command::new(exe).output().unwrap();
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(
        o.status.success(),
        "{} failed:\n{out}\n{err}",
        exe.display()
    );
    (out, err)
}

fn run(exe: &Path) -> String {
    run_both(exe).0
}

#[test]
fn the_documented_example_compiles_runs_and_is_the_documented_text() {
    let src = root().join("examples/minimal.c");
    let out = run(&build(&src, "minimal"));
    assert_eq!(out.trim(), "finished after 3 steps");
    let doc = std::fs::read_to_string(root().join("../docs/c.md")).unwrap();
    let code = std::fs::read_to_string(&src).unwrap();
    assert!(
        doc.contains(code.trim()),
        "docs/c.md's C example differs from capi/examples/minimal.c"
    );
}

fn line<'a>(out: &'a str, prefix: &str) -> &'a str {
    out.lines()
        .find(|l| l.starts_with(prefix))
        .unwrap_or_else(|| panic!("no `{prefix}` line in:\n{out}"))
}

#[test]
fn the_driver_program_sees_what_the_rust_side_computes() {
    let out = run(&build(&root().join("tests/c/driver.c"), "driver"));
    assert!(out.ends_with("ok\n"), "{out}");
    assert_eq!(
        line(&out, "version"),
        format!("version {}", env!("CARGO_PKG_VERSION"))
    );
    // 20 + 33 + 7 prompt tokens in the first step; rows padded to 512 / 16 blocks.
    assert_eq!(
        line(&out, "first step"),
        "first step seqs=3 slots=60 max_blocks=32 ctx=20,33,7"
    );
    // The longest request generates 8 tokens: 8 steps; all three finish.
    assert_eq!(line(&out, "completed"), "completed steps=8 finished=3");
    // Two full 16-token blocks of the repeated 33-token prompt are cached.
    assert_eq!(
        line(&out, "prefix hit"),
        "prefix hit start_pos=32 new_tokens=1"
    );
    assert_eq!(line(&out, "seq tokens"), "seq tokens len=34 last=5");
    // Metrics are as of the last step (before its sequences finished and freed blocks).
    assert_eq!(
        line(&out, "metrics"),
        "metrics prefix_hit_tokens=32 blocks_used=3"
    );
    for (what, status, msg) in [
        ("null_handle", 1, "scheduler is null"),
        ("unknown_request", 4, "unknown request 999"),
        ("done_without_step", 5, "on_step_done() without a step"),
        ("empty_prompt", 2, "must hold at least one token"),
        ("null_out", 1, "out is null"),
        ("use_after_destroy", 5, "destroyed or never created"),
        ("double_destroy", 5, "destroyed or never created"),
        ("bad_config", 2, "block_size"),
        ("context_too_long", 2, "sequence 1: 49 tokens"),
        ("wrong_length", 2, "`q`"),
        ("slot_outside", 2, "slot 96 is outside the pool"),
        ("merge_wrong_lse", 2, "`lse`: 3 elements, expected 4"),
        // fp8: the _fp8 calls check types and scales before the backend.
        ("fp8_f32_queries", 2, "not f32"),
        ("fp8_null_scales", 1, "scales is null"),
        ("fp8_scales_len", 2, "`scales.len`: 1 elements, expected 2"),
        ("fp8_zero_scale", 2, "kv_scales.v"),
        ("fp8_null_backend", 1, "backend is null"),
    ] {
        let l = line(&out, &format!("error {what} "));
        assert!(l.contains(&format!("status={status} ")), "{l}");
        assert!(l.contains(msg), "{what}: `{msg}` not in `{l}`");
    }
    assert_eq!(line(&out, "append"), "append k=323 v=-1");
    // Head 0: part 0 alone; head 1: weights 2^1 and 2^3, so (2 + 24) / 10, log2(10).
    assert_eq!(line(&out, "merge"), "merge out=1,2.6 lse=1,3.32193");
    // The CUDA backend: created on a GPU machine, a clear error elsewhere.
    for what in ["cuda_create", "cuda_create_on_stream"] {
        let cuda = line(&out, &format!("error {what} "));
        assert!(
            cuda.contains("status=0 ") || (cuda.contains("status=6 ") && cuda.contains("no CUDA")),
            "{cuda}"
        );
    }
    assert!(line(&out, "error cuda_null_backend ").contains("status=1 message=backend is null"));
    assert!(
        line(&out, "error cuda_strided_null_backend ").contains("status=1 message=backend is null")
    );
    // fp8: the scales of heads of largest magnitude 319 and 383 (kk[i] = i, vv[i] = -i)
    // as e4m3 maps them (the calls' checks are in the error table above).
    let scales: Vec<f32> = line(&out, "fp8 scales ")
        .split(' ')
        .skip(2)
        .map(|x| x.parse().unwrap())
        .collect();
    let (k0, k1) = (319.0 / 448.0f64, 383.0 / 448.0f64);
    assert_eq!(
        scales,
        [k0, k1, k0, k1].map(|x| x as f32),
        "{}",
        line(&out, "fp8 scales ")
    );

    // The attention values, recomputed in Rust from the same formulas.
    let shape = DecodeShape {
        num_seqs: 2,
        num_q_heads: 4,
        num_kv_heads: 2,
        head_dim: 64,
        block_size: 16,
        num_blocks: 6,
        max_blocks_per_seq: 3,
    };
    let n = 6 * 2 * 16 * 64;
    let f = |v: Vec<f64>| HostTensor::from_f64(DType::F32, &[v.len()], &v).unwrap();
    let kc = f((0..n)
        .map(|i| (0.37 * i as f64).sin() as f32 as f64)
        .collect());
    let vc = f((0..n)
        .map(|i| (0.11 * i as f64).cos() as f32 as f64)
        .collect());
    let q = f((0..512)
        .map(|i| (0.5 * i as f64 + 1.0).sin() as f32 as f64)
        .collect());
    let mut opts = AttentionOptions::new(64);
    opts.scale = 0.125;
    let want = paged_decode_attention(&DecodeInputs {
        shape: &shape,
        opts: &opts,
        q: &q,
        key_cache: &kc,
        value_cache: &vc,
        block_tables: &[0, 4, 2, 5, 1, 3],
        context_lens: &[37, 20],
        plan: None,
        kv_scales: None,
        sinks: None,
    });
    let got: Vec<f64> = line(&out, "attention")
        .split_whitespace()
        .skip(1)
        .map(|x| x.parse().unwrap())
        .collect();
    assert_eq!(got.len(), want.len());
    let err = got
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    assert!(err < 1e-6, "max abs error {err}");
}

#[test]
fn the_hostile_program_gets_errors_never_crashes_and_prints_nothing_to_stderr() {
    let (out, err) = run_both(&build(&root().join("tests/c/hostile.c"), "hostile"));
    // The library never writes to the host's stderr, not even for a panic inside.
    assert_eq!(err, "", "stderr:\n{err}\nstdout:\n{out}");
    assert!(out.ends_with("ok\n"), "{out}");
    // A step's arrays stay as they were through on_step_done and abort.
    assert_eq!(
        line(&out, "check batch_stays "),
        "check batch_stays same=yes"
    );
    assert_eq!(line(&out, "check batch_next "), "check batch_next rows=2");
    // Destroy raced calls from three threads 400 times: every call either ran or was
    // refused (destroyed, or inside a call), and both happened.
    assert_eq!(
        line(&out, "race destroys"),
        "race destroys=400 ok=yes refused=yes unexpected=0",
        "{out}"
    );
    for (what, status, msg) in [
        // n is checked against the last step's 2 sequences before `sampled` is read.
        (
            "n_one_more",
            2,
            "invalid argument `n`: 3 sampled tokens, but the last step scheduled 2",
        ),
        (
            "n_huge",
            2,
            "invalid argument `n`: 18446744073709551615 sampled tokens",
        ),
        ("n_fewer", 2, "invalid argument `n`: 1 sampled tokens"),
        ("n_right", 0, ""),
        ("n_again", 5, "on_step_done() without a step"),
        (
            "panic",
            7,
            "internal panic: pagedkv_testing_panic: a deliberate panic at ",
        ),
        ("after_panic", 5, "an earlier call on it panicked"),
        ("destroy_after_panic", 0, ""),
        // The host's layout check or the C ABI's own: either names num_blocks.
        ("huge_layout", 2, "invalid argument `num_blocks`: "),
        ("huge_shape", 2, "invalid argument `num_blocks`"),
        // prompt_len is checked against max_model_len before the prompt is read.
        (
            "prompt_len_0",
            2,
            "`req->prompt_len`: 4096 prompt + 1 output tokens exceed max_model_len 256",
        ),
        ("prompt_len_1", 2, "`req->prompt_len`: 4097 prompt"),
        ("prompt_len_2", 2, "`req->prompt_len`: 2000 prompt"),
        ("prompt_len_3", 2, "`req->prompt_len`: 1048576 prompt"),
        ("prompt_len_fits", 0, ""),
        // The pool's size and a live id, too, before the prompt is read.
        (
            "prompt_pool",
            2,
            "`req->prompt_len`: needs 126 blocks, the pool holds 63: it could never run (nothing was read)",
        ),
        (
            "prompt_dup_id",
            2,
            "`req->id`: request 5 is already live (nothing was read)",
        ),
        // Pools beyond the cap: refused by name, not an abort.
        (
            "pool_host_max",
            2,
            "invalid argument `num_host_blocks`: 4294967294 blocks: more than a pool may have",
        ),
        (
            "pool_host_2e28",
            2,
            "invalid argument `num_host_blocks`: 268435456",
        ),
        (
            "pool_blocks_i32",
            2,
            "invalid argument `num_blocks`: 2147483647",
        ),
        // reset_prefix_cache waits for the running requests.
        ("reset_in_step", 5, "between step() and on_step_done()"),
        ("reset_running", 5, "while 1 request groups run"),
        ("reset_idle", 0, ""),
    ] {
        let l = line(&out, &format!("check {what} "));
        assert!(l.contains(&format!("status={status} ")), "{l}");
        assert!(l.contains(msg), "{what}: `{msg}` not in `{l}`");
    }
}

//! KV blocks from a prefill process to a decode process over NIXL's UCX backend (host
//! memory, TCP on loopback), with `--features nixl`: the decode process reads the
//! prefill process's export out of its registered memory, imports the blocks, and its
//! decode outputs equal one instance's, bit for bit. Both processes are this test
//! binary run again (`nixl_role_process`), with the environment
//! `scripts/install-nixl.sh` prints (the library from the nixl-cu12 wheel).

use std::os::unix::net::{UnixListener, UnixStream};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::common::disagg::{decodes, prefill_and_export, receive, same, serve};
use crate::common::{Rank, scheduler};

use pagedkv_dist::ShardSpec;
use pagedkv_dist::nixl::NixlTransfer;
use pagedkv_dist::transfer::{Outcome, Transfer, encode_export};

const ROLE: &str = "PAGEDKV_NIXL_TEST_ROLE";
const SOCK: &str = "PAGEDKV_NIXL_TEST_SOCKET";

/// The prefill or the decode process, by `PAGEDKV_NIXL_TEST_ROLE`.
#[test]
#[ignore = "a process of the NIXL test, which runs it"]
fn nixl_role_process() {
    let (Ok(role), Ok(sock)) = (std::env::var(ROLE), std::env::var(SOCK)) else {
        println!("a process of prefill_to_decode_over_nixl: nothing to do run alone");
        return;
    };
    match role.as_str() {
        "prefill" => {
            let listener = UnixListener::bind(&sock).unwrap();
            listener.set_nonblocking(true).unwrap();
            let start = Instant::now();
            let side = loop {
                match listener.accept() {
                    Ok((s, _)) => break s,
                    Err(_) if start.elapsed() < Duration::from_secs(60) => {
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    Err(e) => panic!("no decode process in 60 s: {e}"),
                }
            };
            side.set_nonblocking(false).unwrap();
            let mut t = NixlTransfer::new("prefill", side).unwrap();
            for id in [1, 2] {
                t.send(encode_export(prefill_and_export(id)).unwrap())
                    .unwrap();
            }
            println!("nixl prefill: exports of requests 1 and 2 read by the decode process");
        }
        "decode" => {
            let start = Instant::now();
            let side = loop {
                match UnixStream::connect(&sock) {
                    Ok(s) => break s,
                    Err(_) if start.elapsed() < Duration::from_secs(60) => {
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    Err(e) => panic!("no prefill process: {e}"),
                }
            };
            let mut t = NixlTransfer::new("decode", side).unwrap();
            let (mut s, mut rank) = (scheduler(), Rank::new(ShardSpec::WHOLE));
            // Two transfers over one agent pair: each offer's ack is its own.
            for id in [1, 2] {
                let (want, _) = serve(&mut scheduler(), &mut Rank::new(ShardSpec::WHOLE), id);
                let out = receive(&mut t, id, Duration::from_secs(60), &mut s, &mut rank);
                assert_eq!(out, Outcome::Imported { blocks: 3 }, "{out}");
                let (got, cached) = serve(&mut s, &mut rank, id);
                assert_eq!(cached, 48, "the imported blocks are prefix hits");
                assert!(same(decodes(&got), decodes(&want)), "decode outputs differ");
                println!(
                    "nixl decode: request {id}: {out}; 48 cached tokens; decode outputs equal"
                );
            }
        }
        "missing" => {
            let (side, _) = UnixStream::pair().unwrap();
            let e = NixlTransfer::new("nobody", side).err().unwrap();
            assert!(e.to_string().contains("install-nixl.sh"), "{e}");
            println!("nixl missing: {e}");
        }
        other => panic!("unknown role {other}"),
    }
}

#[test]
fn prefill_to_decode_over_nixl() {
    // The library's environment, from the install script (idempotent).
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/install-nixl.sh");
    let o = Command::new("bash").arg(script).output().unwrap();
    assert!(
        o.status.success(),
        "scripts/install-nixl.sh failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let env: Vec<(String, String)> = String::from_utf8(o.stdout)
        .unwrap()
        .lines()
        .filter_map(|l| l.strip_prefix("export "))
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| {
            // (The script's `${LD_LIBRARY_PATH:+...}` tail is for a shell.)
            let v = v.split("${").next().unwrap();
            (k.to_string(), v.to_string())
        })
        .collect();
    assert_eq!(env.len(), 3, "{env:?}");
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("side.sock");
    let spawn = |role: &str| {
        Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "nixl::nixl_role_process",
                "--ignored",
                "--nocapture",
            ])
            .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .env(ROLE, role)
            .env(SOCK, &sock)
            .output()
    };
    let (prefill, decode) = std::thread::scope(|sc| {
        let prefill = sc.spawn(|| spawn("prefill"));
        let decode = spawn("decode").unwrap();
        (prefill.join().unwrap().unwrap(), decode)
    });
    for (role, o) in [("prefill", &prefill), ("decode", &decode)] {
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(
            o.status.success(),
            "{role} process failed:\n{out}\n{}",
            String::from_utf8_lossy(&o.stderr)
        );
        assert!(out.contains(&format!("nixl {role}:")), "{role}: {out}");
    }
}

/// Without the library (no LD_LIBRARY_PATH to it) making a transfer is an error that
/// says how to install it, not the stub's abort on first use.
#[test]
fn a_missing_library_is_an_error_that_says_how_to_install_it() {
    let o = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "nixl::nixl_role_process",
            "--ignored",
            "--nocapture",
        ])
        .env_remove("LD_LIBRARY_PATH")
        .env(ROLE, "missing")
        .env(SOCK, "-")
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{out}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(out.contains("nixl missing:"), "{out}");
}

//! KV blocks from a prefill process to a decode process over NIXL's UCX backend (host
//! memory, TCP on loopback), with `--features nixl`: the decode process reads the
//! prefill process's export out of its registered memory, imports the blocks, and its
//! decode outputs equal one instance's, bit for bit. Both processes are this test
//! binary run again (`nixl_role_process`). Offers that fail and offers never
//! acknowledged give their memory back, or hold at most a bound of it, and say why.
//!
//! The library comes from the nixl-cu12 wheel: these tests need the environment
//! `scripts/install-nixl.sh` prints (`eval "$(scripts/install-nixl.sh)"` first, as
//! .ci/run's NIXL step does; the script downloads the wheel), and fail saying so
//! without it. They download nothing themselves.

use std::os::unix::net::{UnixListener, UnixStream};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::common::alloc;
use crate::common::disagg::{decodes, prefill_and_export, receive, same, serve};
use crate::common::{Rank, scheduler};

use pagedkv_dist::ShardSpec;
use pagedkv_dist::nixl::NixlTransfer;
use pagedkv_dist::transfer::{Outcome, Transfer, encode_export};
use pagedkv_dist::wire::{Message, read_message, write_message};

/// What the NIXL tests say when this process cannot use the library.
const INSTALL: &str = "NIXL is not installed for this process: run \
    `eval \"$(scripts/install-nixl.sh)\"` in this shell first (it downloads the pinned \
    nixl-cu12 wheel from PyPI with `python3 -m pip download`, unpacks it with unzip into \
    .tools/, and prints LD_LIBRARY_PATH, NIXL_PLUGIN_DIR and UCX_TLS), then run the test \
    again: `cargo test -p pagedkv-dist --features nixl --test dist nixl::`";

/// Fails the test, saying what to run, unless this process can use NIXL.
fn require_nixl() {
    let plugins = std::env::var_os("NIXL_PLUGIN_DIR");
    assert!(
        plugins.is_some() && !nixl_sys::is_stub(),
        "{INSTALL} (libnixl_capi.so opens: {}; NIXL_PLUGIN_DIR: {plugins:?})",
        !nixl_sys::is_stub()
    );
}

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
    // The processes inherit this one's environment: the library's.
    require_nixl();
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

/// Without the library's environment the NIXL test fails, saying what to run (it ran
/// scripts/install-nixl.sh, a download, from inside the test).
#[test]
fn without_the_library_the_nixl_test_says_what_to_run() {
    let o = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "nixl::prefill_to_decode_over_nixl",
            "--nocapture",
        ])
        .env_remove("LD_LIBRARY_PATH")
        .env_remove("NIXL_PLUGIN_DIR")
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout) + String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "it passed without the library:\n{out}");
    assert!(
        out.contains("eval \"$(scripts/install-nixl.sh)\"") && out.contains("PyPI"),
        "{out}"
    );
}

/// A sender agent for hand-made offers: its metadata, nothing registered.
fn bare_agent(name: &str) -> (nixl_sys::Agent, nixl_sys::Backend) {
    let agent = nixl_sys::Agent::new(name).unwrap();
    let (_mems, params) = agent.get_plugin_params("UCX").unwrap();
    let backend = agent.create_backend("UCX", &params).unwrap();
    (agent, backend)
}

/// Offers the receiver cannot read (64 MiB at an address the sender never
/// registered, and metadata that is not an agent's) are errors that say why, the
/// receiver acknowledges each (the sender may release it), and their memory is given
/// back (each leaked its length: +257 MiB from four).
#[test]
fn offers_that_cannot_be_read_give_their_memory_back_and_say_why() {
    require_nixl();
    let (a, mut b) = UnixStream::pair().unwrap();
    let mut rx = NixlTransfer::new("decode-bad-offers", a).unwrap();
    let (agent, _backend) = bare_agent("sender-bad-offers");
    let md = agent.get_local_md().unwrap();
    let base = alloc::live();
    for seq in 0..5u64 {
        let agent_md = if seq == 4 { vec![7; 100] } else { md.clone() };
        let offer = Message::NixlOffer {
            seq,
            agent_md,
            addr: 0x10_0000,
            len: 64 << 20,
        };
        write_message(&mut b, &offer).unwrap();
        let e = rx.recv(Duration::from_secs(10)).unwrap_err().to_string();
        assert!(
            e.contains(&format!("offer {seq}")) && e.contains("NIXL"),
            "{e}"
        );
        match read_message(&mut b, 1 << 20).unwrap() {
            Message::NixlDone { seq: s } => assert_eq!(s, seq),
            m => panic!("{m:?}"),
        }
    }
    let held = alloc::live() - base;
    assert!(
        held < 1 << 20,
        "five bad offers of 64 MiB: the receiver holds {held} bytes"
    );
    assert_eq!(rx.outstanding(), (0, 0));
}

/// Offers never acknowledged stay registered (the receiver may be reading them), but
/// at most `max_outstanding_bytes` of them (256 MiB): past it a send is refused, and
/// each error says what is held (it was "os error 11", and every such frame leaked);
/// late acknowledgements release them.
#[test]
fn offers_never_acknowledged_are_bounded_and_released_by_late_acks() {
    require_nixl();
    let (a, mut b) = UnixStream::pair().unwrap();
    let mut tx = NixlTransfer::new("prefill-unacked", a).unwrap();
    tx.ack_timeout = Duration::from_millis(50);
    let base = alloc::live();
    let errors: Vec<String> = (0..6)
        .map(|_| tx.send(vec![1u8; 64 << 20]).unwrap_err().to_string())
        .collect();
    let held = alloc::live() - base;
    assert!(
        held <= (256 << 20) + (1 << 20),
        "six offers of 64 MiB never acknowledged: {held} bytes held"
    );
    for (i, e) in errors.iter().enumerate() {
        let want = if i < 4 {
            format!("did not acknowledge offer {i}")
        } else {
            "not offered".to_string()
        };
        assert!(e.contains(&want) && e.contains("held"), "send {i}: {e}");
    }
    assert_eq!(tx.outstanding(), (4, 256 << 20));
    // The receiver acknowledges the four late: the next send releases them.
    for seq in 0..4 {
        match read_message(&mut b, 1 << 20).unwrap() {
            Message::NixlOffer { seq: s, .. } => assert_eq!(s, seq),
            m => panic!("{m:?}"),
        }
        write_message(&mut b, &Message::NixlDone { seq }).unwrap();
    }
    let e = tx.send(vec![2u8; 1 << 20]).unwrap_err().to_string();
    assert!(e.contains("did not acknowledge offer 4"), "{e}");
    assert_eq!(tx.outstanding(), (1, 1 << 20));
    let held = alloc::live() - base;
    assert!(
        held <= 2 << 20,
        "acknowledged offers still held: {held} bytes"
    );
}

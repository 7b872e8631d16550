//! Tensor-parallel shards across OS processes: one scheduler (the leader, this test's
//! process, rank 0) and a worker process (rank 1, this test binary run again as
//! `shard_worker_process`), each with half of the KV heads on the CPU backend, over a
//! Unix socket. Their attention outputs, put side by side along the head axis, equal
//! one process holding every head, bit for bit, over a serving run with prefix hits
//! and preemption; a killed worker is an error on the leader, not a hang, and the
//! leader's requests are all still there.

use std::io::ErrorKind;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use crate::common::{LAYERS, MODEL, Rank, full_shape, input_tokens, sampled, scheduler};

use pagedkv_dist::wire::{Hello, Message, StepMessage, WIRE_VERSION, encode, write_message};
use pagedkv_dist::{DistError, GroupConfig, Leader, ShardSpec, Worker};
use pagedkv_host::scheduler::{Batch, Request, Scheduler};

/// The environment variable that turns `shard_worker_process` into the worker: the
/// leader's socket path.
const WORKER_ENV: &str = "PAGEDKV_DIST_TEST_SOCKET";

/// Request `i`'s prompt: requests 0..4 share their first 40 tokens (two full blocks
/// and a part), the others are their own.
fn prompt(i: u64) -> Vec<u32> {
    let len = 36 + 5 * i as u32;
    (0..len)
        .map(|p| {
            if i < 4 && p < 40 {
                500 + p
            } else {
                (i as u32 * 97 + p * 13) % 1000
            }
        })
        .collect()
}

/// Requests arrive two per step for the first steps (the later ones find the shared
/// prefix cached).
const REQUESTS: u64 = 8;

/// Serves every request; `step` runs one step on every rank and returns its outputs
/// (all heads, per token). Returns each step's outputs and the scheduler.
fn serve(
    mut step: impl FnMut(&Batch, &[u32]) -> Result<Vec<f32>, DistError>,
    stop_after: Option<usize>,
) -> (Vec<Vec<f32>>, Scheduler, Option<DistError>) {
    let mut s = scheduler();
    let mut outs = Vec::new();
    let mut next = 0;
    loop {
        for _ in 0..2 {
            if next < REQUESTS {
                s.add_request(Request::new(next, prompt(next), 10 + next as u32 % 5))
                    .unwrap();
                next += 1;
            }
        }
        if s.is_idle() {
            break;
        }
        if stop_after == Some(outs.len()) {
            return (outs, s, None);
        }
        let batch = s.step().unwrap().clone();
        let tokens = input_tokens(&s, &batch);
        match step(&batch, &tokens) {
            Ok(o) => outs.push(o),
            Err(e) => return (outs, s, Some(e)),
        }
        s.on_step_done(&sampled(&batch)).unwrap();
    }
    (outs, s, None)
}

/// Puts two ranks' outputs of one step side by side along the heads: each rank's are
/// `[layer][tokens, qh / 2, d]` in the order `Rank::step` writes them.
fn merge(a: &[f32], b: &[f32]) -> Vec<f32> {
    let half = (full_shape().num_q_heads / 2 * full_shape().head_dim) as usize;
    assert_eq!(a.len(), b.len());
    a.chunks(half)
        .zip(b.chunks(half))
        .flat_map(|(x, y)| x.iter().chain(y).copied())
        .collect()
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// The group the leader serves.
fn group(timeout: Option<Duration>) -> GroupConfig {
    GroupConfig {
        shape: full_shape(),
        num_layers: LAYERS as u32,
        model: MODEL.into(),
        engine: vec![7; 3],
        timeout,
    }
}

/// The worker rank's hello: what it expects to serve.
fn worker_hello() -> Hello {
    Hello {
        shape: full_shape(),
        num_layers: LAYERS as u32,
        shard: ShardSpec::new(1, 2).unwrap(),
        model: MODEL.into(),
        engine: Vec::new(),
    }
}

/// Starts the worker process and accepts its connection (at most 60 s; a worker that
/// exits first is a failure).
fn spawn_worker(dir: &Path) -> (Child, UnixStream) {
    let sock = dir.join("leader.sock");
    let listener = UnixListener::bind(&sock).unwrap();
    listener.set_nonblocking(true).unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "shards::shard_worker_process",
            "--ignored",
            "--nocapture",
        ])
        .env(WORKER_ENV, &sock)
        .spawn()
        .unwrap();
    let start = Instant::now();
    loop {
        match listener.accept() {
            Ok((s, _)) => {
                s.set_nonblocking(false).unwrap();
                return (child, s);
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                if let Some(status) = child.try_wait().unwrap() {
                    panic!("the worker exited before connecting: {status}");
                }
                assert!(
                    start.elapsed() < Duration::from_secs(60),
                    "no worker in 60 s"
                );
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => panic!("{e}"),
        }
    }
}

/// The worker rank: run by the two-process tests (this binary again, with the
/// leader's socket in `PAGEDKV_DIST_TEST_SOCKET`).
#[test]
#[ignore = "the worker rank of the two-process tests, which run it"]
fn shard_worker_process() {
    let Ok(path) = std::env::var(WORKER_ENV) else {
        println!("the worker rank of the two-process tests: nothing to do run alone");
        return;
    };
    let link = UnixStream::connect(path).unwrap();
    let mut w = Worker::accept(link, &worker_hello(), Some(Duration::from_secs(60))).unwrap();
    assert_eq!(w.hello().engine, [7; 3], "the leader's engine bytes");
    let mut rank = Rank::new(w.shard());
    while let Some(step) = w.next_step().unwrap() {
        let out = rank.step(&step.batch, &step.input_tokens);
        w.reply(step.step, bytes(&out)).unwrap();
    }
}

/// The outputs of one process holding every head.
fn single_process() -> (Vec<Vec<f32>>, Scheduler) {
    let mut whole = Rank::new(ShardSpec::WHOLE);
    let (outs, s, e) = serve(|b, t| Ok(whole.step(b, t)), None);
    assert!(e.is_none());
    (outs, s)
}

#[test]
fn two_processes_with_half_the_heads_each_equal_one_with_all_bit_for_bit() {
    let (want, s) = single_process();
    let m = s.metrics();
    assert!(m.prefix_hit_tokens > 0, "no prefix hits: {m:?}");
    assert!(
        m.preempted_recompute + m.preempted_swap > 0,
        "no preemption: {m:?}"
    );

    let dir = tempfile::tempdir().unwrap();
    let (mut child, link) = spawn_worker(dir.path());
    let mut leader = Leader::connect(vec![link], &group(Some(Duration::from_secs(60)))).unwrap();
    let mut rank0 = Rank::new(leader.shard());
    let (got, _, e) = serve(
        |b, t| {
            let step = leader.send_step(b, t)?;
            let mine = rank0.step(b, t);
            let theirs = leader.gather(step)?;
            Ok(merge(&mine, &f32s(&theirs[0])))
        },
        None,
    );
    assert!(e.is_none(), "{e:?}");
    leader.stop();
    assert!(child.wait().unwrap().success());
    assert_eq!(got.len(), want.len(), "steps");
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g.len(), w.len(), "step {i}");
        let same = g.iter().zip(w).all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(
            same,
            "step {i}: the shards' outputs differ from one process's"
        );
    }
}

#[test]
fn a_killed_worker_is_an_error_on_the_leader_and_nothing_is_lost() {
    let dir = tempfile::tempdir().unwrap();
    let (mut child, link) = spawn_worker(dir.path());
    let mut leader = Leader::connect(vec![link], &group(Some(Duration::from_secs(30)))).unwrap();
    let mut rank0 = Rank::new(leader.shard());
    let mut steps = 0;
    let start = Instant::now();
    let (_, s, e) = serve(
        |b, t| {
            if steps == 3 {
                child.kill().unwrap();
                child.wait().unwrap();
            }
            steps += 1;
            let step = leader.send_step(b, t)?;
            let mine = rank0.step(b, t);
            let theirs = leader.gather(step)?;
            Ok(merge(&mine, &f32s(&theirs[0])))
        },
        None,
    );
    let e = e.expect("the leader went on without its worker");
    assert!(matches!(e, DistError::Lost { rank: 1, .. }), "{e}");
    assert!(
        start.elapsed() < Duration::from_secs(30),
        "waited for the timeout"
    );
    // The failed step never reached on_step_done: every request is still live or
    // finished before, none dropped.
    let finished: Vec<u64> = s.finished().iter().map(|f| f.0).collect();
    // (Two requests arrive before each step: all of them by the fourth.)
    assert_eq!(steps, 4);
    let added = REQUESTS;
    for id in 0..added {
        assert!(
            finished.contains(&id) || s.request_seqs(id).is_ok(),
            "request {id} was lost"
        );
    }
    let m = s.metrics();
    assert_eq!(
        m.running + m.waiting + m.swapped + finished.len(),
        added as usize
    );
}

/// In-process checks of the protocol's refusals: a hello for another model, a step
/// planned for another shape, a frame of another version and a corrupted one are each
/// refused by the worker, and the leader's error says why.
#[test]
fn workers_refuse_what_does_not_match_and_the_leader_says_why() {
    // Another model.
    let (a, b) = UnixStream::pair().unwrap();
    let w = std::thread::spawn(move || Worker::accept(b, &worker_hello(), None).err().unwrap());
    let other = GroupConfig {
        model: "other model".into(),
        ..group(None)
    };
    let e = Leader::connect(vec![a], &other).err().unwrap();
    assert!(
        matches!(&e, DistError::Refused { rank: 1, reason } if reason.contains("model")),
        "{e}"
    );
    assert!(w.join().unwrap().to_string().contains("model"));

    // A step of another shape, another version, a corrupted frame: sent by hand after
    // a good hello.
    let bad_step = {
        let mut shape = full_shape();
        shape.head_dim = 128;
        encode(&Message::Step(Box::new(StepMessage {
            step: 0,
            shape,
            shard_size: 2,
            batch: Batch::default(),
            input_tokens: Vec::new(),
        })))
        .unwrap()
    };
    let mut other_version = encode(&Message::Stop).unwrap();
    other_version[4..6].copy_from_slice(&(WIRE_VERSION + 1).to_le_bytes());
    let mut corrupted = encode(&Message::Reply {
        step: 0,
        rank: 0,
        data: vec![1, 2, 3],
    })
    .unwrap();
    *corrupted.last_mut().unwrap() ^= 0x40;
    for (frame, want) in [
        (bad_step, "planned for"),
        (other_version, "wire version"),
        (corrupted, "checksum"),
    ] {
        let (mut a, b) = UnixStream::pair().unwrap();
        let w = std::thread::spawn(move || {
            let mut w = Worker::accept(b, &worker_hello(), None).unwrap();
            w.next_step().err().unwrap()
        });
        write_message(&mut a, &Message::Hello(worker_hello())).unwrap();
        let ready = pagedkv_dist::wire::read_message(&mut a, 1 << 20).unwrap();
        assert!(matches!(ready, Message::Ready { rank: 1 }));
        std::io::Write::write_all(&mut a, &frame).unwrap();
        let e = w.join().unwrap();
        assert!(e.to_string().contains(want), "{want}: {e}");
        match pagedkv_dist::wire::read_message(&mut a, 1 << 20).unwrap() {
            Message::Refused { rank: 1, reason } => assert!(reason.contains(want), "{reason}"),
            m => panic!("{want}: {m:?}"),
        }
    }
}

/// A link that edits the bytes the leader writes (`edit(offset in the stream, byte)`),
/// as a leader of another build or a corrupting network would send them.
struct Tamper<L> {
    inner: L,
    sent: usize,
    edit: fn(usize, u8) -> u8,
}

impl<L: pagedkv_dist::Link> std::io::Read for Tamper<L> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.inner.read(buf)
    }
}

impl<L: pagedkv_dist::Link> std::io::Write for Tamper<L> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let edited: Vec<u8> = (buf.iter().enumerate())
            .map(|(i, &b)| (self.edit)(self.sent + i, b))
            .collect();
        let n = self.inner.write(&edited)?;
        self.sent += n;
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

impl<L: pagedkv_dist::Link> pagedkv_dist::Link for Tamper<L> {
    fn set_read_timeout(&self, t: Option<Duration>) -> std::io::Result<()> {
        self.inner.set_read_timeout(t)
    }
    fn set_write_timeout(&self, t: Option<Duration>) -> std::io::Result<()> {
        self.inner.set_write_timeout(t)
    }
}

/// A hello of another wire version, or one whose checksum fails, is refused by the
/// worker with the check that failed, and `Leader::connect`'s error gives it (it was
/// "connection reset", or "closed the connection": the worker hung up without a word),
/// over a Unix socket and over TCP on loopback (where a worker that closes with the
/// hello's payload unread resets the connection, and the reset can overtake its
/// answer).
#[test]
fn a_hello_of_another_version_or_a_bad_checksum_is_refused_and_the_leader_says_why() {
    let other_version: fn(usize, u8) -> u8 = |i, b| match i {
        4 | 5 => (WIRE_VERSION + 1).to_le_bytes()[i - 4],
        _ => b,
    };
    // The first byte of the hello's CRC-32.
    let bad_checksum: fn(usize, u8) -> u8 = |i, b| if i == 12 { b ^ 0x5a } else { b };
    fn refused<L: pagedkv_dist::Link + Send + 'static>(
        (a, b): (L, L),
        edit: fn(usize, u8) -> u8,
        want: &str,
    ) {
        let timeout = Some(Duration::from_secs(30));
        let w = std::thread::spawn(move || {
            Worker::accept(b, &worker_hello(), timeout)
                .err()
                .expect("a bad hello accepted")
        });
        let link = Tamper {
            inner: a,
            sent: 0,
            edit,
        };
        let e = Leader::connect(vec![link], &group(timeout)).err().unwrap();
        assert!(
            matches!(&e, DistError::Refused { rank: 1, reason } if reason.contains(want)),
            "{want}: {e}"
        );
        let we = w.join().unwrap();
        assert!(we.to_string().contains(want), "{want}: {we}");
    }
    let tcp = || {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let a = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        (a, l.accept().unwrap().0)
    };
    for (edit, want) in [(other_version, "wire version"), (bad_checksum, "checksum")] {
        refused(UnixStream::pair().unwrap(), edit, want);
        for _ in 0..20 {
            refused(tcp(), edit, want);
        }
    }
}

/// A worker that answers out of turn is a protocol error that says what came, not
/// "expected Ready, got Ready": a Ready from another rank, a Reply to another step.
#[test]
fn an_answer_out_of_turn_says_what_was_expected_and_what_came() {
    let timeout = Some(Duration::from_secs(30));
    let (a, mut b) = UnixStream::pair().unwrap();
    let w = std::thread::spawn(move || {
        let hello = pagedkv_dist::wire::read_message(&mut b, 1 << 20).unwrap();
        assert!(matches!(hello, Message::Hello(_)));
        write_message(&mut b, &Message::Ready { rank: 2 }).unwrap();
        b
    });
    let e = Leader::connect(vec![a], &group(timeout)).err().unwrap();
    w.join().unwrap();
    let text = e.to_string();
    assert!(
        matches!(e, DistError::Protocol { rank: 1, .. })
            && text.contains("expected Ready from rank 1, got Ready from rank 2"),
        "{text}"
    );

    let (a, mut b) = UnixStream::pair().unwrap();
    let w = std::thread::spawn(move || {
        let _hello = pagedkv_dist::wire::read_message(&mut b, 1 << 20).unwrap();
        write_message(&mut b, &Message::Ready { rank: 1 }).unwrap();
        let _step = pagedkv_dist::wire::read_message(&mut b, 1 << 20).unwrap();
        let reply = Message::Reply {
            step: 5,
            rank: 1,
            data: Vec::new(),
        };
        write_message(&mut b, &reply).unwrap();
        b
    });
    let mut leader = Leader::connect(vec![a], &group(timeout)).unwrap();
    let step = leader.send_step(&Batch::default(), &[]).unwrap();
    let e = leader.gather(step).unwrap_err();
    w.join().unwrap();
    let text = e.to_string();
    assert!(
        text.contains("expected Reply to step 0 from rank 1, got Reply to step 5 from rank 1"),
        "{text}"
    );
}

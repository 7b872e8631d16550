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

use pagedkv_dist::wire::{Hello, Message, StepMessage, WIRE_VERSION, encode, write_message};
use pagedkv_dist::{DistError, GroupConfig, Leader, ShardSpec, Worker};
use pagedkv_host::backend::{
    AsView, AttentionBackend, BackendConfig, CpuBackend, DecodeArgs, KvAppendArgs, PagedCache,
    PrefillArgs, SplitPolicy, decode_rows, prefill_rows,
};
use pagedkv_host::ops::attention::AttentionOptions;
use pagedkv_host::ops::cascade::CascadePolicy;
use pagedkv_host::scheduler::{Batch, Request, Scheduler, SchedulerConfig};
use pagedkv_host::step::StepShape;
use pagedkv_host::{DType, HostTensor};

const LAYERS: usize = 2;
const MODEL: &str = "test-model rev 1";
/// The environment variable that turns `shard_worker_process` into the worker: the
/// leader's socket path.
const WORKER_ENV: &str = "PAGEDKV_DIST_TEST_SOCKET";

fn full_shape() -> StepShape {
    StepShape {
        num_q_heads: 8,
        num_kv_heads: 4,
        head_dim: 64,
        block_size: 16,
        num_blocks: 22,
        dtype: DType::F32,
        kv_dtype: DType::F32,
    }
}

/// A value in [-1, 1) from a tuple (splitmix64): the same on every rank.
fn value(parts: [u64; 6]) -> f64 {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for p in parts {
        x = (x ^ p).wrapping_add(0x9e37_79b9_7f4a_7c15);
        x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        x ^= x >> 31;
    }
    // 24 bits: exact in f32.
    (x >> 40) as f64 / (1u64 << 23) as f64 - 1.0
}

/// One rank's backend and cache over its heads.
struct Rank {
    be: CpuBackend,
    cache: PagedCache<HostTensor>,
    shard: ShardSpec,
    full: StepShape,
}

impl Rank {
    fn new(shard: ShardSpec) -> Self {
        let full = full_shape();
        let mut cfg = BackendConfig::new(shard.shape(&full).unwrap(), LAYERS, 8, 8);
        // The same plan on every rank: unsplit, flat.
        cfg.split = SplitPolicy::Never;
        cfg.cascade = CascadePolicy::Off;
        let mut be = CpuBackend::new(cfg).unwrap();
        let cache = be.alloc_cache().unwrap();
        Self {
            be,
            cache,
            shard,
            full,
        }
    }

    /// `[n, heads, d]` of this rank's heads of `kind` (1: K, 2: V, 3: Q) for the new
    /// tokens `tokens[i]` at `pos[i]` in `layer`; `heads` global heads from `first`.
    fn inputs(
        kind: u64,
        layer: usize,
        tokens: &[u32],
        pos: &[u32],
        first: u32,
        heads: u32,
        d: u32,
    ) -> HostTensor {
        let mut v = Vec::with_capacity(tokens.len() * (heads * d) as usize);
        for (&t, &p) in tokens.iter().zip(pos) {
            for h in first..first + heads {
                for j in 0..d {
                    v.push(value([
                        kind,
                        layer as u64,
                        t as u64,
                        p as u64,
                        h as u64,
                        j as u64,
                    ]));
                }
            }
        }
        HostTensor::from_f64(DType::F32, &[tokens.len(), heads as usize, d as usize], &v).unwrap()
    }

    /// A `[n, heads, d]` output poisoned with NaN.
    fn nan(&mut self, n: usize, heads: u32, d: u32) -> HostTensor {
        let t = HostTensor::full(DType::F32, &[n, heads as usize, d as usize], f64::NAN);
        self.be.upload(&t).unwrap()
    }

    /// An output's values.
    fn f32s(&mut self, o: &HostTensor) -> Vec<f32> {
        let v = self.be.download(o).unwrap().to_f64();
        v.iter().map(|&x| x as f32).collect()
    }

    /// One step over this rank's heads: per layer, the decode rows' outputs then the
    /// prefill tokens', `[tokens, q heads of this rank, head_dim]` each, as f32.
    fn step(&mut self, batch: &Batch, tokens: &[u32]) -> Vec<f32> {
        let shape = self.shard.shape(&self.full).unwrap();
        let (qh, kvh, d) = (shape.num_q_heads, shape.num_kv_heads, shape.head_dim);
        let q0 = self.shard.q_heads(&self.full).unwrap().start;
        let kv0 = self.shard.kv_heads(&self.full).unwrap().start;
        let mut pos = Vec::with_capacity(tokens.len());
        for s in &batch.seqs {
            pos.extend(s.start_pos..s.start_pos + s.num_new_tokens);
        }
        assert_eq!(pos.len(), tokens.len());
        self.be.begin_step(batch, &mut self.cache).unwrap();
        let opts = AttentionOptions::new(d);
        let decodes: Vec<usize> = decode_rows(batch)
            .map(|i| batch.seqs[i].token_offset as usize)
            .collect();
        let first_prefill = prefill_rows(batch)
            .next()
            .map(|i| batch.seqs[i].token_offset as usize);
        let mut out = Vec::new();
        for layer in 0..LAYERS {
            let k = Self::inputs(1, layer, tokens, &pos, kv0, kvh, d);
            let v = Self::inputs(2, layer, tokens, &pos, kv0, kvh, d);
            let (k, v) = (self.be.upload(&k).unwrap(), self.be.upload(&v).unwrap());
            self.be
                .kv_append(KvAppendArgs {
                    key: k.view(),
                    value: v.view(),
                    cache: &mut self.cache.layers[layer],
                    group: 0,
                })
                .unwrap();
            if !decodes.is_empty() {
                let dt: Vec<u32> = decodes.iter().map(|&i| tokens[i]).collect();
                let dp: Vec<u32> = decodes.iter().map(|&i| pos[i]).collect();
                let q = self
                    .be
                    .upload(&Self::inputs(3, layer, &dt, &dp, q0, qh, d))
                    .unwrap();
                let n = decodes.len();
                let mut o = self.nan(n, qh, d);
                self.be
                    .decode(DecodeArgs {
                        opts: &opts,
                        q: q.view(),
                        cache: &self.cache.layers[layer],
                        sinks: None,
                        group: 0,
                        out: o.view_mut(),
                        lse: None,
                    })
                    .unwrap();
                out.extend(self.f32s(&o));
            }
            if let Some(first) = first_prefill {
                let q = self
                    .be
                    .upload(&Self::inputs(
                        3,
                        layer,
                        &tokens[first..],
                        &pos[first..],
                        q0,
                        qh,
                        d,
                    ))
                    .unwrap();
                let n = tokens.len() - first;
                let mut o = self.nan(n, qh, d);
                self.be
                    .prefill(PrefillArgs {
                        opts: &opts,
                        q: q.view(),
                        cache: &self.cache.layers[layer],
                        sinks: None,
                        group: 0,
                        out: o.view_mut(),
                        lse: None,
                    })
                    .unwrap();
                out.extend(self.f32s(&o));
            }
        }
        assert!(out.iter().all(|x| x.is_finite()), "a NaN output");
        out
    }
}

/// The scheduler of every run: a pool small enough to preempt, prefix caching on.
fn scheduler() -> Scheduler {
    Scheduler::new(SchedulerConfig {
        num_blocks: full_shape().num_blocks,
        block_size: 16,
        max_num_seqs: 8,
        max_model_len: 128,
        enable_prefix_caching: true,
        ..SchedulerConfig::default()
    })
    .unwrap()
}

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

/// The token sampled for a request at a position: the same in every run.
fn sampled_token(request: u64, pos: u32) -> u32 {
    (request as u32 * 31 + pos * 7) % 1000
}

/// The step's input tokens, in `slot_mapping` order.
fn input_tokens(s: &Scheduler, batch: &Batch) -> Vec<u32> {
    let mut t = Vec::with_capacity(batch.slot_mapping.len());
    for q in &batch.seqs {
        let toks = s.tokens(q.seq).unwrap();
        t.extend(toks.range(
            q.start_pos as usize,
            (q.start_pos + q.num_new_tokens) as usize,
        ));
    }
    t
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
        let sampled: Vec<(u64, u32)> = batch
            .seqs
            .iter()
            .map(|q| (q.seq, sampled_token(q.request, q.context_len)))
            .collect();
        s.on_step_done(&sampled).unwrap();
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
            "shard_worker_process",
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
    let path = std::env::var(WORKER_ENV).expect("run by the two-process tests");
    let link = UnixStream::connect(path).unwrap();
    let mut w = Worker::accept(link, &worker_hello()).unwrap();
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
    let w = std::thread::spawn(move || Worker::accept(b, &worker_hello()).err().unwrap());
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
            let mut w = Worker::accept(b, &worker_hello()).unwrap();
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

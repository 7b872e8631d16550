//! The wire against hostile peers: a header claiming 256 MiB allocates only as bytes
//! arrive, and a peer that trickles a byte at a time (or reads one at a time) misses
//! the deadline of each call, the leader's and the worker's, as one that sends
//! nothing would (the bound was per read: a byte per timeout held the other side
//! forever).

use std::io::{ErrorKind, Read, Write};
use std::os::unix::net::UnixStream;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::common::{LAYERS, MODEL, alloc, full_shape};

use pagedkv_dist::wire::{
    DEFAULT_MAX_PAYLOAD, HEADER_BYTES, Hello, MAGIC, Message, StepMessage, WIRE_VERSION, WireError,
    encode, read_message, write_message,
};
use pagedkv_dist::{DistError, GroupConfig, Leader, ShardSpec, Worker};
use pagedkv_host::scheduler::Batch;

/// A frame header claiming `len` payload bytes.
fn header(len: u32) -> Vec<u8> {
    let mut h = Vec::with_capacity(HEADER_BYTES);
    h.extend_from_slice(&MAGIC);
    h.extend_from_slice(&WIRE_VERSION.to_le_bytes());
    h.extend_from_slice(&[0, 0]);
    h.extend_from_slice(&len.to_le_bytes());
    h.extend_from_slice(&0u32.to_le_bytes());
    h
}

/// A peer that sent `bytes`, in reads of at most `chunk`, and then stalls (its reads
/// time out).
struct Stalled {
    bytes: Vec<u8>,
    at: usize,
    chunk: usize,
}

impl Read for Stalled {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if self.at == self.bytes.len() {
            return Err(ErrorKind::WouldBlock.into());
        }
        let n = buf.len().min(self.chunk).min(self.bytes.len() - self.at);
        buf[..n].copy_from_slice(&self.bytes[self.at..self.at + n]);
        self.at += n;
        Ok(n)
    }
}

/// A header claiming 256 MiB then `sent` bytes of its payload: the reader holds at
/// most about twice what arrived (plus its first 64 KiB), however much the header
/// claims (it allocated the claimed length before the first byte: two stalled peers
/// held 512 MiB).
#[test]
fn a_frame_header_claiming_256_mib_allocates_with_the_bytes_that_arrive() {
    for sent in [0usize, 1000, 300_000, 3 << 20] {
        let mut bytes = header(DEFAULT_MAX_PAYLOAD);
        bytes.resize(HEADER_BYTES + sent, 7);
        let mut peer = Stalled {
            bytes,
            at: 0,
            chunk: 1 << 20,
        };
        let base = alloc::start();
        let e = read_message(&mut peer, DEFAULT_MAX_PAYLOAD).unwrap_err();
        let held = alloc::peak_since(base);
        assert!(
            matches!(&e, WireError::Io(io) if io.kind() == ErrorKind::WouldBlock),
            "{e}"
        );
        let bound = 2 * sent + (128 << 10);
        assert!(
            held <= bound as isize,
            "{sent} bytes of a 256 MiB payload arrived: {held} bytes held, more than {bound}"
        );
    }
    // A frame delivered a byte per read still reads whole.
    let frame = encode(&Message::Reply {
        step: 3,
        rank: 1,
        data: vec![5; 200_000],
    })
    .unwrap();
    let mut peer = Stalled {
        bytes: frame,
        at: 0,
        chunk: 1,
    };
    match read_message(&mut peer, DEFAULT_MAX_PAYLOAD).unwrap() {
        Message::Reply { step: 3, data, .. } => assert_eq!(data, vec![5; 200_000]),
        m => panic!("{m:?}"),
    }
}

/// Writes `bytes` to `to` one byte every `every`, until done or the other side is
/// gone; returns how many it wrote.
fn trickle(mut to: UnixStream, bytes: Vec<u8>, every: Duration) -> JoinHandle<usize> {
    std::thread::spawn(move || {
        for (i, b) in bytes.iter().enumerate() {
            if to.write_all(&[*b]).is_err() {
                return i;
            }
            std::thread::sleep(every);
        }
        bytes.len()
    })
}

fn group(timeout: Option<Duration>) -> GroupConfig {
    GroupConfig {
        shape: full_shape(),
        num_layers: LAYERS as u32,
        model: MODEL.into(),
        engine: Vec::new(),
        timeout,
    }
}

fn worker_hello() -> Hello {
    Hello {
        shape: full_shape(),
        num_layers: LAYERS as u32,
        shard: ShardSpec::new(1, 2).unwrap(),
        model: MODEL.into(),
        engine: Vec::new(),
    }
}

/// Well past every deadline below (200 ms, 300 ms idle), a margin for a loaded CI
/// machine, and well short of every trickle (5 s and more): a call that returns
/// within it kept its deadline.
const WITHIN: Duration = Duration::from_secs(3);
const TIMEOUT: Option<Duration> = Some(Duration::from_millis(200));

fn assert_lost_in_time(what: &str, e: Option<DistError>, start: Instant) {
    let took = start.elapsed();
    let e = e.unwrap_or_else(|| panic!("{what}: the trickled frame was accepted after {took:?}"));
    assert!(matches!(e, DistError::Lost { .. }), "{what}: {e}");
    assert!(
        took < WITHIN,
        "{what}: {took:?} for a deadline of {TIMEOUT:?} ({e})"
    );
}

/// A worker that trickles its Ready (a byte per 300 ms, 6 s in all) or its reply (a
/// byte per 40 ms, 5 s) makes `connect` and `gather` fail as lost within the group's
/// 200 ms, not when the last byte comes.
#[test]
fn a_worker_that_trickles_its_answer_is_lost_within_the_leaders_timeout() {
    let (a, mut b) = UnixStream::pair().unwrap();
    let start = Instant::now();
    let t = std::thread::spawn(move || {
        let _hello = read_message(&mut b, 1 << 20).unwrap();
        let ready = encode(&Message::Ready { rank: 1 }).unwrap();
        trickle(b, ready, Duration::from_millis(300))
            .join()
            .unwrap()
    });
    let e = Leader::connect(vec![a], &group(TIMEOUT)).err();
    assert_lost_in_time("connect", e, start);
    t.join().unwrap();

    let (a, mut b) = UnixStream::pair().unwrap();
    let t = std::thread::spawn(move || {
        let _hello = read_message(&mut b, 1 << 20).unwrap();
        write_message(&mut b, &Message::Ready { rank: 1 }).unwrap();
        let _step = read_message(&mut b, 1 << 20).unwrap();
        let reply = Message::Reply {
            step: 0,
            rank: 1,
            data: vec![1; 100],
        };
        trickle(b, encode(&reply).unwrap(), Duration::from_millis(40))
            .join()
            .unwrap()
    });
    let mut leader = Leader::connect(vec![a], &group(TIMEOUT)).unwrap();
    let step = leader.send_step(&Batch::default(), &[]).unwrap();
    let start = Instant::now();
    let e = leader.gather(step).err();
    assert_lost_in_time("gather", e, start);
    drop(leader);
    t.join().unwrap();
}

/// The worker has deadlines of its own: a leader that trickles its hello, or a step
/// once begun, is lost within the worker's timeout; a step that does not begin within
/// the idle timeout too; and a reply the leader does not read.
#[test]
fn a_leader_that_trickles_or_stalls_is_lost_within_the_workers_timeout() {
    let hello = encode(&Message::Hello(worker_hello())).unwrap();
    let (a, b) = UnixStream::pair().unwrap();
    let t = trickle(a, hello.clone(), Duration::from_millis(200));
    let start = Instant::now();
    let e = Worker::accept(b, &worker_hello(), TIMEOUT).err();
    assert_lost_in_time("accept", e, start);
    t.join().unwrap();

    // A step begun, then trickled.
    let step = encode(&Message::Step(Box::new(StepMessage {
        step: 0,
        shape: full_shape(),
        shard_size: 2,
        batch: Batch::default(),
        input_tokens: Vec::new(),
    })))
    .unwrap();
    let (mut a, b) = UnixStream::pair().unwrap();
    a.write_all(&hello).unwrap();
    let mut w = Worker::accept(b, &worker_hello(), TIMEOUT).unwrap();
    assert!(matches!(
        read_message(&mut a, 1 << 20).unwrap(),
        Message::Ready { rank: 1 }
    ));
    let t = trickle(a, step, Duration::from_millis(200));
    let start = Instant::now();
    let e = w.next_step().err();
    assert_lost_in_time("next_step, trickled", e, start);
    drop(w);
    t.join().unwrap();

    // No step within the idle timeout; a reply the leader never reads.
    let (mut a, b) = UnixStream::pair().unwrap();
    a.write_all(&hello).unwrap();
    let mut w = Worker::accept(b, &worker_hello(), TIMEOUT).unwrap();
    w.set_idle_timeout(Some(Duration::from_millis(300)));
    let start = Instant::now();
    let e = w.next_step().err();
    // The error names the bound that passed: the idle timeout, not the step's.
    let text = e.as_ref().map(|e| e.to_string()).unwrap_or_default();
    assert!(text.contains("nothing arrived within 300ms"), "{text}");
    assert_lost_in_time("next_step, idle", e, start);

    let (mut a, b) = UnixStream::pair().unwrap();
    a.write_all(&hello).unwrap();
    let mut w = Worker::accept(b, &worker_hello(), TIMEOUT).unwrap();
    let start = Instant::now();
    let e = w.reply(0, vec![0; 16 << 20]).err();
    assert_lost_in_time("reply", e, start);
    drop(a);
}

//! A leader and its worker ranks over any byte stream (a Unix socket, loopback or
//! real TCP): the hello that checks they serve the same thing, then one
//! [`StepMessage`] per step out and one reply per rank back.
//!
//! The leader runs the scheduler (and usually rank 0's backend); each worker runs its
//! rank's backend. Per step the leader [`send_step`](Leader::send_step)s the batch and
//! the step's input tokens, every rank runs its layers over its heads, the engine's
//! collectives (NCCL's all-reduce after the output projection, on the GPUs) combine
//! them, and the workers [`reply`](Worker::reply) with whatever the leader needs back
//! (in this crate's tests: their attention outputs, which the leader compares; in an
//! engine, often nothing but "done", the sampled token coming from rank 0).
//!
//! Failures are errors that name the rank, never a hang: each call of the leader
//! ([`Leader::connect`], [`send_step`](Leader::send_step),
//! [`gather`](Leader::gather)) has one deadline, its timeout from the call's start, for
//! every byte it writes and reads (a peer that trickles a byte per second is caught
//! as one that sends nothing), and so has each call of a [`Worker`]. A worker that
//! died or missed the deadline is [`DistError::Lost`], one that refused a hello or a
//! step (another wire version, model, shape or group size, a corrupted frame) is
//! [`DistError::Refused`] with its reason. The leader's scheduler is untouched by a
//! failed step: it has not seen `on_step_done`, so every request is still where it
//! was (the engine may retry the step on a replacement rank or abort).

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use pagedkv_host::scheduler::Batch;
use pagedkv_host::step::StepShape;

use crate::wire::{DEFAULT_MAX_PAYLOAD, Hello, Message, StepMessage, WireError, read_message};
use crate::{DistError, ShardSpec};

/// A byte stream to a peer whose reads and writes can time out.
pub trait Link: Read + Write {
    /// Sets how long one read may wait (`None`: forever).
    fn set_read_timeout(&self, timeout: Option<Duration>) -> std::io::Result<()>;
    /// Sets how long one write may wait for room (`None`: forever).
    fn set_write_timeout(&self, timeout: Option<Duration>) -> std::io::Result<()>;
}

impl Link for UnixStream {
    fn set_read_timeout(&self, timeout: Option<Duration>) -> std::io::Result<()> {
        UnixStream::set_read_timeout(self, timeout)
    }
    fn set_write_timeout(&self, timeout: Option<Duration>) -> std::io::Result<()> {
        UnixStream::set_write_timeout(self, timeout)
    }
}

impl Link for TcpStream {
    fn set_read_timeout(&self, timeout: Option<Duration>) -> std::io::Result<()> {
        TcpStream::set_read_timeout(self, timeout)
    }
    fn set_write_timeout(&self, timeout: Option<Duration>) -> std::io::Result<()> {
        TcpStream::set_write_timeout(self, timeout)
    }
}

/// `now + d`, or `None` (no deadline) when `d` is `None` or too far to represent.
pub(crate) fn deadline_in(d: Option<Duration>) -> Option<Instant> {
    d.and_then(|d| Instant::now().checked_add(d))
}

/// A bound in an error's words: `200ms`, or "its deadline" where none was given (a
/// deadline with no bound never passes, so this is for completeness).
fn within(bound: Option<Duration>) -> String {
    bound.map_or_else(|| "its deadline".into(), |d| format!("{d:?}"))
}

/// What is left until `by` as a socket timeout: `Ok(None)` for no deadline, an error
/// of kind `TimedOut` saying `what` once it has passed.
fn left_until(
    by: Option<Instant>,
    what: impl FnOnce() -> String,
) -> std::io::Result<Option<Duration>> {
    match by {
        None => Ok(None),
        Some(t) => {
            let left = t.saturating_duration_since(Instant::now());
            if left.is_zero() {
                Err(std::io::Error::new(ErrorKind::TimedOut, what()))
            } else {
                Ok(Some(left))
            }
        }
    }
}

/// Reads and drops what has already arrived on `link` (at most 1 MiB, waiting 10 ms
/// at most for each read), before a refusing worker closes it: a TCP socket closed
/// with unread bytes (a refused hello's payload) resets the connection, and the reset
/// may overtake the refusal the peer is about to read.
fn drain_arrived<L: Link>(link: &mut L) {
    if link
        .set_read_timeout(Some(Duration::from_millis(10)))
        .is_err()
    {
        return;
    }
    let mut buf = [0u8; 4096];
    let mut total = 0;
    while total < 1 << 20 {
        match link.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => total += n,
        }
    }
}

/// A link read against deadlines rather than per read: a frame's first byte must come
/// by `first_by`, and the rest within `rest_within` of it (`None`: by `first_by`).
/// Each read sets the link's timeout to what is left, so a peer that trickles a byte
/// per timeout is caught like one that sends nothing. Once a deadline has passed a
/// read fails with kind `TimedOut`; [`received`](Self::received) then says whether
/// the stream is still between frames (0) or out of step.
pub(crate) struct Paced<'a, L: Link> {
    link: &'a mut L,
    first_by: Option<Instant>,
    rest_within: Option<Duration>,
    rest_by: Option<Instant>,
    /// The bound of the first byte's wait, for the error's words.
    first_within: Option<Duration>,
    received: usize,
}

impl<'a, L: Link> Paced<'a, L> {
    /// Reads of one frame from `link`: its first byte by `first_by` (which is
    /// `first_within` from the start of the wait: the error's words), the rest within
    /// `rest_within` of it (`None`: by `first_by`).
    pub(crate) fn new(
        link: &'a mut L,
        (first_by, first_within): (Option<Instant>, Option<Duration>),
        rest_within: Option<Duration>,
    ) -> Self {
        Self {
            link,
            first_by,
            rest_within,
            rest_by: first_by,
            first_within,
            received: 0,
        }
    }

    /// Bytes of the frame read so far.
    #[cfg_attr(not(feature = "nixl"), allow(dead_code))]
    pub(crate) fn received(&self) -> usize {
        self.received
    }
}

impl<L: Link> Read for Paced<'_, L> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        loop {
            let (by, received) = if self.received == 0 {
                (self.first_by, 0)
            } else {
                (self.rest_by, self.received)
            };
            let (first, rest) = (self.first_within, self.rest_within.or(self.first_within));
            let left = left_until(by, || {
                if received == 0 {
                    format!("nothing arrived within {}", within(first))
                } else {
                    format!(
                        "a frame stopped {received} bytes in: not whole within {}",
                        within(rest)
                    )
                }
            })?;
            self.link.set_read_timeout(left)?;
            match self.link.read(buf) {
                Ok(n) => {
                    if self.received == 0 && n > 0 && self.rest_within.is_some() {
                        self.rest_by = deadline_in(self.rest_within);
                    }
                    self.received += n;
                    return Ok(n);
                }
                // The link's own timeout: the deadline decides, above.
                Err(e)
                    if matches!(
                        e.kind(),
                        ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted
                    ) => {}
                Err(e) => return Err(e),
            }
        }
    }
}

/// Writes `frame` to `link` by `by` (`None`: as long as it takes), each write's
/// timeout what is left: a peer that reads a byte per timeout is caught like one that
/// reads nothing. `bound` is what the error says was exceeded.
pub(crate) fn write_by<L: Link>(
    link: &mut L,
    frame: &[u8],
    by: Option<Instant>,
    bound: Option<Duration>,
) -> std::io::Result<()> {
    let mut sent = 0;
    while sent < frame.len() {
        let left = left_until(by, || {
            format!(
                "the peer took {sent} of {} bytes, not all within {}: it is not reading",
                frame.len(),
                within(bound)
            )
        })?;
        link.set_write_timeout(left)?;
        match link.write(&frame[sent..]) {
            Ok(0) => return Err(ErrorKind::WriteZero.into()),
            Ok(n) => sent += n,
            Err(e)
                if matches!(
                    e.kind(),
                    ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted
                ) => {}
            Err(e) => return Err(e),
        }
    }
    link.flush()
}

/// `msg` as a frame written by `by` ([`write_by`]).
pub(crate) fn write_message_by<L: Link>(
    link: &mut L,
    msg: &Message,
    by: Option<Instant>,
    bound: Option<Duration>,
) -> Result<(), WireError> {
    let frame = crate::wire::encode(msg)?;
    Ok(write_by(link, &frame, by, bound)?)
}

/// A failed read from `rank`, as the caller should see it.
fn lost_or_wire(rank: u32, e: WireError, timeout: Option<Duration>) -> DistError {
    use std::io::ErrorKind::*;
    match e {
        WireError::Closed => DistError::Lost {
            rank,
            detail: "it closed the connection (exited or was killed)".into(),
        },
        // A deadline of ours ([`Paced`], [`write_by`]): its words say which.
        WireError::Io(io) if io.kind() == TimedOut => DistError::Lost {
            rank,
            detail: io.to_string(),
        },
        WireError::Io(io) if io.kind() == WouldBlock => DistError::Lost {
            rank,
            detail: format!("no answer within {timeout:?}"),
        },
        WireError::Io(io)
            if matches!(
                io.kind(),
                BrokenPipe | ConnectionReset | ConnectionAborted | UnexpectedEof
            ) =>
        {
            DistError::Lost {
                rank,
                detail: io.to_string(),
            }
        }
        e => DistError::Wire { rank, source: e },
    }
}

/// What a leader tells its group ([`Leader::connect`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupConfig {
    /// The model's attention shape, unsharded.
    pub shape: StepShape,
    /// Layers of the model.
    pub num_layers: u32,
    /// The model's fingerprint, as [`Hello::model`].
    pub model: String,
    /// Bytes for every rank, as [`Hello::engine`] (the NCCL id, say).
    pub engine: Vec<u8>,
    /// How long one call of the leader may take in all (`None`: forever; then a
    /// worker that hangs without closing its connection hangs the leader): `connect`
    /// (every hello written, every `Ready` read), `send_step` (the step written to
    /// every worker), `gather` (every reply read). The bound is the call's, not each
    /// read's: a worker that trickles its bytes misses it as one that sends nothing.
    pub timeout: Option<Duration>,
}

/// The leader's side: the links to ranks `1..size` (rank 0 is the leader's own).
pub struct Leader<L: Link> {
    links: Vec<L>,
    shape: StepShape,
    size: u32,
    next_step: u64,
    timeout: Option<Duration>,
    max_payload: u32,
    /// The first error: the links may be out of step since, so every later call
    /// fails with it (recovery is a new connection).
    broken: Option<String>,
}

impl<L: Link> Leader<L> {
    /// Greets the workers: `links[i]` is rank `i + 1` of `links.len() + 1`, each sent
    /// a [`Hello`] of `group`, and awaited [`Message::Ready`], all within
    /// `group.timeout` of the call. An error names the first rank that refused (with
    /// its reason), failed or did not answer.
    pub fn connect(links: Vec<L>, group: &GroupConfig) -> Result<Self, DistError> {
        let (shape, timeout) = (group.shape, group.timeout);
        let size = u32::try_from(links.len() + 1)
            .map_err(|_| DistError::Shard("more ranks than u32 holds".into()))?;
        ShardSpec::new(0, size)?.shape(&shape)?;
        let mut me = Self {
            links,
            shape,
            size,
            next_step: 0,
            timeout,
            max_payload: DEFAULT_MAX_PAYLOAD,
            broken: None,
        };
        let by = deadline_in(timeout);
        for (i, link) in me.links.iter_mut().enumerate() {
            let rank = i as u32 + 1;
            let hello = Hello {
                shape,
                num_layers: group.num_layers,
                shard: ShardSpec { rank, size },
                model: group.model.clone(),
                engine: group.engine.clone(),
            };
            write_message_by(link, &Message::Hello(hello), by, timeout)
                .map_err(|e| lost_or_wire(rank, e, timeout))?;
        }
        for rank in 1..size {
            match me.read(rank, by)? {
                Message::Ready { rank: r } if r == rank => {}
                m => return Err(me.unexpected(rank, m, &format!("Ready from rank {rank}"))),
            }
        }
        Ok(me)
    }

    /// The leader's own shard (rank 0).
    pub fn shard(&self) -> ShardSpec {
        ShardSpec {
            rank: 0,
            size: self.size,
        }
    }

    /// Sends one step to every worker: the batch as the scheduler handed it out and
    /// the step's input tokens (one per `batch.slot_mapping` entry, checked). Returns
    /// the step's number, for [`gather`](Self::gather). Every worker must take the
    /// whole step within the group's timeout of the call. After any error of this or
    /// [`gather`](Self::gather), every later call fails with it: some ranks may have
    /// the step and others not, so the group must be connected again.
    pub fn send_step(&mut self, batch: &Batch, input_tokens: &[u32]) -> Result<u64, DistError> {
        self.check_broken()?;
        let r = self.send_step_inner(batch, input_tokens);
        self.note(r)
    }

    fn send_step_inner(&mut self, batch: &Batch, input_tokens: &[u32]) -> Result<u64, DistError> {
        if input_tokens.len() != batch.slot_mapping.len() {
            return Err(DistError::Mismatch(format!(
                "{} input tokens for a step of {} new tokens",
                input_tokens.len(),
                batch.slot_mapping.len()
            )));
        }
        let step = self.next_step;
        let msg = Message::Step(Box::new(StepMessage {
            step,
            shape: self.shape,
            shard_size: self.size,
            batch: batch.clone(),
            input_tokens: input_tokens.to_vec(),
        }));
        let frame =
            crate::wire::encode(&msg).map_err(|e| DistError::Wire { rank: 0, source: e })?;
        let by = deadline_in(self.timeout);
        for (i, link) in self.links.iter_mut().enumerate() {
            let rank = i as u32 + 1;
            write_by(link, &frame, by, self.timeout)
                .map_err(|e| lost_or_wire(rank, e.into(), self.timeout))?;
        }
        self.next_step += 1;
        Ok(step)
    }

    /// Every worker's reply to step `step`, in rank order (ranks `1..size`), all within
    /// the group's timeout of the call.
    pub fn gather(&mut self, step: u64) -> Result<Vec<Vec<u8>>, DistError> {
        self.check_broken()?;
        let r = self.gather_inner(step);
        self.note(r)
    }

    fn check_broken(&self) -> Result<(), DistError> {
        match &self.broken {
            Some(e) => Err(DistError::Broken(e.clone())),
            None => Ok(()),
        }
    }

    /// Records the first error.
    fn note<T>(&mut self, r: Result<T, DistError>) -> Result<T, DistError> {
        if let Err(e) = &r {
            self.broken.get_or_insert_with(|| e.to_string());
        }
        r
    }

    fn gather_inner(&mut self, step: u64) -> Result<Vec<Vec<u8>>, DistError> {
        let mut out = Vec::with_capacity(self.links.len());
        let by = deadline_in(self.timeout);
        for rank in 1..self.size {
            match self.read(rank, by)? {
                Message::Reply {
                    step: s,
                    rank: r,
                    data,
                } if s == step && r == rank => out.push(data),
                m => {
                    let want = format!("Reply to step {step} from rank {rank}");
                    return Err(self.unexpected(rank, m, &want));
                }
            }
        }
        Ok(out)
    }

    /// Tells every worker to stop, within the group's timeout (a worker that is gone
    /// already, or not reading, is not an error).
    pub fn stop(mut self) {
        let by = deadline_in(self.timeout);
        for link in &mut self.links {
            let _ = write_message_by(link, &Message::Stop, by, self.timeout);
        }
    }

    /// The next frame from `rank`, whole by `by`.
    fn read(&mut self, rank: u32, by: Option<Instant>) -> Result<Message, DistError> {
        let link = &mut self.links[rank as usize - 1];
        read_message(
            &mut Paced::new(link, (by, self.timeout), None),
            self.max_payload,
        )
        .map_err(|e| lost_or_wire(rank, e, self.timeout))
    }

    fn unexpected(&self, rank: u32, m: Message, want: &str) -> DistError {
        match m {
            Message::Refused { reason, .. } => DistError::Refused { rank, reason },
            m => DistError::Protocol {
                rank,
                detail: format!("expected {want}, got {}", describe(&m)),
            },
        }
    }
}

/// A message in a few words: its kind and what tells it from another of that kind.
pub(crate) fn describe(m: &Message) -> String {
    match m {
        Message::Hello(h) => format!("Hello for rank {} of {}", h.shard.rank, h.shard.size),
        Message::Ready { rank } => format!("Ready from rank {rank}"),
        Message::Refused { rank, .. } => format!("Refused from rank {rank}"),
        Message::Step(s) => format!("Step {}", s.step),
        Message::Reply { step, rank, .. } => format!("Reply to step {step} from rank {rank}"),
        Message::Stop => "Stop".into(),
        Message::Export(e) => format!("Export of request {}", e.request),
        Message::NixlOffer { seq, .. } => format!("NixlOffer {seq}"),
        Message::NixlDone { seq } => format!("NixlDone {seq}"),
    }
}

/// A worker rank's side.
pub struct Worker<L: Link> {
    link: L,
    hello: Hello,
    max_payload: u32,
    /// How long a call may take (`None`: forever): the hello, each step frame from its
    /// first byte, each reply.
    timeout: Option<Duration>,
    /// How long [`next_step`](Self::next_step) waits for a step to begin.
    idle_timeout: Option<Duration>,
    /// A frame failed: the stream may be out of step, every later read fails.
    broken: Option<String>,
}

impl<L: Link> Worker<L> {
    /// Waits for the leader's [`Hello`] and compares it with `expect` (shard, shape,
    /// layers, model; not `engine`, which the leader sends and
    /// [`hello`](Self::hello) returns): [`Message::Ready`] when they match, else
    /// [`Message::Refused`] with what differs, and that as the error. A hello that
    /// fails its checks (another wire version, a bad checksum, a malformed payload) is
    /// refused the same way, with the check that failed: the leader's error says why.
    ///
    /// `timeout` bounds this call (the hello read and the answer written) and, kept,
    /// every later one: each step's frame from its first byte, each reply
    /// ([`set_idle_timeout`](Self::set_idle_timeout) bounds the wait for a step to
    /// begin). `None`: forever (a leader that hangs without closing its connection
    /// then hangs the worker).
    pub fn accept(
        mut link: L,
        expect: &Hello,
        timeout: Option<Duration>,
    ) -> Result<Self, DistError> {
        let rank = expect.shard.rank;
        let by = deadline_in(timeout);
        let refuse = |link: &mut L, reason: String| {
            let _ = write_message_by(
                link,
                &Message::Refused {
                    rank,
                    reason: reason.clone(),
                },
                by,
                timeout,
            );
            drain_arrived(link);
            reason
        };
        let mut paced = Paced::new(&mut link, (by, timeout), None);
        let got = match read_message(&mut paced, DEFAULT_MAX_PAYLOAD) {
            Ok(Message::Hello(h)) => h,
            Ok(m) => {
                let detail = format!("expected Hello, got {}", describe(&m));
                return Err(DistError::Protocol {
                    rank: 0,
                    detail: refuse(&mut link, detail),
                });
            }
            Err(e @ (WireError::Io(_) | WireError::Closed)) => {
                return Err(lost_or_wire(0, e, timeout));
            }
            Err(e) => {
                refuse(
                    &mut link,
                    format!("the leader's hello failed its checks: {e}"),
                );
                return Err(DistError::Wire { rank: 0, source: e });
            }
        };
        let mut diffs = Vec::new();
        if got.shard != expect.shard {
            diffs.push(format!(
                "rank {} of {} (this worker: {} of {})",
                got.shard.rank, got.shard.size, expect.shard.rank, expect.shard.size
            ));
        }
        if got.shape != expect.shape {
            diffs.push(format!(
                "shape {:?} (this worker: {:?})",
                got.shape, expect.shape
            ));
        }
        if got.num_layers != expect.num_layers {
            diffs.push(format!(
                "{} layers (this worker: {})",
                got.num_layers, expect.num_layers
            ));
        }
        if got.model != expect.model {
            diffs.push(format!(
                "model {:?} (this worker: {:?})",
                got.model, expect.model
            ));
        }
        if !diffs.is_empty() {
            let reason = format!("the leader's hello does not match: {}", diffs.join("; "));
            return Err(DistError::Mismatch(refuse(&mut link, reason)));
        }
        if let Err(e) = expect.shard.shape(&expect.shape) {
            refuse(
                &mut link,
                format!("this worker cannot serve its own shard: {e}"),
            );
            return Err(e);
        }
        write_message_by(&mut link, &Message::Ready { rank }, by, timeout)
            .map_err(|e| lost_or_wire(0, e, timeout))?;
        Ok(Self {
            link,
            hello: got,
            max_payload: DEFAULT_MAX_PAYLOAD,
            timeout,
            idle_timeout: None,
            broken: None,
        })
    }

    /// How long [`next_step`](Self::next_step) waits for the leader's next step to
    /// begin (`None`, the default: as long as it takes, since a group with no
    /// requests sends no steps; set it when the leader is known to send steps at some
    /// rate). A step's frame, once begun, must arrive whole within the timeout of
    /// [`accept`](Self::accept) either way.
    pub fn set_idle_timeout(&mut self, idle: Option<Duration>) {
        self.idle_timeout = idle;
    }

    /// The leader's hello (with its [`Hello::engine`] bytes).
    pub fn hello(&self) -> &Hello {
        &self.hello
    }

    /// This worker's shard.
    pub fn shard(&self) -> ShardSpec {
        self.hello.shard
    }

    /// The shape this rank's backend serves (its slice of the heads).
    pub fn shape(&self) -> StepShape {
        self.hello
            .shard
            .shape(&self.hello.shape)
            .expect("checked by accept")
    }

    /// The next step, or `None` when the leader stopped or closed the connection. A
    /// frame that fails its checks (another wire version, a bad checksum, a malformed
    /// payload) or a step planned for another shape or group size is refused: the
    /// leader is told why, and the error returned; a step that does not begin within
    /// the idle timeout, or not arrive whole within the timeout of its first byte, is
    /// [`DistError::Lost`]. After any error every later call fails with it (the stream
    /// may be out of step).
    pub fn next_step(&mut self) -> Result<Option<StepMessage>, DistError> {
        if let Some(e) = &self.broken {
            return Err(DistError::Broken(e.clone()));
        }
        let r = self.next_step_inner();
        if let Err(e) = &r {
            self.broken = Some(e.to_string());
        }
        r
    }

    fn next_step_inner(&mut self) -> Result<Option<StepMessage>, DistError> {
        let rank = self.hello.shard.rank;
        let mut paced = Paced::new(
            &mut self.link,
            (deadline_in(self.idle_timeout), self.idle_timeout),
            self.timeout,
        );
        let msg = match read_message(&mut paced, self.max_payload) {
            Ok(m) => m,
            Err(WireError::Closed) => return Ok(None),
            Err(e @ WireError::Io(_)) => return Err(lost_or_wire(0, e, self.timeout)),
            Err(e) => {
                self.refuse(format!("a frame failed its checks: {e}"));
                return Err(DistError::Wire { rank: 0, source: e });
            }
        };
        let step = match msg {
            Message::Stop => return Ok(None),
            Message::Step(s) => s,
            m => {
                let reason = format!("expected Step or Stop, got {}", describe(&m));
                self.refuse(reason.clone());
                return Err(DistError::Protocol {
                    rank: 0,
                    detail: reason,
                });
            }
        };
        if step.shape != self.hello.shape || step.shard_size != self.hello.shard.size {
            let reason = format!(
                "step {} was planned for {:?} over {} ranks; rank {rank} serves {:?} over {}",
                step.step, step.shape, step.shard_size, self.hello.shape, self.hello.shard.size
            );
            self.refuse(reason.clone());
            return Err(DistError::Mismatch(reason));
        }
        if step.input_tokens.len() != step.batch.slot_mapping.len() {
            let reason = format!(
                "step {}: {} input tokens for {} new tokens",
                step.step,
                step.input_tokens.len(),
                step.batch.slot_mapping.len()
            );
            self.refuse(reason.clone());
            return Err(DistError::Mismatch(reason));
        }
        Ok(Some(*step))
    }

    /// Answers step `step` with the engine's bytes, within the timeout.
    pub fn reply(&mut self, step: u64, data: Vec<u8>) -> Result<(), DistError> {
        let rank = self.hello.shard.rank;
        let msg = Message::Reply { step, rank, data };
        write_message_by(
            &mut self.link,
            &msg,
            deadline_in(self.timeout),
            self.timeout,
        )
        .map_err(|e| lost_or_wire(0, e, self.timeout))
    }

    fn refuse(&mut self, reason: String) {
        let rank = self.hello.shard.rank;
        let msg = Message::Refused { rank, reason };
        let _ = write_message_by(
            &mut self.link,
            &msg,
            deadline_in(self.timeout),
            self.timeout,
        );
    }
}

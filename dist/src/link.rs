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
//! Failures are errors that name the rank, never a hang: the leader waits at most its
//! timeout for each reply, a worker that died is [`DistError::Lost`], one that refused
//! a step (another wire version, shape or group size, a corrupted frame) is
//! [`DistError::Refused`] with its reason. The leader's scheduler is untouched by a
//! failed step: it has not seen `on_step_done`, so every request is still where it
//! was (the engine may retry the step on a replacement rank or abort).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::time::Duration;

use pagedkv_host::scheduler::Batch;
use pagedkv_host::step::StepShape;

use crate::wire::{
    DEFAULT_MAX_PAYLOAD, Hello, Message, StepMessage, WireError, read_message, write_message,
};
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

/// A failed read from `rank`, as the caller should see it.
fn lost_or_wire(rank: u32, e: WireError, timeout: Option<Duration>) -> DistError {
    use std::io::ErrorKind::*;
    match e {
        WireError::Closed => DistError::Lost {
            rank,
            detail: "it closed the connection (exited or was killed)".into(),
        },
        WireError::Io(io) if matches!(io.kind(), WouldBlock | TimedOut) => DistError::Lost {
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
    /// How long one read or write of the leader's may wait (`None`: forever; then a
    /// worker that hangs without closing its connection hangs the leader). A reply
    /// that trickles in a few bytes per timeout is not caught: the bound is per read.
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
    /// a [`Hello`] of `group`, and awaited [`Message::Ready`]. Every read waits at most
    /// `group.timeout`. An error names the first rank that refused, failed or did not
    /// answer.
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
        for (i, link) in me.links.iter_mut().enumerate() {
            let rank = i as u32 + 1;
            link.set_read_timeout(timeout)
                .and_then(|()| link.set_write_timeout(timeout))
                .map_err(|e| DistError::Wire {
                    rank,
                    source: e.into(),
                })?;
            let hello = Hello {
                shape,
                num_layers: group.num_layers,
                shard: ShardSpec { rank, size },
                model: group.model.clone(),
                engine: group.engine.clone(),
            };
            write_message(link, &Message::Hello(hello))
                .map_err(|e| lost_or_wire(rank, e, timeout))?;
        }
        for rank in 1..size {
            match me.read(rank)? {
                Message::Ready { rank: r } if r == rank => {}
                m => return Err(me.unexpected(rank, m, "Ready")),
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
    /// the step's number, for [`gather`](Self::gather). After any error of this or
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
        for (i, link) in self.links.iter_mut().enumerate() {
            let rank = i as u32 + 1;
            link.write_all(&frame)
                .and_then(|()| link.flush())
                .map_err(|e| lost_or_wire(rank, e.into(), self.timeout))?;
        }
        self.next_step += 1;
        Ok(step)
    }

    /// Every worker's reply to step `step`, in rank order (ranks `1..size`).
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
        for rank in 1..self.size {
            match self.read(rank)? {
                Message::Reply {
                    step: s,
                    rank: r,
                    data,
                } if s == step && r == rank => out.push(data),
                m => return Err(self.unexpected(rank, m, &format!("Reply to step {step}"))),
            }
        }
        Ok(out)
    }

    /// Tells every worker to stop (a worker that is gone already is not an error).
    pub fn stop(mut self) {
        for link in &mut self.links {
            let _ = write_message(link, &Message::Stop);
        }
    }

    fn read(&mut self, rank: u32) -> Result<Message, DistError> {
        let link = &mut self.links[rank as usize - 1];
        read_message(link, self.max_payload).map_err(|e| lost_or_wire(rank, e, self.timeout))
    }

    fn unexpected(&self, rank: u32, m: Message, want: &str) -> DistError {
        match m {
            Message::Refused { reason, .. } => DistError::Refused { rank, reason },
            m => DistError::Protocol {
                rank,
                detail: format!("expected {want}, got {}", kind(&m)),
            },
        }
    }
}

fn kind(m: &Message) -> &'static str {
    match m {
        Message::Hello(_) => "Hello",
        Message::Ready { .. } => "Ready",
        Message::Refused { .. } => "Refused",
        Message::Step(_) => "Step",
        Message::Reply { .. } => "Reply",
        Message::Stop => "Stop",
        Message::Export(_) => "Export",
        Message::NixlOffer { .. } => "NixlOffer",
        Message::NixlDone { .. } => "NixlDone",
    }
}

/// A worker rank's side.
pub struct Worker<L: Link> {
    link: L,
    hello: Hello,
    max_payload: u32,
    /// A frame failed: the stream may be out of step, every later read fails.
    broken: Option<String>,
}

impl<L: Link> Worker<L> {
    /// Waits for the leader's [`Hello`] and compares it with `expect` (shard, shape,
    /// layers, model; not `engine`, which the leader sends and
    /// [`hello`](Self::hello) returns): [`Message::Ready`] when they match, else
    /// [`Message::Refused`] with what differs, and that as the error.
    pub fn accept(mut link: L, expect: &Hello) -> Result<Self, DistError> {
        let rank = expect.shard.rank;
        let got = match read_message(&mut link, DEFAULT_MAX_PAYLOAD) {
            Ok(Message::Hello(h)) => h,
            Ok(m) => {
                return Err(DistError::Protocol {
                    rank: 0,
                    detail: format!("expected Hello, got {}", kind(&m)),
                });
            }
            Err(e) => return Err(lost_or_wire(0, e, None)),
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
            let _ = write_message(
                &mut link,
                &Message::Refused {
                    rank,
                    reason: reason.clone(),
                },
            );
            return Err(DistError::Mismatch(reason));
        }
        expect.shard.shape(&expect.shape)?;
        write_message(&mut link, &Message::Ready { rank }).map_err(|e| lost_or_wire(0, e, None))?;
        Ok(Self {
            link,
            hello: got,
            max_payload: DEFAULT_MAX_PAYLOAD,
            broken: None,
        })
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
    /// leader is told why, and the error returned; every later call fails with it (the
    /// stream may be out of step).
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
        let msg = match read_message(&mut self.link, self.max_payload) {
            Ok(m) => m,
            Err(WireError::Closed) => return Ok(None),
            Err(e) => {
                self.refuse(format!("a frame failed its checks: {e}"));
                return Err(DistError::Wire { rank: 0, source: e });
            }
        };
        let step = match msg {
            Message::Stop => return Ok(None),
            Message::Step(s) => s,
            m => {
                let reason = format!("expected Step or Stop, got {}", kind(&m));
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

    /// Answers step `step` with the engine's bytes.
    pub fn reply(&mut self, step: u64, data: Vec<u8>) -> Result<(), DistError> {
        let rank = self.hello.shard.rank;
        write_message(&mut self.link, &Message::Reply { step, rank, data })
            .map_err(|e| lost_or_wire(0, e, None))
    }

    fn refuse(&mut self, reason: String) {
        let rank = self.hello.shard.rank;
        let _ = write_message(&mut self.link, &Message::Refused { rank, reason });
    }
}

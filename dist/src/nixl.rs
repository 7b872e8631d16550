//! KV transfers over NIXL (feature `nixl`): the receiver reads the sender's frame
//! straight out of the sender's registered memory, as a decode instance reads a
//! prefill instance's blocks over RDMA (here: host memory, UCX over TCP).
//!
//! [`NixlTransfer`] is a [`Transfer`]: `send` copies the frame (an
//! [`encode_export`](crate::transfer::encode_export)) into memory it registers with
//! its NIXL agent, offers it on a side channel ([`Message::NixlOffer`]: the agent's
//! metadata, the address and length) and waits until the receiver says it is done
//! with it ([`Message::NixlDone`]); `recv` takes an offer, loads the sender's
//! metadata, reads the frame with a NIXL `READ` into memory of its own, and
//! acknowledges. The frame then goes through the same checks as any other (CRC-32,
//! descriptor, names). Whatever fails (no offer in time, a read that fails or does not
//! complete in time, the library missing) is an error from `recv` that says why, or
//! `Ok(None)` when no offer came: the request is recomputed.
//!
//! **Memory.** Every failed path gives its memory back, except where NIXL may still
//! touch it: an offer not yet acknowledged (the receiver may be reading it) stays
//! registered until its acknowledgement arrives (read by later calls) or the transfer
//! is dropped; a read that did not complete in time stays registered until it ends
//! (checked by later calls, then acknowledged). What is held so is bounded by
//! [`NixlTransfer::max_outstanding_bytes`]: past it `send` and `recv` refuse, saying
//! how much is held and why. The receiver acknowledges an offer it will not read (too
//! long, over the bound, a read that could not start or failed) too: the sender may
//! release it. Dropping the transfer destroys its agent before it frees the memory.
//!
//! nixl-sys is built with its `stub-api` feature: no NIXL headers at build time, the
//! library (`libnixl_capi.so`) opened when first used. [`NixlTransfer::new`] checks it
//! is there (`scripts/install-nixl.sh` installs it from the nixl-cu12 wheel and
//! prints the `LD_LIBRARY_PATH`, `NIXL_PLUGIN_DIR` and `UCX_TLS` a process needs).

use std::mem::ManuallyDrop;
use std::time::{Duration, Instant};

use nixl_sys::{
    Agent, Backend, MemType, MemoryRegion, NixlDescriptor, RegistrationHandle, XferDescList,
    XferOp, XferRequest, XferStatus,
};

use crate::link::{Link, Paced, deadline_in, describe, write_message_by};
use crate::transfer::{Transfer, TransferError};
use crate::wire::{DEFAULT_MAX_PAYLOAD, Message, WireError, read_message};

/// Host memory NIXL reads from or writes into. Its bytes are only touched by Rust
/// when no transfer on it is in flight (see [`NixlTransfer`]).
#[derive(Debug)]
struct Region {
    data: Vec<u8>,
}

impl MemoryRegion for Region {
    unsafe fn as_ptr(&self) -> *const u8 {
        self.data.as_ptr()
    }

    fn size(&self) -> usize {
        self.data.len()
    }
}

impl NixlDescriptor for Region {
    fn mem_type(&self) -> MemType {
        MemType::Dram
    }

    fn device_id(&self) -> u64 {
        0
    }
}

/// The least time an acknowledgement gets to be written, when its call's deadline
/// is sooner.
const ACK_GRACE: Duration = Duration::from_millis(100);

fn nixl_err(what: &str, e: impl std::fmt::Debug) -> TransferError {
    TransferError::Transport(format!("NIXL {what}: {e:?}"))
}

/// An offer sent and not acknowledged: the receiver may be reading its memory.
struct Unacked {
    seq: u64,
    // (Deregistered before the region is freed: fields drop in order.)
    handle: RegistrationHandle,
    region: Region,
}

/// A read posted that did not complete in time: NIXL may still write its memory.
struct Stranded {
    seq: u64,
    req: XferRequest,
    handle: RegistrationHandle,
    region: Region,
}

/// One side of NIXL transfers: an agent with the UCX backend, and the side channel to
/// the peer (a Unix socket or TCP stream: offers and acknowledgements, a few hundred
/// bytes each).
///
/// One direction per transfer: a prefill instance's object only sends and the decode
/// instance's only receives (a `send` reads acknowledgements off the side channel and
/// would take an offer for one; an instance that does both keeps two, over two side
/// channels). `recv(timeout)` waits at least 1 ms, so a zero timeout polls for an
/// offer that has arrived, and each acknowledgement it writes may take up to 100 ms
/// past `timeout` (the least an ack of a few bytes is given to be written).
pub struct NixlTransfer<L: Link> {
    /// Dropped by hand, before the memory of `unacked` and `stranded` (see `Drop`).
    agent: ManuallyDrop<Agent>,
    _backend: Backend,
    side: L,
    /// Offers sent so far (each offer's number).
    sent: u64,
    unacked: Vec<Unacked>,
    stranded: Vec<Stranded>,
    /// The side channel went out of step (a frame cut by a deadline, an unexpected
    /// message): every later call fails with this.
    broken: Option<String>,
    /// How long `send` waits for the receiver's acknowledgement (default 30 s).
    pub ack_timeout: Duration,
    /// The largest frame `recv` reads (default 256 MiB).
    pub max_frame_bytes: u32,
    /// The most bytes offers not acknowledged (sender) and reads not completed
    /// (receiver) may hold (default 256 MiB): past it `send` and `recv` refuse.
    pub max_outstanding_bytes: u64,
}

impl<L: Link> NixlTransfer<L> {
    /// An agent named `name` (unique among the peers) with NIXL's UCX backend, talking
    /// to its peer over `side`. An error when libnixl_capi.so cannot be opened or the
    /// UCX plugin is missing.
    pub fn new(name: &str, side: L) -> Result<Self, TransferError> {
        if nixl_sys::is_stub() {
            return Err(nixl_err(
                "library",
                "libnixl_capi.so cannot be opened: run `eval \"$(scripts/install-nixl.sh)\"` before starting the process",
            ));
        }
        let agent = Agent::new(name).map_err(|e| nixl_err("agent", e))?;
        let (_mems, params) = agent
            .get_plugin_params("UCX")
            .map_err(|e| nixl_err("UCX plugin (is NIXL_PLUGIN_DIR set?)", e))?;
        let backend = agent
            .create_backend("UCX", &params)
            .map_err(|e| nixl_err("UCX backend", e))?;
        Ok(Self {
            agent: ManuallyDrop::new(agent),
            _backend: backend,
            side,
            sent: 0,
            unacked: Vec::new(),
            stranded: Vec::new(),
            broken: None,
            ack_timeout: Duration::from_secs(30),
            max_frame_bytes: DEFAULT_MAX_PAYLOAD,
            max_outstanding_bytes: DEFAULT_MAX_PAYLOAD as u64,
        })
    }

    /// Bytes held by offers not acknowledged and reads not completed, and how many
    /// there are: what `send` and `recv` keep registered because NIXL may still touch
    /// it.
    pub fn outstanding(&self) -> (usize, u64) {
        let bytes = self.unacked.iter().map(|u| u.region.data.len() as u64);
        let bytes = bytes.chain(self.stranded.iter().map(|s| s.region.data.len() as u64));
        (self.unacked.len() + self.stranded.len(), bytes.sum())
    }

    fn held(&self) -> String {
        let (n, bytes) = self.outstanding();
        format!(
            "{n} held ({bytes} bytes, at most {})",
            self.max_outstanding_bytes
        )
    }

    fn register(&self, r: &Region) -> Result<RegistrationHandle, TransferError> {
        self.agent
            .register_memory(r, None)
            .map_err(|e| nixl_err("register", e))
    }

    fn check_broken(&self) -> Result<(), TransferError> {
        match &self.broken {
            Some(e) => Err(TransferError::Transport(format!(
                "the side channel failed earlier ({e}); connect again"
            ))),
            None => Ok(()),
        }
    }

    /// Records `e` as what broke the side channel, and returns it.
    fn fail(&mut self, e: String) -> TransferError {
        self.broken.get_or_insert_with(|| e.clone());
        TransferError::Transport(e)
    }

    /// The next message on the side channel: `Ok(None)` when none began by
    /// `first_by`; a message begun must be whole within `rest_within` (`None`: by
    /// `first_by`). A message cut short breaks the channel.
    fn read_side(
        &mut self,
        first_by: Option<Instant>,
        rest_within: Option<Duration>,
        bound: Duration,
    ) -> Result<Option<Message>, TransferError> {
        let mut paced = Paced::new(&mut self.side, (first_by, Some(bound)), rest_within);
        let r = read_message(&mut paced, DEFAULT_MAX_PAYLOAD);
        let between_frames = paced.received() == 0;
        match r {
            Ok(m) => Ok(Some(m)),
            Err(WireError::Io(e)) if between_frames && e.kind() == std::io::ErrorKind::TimedOut => {
                Ok(None)
            }
            Err(WireError::Closed) => Err(self.fail("the peer closed the side channel".into())),
            Err(e) => Err(self.fail(format!("the side channel: {e}"))),
        }
    }

    /// Tells the sender this side is done with offer `seq`'s memory, by `by` (or
    /// within [`ACK_GRACE`] when that is sooner than it: an ack is a few bytes).
    fn done(&mut self, seq: u64, by: Option<Instant>) -> Result<(), TransferError> {
        let by = by.map(|t| t.max(Instant::now() + ACK_GRACE));
        let bound = by.map(|t| t.saturating_duration_since(Instant::now()));
        write_message_by(&mut self.side, &Message::NixlDone { seq }, by, bound)
            .map_err(|e| self.fail(format!("acknowledging offer {seq}: {e}")))
    }

    /// The sender's side of an acknowledgement: offer `seq`'s memory is released (an
    /// ack of an offer released already, or never made, is an error).
    fn release_offer(&mut self, seq: u64) -> Result<(), TransferError> {
        match self.unacked.iter().position(|u| u.seq == seq) {
            Some(i) => {
                let mut u = self.unacked.swap_remove(i);
                let _ = u.handle.deregister();
                Ok(())
            }
            None => Err(self.fail(format!(
                "the receiver acknowledged offer {seq}, which is not outstanding"
            ))),
        }
    }

    /// Releases the offers whose acknowledgements are there already (waiting for one
    /// to begin at most 1 ms).
    fn reap_acks(&mut self) -> Result<(), TransferError> {
        while !self.unacked.is_empty() {
            let first_by = deadline_in(Some(Duration::from_millis(1)));
            match self.read_side(first_by, Some(self.ack_timeout), self.ack_timeout)? {
                None => break,
                Some(Message::NixlDone { seq }) => self.release_offer(seq)?,
                Some(m) => {
                    return Err(self.fail(format!("expected NixlDone, got {}", describe(&m))));
                }
            }
        }
        Ok(())
    }

    /// Frees the reads that ended since (completed or failed: NIXL is done with their
    /// memory) and acknowledges their offers.
    fn reap_reads(&mut self) -> Result<(), TransferError> {
        let mut i = 0;
        while i < self.stranded.len() {
            let s = &self.stranded[i];
            if let Ok(XferStatus::InProgress) = self.agent.get_xfer_status(&s.req) {
                i += 1;
                continue;
            }
            let Stranded {
                seq,
                req,
                mut handle,
                region,
            } = self.stranded.swap_remove(i);
            drop(req);
            let _ = handle.deregister();
            drop(region);
            self.done(seq, Some(Instant::now()))?;
        }
        Ok(())
    }

    /// Reads `len` bytes at `addr` of the agent `agent_md` describes, by `deadline`.
    /// Every error gives the memory back, but one: a read posted that has not ended by
    /// the deadline, whose memory is NIXL's until it does (it joins `stranded`).
    fn read_offer(
        &mut self,
        seq: u64,
        agent_md: &[u8],
        addr: u64,
        len: u64,
        deadline: Option<Instant>,
    ) -> Result<Vec<u8>, TransferError> {
        let remote = self
            .agent
            .load_remote_md(agent_md)
            .map_err(|e| nixl_err(&format!("offer {seq}: the sender's metadata"), e))?;
        let n = usize::try_from(len)
            .map_err(|_| TransferError::Transport(format!("offer {seq}: {len} bytes")))?;
        let mut data = Vec::new();
        data.try_reserve_exact(n).map_err(|_| {
            TransferError::Transport(format!("offer {seq}: cannot allocate {len} bytes"))
        })?;
        data.resize(n, 0);
        let region = Region { data };
        // On any error below before the read is posted, `region` and `handle` drop
        // here: nothing of NIXL's refers to them.
        let mut handle = self.register(&region)?;
        let posted = (|| {
            let mut local = XferDescList::new(MemType::Dram).map_err(|e| nixl_err("list", e))?;
            local
                .add_storage_desc(&region)
                .map_err(|e| nixl_err("local descriptor", e))?;
            let mut far = XferDescList::new(MemType::Dram).map_err(|e| nixl_err("list", e))?;
            far.add_desc(addr as usize, n, 0);
            let req = self
                .agent
                .create_xfer_req(XferOp::Read, &local, &far, &remote, None)
                .map_err(|e| nixl_err(&format!("offer {seq}: the read request"), e))?;
            self.agent
                .post_xfer_req(&req, None)
                .map_err(|e| nixl_err(&format!("offer {seq}: posting the read"), e))?;
            Ok::<_, TransferError>(req)
        })();
        let req = match posted {
            Ok(req) => req,
            Err(e) => {
                let _ = handle.deregister();
                return Err(e);
            }
        };
        loop {
            match self.agent.get_xfer_status(&req) {
                Ok(XferStatus::Success) => break,
                Ok(XferStatus::InProgress) if deadline.is_none_or(|d| Instant::now() < d) => {
                    std::thread::sleep(Duration::from_micros(200));
                }
                Ok(XferStatus::InProgress) => {
                    // NIXL may yet write the region: it stays registered, and is
                    // checked by later calls until the read ends.
                    self.stranded.push(Stranded {
                        seq,
                        req,
                        handle,
                        region,
                    });
                    return Err(TransferError::Transport(format!(
                        "the read of offer {seq} ({len} bytes) did not complete in time; \
                         its memory stays registered until it ends: {}",
                        self.held()
                    )));
                }
                Err(e) => {
                    // The read ended in an error: NIXL is done with the region.
                    drop(req);
                    let _ = handle.deregister();
                    return Err(nixl_err(&format!("offer {seq}: the read failed"), e));
                }
            }
        }
        drop(req);
        let _ = handle.deregister();
        // The read completed: NIXL wrote the region and is done with it.
        Ok(region.data)
    }
}

impl<L: Link> Transfer for NixlTransfer<L> {
    fn send(&mut self, frame: Vec<u8>) -> Result<(), TransferError> {
        self.check_broken()?;
        self.reap_acks()?;
        let len = frame.len() as u64;
        let (_, held) = self.outstanding();
        if held.saturating_add(len) > self.max_outstanding_bytes {
            return Err(TransferError::Transport(format!(
                "a frame of {len} bytes not offered: offers the receiver never acknowledged \
                 stay registered, {}",
                self.held()
            )));
        }
        let region = Region { data: frame };
        let handle = self.register(&region)?;
        let agent_md = self
            .agent
            .get_local_md()
            .map_err(|e| nixl_err("metadata", e))?;
        // SAFETY: only the address is taken (NIXL reads the bytes while the region
        // stays registered and untouched, until the receiver acknowledges it).
        let addr = unsafe { region.as_ptr() } as u64;
        let seq = self.sent;
        self.sent += 1;
        // From here until its acknowledgement the receiver may read the region.
        self.unacked.push(Unacked {
            seq,
            handle,
            region,
        });
        let by = deadline_in(Some(self.ack_timeout));
        let offer = Message::NixlOffer {
            seq,
            agent_md,
            addr,
            len,
        };
        if let Err(e) = write_message_by(&mut self.side, &offer, by, Some(self.ack_timeout)) {
            return Err(self.fail(format!("offering {seq}: {e}")));
        }
        // Acks of earlier offers (their receiver was late) release them on the way.
        loop {
            match self.read_side(by, None, self.ack_timeout)? {
                Some(Message::NixlDone { seq: s }) => {
                    self.release_offer(s)?;
                    if s == seq {
                        return Ok(());
                    }
                }
                Some(m) => {
                    let e = format!("expected NixlDone for offer {seq}, got {}", describe(&m));
                    return Err(self.fail(e));
                }
                None => {
                    return Err(TransferError::Transport(format!(
                        "the receiver did not acknowledge offer {seq} ({len} bytes) within \
                         {:?}; its memory stays registered until it does: {}",
                        self.ack_timeout,
                        self.held()
                    )));
                }
            }
        }
    }

    fn recv(&mut self, timeout: Duration) -> Result<Option<Vec<u8>>, TransferError> {
        self.check_broken()?;
        // (At least 1 ms: a zero timeout takes an offer that has already arrived.)
        let timeout = timeout.max(Duration::from_millis(1));
        let deadline = deadline_in(Some(timeout));
        self.reap_reads()?;
        let Some(msg) = self.read_side(deadline, None, timeout)? else {
            return Ok(None);
        };
        let Message::NixlOffer {
            seq,
            agent_md,
            addr,
            len,
        } = msg
        else {
            return Err(self.fail(format!("expected NixlOffer, got {}", describe(&msg))));
        };
        let (stranded, held) = (self.stranded.len(), self.outstanding().1);
        let read = if len > self.max_frame_bytes as u64 {
            Err(TransferError::Transport(format!(
                "offer {seq} of {len} bytes is more than the limit of {}",
                self.max_frame_bytes
            )))
        } else if held.saturating_add(len) > self.max_outstanding_bytes {
            Err(TransferError::Transport(format!(
                "offer {seq} of {len} bytes not read: reads that never completed stay \
                 registered, {}",
                self.held()
            )))
        } else {
            self.read_offer(seq, &agent_md, addr, len, deadline)
        };
        if self.stranded.len() > stranded {
            // (An error.) The read is in flight: acknowledged once it ends
            // (`reap_reads`).
            return read.map(Some);
        }
        // Read or not, this side is done with the offer: the sender may release it.
        self.done(seq, deadline)?;
        read.map(Some)
    }
}

impl<L: Link> Drop for NixlTransfer<L> {
    fn drop(&mut self) {
        // Memory NIXL may still touch (offers not acknowledged, reads not ended) is
        // freed only after the agent is gone: requests released, registrations
        // dropped, then the agent destroyed, then the bytes.
        let mut memory = Vec::new();
        for u in self.unacked.drain(..) {
            drop(u.handle);
            memory.push(u.region);
        }
        for s in self.stranded.drain(..) {
            drop(s.req);
            drop(s.handle);
            memory.push(s.region);
        }
        // SAFETY: the agent is dropped once, here, and not used after.
        unsafe { ManuallyDrop::drop(&mut self.agent) };
        drop(memory);
    }
}

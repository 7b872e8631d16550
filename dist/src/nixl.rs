//! KV transfers over NIXL (feature `nixl`): the receiver reads the sender's frame
//! straight out of the sender's registered memory, as a decode instance reads a
//! prefill instance's blocks over RDMA (here: host memory, UCX over TCP).
//!
//! [`NixlTransfer`] is a [`Transfer`]: `send` copies the frame (an
//! [`encode_export`](crate::transfer::encode_export)) into memory it registers with
//! its NIXL agent, offers it on a side channel ([`Message::NixlOffer`]: the agent's
//! metadata, the address and length) and waits until the receiver says it has read
//! it ([`Message::NixlDone`]); `recv` takes an offer, loads the sender's metadata,
//! reads the frame with a NIXL `READ` into memory of its own, and acknowledges. The
//! frame then goes through the same checks as any other (CRC-32, descriptor, names).
//! Whatever fails (no offer in time, a read that does not complete in time, the
//! library missing) is `None` from `recv`: the request is recomputed.
//!
//! nixl-sys is built with its `stub-api` feature: no NIXL headers at build time, the
//! library (`libnixl_capi.so`) opened when first used. [`NixlTransfer::new`] checks it
//! is there (`scripts/install-nixl.sh` installs it from the nixl-cu12 wheel and
//! prints the `LD_LIBRARY_PATH`, `NIXL_PLUGIN_DIR` and `UCX_TLS` a process needs).

use std::time::{Duration, Instant};

use nixl_sys::{
    Agent, Backend, MemType, MemoryRegion, NixlDescriptor, RegistrationHandle, XferDescList, XferOp,
};

use crate::link::Link;
use crate::transfer::{Transfer, TransferError};
use crate::wire::{DEFAULT_MAX_PAYLOAD, Message, WireError, read_message, write_message};

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

fn nixl_err(what: &str, e: impl std::fmt::Debug) -> TransferError {
    TransferError::Wire(WireError::Io(std::io::Error::other(format!(
        "NIXL {what}: {e:?}"
    ))))
}

/// One side of NIXL transfers: an agent with the UCX backend, and the side channel to
/// the peer (a Unix socket or TCP stream: offers and acknowledgements, a few hundred
/// bytes each).
pub struct NixlTransfer<L: Link> {
    agent: Agent,
    _backend: Backend,
    side: L,
    /// Offers sent so far (each offer's number).
    sent: u64,
    /// How long `send` waits for the receiver's acknowledgement.
    pub ack_timeout: Duration,
    /// The largest frame `recv` reads (default 256 MiB).
    pub max_frame_bytes: u32,
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
            agent,
            _backend: backend,
            side,
            sent: 0,
            ack_timeout: Duration::from_secs(30),
            max_frame_bytes: DEFAULT_MAX_PAYLOAD,
        })
    }

    fn register(&self, r: &Region) -> Result<RegistrationHandle, TransferError> {
        self.agent
            .register_memory(r, None)
            .map_err(|e| nixl_err("register", e))
    }
}

impl<L: Link> Transfer for NixlTransfer<L> {
    fn send(&mut self, frame: Vec<u8>) -> Result<(), TransferError> {
        let region = Region { data: frame };
        let mut handle = self.register(&region)?;
        let agent_md = self
            .agent
            .get_local_md()
            .map_err(|e| nixl_err("metadata", e))?;
        // SAFETY: only the address is taken (NIXL reads the bytes while the region
        // stays registered and untouched, until the receiver acknowledges below).
        let addr = unsafe { region.as_ptr() } as u64;
        let len = region.data.len() as u64;
        let seq = self.sent;
        self.sent += 1;
        write_message(
            &mut self.side,
            &Message::NixlOffer {
                seq,
                agent_md,
                addr,
                len,
            },
        )?;
        self.side
            .set_read_timeout(Some(self.ack_timeout))
            .map_err(WireError::from)?;
        // Acks of earlier offers (their receiver was late) are skipped; until this
        // offer's ack the receiver may be reading the region.
        let ack = loop {
            match read_message(&mut self.side, DEFAULT_MAX_PAYLOAD) {
                Ok(Message::NixlDone { seq: s }) if s < seq => continue,
                r => break r,
            }
        };
        match ack {
            Ok(Message::NixlDone { seq: s }) if s == seq => {
                let _ = handle.deregister();
                Ok(())
            }
            other => {
                // No ack: the receiver may still read the region, so it stays
                // registered and allocated (leaked) rather than freed under a read.
                std::mem::forget(handle);
                std::mem::forget(region);
                Err(match other {
                    Err(e) => e.into(),
                    Ok(_) => TransferError::Wire(WireError::Decode(format!(
                        "expected the receiver's NixlDone for offer {seq}"
                    ))),
                })
            }
        }
    }

    fn recv(&mut self, timeout: Duration) -> Result<Option<Vec<u8>>, TransferError> {
        Ok(self.recv_frame(timeout))
    }
}

impl<L: Link> NixlTransfer<L> {
    fn recv_frame(&mut self, timeout: Duration) -> Option<Vec<u8>> {
        let deadline = Instant::now() + timeout;
        self.side
            .set_read_timeout(Some(timeout.max(Duration::from_millis(1))))
            .ok()?;
        let (seq, agent_md, addr, len) = match read_message(&mut self.side, DEFAULT_MAX_PAYLOAD) {
            Ok(Message::NixlOffer {
                seq,
                agent_md,
                addr,
                len,
            }) => (seq, agent_md, addr, len),
            _ => return None,
        };
        if len > self.max_frame_bytes as u64 {
            return None;
        }
        let remote = self.agent.load_remote_md(&agent_md).ok()?;
        let mut data = Vec::new();
        data.try_reserve_exact(len as usize).ok()?;
        data.resize(len as usize, 0);
        let region = Region { data };
        let mut handle = self.register(&region).ok()?;
        let read = (|| {
            let mut local = XferDescList::new(MemType::Dram).ok()?;
            local.add_storage_desc(&region).ok()?;
            let mut far = XferDescList::new(MemType::Dram).ok()?;
            far.add_desc(addr as usize, len as usize, 0);
            let req = self
                .agent
                .create_xfer_req(XferOp::Read, &local, &far, &remote, None)
                .ok()?;
            self.agent.post_xfer_req(&req, None).ok()?;
            while !self.agent.get_xfer_status(&req).ok()?.is_success() {
                if Instant::now() > deadline {
                    return None;
                }
                std::thread::sleep(Duration::from_micros(200));
            }
            Some(())
        })();
        if read.is_none() {
            // The read may still be in flight: NIXL may yet write the region, so it
            // stays registered and allocated (leaked) rather than freed under it.
            std::mem::forget(handle);
            std::mem::forget(region);
            return None;
        }
        let _ = handle.deregister();
        write_message(&mut self.side, &Message::NixlDone { seq }).ok()?;
        // The read completed: NIXL wrote the region and is done with it.
        Some(region.data)
    }
}

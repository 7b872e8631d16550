//! KV block transfer between instances (disaggregated prefill): a prefill instance
//! exports a request's full blocks, a decode instance imports them into blocks of its
//! own and serves the request as a prefix hit.
//!
//! An export ([`BlockExport`]) carries a [`LayoutDescriptor`] (cache layout, dtype and
//! fp8 scales, block size, heads and shard, layers, the model's fingerprint) and per
//! block its prefix-cache name, its tokens, its bytes (every layer's K and V, as
//! [`AttentionBackend::read_blocks`] lays them out) and their CRC-32. An import
//! ([`TransferEndpoint::import`]) checks, before anything is named:
//! 1. the descriptor equals the importer's (field by field, the first difference
//!    named);
//! 2. each block's bytes have the descriptor's length and their checksum;
//! 3. the blocks' tokens are the request's own, and their names are the chain of
//!    those tokens under the request's salt
//!    ([`Scheduler::block_names`]): names cannot be forged (a SHA-256 chain), so an
//!    export cannot make the importer serve K/V as that of tokens it was not computed
//!    from, and a salted tenant's chain never meets another's;
//!
//! then reserves local blocks, writes the bytes, and commits the names
//! ([`Scheduler::reserve_import`], `write_blocks`, [`Scheduler::commit_import`]); a
//! failure at any point aborts the reservation: nothing is registered.
//!
//! [`Transfer`] moves an export between instances as one frame of
//! [`crate::wire`]; [`InProcess`] is the transport for tests (it can drop, delay and
//! corrupt), NIXL is the real one for GPUs and RDMA. The decode side's rule for
//! anything that goes wrong (nothing arrives in time, it arrives corrupted or late,
//! an import check fails): serve the request anyway, recomputing its prompt, and say
//! why ([`Outcome::Recomputed`]). Nothing is lost, only the prefill is paid twice.

use std::collections::VecDeque;
use std::sync::mpsc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use pagedkv_host::DType;
use pagedkv_host::backend::{AttentionBackend, PagedCache, block_transfer_bytes};
use pagedkv_host::block::BlockHash;
use pagedkv_host::scheduler::Scheduler;

use crate::ShardSpec;
use crate::wire::{DEFAULT_MAX_PAYLOAD, Message, WireError, decode, encode};

/// What the bytes of a block mean: two instances exchange blocks only when their
/// descriptors are equal.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LayoutDescriptor {
    /// The cache layout's name (pagedkv's paged layout: `[block, kv head, token,
    /// head_dim]` per pool, every layer's K then V pool).
    pub layout: String,
    /// The cache's element type.
    pub kv_dtype: DType,
    /// Tokens per block.
    pub block_size: u32,
    /// KV heads of this shard's cache.
    pub num_kv_heads: u32,
    /// Elements per head.
    pub head_dim: u32,
    /// Layers (pools: `2 * num_layers`).
    pub num_layers: u32,
    /// The tensor-parallel shard the blocks hold.
    pub shard: ShardSpec,
    /// The model's fingerprint (as [`Hello::model`](crate::wire::Hello::model)).
    pub model: String,
    /// An fp8 cache's scales, `[layer][K, V][kv head]`, flattened (empty for other
    /// caches): bytes quantised under other scales mean other values.
    pub kv_scales: Vec<f32>,
}

/// The layout name of pagedkv's paged cache.
pub const PAGED_LAYOUT: &str = "pagedkv-paged-v1";

impl LayoutDescriptor {
    /// The descriptor of a backend made with `config` (unsharded when `shard` is
    /// [`ShardSpec::WHOLE`]), for `model`, with an fp8 cache's scales.
    pub fn of(
        config: &pagedkv_host::backend::BackendConfig,
        shard: ShardSpec,
        model: &str,
        kv_scales: Vec<f32>,
    ) -> Self {
        let s = config.shape;
        Self {
            layout: PAGED_LAYOUT.into(),
            kv_dtype: s.kv_dtype,
            block_size: s.block_size,
            num_kv_heads: s.num_kv_heads,
            head_dim: s.head_dim,
            num_layers: config.num_layers as u32,
            shard,
            model: model.into(),
            kv_scales,
        }
    }

    /// Bytes of one block, every pool.
    pub fn block_bytes(&self) -> Option<usize> {
        (self.block_size as usize)
            .checked_mul(self.num_kv_heads as usize)?
            .checked_mul(self.head_dim as usize)?
            .checked_mul(self.kv_dtype.size())?
            .checked_mul(2 * self.num_layers as usize)
    }

    /// The first field where `self` and `other` differ, as words.
    pub fn difference(&self, other: &Self) -> Option<String> {
        macro_rules! cmp {
            ($($f:ident),*) => {$(
                if self.$f != other.$f {
                    return Some(format!(
                        "{}: {:?} here, {:?} in the export",
                        stringify!($f), self.$f, other.$f
                    ));
                }
            )*};
        }
        cmp!(
            layout,
            kv_dtype,
            block_size,
            num_kv_heads,
            head_dim,
            num_layers,
            shard,
            model,
            kv_scales
        );
        None
    }
}

/// One exported block.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ExportedBlock {
    /// Its prefix-cache name ([`BlockHash::to_bytes`]).
    pub name: [u8; 32],
    /// The `block_size` tokens it holds the K/V of.
    pub tokens: Vec<u32>,
    /// CRC-32 of `data`.
    pub crc32: u32,
    /// Its bytes, every pool (see the module docs).
    pub data: Vec<u8>,
}

/// A request's exported blocks.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BlockExport {
    /// The engine's id of the request (what the decode side matches it by).
    pub request: u64,
    /// What the bytes mean.
    pub descriptor: LayoutDescriptor,
    /// The request's leading full blocks, in order.
    pub blocks: Vec<ExportedBlock>,
}

/// A request's tokens as a transfer sees them.
#[derive(Clone, Copy, Debug)]
pub struct RequestTokens<'a> {
    /// The engine's id of the request.
    pub request: u64,
    /// Its prompt (an export covers its full blocks).
    pub tokens: &'a [u32],
    /// Its `cache_salt`.
    pub salt: Option<u64>,
}

/// Why an export or import failed.
#[derive(Debug, thiserror::Error)]
pub enum TransferError {
    /// The export's descriptor differs from the importer's.
    #[error("descriptor mismatch: {0}")]
    Descriptor(String),
    /// A block's bytes are not what the export says.
    #[error("block {block}: {detail}")]
    Block {
        /// The block's index in the export.
        block: usize,
        /// What is wrong.
        detail: String,
    },
    /// The export is of another request, or its names or tokens are not the request's.
    #[error("request {request}: {detail}")]
    Request {
        /// The request.
        request: u64,
        /// What is wrong.
        detail: String,
    },
    /// The scheduler or the backend refused.
    #[error("{0}")]
    Host(#[from] pagedkv_host::Error),
    /// The frame failed its checks.
    #[error("{0}")]
    Wire(#[from] WireError),
    /// The transport failed, or refused to go on, and says why (what NIXL said, an
    /// offer never acknowledged, memory held by transfers that never finished).
    #[error("transport: {0}")]
    Transport(String),
}

/// One instance: its scheduler, backend and cache (what an export reads and an import
/// writes).
pub struct Instance<'a, B: AttentionBackend> {
    /// The instance's scheduler.
    pub sched: &'a mut Scheduler,
    /// Its backend.
    pub be: &'a mut B,
    /// Its paged cache.
    pub cache: &'a mut PagedCache<B::Tensor>,
}

/// One instance's side of KV transfers: its descriptor, and the largest export frame
/// it accepts.
#[derive(Clone, Debug, PartialEq)]
pub struct TransferEndpoint {
    /// This instance's cache, as an export describes it.
    pub descriptor: LayoutDescriptor,
    /// The largest export frame `receive_and_import` decodes (default
    /// [`DEFAULT_MAX_PAYLOAD`], 256 MiB: some 128 blocks of an 8B model's 2 MiB; a
    /// longer prompt's export is refused and the prompt recomputed). At most 4 GiB, the
    /// frame's length field.
    pub max_frame_bytes: u32,
}

impl TransferEndpoint {
    /// The endpoint of `descriptor`, with the default frame limit.
    pub fn new(descriptor: LayoutDescriptor) -> Self {
        Self {
            descriptor,
            max_frame_bytes: DEFAULT_MAX_PAYLOAD,
        }
    }

    /// Exports `req`'s cached full blocks (its leading blocks the pool holds under
    /// their names, up to the first it does not), reading their bytes from `cache`.
    /// Call it after the step that computed them (their names are registered when
    /// scheduled and their bytes written in that step).
    pub fn export<B: AttentionBackend>(
        &self,
        at: Instance<'_, B>,
        req: RequestTokens<'_>,
    ) -> Result<BlockExport, TransferError> {
        let per_block = self.check_instance(&at)?;
        let names = at.sched.block_names(req.tokens, req.salt);
        let blocks = at.sched.cached_blocks(&names)?;
        let mut data = Vec::new();
        at.be.read_blocks(at.cache, &blocks, &mut data)?;
        let bs = self.descriptor.block_size as usize;
        let out = blocks
            .iter()
            .enumerate()
            .map(|(i, _)| {
                let bytes = data[i * per_block..(i + 1) * per_block].to_vec();
                ExportedBlock {
                    name: names[i].to_bytes(),
                    tokens: req.tokens[i * bs..(i + 1) * bs].to_vec(),
                    crc32: crc32fast::hash(&bytes),
                    data: bytes,
                }
            })
            .collect();
        Ok(BlockExport {
            request: req.request,
            descriptor: self.descriptor.clone(),
            blocks: out,
        })
    }

    /// Imports `export` for `req` (the checks of the module docs, then reserve, write,
    /// commit). Returns how many blocks took their names (a block already cached
    /// here keeps its own copy). On any error nothing is registered and every reserved
    /// block is free again.
    pub fn import<B: AttentionBackend>(
        &self,
        at: Instance<'_, B>,
        req: RequestTokens<'_>,
        export: &BlockExport,
    ) -> Result<usize, TransferError> {
        let per_block = self.check_instance(&at)?;
        let Instance { sched, be, cache } = at;
        if let Some(d) = self.descriptor.difference(&export.descriptor) {
            return Err(TransferError::Descriptor(d));
        }
        let bad_request = |detail: String| TransferError::Request {
            request: req.request,
            detail,
        };
        if export.request != req.request {
            return Err(bad_request(format!(
                "the export is of request {}",
                export.request
            )));
        }
        let bs = self.descriptor.block_size as usize;
        let names = sched.block_names(req.tokens, req.salt);
        if export.blocks.len() > names.len() {
            return Err(bad_request(format!(
                "{} blocks exported, the prompt has {} full blocks",
                export.blocks.len(),
                names.len()
            )));
        }
        for (i, b) in export.blocks.iter().enumerate() {
            let block = |detail: String| TransferError::Block { block: i, detail };
            if b.data.len() != per_block {
                return Err(block(format!(
                    "{} bytes, the descriptor's blocks have {per_block}",
                    b.data.len()
                )));
            }
            let crc = crc32fast::hash(&b.data);
            if crc != b.crc32 {
                return Err(block(format!(
                    "checksum {crc:08x}, the export says {:08x}",
                    b.crc32
                )));
            }
            if b.tokens != req.tokens[i * bs..(i + 1) * bs] {
                return Err(bad_request(format!("block {i} holds other tokens")));
            }
            if BlockHash::from_bytes(b.name) != names[i] {
                return Err(bad_request(format!(
                    "block {i}'s name is not the chain of the request's tokens under its salt"
                )));
            }
        }
        let r = sched.reserve_import(&names[..export.blocks.len()])?;
        let mut data = Vec::new();
        let total = per_block.checked_mul(export.blocks.len());
        if total.is_none_or(|n| data.try_reserve_exact(n).is_err()) {
            let _ = sched.abort_import(r);
            return Err(bad_request("cannot allocate the import's bytes".into()));
        }
        for b in &export.blocks {
            data.extend_from_slice(&b.data);
        }
        if let Err(e) = be.write_blocks(cache, r.blocks(), &data) {
            // (The write's error is the one to report; an abort of this scheduler's
            // own reservation between steps does not fail.)
            let _ = sched.abort_import(r);
            return Err(e.into());
        }
        Ok(sched.commit_import(r)?)
    }

    /// Bytes of a block of the instance's cache, once its backend's shape and its
    /// scheduler's block size are checked against the descriptor's.
    fn check_instance<B: AttentionBackend>(
        &self,
        at: &Instance<'_, B>,
    ) -> Result<usize, TransferError> {
        let d = &self.descriptor;
        let mine = LayoutDescriptor::of(at.be.config(), d.shard, &d.model, d.kv_scales.clone());
        if let Some(diff) = mine.difference(d) {
            return Err(TransferError::Descriptor(format!(
                "the endpoint's descriptor is not its backend's: {diff}"
            )));
        }
        let bs = at.sched.kv().block_size();
        if bs != d.block_size {
            return Err(TransferError::Descriptor(format!(
                "the scheduler's blocks hold {bs} tokens, the descriptor's {}",
                d.block_size
            )));
        }
        Ok(block_transfer_bytes(at.be.config())?)
    }
}

/// An export as one wire frame ([`Message::Export`]: the frame's CRC-32 covers it
/// all, each block's covers its bytes).
pub fn encode_export(export: BlockExport) -> Result<Vec<u8>, WireError> {
    encode(&Message::Export(Box::new(export)))
}

/// The export of a frame from [`encode_export`], of at most `max_payload` bytes.
pub fn decode_export(frame: &[u8], max_payload: u32) -> Result<BlockExport, WireError> {
    match decode(frame, max_payload)? {
        Message::Export(e) => Ok(*e),
        _ => Err(WireError::Decode("not an export frame".into())),
    }
}

/// What became of a request's transfer on the decode side.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Its blocks were imported: the request is a prefix hit on them.
    Imported {
        /// Blocks that took their names.
        blocks: usize,
    },
    /// The request is served by recomputing its prompt, for this reason.
    Recomputed {
        /// Why the transfer was not used.
        reason: String,
    },
}

impl std::fmt::Display for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Outcome::Imported { blocks } => write!(f, "imported {blocks} blocks"),
            Outcome::Recomputed { reason } => {
                write!(f, "KV transfer not used, recomputing the prompt: {reason}")
            }
        }
    }
}

/// Moves export frames from a prefill instance to a decode instance.
pub trait Transfer {
    /// Sends one export frame.
    fn send(&mut self, frame: Vec<u8>) -> Result<(), TransferError>;
    /// The next frame, waiting at most `timeout` in all: `Ok(None)` when none came in
    /// time, an error when the transport failed (and why).
    fn recv(&mut self, timeout: Duration) -> Result<Option<Vec<u8>>, TransferError>;
}

/// Receives `request`'s export over `transport` within `timeout` and imports it:
/// [`Outcome::Imported`], or [`Outcome::Recomputed`] with the reason when nothing
/// arrived in time, the transport failed, a frame failed its checks, or the import
/// refused it. Frames of other requests (late ones) are dropped and the wait goes on,
/// within the same `timeout`: a stream of them does not hold the request past it.
/// Either way the engine then adds the request and serves it.
pub fn receive_and_import<B: AttentionBackend, T: Transfer>(
    endpoint: &TransferEndpoint,
    transport: &mut T,
    timeout: Duration,
    at: Instance<'_, B>,
    req: RequestTokens<'_>,
) -> Outcome {
    let recompute = |reason: String| Outcome::Recomputed { reason };
    let start = std::time::Instant::now();
    let mut dropped = 0usize;
    let none_in_time = |dropped: usize| {
        let others = match dropped {
            0 => String::new(),
            n => format!(" ({n} exports of other requests dropped)"),
        };
        recompute(format!(
            "no export of request {} within {timeout:?}{others}",
            req.request
        ))
    };
    loop {
        let left = timeout.saturating_sub(start.elapsed());
        if dropped > 0 && left.is_zero() {
            return none_in_time(dropped);
        }
        let frame = match transport.recv(left) {
            Ok(Some(f)) => f,
            Ok(None) => return none_in_time(dropped),
            Err(e) => return recompute(format!("the transport failed: {e}")),
        };
        let export = match decode_export(&frame, endpoint.max_frame_bytes) {
            Ok(e) => e,
            Err(e) => return recompute(format!("the export frame failed its checks: {e}")),
        };
        if export.request != req.request {
            // A late export of a request served already: dropped, keep waiting.
            dropped += 1;
            continue;
        }
        return match endpoint.import(at, req, &export) {
            Ok(blocks) => Outcome::Imported { blocks },
            Err(e) => recompute(format!("the import refused the export: {e}")),
        };
    }
}

/// A transport within one process (tests): a channel, with faults to inject.
pub struct InProcess {
    tx: mpsc::Sender<Vec<u8>>,
    rx: mpsc::Receiver<Vec<u8>>,
    /// Frames to drop, delay or corrupt, in the order they are sent.
    pub faults: VecDeque<Fault>,
    held: Vec<Vec<u8>>,
}

/// A fault [`InProcess`] injects into one sent frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Delivered as sent.
    None,
    /// Never delivered.
    Drop,
    /// Held back, and delivered just before the next frame sent.
    Late,
    /// Delivered with one payload byte flipped.
    Corrupt,
}

impl Default for InProcess {
    fn default() -> Self {
        let (tx, rx) = mpsc::channel();
        Self {
            tx,
            rx,
            faults: VecDeque::new(),
            held: Vec::new(),
        }
    }
}

impl Transfer for InProcess {
    fn send(&mut self, mut frame: Vec<u8>) -> Result<(), TransferError> {
        let send = |tx: &mpsc::Sender<Vec<u8>>, f: Vec<u8>| {
            tx.send(f)
                .map_err(|_| TransferError::Wire(WireError::Closed))
        };
        match self.faults.pop_front().unwrap_or(Fault::None) {
            Fault::Drop => return Ok(()),
            Fault::Late => {
                self.held.push(frame);
                return Ok(());
            }
            Fault::Corrupt => {
                let last = frame.len() - 1;
                frame[last] ^= 0x10;
            }
            Fault::None => {}
        }
        // A late frame arrives before the next one (after its receiver gave up).
        for f in self.held.drain(..) {
            send(&self.tx, f)?;
        }
        send(&self.tx, frame)
    }

    fn recv(&mut self, timeout: Duration) -> Result<Option<Vec<u8>>, TransferError> {
        match self.rx.recv_timeout(timeout) {
            Ok(f) => Ok(Some(f)),
            Err(mpsc::RecvTimeoutError::Timeout) => Ok(None),
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                Err(TransferError::Wire(WireError::Closed))
            }
        }
    }
}

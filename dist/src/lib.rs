//! # pagedkv-dist: pagedkv beyond one GPU
//!
//! An engine outgrows one GPU first by tensor parallelism: each rank holds a slice of
//! the KV heads, and one scheduler decides for all of them. This crate is what pagedkv
//! adds for that; the engine keeps its own collectives.
//!
//! * [`ShardSpec`] (`shard`): rank `r` of `n` holds `num_kv_heads / n` KV heads and the
//!   query heads that read them; [`ShardSpec::shape`] is the
//!   [`StepShape`](pagedkv_host::step::StepShape) its backend is made with. Block ids,
//!   block tables and the whole [`Batch`](pagedkv_host::scheduler::Batch) are the
//!   same on every rank.
//! * [`wire`]: the step's metadata on the wire, versioned ([`wire::WIRE_VERSION`]),
//!   checksummed (CRC-32 per frame) and compact (postcard over serde; the batch's
//!   serde derives are pagedkv-host's `serde` feature).
//! * [`link`]: a [`Leader`] (the scheduler's process) and its [`Worker`]s over Unix
//!   sockets or TCP: a hello that checks every rank serves the same model, shape and
//!   group, then per step the batch out and a reply back; a dead, silent or refusing
//!   rank is an error naming it, never a hang.
//! * [`transfer`]: KV blocks between instances (disaggregated prefill): a request's
//!   full blocks exported with a layout descriptor and a checksum per block, imported
//!   into local blocks of another instance whose scheduler then serves the request as
//!   a prefix hit; a transfer that is dropped, late, corrupted or refused is
//!   recomputed, with a reason to log.
//!
//! ## How an engine runs pagedkv per tensor-parallel rank
//! Every rank makes its backend with `shard.shape(&full)` (its cache then holds its
//! heads of every block) and runs the usual layer loop of
//! [`AttentionBackend`](pagedkv_host::backend::AttentionBackend) over its slice of Q,
//! K and V: `begin_step(&batch)`, then per layer `kv_append`, `decode`, `prefill`.
//! Rank 0 (the leader) owns the [`Scheduler`](pagedkv_host::scheduler::Scheduler):
//! each step it calls `step()`, [`Leader::send_step`]s the batch and the input tokens,
//! runs its own layers, and calls `on_step_done` with the sampled tokens once every
//! rank is through. The output projection's all-reduce (or an all-gather of the
//! attention outputs along heads) is the engine's: on NVIDIA GPUs, NCCL through
//! cudarc's `nccl` feature (`cudarc::nccl::Comm::all_reduce` on each rank's stream,
//! after the layer's attention), exactly where a single-GPU engine would have no
//! collective. pagedkv's kernels need nothing from it: attention is independent per
//! head. For bit-identical results on every rank the split-K plan must not depend on
//! the rank (the plan follows the CTA count, which halves with the heads): give every
//! rank the same `SplitPolicy::ForSms(n)`, or `Never`.
//!
//! ## How an engine moves KV between instances
//! The prefill instance serves the prompt (its scheduler names the full blocks as it
//! schedules them), then [`TransferEndpoint::export`](transfer::TransferEndpoint::export)s
//! them; the transport carries the export ([`transfer::encode_export`], or with NIXL
//! the blocks' memory registered and read remotely); the decode instance
//! [`import`](transfer::TransferEndpoint::import)s them before it adds the request,
//! which is then a prefix hit, and decodes. Both instances' descriptors must be equal
//! (same model, layout, dtype, block size, heads and shard, fp8 scales).
//!
//! What is tested here without GPUs: two OS processes on the CPU backend, each with
//! half of the heads, driven by one scheduler over a Unix socket, whose outputs put
//! side by side equal one process holding every head, bit for bit, over a serving
//! run with prefix hits and preemption; a killed worker, an error on the leader; and
//! prefill-to-decode transfers over the in-process transport, whose decode outputs
//! equal one instance's bit for bit, with dropped, late, corrupted and refused
//! transfers recomputed.

pub mod link;
#[cfg(feature = "nccl")]
pub mod nccl;
#[cfg(feature = "nixl")]
pub mod nixl;
pub mod shard;
pub mod transfer;
pub mod wire;

pub use link::{GroupConfig, Leader, Link, Worker};
pub use shard::ShardSpec;

/// What went wrong between ranks.
#[derive(Debug, thiserror::Error)]
pub enum DistError {
    /// A shard spec that cannot be (a rank outside the group, heads that do not split).
    #[error("shard: {0}")]
    Shard(String),
    /// A frame to or from `rank` failed its checks.
    #[error("rank {rank}: {source}")]
    Wire {
        /// The peer's rank (0: the leader, seen from a worker).
        rank: u32,
        /// What failed.
        source: wire::WireError,
    },
    /// The peer is gone: it closed the connection, or did not answer in time.
    #[error("rank {rank} is lost: {detail}")]
    Lost {
        /// The peer's rank.
        rank: u32,
        /// How it was found lost.
        detail: String,
    },
    /// The peer refused what it was sent, and said why.
    #[error("rank {rank} refused: {reason}")]
    Refused {
        /// The peer's rank.
        rank: u32,
        /// Its reason.
        reason: String,
    },
    /// The peer sent a message out of turn.
    #[error("rank {rank}: protocol error: {detail}")]
    Protocol {
        /// The peer's rank.
        rank: u32,
        /// What was expected and what came.
        detail: String,
    },
    /// What this side was asked to send or accept does not match its configuration.
    #[error("{0}")]
    Mismatch(String),
    /// An earlier error left the links possibly out of step: connect again.
    #[error("the link failed earlier ({0}); connect the group again")]
    Broken(String),
}

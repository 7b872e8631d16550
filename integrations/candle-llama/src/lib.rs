//! A candle Llama served through pagedkv: pagedkv's [`Scheduler`] batches the requests
//! (continuous batching, preemption, prefix caching), its paged cache holds K and V,
//! and its kernels (through the engine-facing
//! [`AttentionBackend`](pagedkv::host::backend::AttentionBackend) trait) write the cache
//! and compute decode attention; candle computes everything else. The model has the
//! weight names of `candle_transformers::models::llama`, so the very same weights load
//! into both, and [`reference`] runs candle's own Llama one request at a time with its
//! own KV cache: the test compares every step's logits.
//!
//! * [`weights`]: a tiny config and seeded random weights (no download);
//! * [`model`]: [`PagedLlama`], the model whose attention goes through pagedkv;
//! * [`bridge`]: [`CandleBackend`], how candle tensors reach a backend (views of their
//!   storage, no copy) and how a prefill reads the paged cache back;
//! * [`engine`]: [`Engine`], the serving loop (scheduler, backend, cache, model,
//!   greedy sampling);
//! * [`reference`]: candle's Llama, request by request, and the comparison;
//! * [`workload`]: the requests and pool of the test and of the speed comparison.
//!
//! Prefill: pagedkv has no multi-query prefill kernel yet, so a prefill's new tokens
//! are appended to the paged cache by the kernel like every token, and their attention
//! is computed by candle over K and V gathered from the paged cache through the
//! sequence's block table (so a prefix-cache hit reads the blocks another request
//! wrote). Decode rows use pagedkv's decode kernel.
//!
//! [`Scheduler`]: pagedkv::host::scheduler::Scheduler

pub mod bridge;
pub mod engine;
pub mod model;
pub mod reference;
pub mod weights;
pub mod workload;

pub use bridge::{CandleBackend, Copies};
pub use engine::{Engine, EngineConfig, Generated, StepReport};
pub use model::PagedLlama;

/// Errors of this crate: candle's, pagedkv's, or a broken expectation.
pub type Error = Box<dyn std::error::Error + Send + Sync>;

/// A result with [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

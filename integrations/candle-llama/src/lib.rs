//! A candle Llama served through pagedkv: pagedkv's [`Scheduler`] batches the requests
//! (continuous batching, preemption, prefix caching), its paged cache holds K and V,
//! and its kernels (through the engine-facing
//! [`AttentionBackend`](pagedkv::host::backend::AttentionBackend) trait) write the cache
//! and compute all attention, decode and prefill; candle computes everything else. The
//! model has the weight names of `candle_transformers::models::llama`, so the very same
//! weights load into both, and [`reference`](mod@reference) runs candle's own Llama one
//! request at a time with its own KV cache: the test compares every step's logits.
//!
//! * [`weights`]: a tiny config and seeded random weights (no download);
//! * [`model`]: [`PagedLlama`], the model whose attention goes through pagedkv;
//! * [`bridge`]: [`CandleBackend`], how candle tensors reach a backend (views of their
//!   storage, no copy);
//! * [`engine`]: [`Engine`], the serving loop (scheduler, backend, cache, model,
//!   greedy sampling);
//! * [`reference`](mod@reference): candle's Llama, request by request, and the
//!   comparison;
//! * [`workload`]: the requests and pool of the test and of the speed comparison;
//! * [`gemma3`]: [`PagedGemma3`], a Gemma 3 whose sliding-window and global layers are
//!   pagedkv layer groups (the hybrid cache), its tiny config, weights and reference.
//!
//! Attention: each layer appends the step's new K and V to the paged cache with the
//! kv_append kernel, then runs the decode kernel for the decoding rows and the prefill
//! kernel for the prefilling rows (causal over the paged cache, so a prefix-cache hit
//! reads the blocks another request wrote): the model computes no attention of its
//! own. [`EngineConfig::dtype`] sets the attention's dtype: f32 (the CUDA-core
//! kernels), or f16 / bf16 (the tensor-core kernels; at block size 16 the multi-warp
//! prefill) with the rest of the model in f32.
//!
//! [`Scheduler`]: pagedkv::host::scheduler::Scheduler

pub mod bridge;
pub mod engine;
pub mod gemma3;
pub mod model;
pub mod reference;
pub mod weights;
pub mod workload;

pub use bridge::{CandleBackend, Copies};
pub use engine::{Engine, EngineConfig, Generated, PagedModel, StepReport};
pub use gemma3::PagedGemma3;
pub use model::PagedLlama;

/// Errors of this crate: candle's, pagedkv's, or a broken expectation.
pub type Error = Box<dyn std::error::Error + Send + Sync>;

/// A result with [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

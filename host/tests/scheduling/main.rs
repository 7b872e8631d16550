//! The block manager and the scheduler, one test binary: the model-based proptest
//! (`scheduler`), chunked prefill, vLLM's expectations re-expressed (`scheduler_examples`),
//! large pools, liveness, and speculative decoding (`speculative`).

mod liveness;
mod scheduler;
mod scheduler_chunked;
mod scheduler_examples;
mod scheduler_hybrid;
mod scheduler_large;
mod speculative;

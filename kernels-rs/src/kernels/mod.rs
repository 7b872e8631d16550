//! Kernel bodies: ordinary generic Rust over [`Ctx`](crate::Ctx), no `unsafe`.
//!
//! Each kernel is a zero-sized type implementing [`Kernel`](crate::Kernel), with its
//! `#[repr(C)]` parameter struct next to it. Every pointer field documents its shape.
//! Kernels generic over the element type have one entry point per type
//! (`..._f16`, `..._bf16`, `..._f32`).

pub mod attention;
pub mod copy_blocks;
pub mod kv_append;
pub mod prefill;

pub use attention::{DecodeParams, DecodeReduce, PagedDecode, ReduceParams};
pub use copy_blocks::{CopyBlocks, CopyBlocksParams, PoolView};
pub use kv_append::{KvAppend, KvAppendParams};
pub use prefill::{PagedPrefill, PagedPrefillSimt, PrefillParams};

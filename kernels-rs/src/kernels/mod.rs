//! Kernel bodies: ordinary generic Rust over [`Ctx`](crate::Ctx), no `unsafe`.
//!
//! Each kernel is a zero-sized type implementing [`Kernel`](crate::Kernel), with its
//! `#[repr(C)]` parameter struct next to it. Every pointer field documents its shape.

pub mod copy_blocks;

pub use copy_blocks::{CopyBlocks, CopyBlocksParams, PoolView};

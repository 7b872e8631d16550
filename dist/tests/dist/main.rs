//! pagedkv-dist's tests, one binary (each test binary links the kernels' CPU bodies
//! again): tensor-parallel shards across processes (`shards`), KV block transfer over
//! the in-process transport (`transfer`), and over NIXL with `--features nixl`
//! (`nixl`), and the frame reader against hostile peers (`wire`). The tests that
//! start processes run this binary again with a filter.

/// Counts each thread's bytes, for the tests of what a call allocates.
#[global_allocator]
static ALLOC: common::alloc::Counting = common::alloc::Counting;

mod common;
#[cfg(feature = "nixl")]
mod nixl;
mod shards;
mod transfer;
mod wire;

//! pagedkv-dist's tests, one binary (each test binary links the kernels' CPU bodies
//! again): tensor-parallel shards across processes (`shards`), KV block transfer over
//! the in-process transport (`transfer`), and over NIXL with `--features nixl`
//! (`nixl`). The tests that start processes run this binary again with a filter.

mod common;
#[cfg(feature = "nixl")]
mod nixl;
mod shards;
mod transfer;

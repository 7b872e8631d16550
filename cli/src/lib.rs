//! # pagedkv-cli: the `pagedkv` command and what it is built from
//!
//! The library crate `pagedkv` is what an engine links: block tables, the scheduler,
//! the kernels and their backends. This crate is the command line on top of it, kept
//! apart so that an engine depending on `pagedkv` builds none of the CLI's
//! dependencies (clap, plotters, indicatif, rand):
//! * [`sim`]: the serving simulator behind `pagedkv simulate` (paged vs contiguous KV
//!   memory), [`plot`], its SVG figure, and [`output`], how the command writes files.
//! * [`tiny`]: `pagedkv run`, decode of a small random transformer through the kernels
//!   over the paged cache.
//! * [`accuracy`]: end-to-end error of the KV cache types (fp8 vs 16-bit), behind
//!   `examples/fp8_accuracy.rs` and the fp8 accuracy table.
//!
//! `cargo run --release` from the workspace root runs the `pagedkv` binary of this
//! crate (`simulate` by default).

pub mod accuracy;
pub mod output;
pub mod plot;
pub mod sim;
pub mod tiny;

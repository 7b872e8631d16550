//! # pagedkv: a paged KV-cache backend for LLM serving
//!
//! pagedkv manages the KV cache of a serving engine the way an OS manages memory
//! pages: one pool of fixed-size blocks, a block table per sequence, and GPU kernels
//! that read and write the cache through those tables. The kernels are written in Rust
//! (`pagedkv-kernels`), compiled to PTX by rustc's NVPTX backend, and embedded here.
//!
//! This crate re-exports the two workspace crates and embeds the PTX:
//! * [`kernels`] (`pagedkv-kernels`): the kernel bodies, their parameter structs and
//!   the device layer.
//! * [`host`] (`pagedkv-host`): the host API of each kernel (validation, CPU reference),
//!   the SIMT emulator that runs the kernel bodies on the CPU.
//! * [`cuda`]: the CUDA backend (cudarc; dynamic loading unless a `cuda-*` feature
//!   picks another linking mode) with the embedded PTX.
//! * [`ptx`]: the committed, validated PTX per architecture, as typed constants.
//!
//! The command line (`pagedkv simulate`, `pagedkv run`, the fp8 accuracy study) is the
//! separate crate `pagedkv-cli` (cli/ in the repository), so an engine that depends on
//! this crate builds none of its dependencies: this crate's normal dependencies are
//! its two workspace crates, and theirs (cudarc with dynamic loading, thiserror,
//! bytemuck, sha2, corosensei and a few small ones).
//!
//! **The emulator is always in.** The SIMT emulator ([`host::emulator`]) is what the
//! CPU backend ([`host::backend::CpuBackend`]) runs the kernels on, so an engine gets
//! a working backend, and its tests a device, with no GPU. It costs one small
//! dependency (corosensei, for the warps' coroutines) and no build step, so it is not
//! behind a feature: a feature would only make `cargo test` of an engine on a machine
//! without a GPU fail to find a backend.
//!
//! ## A first run: copy cache blocks in the emulator
//! ```
//! use pagedkv::host::{AlignedBuf, emulator::Emulator, ops::copy_blocks};
//!
//! // Two pools (K and V of one layer) of 8 blocks of 256 bytes, filled with a pattern.
//! let block_bytes = 256u64;
//! let mut pools: Vec<AlignedBuf> = (0..2u8)
//!     .map(|p| AlignedBuf::from_slice(&(0..8 * 256).map(|i| (i as u8) ^ p).collect::<Vec<u8>>()))
//!     .collect();
//! let pairs = [(1, 5), (2, 6)];
//! let mut expected = pools.clone();
//! copy_blocks::copy_blocks_reference(&mut expected, block_bytes, &pairs)?;
//! copy_blocks::copy_blocks_emulated(&Emulator::new(), &mut pools, block_bytes, &pairs)?;
//! assert_eq!(pools[0].as_bytes(), expected[0].as_bytes());
//! assert_eq!(pools[1].as_bytes(), expected[1].as_bytes());
//! # Ok::<(), pagedkv::host::Error>(())
//! ```

pub mod cuda;
pub mod ptx;

pub use pagedkv_host as host;
pub use pagedkv_kernels as kernels;

/// The README's Rust examples, compiled and run as doctests (`cargo test --doc`), so
/// the quickstart cannot drift from the API.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

/// The Rust examples of docs/rust.md, doctested like the README's.
#[cfg(doctest)]
#[doc = include_str!("../docs/rust.md")]
pub struct RustDocDoctests;

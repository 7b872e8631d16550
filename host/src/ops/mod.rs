//! The host API of each kernel: validation, CPU reference, emulator entry point.
//!
//! Each kernel has one validation function that every backend (the emulator here, the
//! CUDA backend) calls before building the kernel's parameter struct, one launch
//! configuration function, and a plain-Rust reference that is the ground truth in tests.

pub mod copy_blocks;

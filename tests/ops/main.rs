//! The kernels in the emulator, through the path engines use, against the f64 references:
//! one test binary for decode (`attention`, `attention_api`), prefill, `kv_append`,
//! `copy_blocks`, fp8 caches (`fp8_cache`), and the committed PTX (`ptx`).

mod attention;
mod attention_api;
mod cascade;
#[path = "../common/mod.rs"]
mod common;
mod copy_blocks;
mod fp8_cache;
mod interp;
mod kv_append;
mod merge;
mod prefill;
mod ptx;
mod seeds;

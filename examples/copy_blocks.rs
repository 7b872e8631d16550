//! Runs the real `copy_blocks` kernel body in the CPU SIMT emulator and checks it
//! against the plain-Rust reference.
//!
//! `cargo run --release --example copy_blocks`
//!
//! The setting: a model with 4 layers keeps K and V pools of 64 blocks each
//! (block_size 16, 8 KV heads, head_dim 128, f16: 32 KiB per block per pool). Two
//! forked sequences share partial blocks; before each appends into them the scheduler
//! asks for copy-on-write copies, which this launch performs in all 8 pools at once.

use std::time::Instant;

use pagedkv::host::AlignedBuf;
use pagedkv::host::emulator::Emulator;
use pagedkv::host::ops::copy_blocks::{copy_blocks_emulated, copy_blocks_reference};

fn main() -> Result<(), pagedkv::host::Error> {
    let (layers, num_blocks) = (4usize, 64usize);
    let (block_size, kv_heads, head_dim, elem) = (16u64, 8u64, 128u64, 2u64);
    let block_bytes = block_size * kv_heads * head_dim * elem;
    let pools_n = 2 * layers;

    // Deterministic non-zero contents: a different byte pattern per pool and block.
    let mut pools: Vec<AlignedBuf> = (0..pools_n)
        .map(|p| {
            let bytes: Vec<u8> = (0..num_blocks as u64 * block_bytes)
                .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8 ^ p as u8)
                .collect();
            AlignedBuf::from_slice(&bytes)
        })
        .collect();
    let pairs = [(3u32, 40u32), (9, 41), (17, 42), (30, 43)];

    let mut expected = pools.clone();
    copy_blocks_reference(&mut expected, block_bytes, &pairs)?;

    let emu = Emulator::new();
    let t = Instant::now();
    copy_blocks_emulated(&emu, &mut pools, block_bytes, &pairs)?;
    let dt = t.elapsed();

    let ok = pools
        .iter()
        .zip(&expected)
        .all(|(a, b)| a.as_bytes() == b.as_bytes());
    let moved = 2 * pairs.len() as u64 * pools_n as u64 * block_bytes;
    println!(
        "copy_blocks: {} pairs x {pools_n} pools of {num_blocks} blocks ({} KiB per block)",
        pairs.len(),
        block_bytes / 1024
    );
    println!(
        "emulated launch: grid ({}, {pools_n}), 128 threads per block, {:.1} ms on the CPU, {} KiB moved",
        pairs.len(),
        dt.as_secs_f64() * 1e3,
        moved / 1024
    );
    println!(
        "every byte matches the reference: {}",
        if ok { "yes" } else { "NO" }
    );
    let m = pagedkv::ptx::for_compute_capability(9, 0).expect("sm_90 PTX is embedded");
    println!(
        "embedded PTX: {} (entry points {:?}), built by {}",
        pagedkv::ptx::ALL
            .iter()
            .map(|m| m.arch)
            .collect::<Vec<_>>()
            .join(", "),
        m.entry_points,
        pagedkv::ptx::TOOLCHAIN
    );
    if !ok {
        std::process::exit(1);
    }
    Ok(())
}

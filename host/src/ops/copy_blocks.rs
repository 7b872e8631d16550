//! `copy_blocks`: copy whole cache blocks for `(src, dst)` pairs in every pool.
//!
//! A *pool* is one layer's K (or V) cache seen as bytes, `[num_blocks * block_bytes]`;
//! one block id names the same byte range in every pool. The scheduler produces the
//! pairs (copy-on-write of a shared partial block); the kernel copies each pair in
//! every pool in one launch.
//!
//! ```
//! use pagedkv_host::AlignedBuf;
//! use pagedkv_host::emulator::Emulator;
//! use pagedkv_host::ops::copy_blocks::{copy_blocks_emulated, copy_blocks_reference};
//!
//! let block_bytes = 64;
//! let mut pools: Vec<AlignedBuf> = (0..2)
//!     .map(|p| AlignedBuf::from_slice(&(0..4 * 64).map(|i| (i + p) as u8).collect::<Vec<u8>>()))
//!     .collect();
//! let mut expected = pools.clone();
//! copy_blocks_reference(&mut expected, block_bytes, &[(0, 3), (1, 2)]).unwrap();
//! copy_blocks_emulated(&Emulator::new(), &mut pools, block_bytes, &[(0, 3), (1, 2)]).unwrap();
//! assert_eq!(pools[1].as_bytes(), expected[1].as_bytes());
//! ```

use std::collections::HashSet;

use pagedkv_kernels::Dim3;

use crate::buffer::AlignedBuf;
use crate::emulator::{Emulator, LaunchConfig};
use crate::error::{Error, Result};

/// Threads per block of `copy_blocks`.
pub const THREADS: u32 = 128;
/// CUDA's limit on `gridDim.y` (the pool axis).
pub const MAX_POOLS: usize = 65_535;

/// Checks the arguments of a `copy_blocks` launch on pools of `num_blocks` blocks of
/// `block_bytes` bytes each.
///
/// Errors when `block_bytes` is zero or not a multiple of 16, when an id is not below
/// `num_blocks`, when a `dst` repeats, or when a block is both a `src` and a `dst`
/// (then the result would depend on the order of the copies).
pub fn validate(num_blocks: u64, block_bytes: u64, pairs: &[(u32, u32)]) -> Result<()> {
    if block_bytes == 0 || !block_bytes.is_multiple_of(16) {
        return Err(Error::invalid(
            "block_bytes",
            format!("{block_bytes} is not a positive multiple of 16"),
        ));
    }
    let mut dsts = HashSet::with_capacity(pairs.len());
    for (i, &(src, dst)) in pairs.iter().enumerate() {
        for (what, id) in [("src", src), ("dst", dst)] {
            if id as u64 >= num_blocks {
                return Err(Error::invalid(
                    "pairs",
                    format!(
                        "pair {i}: {what} block {id} is outside the pool of {num_blocks} blocks"
                    ),
                ));
            }
        }
        if !dsts.insert(dst) {
            return Err(Error::invalid(
                "pairs",
                format!("pair {i}: dst block {dst} is written twice"),
            ));
        }
    }
    if let Some((i, &(src, _))) = pairs
        .iter()
        .enumerate()
        .find(|(_, (s, _))| dsts.contains(s))
    {
        return Err(Error::invalid(
            "pairs",
            format!("pair {i}: block {src} is both a src and a dst"),
        ));
    }
    Ok(())
}

/// The block count shared by pools of these byte lengths, after checking they have one
/// size that is a whole number of `block_bytes`-byte blocks (shared by every backend).
pub fn pool_blocks(pool_lens: &[u64], block_bytes: u64) -> Result<u64> {
    let Some(&len) = pool_lens.first() else {
        return Ok(0);
    };
    if pool_lens.len() > MAX_POOLS {
        return Err(Error::invalid(
            "pools",
            format!("{} pools (at most {MAX_POOLS})", pool_lens.len()),
        ));
    }
    if let Some((i, l)) = pool_lens.iter().enumerate().find(|(_, l)| **l != len) {
        return Err(Error::invalid(
            "pools",
            format!("pool {i} has {l} bytes, pool 0 has {len}"),
        ));
    }
    if block_bytes == 0 || !len.is_multiple_of(block_bytes) {
        return Err(Error::invalid(
            "block_bytes",
            format!("pools of {len} bytes are not a whole number of {block_bytes}-byte blocks"),
        ));
    }
    Ok(len / block_bytes)
}

fn pools_num_blocks(pools: &[AlignedBuf], block_bytes: u64) -> Result<u64> {
    let lens: Vec<u64> = pools.iter().map(|p| p.len() as u64).collect();
    pool_blocks(&lens, block_bytes)
}

/// The launch configuration: one thread block per (pair, pool).
pub fn launch_config(num_pairs: usize, num_pools: usize) -> LaunchConfig {
    LaunchConfig {
        grid: Dim3::new(num_pairs as u32, num_pools as u32, 1),
        block: Dim3::new(THREADS, 1, 1),
        shared_bytes: 0,
    }
}

/// The reference: plain `copy_within` per pair and pool, after the same validation.
pub fn copy_blocks_reference(
    pools: &mut [AlignedBuf],
    block_bytes: u64,
    pairs: &[(u32, u32)],
) -> Result<()> {
    let num_blocks = pools_num_blocks(pools, block_bytes)?;
    validate(num_blocks, block_bytes, pairs)?;
    let bb = block_bytes as usize;
    for pool in pools.iter_mut() {
        let bytes = pool.as_bytes_mut();
        for &(src, dst) in pairs {
            let (s, d) = (src as usize * bb, dst as usize * bb);
            bytes.copy_within(s..s + bb, d);
        }
    }
    Ok(())
}

/// Runs the real `copy_blocks` kernel body in the emulator over host pools: the one
/// `copy_blocks` launch (`step::once::copy_blocks`) on an
/// [`EmuDevice`](crate::step::EmuDevice).
pub fn copy_blocks_emulated(
    emu: &Emulator,
    pools: &mut [AlignedBuf],
    block_bytes: u64,
    pairs: &[(u32, u32)],
) -> Result<()> {
    let mut dev = crate::step::EmuDevice::new(emu.clone());
    crate::step::once::copy_blocks_in_host(&mut dev, pools, block_bytes, pairs)
}

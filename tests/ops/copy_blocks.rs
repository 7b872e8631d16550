//! The real `copy_blocks` kernel body, run in the emulator, against the plain-Rust
//! reference: random pools, random disjoint pairs, every byte checked; the same call
//! on the committed PTX (the PTX interpreter) must give the same bytes.

use pagedkv::host::emulator::{BlockOrder, Emulator};
use pagedkv::host::ops::copy_blocks::{copy_blocks_emulated, copy_blocks_reference};
use pagedkv::host::step::once;
use pagedkv::host::{AlignedBuf, Error};
use proptest::prelude::*;

/// Pools of random bytes plus valid pairs: distinct destinations, sources drawn from the
/// blocks that are not destinations (a source may be copied to several destinations).
fn case() -> impl Strategy<Value = (Vec<AlignedBuf>, u64, Vec<(u32, u32)>, u64)> {
    (1usize..4, 2u32..40, 1u64..48, any::<u64>()).prop_flat_map(
        |(num_pools, num_blocks, vecs_per_block, seed)| {
            let block_bytes = 16 * vecs_per_block;
            let ids: Vec<u32> = (0..num_blocks).collect();
            (
                Just(ids).prop_shuffle(),
                1..=(num_blocks as usize / 2),
                proptest::collection::vec(any::<u8>(), (num_blocks as u64 * block_bytes) as usize),
            )
                .prop_flat_map(move |(perm, num_pairs, bytes)| {
                    let dsts: Vec<u32> = perm[..num_pairs].to_vec();
                    let srcs_pool: Vec<u32> = perm[num_pairs..].to_vec();
                    let n_src = srcs_pool.len();
                    (
                        Just(dsts),
                        Just(srcs_pool),
                        proptest::collection::vec(0..n_src, num_pairs),
                        Just(bytes),
                    )
                })
                .prop_map(move |(dsts, srcs_pool, picks, bytes)| {
                    let pairs: Vec<(u32, u32)> = dsts
                        .iter()
                        .zip(&picks)
                        .map(|(&d, &p)| (srcs_pool[p], d))
                        .collect();
                    let pools: Vec<AlignedBuf> = (0..num_pools)
                        .map(|p| {
                            let v: Vec<u8> =
                                bytes.iter().map(|b| b.wrapping_add(p as u8 * 37)).collect();
                            AlignedBuf::from_slice(&v)
                        })
                        .collect();
                    (pools, block_bytes, pairs, seed)
                })
        },
    )
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(48),
        ..ProptestConfig::default()
    })]

    #[test]
    fn emulated_kernel_matches_reference((pools, block_bytes, pairs, seed) in case()) {
        let original = pools.clone();
        let mut expected = pools.clone();
        copy_blocks_reference(&mut expected, block_bytes, &pairs).unwrap();
        let mut got = pools.clone();
        let emu = Emulator::new().with_order(BlockOrder::Shuffled(seed));
        copy_blocks_emulated(&emu, &mut got, block_bytes, &pairs).unwrap();
        // The same call on the committed PTX (a module drawn from the seed): the same
        // bytes as the emulator.
        let mut on_ptx = pools;
        let mut dev = crate::interp::device(seed as usize % 2);
        once::copy_blocks_in_host(&mut dev, &mut on_ptx, block_bytes, &pairs).unwrap();
        for (p, (a, b)) in on_ptx.iter().zip(&got).enumerate() {
            prop_assert_eq!(a.as_bytes(), b.as_bytes(), "pool {}: interpreter vs emulator", p);
        }

        let bb = block_bytes as usize;
        for (p, (g, (e, o))) in got.iter().zip(expected.iter().zip(&original)).enumerate() {
            let num_blocks = g.len() / bb;
            for b in 0..num_blocks {
                let r = b * bb..(b + 1) * bb;
                let written = pairs.iter().find(|(_, d)| *d as usize == b);
                match written {
                    Some(&(src, _)) => prop_assert_eq!(
                        &g.as_bytes()[r.clone()],
                        &o.as_bytes()[src as usize * bb..(src as usize + 1) * bb],
                        "pool {} block {} should hold a copy of block {}", p, b, src
                    ),
                    None => prop_assert_eq!(
                        &g.as_bytes()[r.clone()], &o.as_bytes()[r.clone()],
                        "pool {} block {} is not a destination and must be unchanged", p, b
                    ),
                }
                prop_assert_eq!(&g.as_bytes()[r.clone()], &e.as_bytes()[r], "pool {} block {} vs reference", p, b);
            }
        }
    }
}

fn pools(n: usize, num_blocks: usize, block_bytes: usize) -> Vec<AlignedBuf> {
    (0..n)
        .map(|_| AlignedBuf::zeroed(num_blocks * block_bytes))
        .collect()
}

#[test]
fn bad_arguments_are_rejected_before_any_launch() {
    let emu = Emulator::new();
    /// Pools, block bytes, pairs, and a phrase the error must contain.
    type Case = (Vec<AlignedBuf>, u64, Vec<(u32, u32)>, &'static str);
    let cases: Vec<Case> = vec![
        (pools(2, 8, 64), 64, vec![(0, 8)], "outside the pool"),
        (pools(2, 8, 64), 64, vec![(0, 2), (1, 2)], "written twice"),
        (
            pools(2, 8, 64),
            64,
            vec![(0, 2), (2, 3)],
            "both a src and a dst",
        ),
        (pools(2, 8, 64), 64, vec![(4, 4)], "both a src and a dst"),
        (pools(2, 8, 60), 60, vec![(0, 1)], "multiple of 16"),
        (pools(2, 8, 64), 48, vec![(0, 1)], "whole number"),
        (
            vec![AlignedBuf::zeroed(512), AlignedBuf::zeroed(256)],
            64,
            vec![(0, 1)],
            "pool 1 has 256 bytes",
        ),
    ];
    for (mut p, bb, pairs, want) in cases {
        for result in [
            copy_blocks_emulated(&emu, &mut p, bb, &pairs),
            copy_blocks_reference(&mut p, bb, &pairs),
        ] {
            match result {
                Err(Error::InvalidArgument { reason, .. }) => {
                    assert!(reason.contains(want), "{pairs:?}: {reason}")
                }
                other => panic!("{pairs:?}: expected an InvalidArgument error, got {other:?}"),
            }
        }
    }
}

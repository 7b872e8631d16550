//! The real `kv_append` kernel, run in the emulator and (its committed PTX) in the PTX
//! interpreter, against the reference: every dtype, head_dim and block size, padding
//! slots, random slots in a shuffled pool.
//! Caches start as NaN; every slot not appended to must stay NaN.

use crate::common;

use common::{cases, rng, uniform};
use pagedkv::host::emulator::{BlockOrder, Emulator};
use pagedkv::host::ops::SUPPORTED_HEAD_DIMS;
use pagedkv::host::ops::kv_append::{KvAppendInputs, kv_append_emulated, kv_append_reference};
use pagedkv::host::step::once;
use pagedkv::host::{DType, Error, HostTensor};
use pagedkv::kernels::PagedLayout;
use proptest::prelude::*;
use rand::Rng;
use rand::seq::SliceRandom;

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(48), ..ProptestConfig::default() })]

    #[test]
    fn append_writes_exactly_the_mapped_slots(
        dtype in prop::sample::select(DType::ALL.to_vec()),
        head_dim in prop::sample::select(SUPPORTED_HEAD_DIMS.to_vec()),
        block_size in prop::sample::select(vec![8u32, 16, 32]),
        num_kv_heads in 1u32..=4,
        num_blocks in 1u32..=12,
        num_tokens in 0usize..=40,
        seed in any::<u64>(),
    ) {
        let l = PagedLayout { num_blocks, num_kv_heads, block_size, head_dim };
        let mut r = rng(seed);
        let mut slots: Vec<i64> = (0..l.num_slots() as i64).collect();
        slots.shuffle(&mut r);
        let mapping: Vec<i64> = (0..num_tokens)
            .map(|i| if i < slots.len() && r.random_bool(0.8) { slots[i] } else { -1 })
            .collect();
        let row = (num_kv_heads * head_dim) as usize;
        let shape = [num_tokens, num_kv_heads as usize, head_dim as usize];
        let k = HostTensor::from_f64(dtype, &shape, &uniform(&mut r, num_tokens * row)).unwrap();
        let v = HostTensor::from_f64(dtype, &shape, &uniform(&mut r, num_tokens * row)).unwrap();
        let pool = [l.pool_elems() as usize];
        let (mut kc, mut vc) = (HostTensor::full(dtype, &pool, f64::NAN), HostTensor::full(dtype, &pool, f64::NAN));
        let (mut kr, mut vr) = (kc.clone(), vc.clone());
        kv_append_reference(KvAppendInputs {
            layout: &l,
            key: &k,
            value: &v,
            slot_mapping: &mapping,
            key_cache: &mut kr,
            value_cache: &mut vr,
            scales: None,
        }).unwrap();
        let emu = Emulator::new().with_order(BlockOrder::Shuffled(seed));
        kv_append_emulated(&emu, KvAppendInputs {
            layout: &l,
            key: &k,
            value: &v,
            slot_mapping: &mapping,
            key_cache: &mut kc,
            value_cache: &mut vc,
            scales: None,
        }).unwrap();
        prop_assert_eq!(kc.buf().as_bytes(), kr.buf().as_bytes());
        prop_assert_eq!(vc.buf().as_bytes(), vr.buf().as_bytes());
        // The same call on the committed PTX (a module drawn from the seed).
        let (mut kp, mut vp) = (HostTensor::full(dtype, &pool, f64::NAN), HostTensor::full(dtype, &pool, f64::NAN));
        once::kv_append(crate::interp::device(seed as usize % 2), KvAppendInputs {
            layout: &l,
            key: &k,
            value: &v,
            slot_mapping: &mapping,
            key_cache: &mut kp,
            value_cache: &mut vp,
            scales: None,
        }).unwrap();
        prop_assert_eq!(kp.buf().as_bytes(), kr.buf().as_bytes(), "interpreter vs reference (K)");
        prop_assert_eq!(vp.buf().as_bytes(), vr.buf().as_bytes(), "interpreter vs reference (V)");
        // Only the mapped slots changed, and each holds its token's row.
        let written = mapping.iter().filter(|s| **s >= 0).count();
        let non_nan = kc.to_f64().iter().filter(|x| !x.is_nan()).count();
        prop_assert_eq!(non_nan, written * row);
        for (i, &slot) in mapping.iter().enumerate() {
            if slot >= 0 {
                for h in 0..num_kv_heads {
                    let o = l.slot_offset(slot as u64, h) as usize;
                    for e in 0..head_dim as usize {
                        prop_assert_eq!(kc.get(o + e), k.get((i * num_kv_heads as usize + h as usize) * head_dim as usize + e));
                    }
                }
            }
        }
    }
}

#[test]
fn bad_arguments_are_rejected_before_any_launch() {
    let l = PagedLayout {
        num_blocks: 4,
        num_kv_heads: 2,
        block_size: 16,
        head_dim: 64,
    };
    let pool = [l.pool_elems() as usize];
    let tok = |n: usize, dt| HostTensor::full(dt, &[n, 2, 64], 1.0);
    let f16 = DType::F16;
    let cases: Vec<(PagedLayout, HostTensor, Vec<i64>, DType, &str)> = vec![
        (l, tok(2, f16), vec![0, 64], f16, "outside the pool"),
        (l, tok(2, f16), vec![5, 5], f16, "written twice"),
        (
            l,
            tok(3, f16),
            vec![0, 1],
            f16,
            "384 elements, expected 256",
        ),
        (l, tok(2, DType::F32), vec![0, 1], f16, "dtype f32"),
        (
            PagedLayout { head_dim: 72, ..l },
            tok(2, f16),
            vec![0, 1],
            f16,
            "72 is not supported",
        ),
        (
            PagedLayout {
                block_size: 12,
                ..l
            },
            tok(2, f16),
            vec![0, 1],
            f16,
            "12 is not supported",
        ),
    ];
    for (layout, k, mapping, cache_dt, want) in cases {
        let mut kc = HostTensor::full(cache_dt, &pool, 0.0);
        let mut vc = kc.clone();
        let v = k.clone();
        match kv_append_emulated(
            &Emulator::new(),
            KvAppendInputs {
                layout: &layout,
                key: &k,
                value: &v,
                slot_mapping: &mapping,
                key_cache: &mut kc,
                value_cache: &mut vc,
                scales: None,
            },
        ) {
            Err(Error::InvalidArgument { reason, .. }) => {
                assert!(reason.contains(want), "{want}: {reason}")
            }
            other => panic!("{want}: expected InvalidArgument, got {other:?}"),
        }
        assert!(
            kc.to_f64().iter().all(|x| *x == 0.0),
            "{want}: cache modified"
        );
    }
}

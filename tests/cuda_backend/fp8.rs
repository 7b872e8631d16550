//! fp8 caches through the CUDA per-call API (ignored without a GPU): `kv_append`
//! writes the bytes the host reference writes (the GPU's `cvt.rn.satfinite` on sm_90,
//! the software conversion on sm_80, against the host's), and decode, unsplit and
//! split-K, matches f64 attention over the dequantised cache on awkward shapes.

use super::common::case::{Params, build};
use super::common::fp8::quantise_case;
use super::common::{rel_l2, rng, tolerance, uniform};
use super::gpu;
use pagedkv::cuda::DeviceTensor;
use pagedkv::host::ops::attention::SplitPlan;
use pagedkv::host::ops::kv_append::{KvAppendInputs, kv_append_reference};
use pagedkv::host::ops::scales::KvScales;
use pagedkv::host::reference::paged_decode_attention;
use pagedkv::host::{DType, HostTensor};
use pagedkv::kernels::PagedLayout;
use rand::Rng;
use rand::seq::SliceRandom;

const PAIRS: [(DType, DType); 4] = [
    (DType::F16, DType::E4m3),
    (DType::F16, DType::E5m2),
    (DType::Bf16, DType::E4m3),
    (DType::Bf16, DType::E5m2),
];

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn fp8_kv_append_writes_the_reference_bytes() {
    let gpu = gpu();
    for (dtype, cache) in PAIRS {
        let l = PagedLayout {
            num_blocks: 256,
            num_kv_heads: 4,
            block_size: 16,
            head_dim: 128,
        };
        let mut r = rng(11);
        let mut slots: Vec<i64> = (0..l.num_slots() as i64).collect();
        slots.shuffle(&mut r);
        let n = 700;
        let mapping: Vec<i64> = (0..n)
            .map(|i| if i % 13 == 0 { -1 } else { slots[i] })
            .collect();
        let row = 4 * 128;
        // Values up to 1000x the calibrated range: saturation on both paths.
        let vals = |r: &mut rand::rngs::SmallRng| -> Vec<f64> {
            uniform(r, n * row)
                .into_iter()
                .map(|x| {
                    if r.random_range(0..20) == 0 {
                        1000.0 * x
                    } else {
                        x
                    }
                })
                .collect()
        };
        let k = HostTensor::from_f64(dtype, &[n, row], &vals(&mut r)).unwrap();
        let v = HostTensor::from_f64(dtype, &[n, row], &vals(&mut r)).unwrap();
        let scales = KvScales {
            k: vec![1.0 / 448.0, 0.003, 0.01, 0.5],
            v: vec![0.002, 1.0 / 57344.0, 0.02, 1.0],
        };
        let pool = [l.pool_elems() as usize];
        let mut kr = HostTensor::full(cache, &pool, f64::NAN);
        let mut vr = kr.clone();
        let mut kc = DeviceTensor::from_host(&gpu, &kr).unwrap();
        let mut vc = DeviceTensor::from_host(&gpu, &vr).unwrap();
        kv_append_reference(KvAppendInputs {
            layout: &l,
            key: &k,
            value: &v,
            slot_mapping: &mapping,
            key_cache: &mut kr,
            value_cache: &mut vr,
            scales: Some(&scales),
        })
        .unwrap();
        let (kd, vd) = (
            DeviceTensor::from_host(&gpu, &k).unwrap(),
            DeviceTensor::from_host(&gpu, &v).unwrap(),
        );
        gpu.kv_append(KvAppendInputs {
            layout: &l,
            key: &kd,
            value: &vd,
            slot_mapping: &mapping,
            key_cache: &mut kc,
            value_cache: &mut vc,
            scales: Some(&scales),
        })
        .unwrap();
        let (kg, vg) = (kc.to_host(&gpu).unwrap(), vc.to_host(&gpu).unwrap());
        assert_eq!(
            kg.buf().as_bytes(),
            kr.buf().as_bytes(),
            "{dtype} {cache} K"
        );
        assert_eq!(
            vg.buf().as_bytes(),
            vr.buf().as_bytes(),
            "{dtype} {cache} V"
        );
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn fp8_decode_awkward_shapes_split_and_unsplit() {
    let gpu = gpu();
    for (i, (dtype, cache)) in PAIRS.into_iter().enumerate() {
        let p = Params {
            sinks: false,
            dtype,
            head_dim: [64, 80, 128, 256][i],
            block_size: [8, 16, 32, 16][i],
            num_kv_heads: 2,
            group: [1, 3, 4, 7][i],
            batch: 17,
            max_len: 900,
            window: [None, Some(300), None, Some(500)][i],
            softcap: [None, Some(20.0), None, Some(30.0)][i],
            alibi: i % 2 == 1,
            partition: None,
            narrow_heads: false,
            seed: 500 + i as u64,
            full_length: false,
        };
        let mut c = build(&p);
        quantise_case(&mut c, cache, i % 2 == 0);
        let want = paged_decode_attention(&c.inputs());
        for parts in [None, Some(128u32)] {
            let plan = parts.map(|t| SplitPlan {
                heads_per_block: c.shape.group().min(2),
                partition_tokens: t,
                num_partitions: 900u32.div_ceil(t),
            });
            let e = rel_l2(&super::decode_on_gpu(&gpu, &c, plan), &want);
            assert!(e <= tolerance(dtype), "{dtype}/{cache} {parts:?}: {e:e}");
        }
    }
}

//! The CUDA backend. Without a GPU: constructing it is an error, never a panic. With one
//! (`cargo test --release --test cuda_backend -- --ignored`): every kernel against the
//! CPU reference at realistic sizes, on the same test cases as the emulator proofs
//! (`common::case`), outputs poisoned with NaN, unused cache slots NaN.

#[path = "../common/mod.rs"]
mod common;
mod fp8;
mod step;

use common::case::{Params, build};
use common::{approx_tolerance, rel_l2, rng, tolerance, uniform};
use pagedkv::cuda::{CudaDevice, DeviceTensor, device};
use pagedkv::host::ops::attention::DecodeInputs;
use pagedkv::host::ops::kv_append::{KvAppendInputs, kv_append_reference};
use pagedkv::host::reference::paged_decode_attention;
use pagedkv::host::{DType, Error, HostTensor};
use pagedkv::kernels::PagedLayout;
use rand::seq::SliceRandom;

#[test]
fn constructing_the_backend_without_a_gpu_is_an_error_not_a_panic() {
    match device(0) {
        // On a machine with a GPU the backend comes up and knows its SMs.
        Ok(gpu) => assert!(gpu.sm_count() > 0 && !gpu.device_name().is_empty()),
        Err(e @ (Error::NoCudaDriver | Error::NoCudaDevice(_))) => {
            let msg = e.to_string();
            assert!(
                msg.contains("no CUDA driver found") || msg.contains("no CUDA device"),
                "{msg}"
            );
        }
        Err(e) => panic!("unexpected error: {e}"),
    }
    // A device that does not exist is an error on every machine.
    assert!(matches!(
        device(1 << 20),
        Err(Error::NoCudaDriver | Error::NoCudaDevice(_))
    ));
}

pub(crate) fn gpu() -> CudaDevice {
    device(0).expect("this test needs an NVIDIA GPU")
}

fn decode_case(
    gpu: &CudaDevice,
    dtype: DType,
    batch: u32,
    len: u32,
    kv_heads: u32,
    group: u32,
    want_split: Option<bool>,
) {
    let p = Params {
        sinks: false,
        dtype,
        head_dim: 128,
        block_size: 16,
        num_kv_heads: kv_heads,
        group,
        batch,
        max_len: len,
        window: None,
        softcap: None,
        alibi: false,
        partition: None,
        narrow_heads: false,
        seed: 7 + batch as u64 + len as u64,
        full_length: true,
    };
    let c = build(&p);
    let want = paged_decode_attention(&c.inputs());
    let q = DeviceTensor::from_host(gpu, &c.q).unwrap();
    let kc = DeviceTensor::from_host(gpu, &c.kc).unwrap();
    let vc = DeviceTensor::from_host(gpu, &c.vc).unwrap();
    let mut out =
        DeviceTensor::from_host(gpu, &HostTensor::full(dtype, c.q.shape(), f64::NAN)).unwrap();
    let plan = gpu
        .paged_decode_attention(
            DecodeInputs {
                shape: &c.shape,
                opts: &c.opts,
                q: &q,
                key_cache: &kc,
                value_cache: &vc,
                block_tables: &c.tables,
                context_lens: &c.lens,
                plan: None,
                kv_scales: c.scales.as_ref(),
                sinks: c.sinks.as_deref(),
            },
            &mut out,
        )
        .unwrap();
    if let Some(split) = want_split {
        assert_eq!(plan.is_split(), split, "{plan:?}");
    }
    let got = out.to_host(gpu).unwrap().to_f64();
    let e = rel_l2(&got, &want);
    assert!(
        e <= tolerance(dtype),
        "{dtype} batch {batch} ctx {len}: rel L2 {e:e} ({plan:?})"
    );
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn decode_batch_64_context_4096_gqa_32_8_every_dtype() {
    let gpu = gpu();
    for dtype in DType::ALL {
        decode_case(&gpu, dtype, 64, 4096, 8, 4, Some(false));
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn decode_batch_1_context_32768_splits_k_every_dtype() {
    let gpu = gpu();
    for dtype in DType::ALL {
        decode_case(&gpu, dtype, 1, 32768, 8, 4, Some(true));
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn decode_awkward_shapes_with_every_option() {
    let gpu = gpu();
    for (i, dtype) in DType::ALL.into_iter().enumerate() {
        let p = Params {
            sinks: false,
            dtype,
            head_dim: [80, 96, 256][i],
            block_size: [8, 16, 32][i],
            num_kv_heads: 2,
            group: [3, 5, 7][i],
            batch: 17,
            max_len: 700,
            window: Some(300),
            softcap: Some(20.0),
            alibi: true,
            partition: None,
            narrow_heads: false,
            seed: 99 + i as u64,
            full_length: false,
        };
        let c = build(&p);
        let want = paged_decode_attention(&c.inputs());
        for parts in [None, Some(128u32)] {
            let plan = parts.map(|t| pagedkv::host::ops::attention::SplitPlan {
                heads_per_block: c.shape.group(),
                partition_tokens: t,
                num_partitions: 700u32.div_ceil(t),
            });
            let e = rel_l2(&decode_on_gpu(&gpu, &c, plan), &want);
            assert!(e <= tolerance(dtype), "{dtype} {parts:?}: {e:e}");
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn kv_append_matches_the_reference_every_dtype() {
    let gpu = gpu();
    let l = PagedLayout {
        num_blocks: 512,
        num_kv_heads: 8,
        block_size: 16,
        head_dim: 128,
    };
    for dtype in DType::ALL {
        append_matches_the_reference(&gpu, dtype, &l, 1000, 3, |i| i % 17 == 0);
    }
}

/// The case's decode on the GPU with `plan` (`None`: the backend plans): the output.
pub fn decode_on_gpu(
    gpu: &CudaDevice,
    c: &common::case::Case,
    plan: Option<pagedkv::host::ops::attention::SplitPlan>,
) -> Vec<f64> {
    let q = DeviceTensor::from_host(gpu, &c.q).unwrap();
    let kc = DeviceTensor::from_host(gpu, &c.kc).unwrap();
    let vc = DeviceTensor::from_host(gpu, &c.vc).unwrap();
    let nan = HostTensor::full(c.q.dtype(), c.q.shape(), f64::NAN);
    let mut out = DeviceTensor::from_host(gpu, &nan).unwrap();
    gpu.paged_decode_attention(
        DecodeInputs {
            shape: &c.shape,
            opts: &c.opts,
            q: &q,
            key_cache: &kc,
            value_cache: &vc,
            block_tables: &c.tables,
            context_lens: &c.lens,
            plan,
            kv_scales: c.scales.as_ref(),
            sinks: None,
        },
        &mut out,
    )
    .unwrap();
    out.to_host(gpu).unwrap().to_f64()
}

/// `n` random tokens of `dtype` (those where `pad(i)` are padding, slot -1) appended
/// on the GPU and by the reference into NaN caches of layout `l`: the bytes agree.
fn append_matches_the_reference(
    gpu: &CudaDevice,
    dtype: DType,
    l: &PagedLayout,
    n: usize,
    seed: u64,
    pad: impl Fn(usize) -> bool,
) {
    let mut r = rng(seed);
    let mut slots: Vec<i64> = (0..l.num_slots() as i64).collect();
    slots.shuffle(&mut r);
    let mapping: Vec<i64> = (0..n).map(|i| if pad(i) { -1 } else { slots[i] }).collect();
    let row = (l.num_kv_heads * l.head_dim) as usize;
    let shape = [n, l.num_kv_heads as usize, l.head_dim as usize];
    let k = HostTensor::from_f64(dtype, &shape, &uniform(&mut r, n * row)).unwrap();
    let v = HostTensor::from_f64(dtype, &shape, &uniform(&mut r, n * row)).unwrap();
    let pool = [l.pool_elems() as usize];
    let mut kr = HostTensor::full(dtype, &pool, f64::NAN);
    let mut vr = kr.clone();
    let mut kc = DeviceTensor::from_host(gpu, &kr).unwrap();
    let mut vc = DeviceTensor::from_host(gpu, &vr).unwrap();
    kv_append_reference(KvAppendInputs {
        layout: l,
        key: &k,
        value: &v,
        slot_mapping: &mapping,
        key_cache: &mut kr,
        value_cache: &mut vr,
        scales: None,
    })
    .unwrap();
    let (kd, vd) = (
        DeviceTensor::from_host(gpu, &k).unwrap(),
        DeviceTensor::from_host(gpu, &v).unwrap(),
    );
    gpu.kv_append(KvAppendInputs {
        layout: l,
        key: &kd,
        value: &vd,
        slot_mapping: &mapping,
        key_cache: &mut kc,
        value_cache: &mut vc,
        scales: None,
    })
    .unwrap();
    let bytes = |t: &DeviceTensor| t.to_host(gpu).unwrap().buf().as_bytes().to_vec();
    assert_eq!(bytes(&kc), kr.buf().as_bytes(), "{dtype} K");
    assert_eq!(bytes(&vc), vr.buf().as_bytes(), "{dtype} V");
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn copy_blocks_and_swap_round_trip() {
    let gpu = gpu();
    let (num_blocks, block_bytes) = (64usize, 32 * 1024usize);
    let mut r = rng(5);
    let hosts: Vec<HostTensor> = (0..4)
        .map(|_| {
            let bytes: Vec<u8> = (0..num_blocks * block_bytes)
                .map(|_| rand::Rng::random(&mut r))
                .collect();
            HostTensor::from_bytes(DType::F16, &[num_blocks * block_bytes / 2], &bytes).unwrap()
        })
        .collect();
    let mut pools: Vec<DeviceTensor> = hosts
        .iter()
        .map(|h| DeviceTensor::from_host(&gpu, h).unwrap())
        .collect();
    let pairs = [(1u32, 40u32), (2, 41), (1, 42)];
    {
        let mut refs: Vec<&mut DeviceTensor> = pools.iter_mut().collect();
        gpu.copy_blocks(&mut refs, block_bytes as u64, &pairs)
            .unwrap();
    }
    for (h, d) in hosts.iter().zip(&pools) {
        let got = d.to_host(&gpu).unwrap();
        let (g, o) = (got.buf().as_bytes(), h.buf().as_bytes());
        for b in 0..num_blocks {
            let src = pairs
                .iter()
                .find(|p| p.1 as usize == b)
                .map_or(b, |p| p.0 as usize);
            assert_eq!(
                &g[b * block_bytes..(b + 1) * block_bytes],
                &o[src * block_bytes..(src + 1) * block_bytes],
                "block {b}"
            );
        }
    }
    // Swap blocks 3 and 4 out, overwrite them by a copy, swap them back in.
    let mut host = gpu.alloc_swap_pool(8, pools.len(), block_bytes).unwrap();
    let before: Vec<Vec<u8>> = pools
        .iter()
        .map(|p| p.to_host(&gpu).unwrap().buf().as_bytes().to_vec())
        .collect();
    {
        let refs: Vec<&DeviceTensor> = pools.iter().collect();
        gpu.swap_out(&refs, block_bytes as u64, &[(3, 0), (4, 5)], &mut host)
            .unwrap();
    }
    {
        let mut refs: Vec<&mut DeviceTensor> = pools.iter_mut().collect();
        gpu.copy_blocks(&mut refs, block_bytes as u64, &[(10, 3), (11, 4)])
            .unwrap();
        gpu.swap_in(&mut refs, block_bytes as u64, &[(0, 3), (5, 4)], &host)
            .unwrap();
    }
    for (b, p) in before.iter().zip(&pools) {
        assert_eq!(p.to_host(&gpu).unwrap().buf().as_bytes(), b.as_slice());
    }
}

// Small cases for compute-sanitizer (memcheck, racecheck, synccheck), one per kernel
// family: scripts/gpu-check.sh runs each by `--exact` name under each tool, where a
// kernel runs 10-100x slower, so they stay a few thousand threads and a few blocks deep.

/// A small ragged decode case (f16, head_dim 128, 2 KV heads, group 4, 3 sequences of
/// up to 200 tokens, window, soft-cap and ALiBi) run with `plan`, against the reference.
fn sanitizer_decode(parts: u32, heads_per_block: u32) {
    let gpu = gpu();
    let dtype = DType::F16;
    let p = Params {
        sinks: false,
        dtype,
        head_dim: 128,
        block_size: 16,
        num_kv_heads: 2,
        group: 4,
        batch: 3,
        max_len: 200,
        window: Some(150),
        softcap: Some(30.0),
        alibi: true,
        partition: None,
        narrow_heads: false,
        seed: 11,
        full_length: false,
    };
    let c = build(&p);
    let want = paged_decode_attention(&c.inputs());
    let plan = pagedkv::host::ops::attention::SplitPlan {
        heads_per_block,
        partition_tokens: 200u32.div_ceil(parts).next_multiple_of(64),
        num_partitions: parts,
    };
    let e = rel_l2(&decode_on_gpu(&gpu, &c, Some(plan)), &want);
    assert!(
        e <= approx_tolerance(dtype, p.softcap),
        "{plan:?}: rel L2 {e:e}"
    );
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn sanitizer_small_decode() {
    // One partition: the unsplit decode kernel, all 4 heads of a group per block.
    sanitizer_decode(1, 4);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn sanitizer_small_decode_split() {
    // Four partitions of 64 tokens and two head chunks: the split decode and the reduce.
    sanitizer_decode(4, 2);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn sanitizer_small_append() {
    let l = PagedLayout {
        num_blocks: 8,
        num_kv_heads: 2,
        block_size: 16,
        head_dim: 128,
    };
    // Some tokens are padding (-1) and write nothing.
    append_matches_the_reference(&gpu(), DType::F16, &l, 37, 13, |i| i % 9 == 4);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn sanitizer_small_copy_blocks() {
    let gpu = gpu();
    // Two pools of 8 blocks of 257 vectors of 16 bytes: the unrolled main loop, then a
    // tail that only some threads of the block take.
    let (num_blocks, block_bytes) = (8usize, 257 * 16usize);
    let mut r = rng(17);
    let hosts: Vec<HostTensor> = (0..2)
        .map(|_| {
            let bytes: Vec<u8> = (0..num_blocks * block_bytes)
                .map(|_| rand::Rng::random(&mut r))
                .collect();
            HostTensor::from_bytes(DType::F16, &[num_blocks * block_bytes / 2], &bytes).unwrap()
        })
        .collect();
    let mut pools: Vec<DeviceTensor> = hosts
        .iter()
        .map(|h| DeviceTensor::from_host(&gpu, h).unwrap())
        .collect();
    let pairs = [(0u32, 5u32), (1, 6), (0, 7)];
    {
        let mut refs: Vec<&mut DeviceTensor> = pools.iter_mut().collect();
        gpu.copy_blocks(&mut refs, block_bytes as u64, &pairs)
            .unwrap();
    }
    for (h, d) in hosts.iter().zip(&pools) {
        let got = d.to_host(&gpu).unwrap();
        let (g, o) = (got.buf().as_bytes(), h.buf().as_bytes());
        for b in 0..num_blocks {
            let src = pairs
                .iter()
                .find(|p| p.1 as usize == b)
                .map_or(b, |p| p.0 as usize);
            assert_eq!(
                &g[b * block_bytes..(b + 1) * block_bytes],
                &o[src * block_bytes..(src + 1) * block_bytes],
                "block {b}"
            );
        }
    }
}

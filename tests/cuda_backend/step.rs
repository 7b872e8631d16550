//! The step path on a GPU: the runner against the CPU reference, a whole step
//! captured in a CUDA graph whose replays, after the next plan updates the metadata in
//! place, give the same outputs as direct launches, and the engine-facing
//! `AttentionBackend` serving a scheduler (the body `tests/serving/backend.rs` runs on the CPU).

use super::common::case::{Params, build};
use super::common::{self, rel_l2, tolerance};
use super::gpu;
use pagedkv::cuda::{CudaStepDevice, DeviceTensor};
use pagedkv::host::reference::paged_decode_attention;
use pagedkv::host::step::{DecodeIo, StepCapacity, StepMeta, StepRunner, StepShape};
use pagedkv::host::{DType, HostTensor};

fn step_case(dtype: DType, batch: u32, len: u32, seed: u64) -> common::case::Case {
    build(&Params {
        sinks: false,
        dtype,
        head_dim: 128,
        block_size: 16,
        num_kv_heads: 8,
        group: 4,
        batch,
        max_len: len,
        window: None,
        softcap: None,
        alibi: false,
        partition: None,
        narrow_heads: false,
        seed,
        full_length: true,
    })
}

fn shape_of(c: &common::case::Case, dtype: DType) -> StepShape {
    c.shape.with_dtypes(dtype, dtype)
}

/// A runner on `g` for the case's shapes (room for `max_seqs` sequences), planned
/// for the case's decode.
fn planned_runner<'g>(
    g: &'g pagedkv::cuda::CudaDevice,
    c: &common::case::Case,
    dtype: DType,
    max_seqs: u32,
) -> StepRunner<CudaStepDevice<'g>> {
    let cap = StepCapacity {
        max_seqs,
        max_blocks_per_seq: c.shape.max_blocks_per_seq,
        max_tokens: max_seqs,
        max_partitions: 64,
    };
    let mut r = StepRunner::new(
        CudaStepDevice::new(g),
        shape_of(c, dtype),
        cap,
        g.split_target(),
    )
    .unwrap();
    r.plan(&StepMeta {
        block_tables: &c.tables,
        max_blocks_per_seq: c.shape.max_blocks_per_seq,
        context_lens: &c.lens,
        slot_mapping: &[],
        window: None,
    })
    .unwrap();
    r
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn the_runner_on_the_gpu_matches_the_reference_split_and_unsplit() {
    let g = gpu();
    for (batch, len) in [(64, 1000), (1, 8192)] {
        let dtype = DType::F16;
        let c = step_case(dtype, batch, len, 11);
        let want = paged_decode_attention(&c.inputs());
        let r = planned_runner(&g, &c, dtype, 64);
        let (q, kc, vc) = (
            DeviceTensor::from_host(&g, &c.q).unwrap(),
            DeviceTensor::from_host(&g, &c.kc).unwrap(),
            DeviceTensor::from_host(&g, &c.vc).unwrap(),
        );
        let mut out =
            DeviceTensor::from_host(&g, &HostTensor::full(dtype, c.q.shape(), f64::NAN)).unwrap();
        let p = r
            .decode(
                &c.opts,
                DecodeIo {
                    lse: None,
                    q: q.view(),
                    key_cache: kc.view(),
                    value_cache: vc.view(),
                    sinks: None,
                    out: out.view_mut(),
                    kv_scales: None,
                    group: 0,
                },
            )
            .unwrap()
            .unwrap();
        assert_eq!(p.is_split(), batch == 1, "{p:?}");
        let e = rel_l2(&out.to_host(&g).unwrap().to_f64(), &want);
        assert!(e <= tolerance(dtype), "batch {batch}: rel L2 {e:e} ({p:?})");
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_captured_step_replays_like_direct_launches_after_the_tables_change() {
    let g = gpu();
    let dtype = DType::F16;
    let layers = 4;
    let c = step_case(dtype, 16, 2000, 5);
    // The same shapes with the sequences' rows (and lengths) rotated: new metadata.
    let width = c.shape.max_blocks_per_seq as usize;
    let mut tables2 = c.tables.clone();
    tables2.rotate_left(width);
    let mut lens2 = c.lens.clone();
    lens2.rotate_left(1);
    let cap = StepCapacity {
        max_seqs: 16,
        max_blocks_per_seq: c.shape.max_blocks_per_seq,
        max_tokens: 16,
        max_partitions: 64,
    };
    let mut r = StepRunner::new(
        CudaStepDevice::new(&g),
        shape_of(&c, dtype),
        cap,
        g.split_target(),
    )
    .unwrap();
    let (kc, vc) = (
        DeviceTensor::from_host(&g, &c.kc).unwrap(),
        DeviceTensor::from_host(&g, &c.vc).unwrap(),
    );
    let q = DeviceTensor::from_host(&g, &c.q).unwrap();
    let mut outs: Vec<DeviceTensor> = (0..layers)
        .map(|_| {
            DeviceTensor::from_host(&g, &HostTensor::full(dtype, c.q.shape(), f64::NAN)).unwrap()
        })
        .collect();
    let step = |r: &StepRunner<CudaStepDevice<'_>>,
                outs: &mut [DeviceTensor]|
     -> pagedkv::host::Result<()> {
        for o in outs.iter_mut() {
            r.decode(
                &c.opts,
                DecodeIo {
                    lse: None,
                    q: q.view(),
                    key_cache: kc.view(),
                    value_cache: vc.view(),
                    sinks: None,
                    out: o.view_mut(),
                    kv_scales: None,
                    group: 0,
                },
            )?;
        }
        Ok(())
    };
    let read = |outs: &[DeviceTensor]| -> Vec<Vec<f64>> {
        outs.iter()
            .map(|o| o.to_host(&g).unwrap().to_f64())
            .collect()
    };
    let nan = DeviceTensor::from_host(&g, &HostTensor::full(dtype, c.q.shape(), f64::NAN)).unwrap();
    let plan = |r: &mut StepRunner<CudaStepDevice<'_>>, tables: &[i32], lens: &[i32]| {
        r.plan(&StepMeta {
            block_tables: tables,
            max_blocks_per_seq: width as u32,
            context_lens: lens,
            slot_mapping: &[],
            window: None,
        })
        .map(|_| ())
    };
    // Direct launches for both metadata sets, capturing the first step into a graph.
    plan(&mut r, &c.tables, &c.lens).unwrap();
    step(&r, &mut outs).unwrap();
    let direct1 = read(&outs);
    let graph = r.device().capture(|| step(&r, &mut outs)).unwrap();
    plan(&mut r, &tables2, &lens2).unwrap();
    step(&r, &mut outs).unwrap();
    let direct2 = read(&outs);
    assert_ne!(
        direct1, direct2,
        "the two steps must differ for this test to mean anything"
    );
    // Replays after in-place metadata updates follow the new metadata.
    for (tables, lens, want) in [(&tables2, &lens2, &direct2), (&c.tables, &c.lens, &direct1)] {
        for o in outs.iter_mut() {
            g.copy_d2d(&nan, o).unwrap();
        }
        plan(&mut r, tables, lens).unwrap();
        graph.replay().unwrap();
        g.synchronize().unwrap();
        assert_eq!(&read(&outs), want, "replay differs from direct launches");
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn attention_backend_serves_a_batch_through_swaps_and_prefix_hits() {
    let gpu = gpu();
    for dtype in [DType::F32, DType::F16] {
        let mut be = pagedkv::cuda::CudaBackend::new(
            &gpu,
            common::serve::config(dtype, pagedkv::host::backend::SplitPolicy::Auto, 4),
        )
        .unwrap();
        let s = common::serve::serve_and_check(&mut be, 4);
        assert!(s.checked > 100 && s.swapped_in > 0);
    }
}

/// The shared serving body over fp8 caches on the GPU (the hardware conversions on
/// sm_90): e4m3 under f16 queries, e5m2 under bf16.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn attention_backend_serves_from_fp8_caches() {
    let gpu = gpu();
    for (dtype, kv) in [(DType::F16, DType::E4m3), (DType::Bf16, DType::E5m2)] {
        let mut be = pagedkv::cuda::CudaBackend::new(
            &gpu,
            common::serve::config_kv(dtype, kv, pagedkv::host::backend::SplitPolicy::Auto, 4),
        )
        .unwrap();
        let s = common::serve::serve_and_check(&mut be, 4);
        assert!(
            s.checked > 100 && s.prefill_checked > 100 && s.swapped_in > 0,
            "{kv}"
        );
    }
}

/// Prefill on the GPU through the step path, small enough for compute-sanitizer
/// (gpu-check runs every `sanitizer_small_*` test under memcheck, racecheck and
/// synccheck): 3 sequences of 200 tokens whose last 1, 36 and 200 are new, GQA 4/2 over
/// head_dim 128 (two 64-column passes), window, soft-cap and ALiBi, every dtype.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn sanitizer_small_prefill() {
    use pagedkv::host::ops::prefill::PrefillInputs;
    use pagedkv::host::reference::paged_prefill_attention;
    use pagedkv::host::step::{PrefillIo, PrefillMeta};
    let g = gpu();
    for dtype in [DType::F16, DType::Bf16, DType::F32] {
        let mut c = build(&Params {
            sinks: false,
            dtype,
            head_dim: 128,
            block_size: 16,
            num_kv_heads: 2,
            group: 2,
            batch: 3,
            max_len: 200,
            window: None,
            softcap: Some(20.0),
            alibi: true,
            partition: None,
            narrow_heads: false,
            seed: 3,
            full_length: true,
        });
        c.opts.window = Some(150);
        let indptr = [0, 1, 37, 237];
        let (qh, d) = (c.shape.num_q_heads as usize, 128);
        let mut r = common::rng(9);
        let q = HostTensor::from_f64(dtype, &[237, qh, d], &common::uniform(&mut r, 237 * qh * d))
            .unwrap();
        let want = paged_prefill_attention(&PrefillInputs {
            tree_mask: None,
            shape: &c.shape,
            opts: &c.opts,
            q: &q,
            key_cache: &c.kc,
            value_cache: &c.vc,
            block_tables: &c.tables,
            qo_indptr: &indptr,
            context_lens: &c.lens,
            kv_scales: c.scales.as_ref(),
            sinks: None,
        });
        let cap = StepCapacity {
            max_seqs: 3,
            max_blocks_per_seq: c.shape.max_blocks_per_seq,
            max_tokens: 237,
            max_partitions: 1,
        };
        let mut run = StepRunner::new(
            CudaStepDevice::new(&g),
            shape_of(&c, dtype),
            cap,
            g.sm_count(),
        )
        .unwrap();
        run.set_alibi_slopes(c.opts.alibi_slopes.as_deref())
            .unwrap();
        run.plan(&StepMeta {
            block_tables: &[],
            max_blocks_per_seq: 0,
            context_lens: &[],
            slot_mapping: &[],
            window: None,
        })
        .unwrap();
        run.plan_prefill(&PrefillMeta {
            tree_mask: None,
            block_tables: &c.tables,
            max_blocks_per_seq: c.shape.max_blocks_per_seq,
            qo_indptr: &indptr,
            context_lens: &c.lens,
            window: None,
        })
        .unwrap();
        let (kc, vc) = (
            DeviceTensor::from_host(&g, &c.kc).unwrap(),
            DeviceTensor::from_host(&g, &c.vc).unwrap(),
        );
        let qd = DeviceTensor::from_host(&g, &q).unwrap();
        let mut out =
            DeviceTensor::from_host(&g, &HostTensor::full(dtype, &[237, qh, d], f64::NAN)).unwrap();
        run.prefill(
            &c.opts,
            PrefillIo {
                lse: None,
                q: qd.view(),
                key_cache: kc.view(),
                value_cache: vc.view(),
                sinks: None,
                out: out.view_mut(),
                kv_scales: None,
                group: 0,
            },
        )
        .unwrap();
        let e = rel_l2(&out.to_host(&g).unwrap().to_f64(), &want);
        assert!(e <= tolerance(dtype), "{dtype}: rel L2 {e:e}");
    }
}

/// An engine's own `CudaSlice`s (a candle tensor's storage and its layout offset) run
/// the step path through safe views with no copy; a slice on another stream, or a
/// range past its end, is refused.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn views_of_an_engines_cuda_slices_match_the_reference() {
    use pagedkv::host::step::{TensorView, TensorViewMut};
    let g = gpu();
    let dtype = DType::F32;
    let c = step_case(dtype, 4, 300, 5);
    let want = paged_decode_attention(&c.inputs());
    let r = planned_runner(&g, &c, dtype, 4);
    // Four elements (16 bytes) of padding before q and out: the views start at an offset.
    let f32s = |t: &HostTensor, pad: usize| -> Vec<f32> {
        let mut v = vec![0.0f32; pad];
        v.extend(t.to_f64().iter().map(|&x| x as f32));
        v
    };
    let s = g.stream();
    let q = s.clone_htod(&f32s(&c.q, 4)).unwrap();
    let kc = s.clone_htod(&f32s(&c.kc, 0)).unwrap();
    let vc = s.clone_htod(&f32s(&c.vc, 0)).unwrap();
    let n = c.q.len();
    let mut out = s.clone_htod(&vec![f32::NAN; n + 4]).unwrap();
    r.decode(
        &c.opts,
        DecodeIo {
            lse: None,
            q: TensorView::of_cuda_slice(&g, &q, 4, n, dtype).unwrap(),
            key_cache: TensorView::of_cuda_slice(&g, &kc, 0, kc.len(), dtype).unwrap(),
            value_cache: TensorView::of_cuda_slice(&g, &vc, 0, vc.len(), dtype).unwrap(),
            sinks: None,
            out: TensorViewMut::of_cuda_slice_mut(&g, &mut out, 4, n, dtype).unwrap(),
            kv_scales: None,
            group: 0,
        },
    )
    .unwrap();
    let got: Vec<f64> = s.clone_dtoh(&out).unwrap()[4..]
        .iter()
        .map(|&x| x as f64)
        .collect();
    let e = rel_l2(&got, &want);
    assert!(e <= tolerance(dtype), "rel L2 {e:e}");

    assert!(TensorView::of_cuda_slice(&g, &q, 5, n, dtype).is_err());
    assert!(TensorView::of_cuda_slice(&g, &q, 0, n, DType::F16).is_err());
    let other = s.context().new_stream().unwrap();
    let elsewhere = other.clone_htod(&[0.0f32; 16]).unwrap();
    assert!(TensorView::of_cuda_slice(&g, &elsewhere, 0, 16, dtype).is_err());
}

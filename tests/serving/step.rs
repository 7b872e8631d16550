//! The step path (plan once per step, run per layer): launch-only runs proven with the
//! recording device, results proven in the emulator against the f64 reference with
//! row-strided q and out, and every bad view an error naming the argument.

use crate::common;

use common::case::{Params, build};
use common::{cases, rel_l2, tolerance};
use pagedkv::host::emulator::Emulator;
use pagedkv::host::ops::SUPPORTED_HEAD_DIMS;
use pagedkv::host::ops::attention::AttentionOptions;
use pagedkv::host::reference::paged_decode_attention;
use pagedkv::host::step::{
    DecodeIo, DeviceOp, EmuDevice, KvAppendIo, Recorder, Space, StepCapacity, StepMeta, StepRunner,
    StepShape, TensorView, TensorViewMut,
};
use pagedkv::host::{DType, Error, HostTensor};
use proptest::prelude::*;

fn llama(dtype: DType) -> StepShape {
    StepShape {
        num_q_heads: 32,
        num_kv_heads: 8,
        head_dim: 128,
        block_size: 16,
        num_blocks: 4096,
        dtype,
        kv_dtype: dtype,
    }
}

const CAP: StepCapacity = StepCapacity {
    max_seqs: 64,
    max_blocks_per_seq: 2048,
    max_tokens: 512,
    max_partitions: 64,
};

#[test]
fn a_run_does_nothing_but_launch_and_a_plan_makes_one_upload() {
    let shape = llama(DType::F16);
    let mut r = StepRunner::new(Recorder::new(), shape, CAP, 132).unwrap();
    let made = r.device().take();
    assert!(
        made.iter().all(|op| matches!(op, DeviceOp::Alloc(_))),
        "{made:?}"
    );

    // Two steps: batch 64 at context ~4096 (no split), then batch 1 at 32768 (split).
    for (seqs, len) in [(64u32, 4000i32), (1, 32768)] {
        let width = (len as u32).div_ceil(16);
        let tables: Vec<i32> = (0..seqs * width).map(|i| (i % 4096) as i32).collect();
        let lens = vec![len; seqs as usize];
        let slots: Vec<i64> = (0..seqs as i64).map(|i| i * 16).collect();
        r.plan(&StepMeta {
            block_tables: &tables,
            max_blocks_per_seq: width,
            context_lens: &lens,
            slot_mapping: &slots,
            window: None,
        })
        .unwrap();
        let planned = r.device().take();
        assert_eq!(planned.len(), 1, "{planned:?}");
        assert!(matches!(planned[0], DeviceOp::Upload(_)), "{planned:?}");

        let pool = 4096 * 8 * 16 * 128;
        let row = 32 * 128;
        let dev = r.device_mut();
        let (k, v) = (
            dev.view(seqs as u64 * 8 * 128, DType::F16),
            dev.view(seqs as u64 * 8 * 128, DType::F16),
        );
        let (mut kc, mut vc) = (dev.view(pool, DType::F16), dev.view(pool, DType::F16));
        // q inside a fused QKV row: stride (32 + 2 * 8) heads of 128.
        let qkv = dev
            .view(seqs as u64 * 48 * 128, DType::F16)
            .with_row_stride(48 * 128);
        let mut out = dev.view(seqs as u64 * row, DType::F16);
        r.device().take();
        let layers = 32;
        let mut split = false;
        for _ in 0..layers {
            r.kv_append(KvAppendIo {
                key: k.as_view(),
                value: v.as_view(),
                key_cache: kc.reborrow(),
                value_cache: vc.reborrow(),
                kv_scales: None,
                group: 0,
            })
            .unwrap();
            let p = r
                .decode(
                    &AttentionOptions::new(128),
                    DecodeIo {
                        lse: None,
                        q: qkv.as_view(),
                        key_cache: kc.as_view(),
                        value_cache: vc.as_view(),
                        sinks: None,
                        out: out.reborrow(),
                        kv_scales: None,
                        group: 0,
                    },
                )
                .unwrap()
                .unwrap();
            split = p.is_split();
        }
        let ops = r.device().take();
        assert!(
            ops.iter().all(|op| matches!(op, DeviceOp::Launch(..))),
            "a run did something other than launch: {ops:?}"
        );
        let per_layer = if split { 3 } else { 2 };
        assert_eq!(ops.len(), layers * per_layer, "seqs {seqs}, split {split}");
        assert_eq!(split, seqs == 1, "batch {seqs}");
    }
}

fn params() -> impl Strategy<Value = (Params, u64, u64)> {
    (
        prop::sample::select(DType::ALL.to_vec()),
        prop::sample::select(SUPPORTED_HEAD_DIMS.to_vec()),
        prop::sample::select(vec![8u32, 16, 32]),
        1u32..=2,
        1u32..=4,
        prop::sample::select(vec![1u32, 3, 17]),
        1u32..=120,
        any::<u64>(),
        (0u64..3, 0u64..3),
    )
        .prop_map(
            |(dtype, head_dim, block_size, kvh, group, batch, max_len, seed, pads)| {
                let p = Params {
                    sinks: false,
                    dtype,
                    head_dim,
                    block_size,
                    num_kv_heads: kvh,
                    group,
                    batch,
                    max_len,
                    window: None,
                    softcap: None,
                    alibi: false,
                    partition: None,
                    narrow_heads: false,
                    seed,
                    full_length: false,
                };
                (p, pads.0, pads.1)
            },
        )
}

/// `rows` rows of `src`'s `row` elements, each in a row of `row + pad` elements (the pad
/// a multiple of 16 bytes), the padding NaN.
fn strided(src: &HostTensor, rows: usize, row: usize, pad: usize) -> HostTensor {
    let stride = row + pad;
    let mut t = HostTensor::full(src.dtype(), &[rows, stride], f64::NAN);
    for r in 0..rows {
        for e in 0..row {
            t.set(r * stride + e, src.get(r * row + e));
        }
    }
    t
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(24), ..ProptestConfig::default() })]

    /// The runner on the emulator gives the reference's answer, with q and out as
    /// strided views whose padding must stay untouched.
    #[test]
    fn the_runner_in_the_emulator_matches_the_reference_with_strided_q_and_out(
        (p, q_pad, out_pad) in params()
    ) {
        let c = build(&p);
        let want = paged_decode_attention(&c.inputs());
        let shape = c.shape.with_dtypes(p.dtype, p.dtype);
        let cap = StepCapacity { max_seqs: 32, max_blocks_per_seq: 64, max_tokens: 64, max_partitions: 4 };
        // sm_count 64: small batches split, so both paths run.
        let mut r = StepRunner::new(EmuDevice::new(Emulator::new()), shape, cap, 64).unwrap();
        r.plan(&StepMeta {
            block_tables: &c.tables,
            max_blocks_per_seq: c.shape.max_blocks_per_seq,
            context_lens: &c.lens,
            slot_mapping: &[],
            window: None,
        }).unwrap();
        let rows = c.shape.num_seqs as usize;
        let row = (c.shape.num_q_heads * c.shape.head_dim) as usize;
        let per16 = 16 / p.dtype.size();
        let q = strided(&c.q, rows, row, q_pad as usize * per16);
        let mut out = HostTensor::full(p.dtype, &[rows, row + out_pad as usize * per16], f64::NAN);
        {
            let qv = TensorView::of_host(&q).with_row_stride((row + q_pad as usize * per16) as u64);
            let ov = TensorViewMut::of_host(&mut out).with_row_stride((row + out_pad as usize * per16) as u64);
            r.decode(&c.opts, DecodeIo {
                lse: None,
                q: qv,
                key_cache: TensorView::of_host(&c.kc),
                value_cache: TensorView::of_host(&c.vc),
                sinks: None,
                out: ov,
                kv_scales: None,
                group: 0,
            }).unwrap();
        }
        let stride = row + out_pad as usize * per16;
        let got: Vec<f64> = (0..rows).flat_map(|s| (0..row).map(move |e| (s, e))).map(|(s, e)| out.get(s * stride + e)).collect();
        let e = rel_l2(&got, &want);
        prop_assert!(e <= tolerance(p.dtype), "runner vs reference: {:e} ({:?})", e, r.planned());
        for s in 0..rows {
            for e in row..stride {
                prop_assert!(out.get(s * stride + e).is_nan(), "padding of row {} written", s);
            }
        }
    }
}

fn emu_runner() -> StepRunner<EmuDevice> {
    let shape = StepShape {
        num_q_heads: 4,
        num_kv_heads: 2,
        head_dim: 64,
        block_size: 16,
        num_blocks: 8,
        dtype: DType::F16,
        kv_dtype: DType::F16,
    };
    let cap = StepCapacity {
        max_seqs: 2,
        max_blocks_per_seq: 4,
        max_tokens: 8,
        max_partitions: 4,
    };
    StepRunner::new(EmuDevice::new(Emulator::new()), shape, cap, 1).unwrap()
}

fn names(e: Error, arg: &str) {
    match &e {
        Error::InvalidArgument { arg: a, .. } => assert_eq!(*a, arg, "{e}"),
        _ => panic!("expected an error naming `{arg}`, got {e}"),
    }
}

#[test]
fn bad_views_and_metadata_are_errors_naming_the_argument() {
    let mut r = emu_runner();
    let meta = StepMeta {
        block_tables: &[3, 0],
        max_blocks_per_seq: 2,
        context_lens: &[5],
        slot_mapping: &[52],
        window: None,
    };
    // Over capacity; block ids outside the pool; a slot written twice.
    let big = [0i32; 3];
    names(
        r.plan(&StepMeta {
            context_lens: &big,
            block_tables: &[0; 6],
            ..meta
        })
        .unwrap_err(),
        "meta",
    );
    names(
        r.plan(&StepMeta {
            block_tables: &[9, 0],
            ..meta
        })
        .unwrap_err(),
        "block_tables",
    );
    names(
        r.plan(&StepMeta {
            slot_mapping: &[52, 52],
            ..meta
        })
        .unwrap_err(),
        "slot_mapping",
    );
    // A run before any successful plan.
    let q = HostTensor::full(DType::F16, &[1, 4, 64], 0.0);
    let pool = [8 * 2 * 16 * 64];
    let kc = HostTensor::full(DType::F16, &pool, 0.0);
    let mut out = HostTensor::full(DType::F16, &[1, 4, 64], 0.0);
    let kc_view = TensorView::of_host(&kc);
    let run = |r: &StepRunner<EmuDevice>, q: TensorView<'_>, out: TensorViewMut<'_>| {
        r.decode(
            &AttentionOptions::new(64),
            DecodeIo {
                lse: None,
                q,
                key_cache: kc_view,
                value_cache: kc_view,
                kv_scales: None,
                sinks: None,
                out,
                group: 0,
            },
        )
    };
    assert!(matches!(
        run(
            &r,
            TensorView::of_host(&q),
            TensorViewMut::of_host(&mut out)
        )
        .unwrap_err(),
        Error::InvalidState(_)
    ));
    r.plan(&meta).unwrap();
    run(
        &r,
        TensorView::of_host(&q),
        TensorViewMut::of_host(&mut out),
    )
    .unwrap();

    // Misaligned by 4 bytes (a view into the middle of a buffer).
    let addr = TensorView::of_host(&q);
    // SAFETY: 4 bytes into `q`, one element short of its end: valid host memory.
    let shifted = unsafe {
        TensorView::from_raw(
            q.buf().as_bytes().as_ptr() as u64 + 4,
            255,
            DType::F16,
            Space::Host,
        )
    };
    let _ = addr;
    names(
        run(&r, shifted, TensorViewMut::of_host(&mut out)).unwrap_err(),
        "q",
    );
    // A stride that is not a multiple of 16 bytes, or shorter than a row.
    names(
        run(
            &r,
            TensorView::of_host(&q).with_row_stride(260),
            TensorViewMut::of_host(&mut out),
        )
        .unwrap_err(),
        "q",
    );
    names(
        run(
            &r,
            TensorView::of_host(&q).with_row_stride(128),
            TensorViewMut::of_host(&mut out),
        )
        .unwrap_err(),
        "q",
    );
    // The wrong dtype, and memory of another device.
    let q32 = HostTensor::full(DType::F32, &[1, 4, 64], 0.0);
    names(
        run(
            &r,
            TensorView::of_host(&q32),
            TensorViewMut::of_host(&mut out),
        )
        .unwrap_err(),
        "q",
    );
    let mut rec = Recorder::new();
    let foreign = rec.view(256, DType::F16);
    names(
        run(&r, foreign.as_view(), TensorViewMut::of_host(&mut out)).unwrap_err(),
        "q",
    );
    // Too short an output.
    let mut short = HostTensor::full(DType::F16, &[1, 4, 32], 0.0);
    names(
        run(
            &r,
            TensorView::of_host(&q),
            TensorViewMut::of_host(&mut short),
        )
        .unwrap_err(),
        "out",
    );
}

/// A stride near `u64::MAX` once wrapped the span `(rows - 1) * stride + row` around to
/// a small count that passed; only the emulator's own bounds check then stopped the
/// launch (on CUDA nothing would have: reads and writes outside the buffers).
#[test]
fn a_row_stride_whose_span_overflows_is_an_error_naming_the_view() {
    let mut r = emu_runner();
    r.plan(&two_rows()).unwrap();
    let pool = [8 * 2 * 16 * 64];
    let kc = HostTensor::full(DType::F16, &pool, 0.0);
    let q = HostTensor::full(DType::F16, &[2, 4, 64], 0.0);
    let mut out = HostTensor::full(DType::F16, &[2, 4, 64], 0.0);
    for stride in [u64::MAX - 255, u64::MAX - 7, 1 << 63, u64::MAX] {
        let e = r.decode(
            &AttentionOptions::new(64),
            DecodeIo {
                lse: None,
                q: TensorView::of_host(&q).with_row_stride(stride),
                key_cache: TensorView::of_host(&kc),
                value_cache: TensorView::of_host(&kc),
                kv_scales: None,
                sinks: None,
                out: TensorViewMut::of_host(&mut out),
                group: 0,
            },
        );
        names(e.unwrap_err(), "q");
        let e = r.decode(
            &AttentionOptions::new(64),
            DecodeIo {
                lse: None,
                q: TensorView::of_host(&q),
                key_cache: TensorView::of_host(&kc),
                value_cache: TensorView::of_host(&kc),
                kv_scales: None,
                sinks: None,
                out: TensorViewMut::of_host(&mut out).with_row_stride(stride),
                group: 0,
            },
        );
        names(e.unwrap_err(), "out");
    }
}

/// Two decoding sequences of 5 and 3 tokens in blocks 3 and 4 of [`emu_runner`]'s pool.
fn two_rows() -> StepMeta<'static> {
    StepMeta {
        block_tables: &[3, 0, 4, 0],
        max_blocks_per_seq: 2,
        context_lens: &[5, 3],
        slot_mapping: &[52, 66],
        window: None,
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(256), ..ProptestConfig::default() })]

    /// Row strides anywhere in `u64`, most near its limits or powers of two, for q and
    /// out over real buffers of random length: a decode either runs or is an error
    /// naming the view, and it runs only when every row lies inside its buffer (the
    /// emulator's bounds check would make any read or write outside it an error of
    /// another kind).
    #[test]
    fn row_strides_near_the_limits_are_runs_inside_the_buffer_or_errors_naming_the_view(
        q_stride in stride(),
        out_stride in stride(),
        q_extra in 0usize..1024,
        out_extra in 0usize..1024,
    ) {
        let mut r = emu_runner();
        r.plan(&two_rows()).unwrap();
        let row = 4 * 64usize;
        let kc = HostTensor::full(DType::F16, &[8 * 2 * 16 * 64], 0.5);
        let q = HostTensor::full(DType::F16, &[2 * row + q_extra], 1.0);
        let mut out = HostTensor::full(DType::F16, &[2 * row + out_extra], f64::NAN);
        let fits = |stride: Option<u64>, len: usize| {
            let s = stride.unwrap_or(row as u64) as u128;
            s >= row as u128 && (s * 2).is_multiple_of(16) && s + row as u128 <= len as u128
        };
        let mut qv = TensorView::of_host(&q);
        if let Some(s) = q_stride {
            qv = qv.with_row_stride(s);
        }
        let mut ov = TensorViewMut::of_host(&mut out);
        if let Some(s) = out_stride {
            ov = ov.with_row_stride(s);
        }
        let res = r.decode(
            &AttentionOptions::new(64),
            DecodeIo {
                lse: None,
                q: qv,
                key_cache: TensorView::of_host(&kc),
                value_cache: TensorView::of_host(&kc),
                kv_scales: None,
                sinks: None,
                out: ov,
                group: 0,
            },
        );
        // (A dense view must be exactly two rows long.)
        let q_ok = fits(q_stride, 2 * row + q_extra) && (q_stride.is_some() || q_extra == 0);
        let out_ok = fits(out_stride, 2 * row + out_extra) && (out_stride.is_some() || out_extra == 0);
        match res {
            Ok(_) => prop_assert!(q_ok && out_ok, "ran with q {:?} out {:?}", q_stride, out_stride),
            Err(Error::InvalidArgument { arg, .. }) => {
                prop_assert!(!q_ok || !out_ok, "refused a good view");
                prop_assert!(arg == "q" || arg == "out", "{}", arg);
            }
            Err(e) => prop_assert!(false, "not an argument error: {}", e),
        }
    }
}

/// A row stride whose bytes overflow 64 bits (2^64 - 256 f16 elements: at least a row
/// and an even number of elements) is refused for the overflow, naming the view; it
/// was refused as "not a multiple of 16 bytes", which it is.
#[test]
fn a_row_stride_whose_bytes_overflow_is_refused_for_that() {
    let mut r = emu_runner();
    r.plan(&two_rows()).unwrap();
    let row = 4 * 64usize;
    let kc = HostTensor::full(DType::F16, &[8 * 2 * 16 * 64], 0.5);
    let q = HostTensor::full(DType::F16, &[2 * row], 1.0);
    let mut out = HostTensor::full(DType::F16, &[2 * row], f64::NAN);
    let e = r.decode(
        &AttentionOptions::new(64),
        DecodeIo {
            lse: None,
            q: TensorView::of_host(&q).with_row_stride(u64::MAX - 255),
            key_cache: TensorView::of_host(&kc),
            value_cache: TensorView::of_host(&kc),
            kv_scales: None,
            sinks: None,
            out: TensorViewMut::of_host(&mut out),
            group: 0,
        },
    );
    match e {
        Err(Error::InvalidArgument { arg: "q", reason }) => {
            assert!(
                reason.contains("overflow") && !reason.contains("multiple of 16"),
                "{reason}"
            );
        }
        e => panic!("{e:?}"),
    }
}

/// A row stride: none (dense), near `u64::MAX`, near a power of two, or small.
fn stride() -> impl Strategy<Value = Option<u64>> {
    prop_oneof![
        1 => Just(None),
        2 => (0u64..4096).prop_map(|k| Some(u64::MAX - k)),
        2 => (0u32..64, -8i64..8).prop_map(|(p, d)| Some((1u64 << p).wrapping_add(d as u64))),
        3 => (0u64..2048).prop_map(Some),
    ]
}

/// A capacity within every per-field limit but whose metadata is hundreds of TiB
/// (65535 rows of 2^31 blocks) was allocated as asked: the emulator's host
/// allocation aborted or met the OOM killer. It is refused by name, under a documented
/// budget.
#[test]
fn a_capacity_beyond_the_metadata_budget_is_refused_by_name() {
    let shape = llama(DType::F16);
    for (max_seqs, max_blocks) in [(65535, i32::MAX as u32), (65535, 8192), (2, 1 << 28)] {
        let cap = StepCapacity {
            max_seqs,
            max_blocks_per_seq: max_blocks,
            max_tokens: 64,
            max_partitions: 4,
        };
        let e = StepRunner::new(EmuDevice::new(Emulator::new()), shape, cap, 1).err();
        match e {
            Some(Error::InvalidArgument { arg, reason }) => {
                assert_eq!(arg, "capacity", "{reason}");
                assert!(reason.contains("MAX_STEP_META_BYTES"), "{reason}");
            }
            other => panic!("{max_seqs} x {max_blocks}: {other:?}"),
        }
    }
    // Within the budget it is fine.
    let cap = StepCapacity {
        max_seqs: 256,
        max_blocks_per_seq: 4096,
        max_tokens: 64,
        max_partitions: 4,
    };
    assert!(StepRunner::new(EmuDevice::new(Emulator::new()), shape, cap, 1).is_ok());
}

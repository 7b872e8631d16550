//! The shared backend test body (`tests/common/serve.rs`) on the CPU backend (over the
//! emulator, and over the PTX interpreter running the committed PTX), and the backend
//! API's errors.

use crate::common;

use common::serve::{
    HOST_BLOCKS, LAYERS, NUM_BLOCKS, ServeCase, config, config_kv, fp8_scales, serve_and_check,
    serve_case, shape,
};
use pagedkv::host::backend::{
    AsView, AttentionBackend, BackendConfig, CpuBackend, DecodeArgs, SplitPolicy, decode_rows,
};
use pagedkv::host::ops::attention::AttentionOptions;
use pagedkv::host::scheduler::{Request, Scheduler, SchedulerConfig};
use pagedkv::host::step::StepShape;
use pagedkv::host::{DType, Error, HostTensor};
use proptest::prelude::*;

#[test]
fn the_cpu_backend_serves_a_batch_through_swaps_and_prefix_hits() {
    for dtype in [DType::F32, DType::F16] {
        let mut be = CpuBackend::new(config(dtype, SplitPolicy::Auto, 1)).unwrap();
        let s = serve_and_check(&mut be, 1);
        // The run must exercise what it claims to.
        assert!(s.checked > 100, "{} outputs checked", s.checked);
        assert!(
            s.prefill_checked > 100,
            "{} prefill outputs",
            s.prefill_checked
        );
        assert!(
            s.preempted > 0 && s.swapped_out > 0 && s.swapped_in > 0,
            "no swap"
        );
        // Split-K fills a GPU's SMs: the CPU backend never splits unless asked.
        assert_eq!(s.split_steps, 0);
    }
}

/// Chunked prefill at block 16, head_dim 64, f16 and bf16, an e4m3 cache under f16:
/// the planner gives each step's prefill rows the multi-warp tensor-core kernel, steps
/// mix decoding rows with prefill chunks (prefix hits and swaps too), and every
/// prefilling token and decode output holds against f64 attention.
#[test]
fn steps_mixing_decodes_and_prefill_chunks_on_the_multi_warp_kernel() {
    for (dtype, kv) in [
        (DType::F16, DType::F16),
        (DType::Bf16, DType::Bf16),
        (DType::F16, DType::E4m3),
    ] {
        let shape = StepShape {
            block_size: 16,
            num_blocks: 14,
            kv_dtype: kv,
            ..shape(dtype, 1)
        };
        let mut c = BackendConfig::new(shape, LAYERS, 16, 128 / 16);
        c.num_host_blocks = HOST_BLOCKS;
        let mut be = CpuBackend::new(c).unwrap();
        let mut case = common::serve::shared_prefix_case(2);
        case.sched.block_size = 16;
        case.sched.num_blocks = 14;
        case.sched.max_tokens_per_step = 40;
        case.chunked = true;
        let s = serve_case(&mut be, &case);
        assert!(
            s.mixed_multi_warp_steps > 0 && s.prefill_checked > 100 && s.checked > 100,
            "{dtype}/{kv}: {s:?}"
        );
        assert!(
            s.swapped_out > 0 && s.cached_tokens > 0,
            "{dtype}/{kv}: {s:?}"
        );
    }
}

/// Cascade attention in the serving loop (every decode step whose rows share a full
/// block, `CascadePolicy::Always`): four requests share a 34-token prefix, through
/// prefix hits, swaps and split-K, f16 and an e4m3 cache; every output holds against
/// f64 attention as without it.
#[test]
fn the_serving_loop_decodes_shared_prefixes_as_cascades() {
    use pagedkv::host::ops::cascade::CascadePolicy;
    for (kv, split) in [
        (DType::F16, SplitPolicy::ForSms(132)),
        (DType::E4m3, SplitPolicy::Never),
    ] {
        let mut c = config_kv(DType::F16, kv, split, 2);
        c.cascade = CascadePolicy::Always {
            min_shared_blocks: 1,
        };
        let mut be = CpuBackend::new(c).unwrap();
        let s = serve_and_check(&mut be, 2);
        assert!(s.cascade_steps > 5 && s.checked > 100, "{kv}: {s:?}");
        assert!(s.swapped_out > 0 && s.cached_tokens > 0, "{kv}: {s:?}");
    }
}

/// The same serving loop over fp8 caches (e4m3 under f16 queries, e5m2 under bf16):
/// every output against f64 attention over what the cache holds (each K/V value
/// through `encode(x / scale)`, decoded, times the layer's and head's scale), through
/// swaps and prefix hits (split-K over fp8 is proven in `tests/ops/fp8_cache.rs`: these
/// contexts are too short to split).
#[test]
fn the_cpu_backend_serves_from_fp8_caches() {
    for (dtype, kv, split) in [
        (DType::F16, DType::E4m3, SplitPolicy::Auto),
        (DType::Bf16, DType::E5m2, SplitPolicy::Never),
    ] {
        let mut be = CpuBackend::new(config_kv(dtype, kv, split, 1)).unwrap();
        let s = serve_and_check(&mut be, 1);
        assert!(s.checked > 100, "{kv}: {} outputs checked", s.checked);
        assert!(
            s.prefill_checked > 100,
            "{kv}: {} prefill",
            s.prefill_checked
        );
        assert!(s.swapped_out > 0 && s.swapped_in > 0, "{kv}: no swap");
    }
}

/// The serving body over the committed PTX: the CPU backend on the PTX interpreter
/// (`ptx-interp/`), both modules, f16 and an fp8 cache, every output against f64
/// attention through swaps and prefix hits, as on the emulator (this case forks no
/// sequence, so copy_blocks runs in the ops tests instead).
#[test]
fn the_serving_loop_runs_on_the_committed_ptx() {
    use pagedkv_ptx_interp::{MathMode, Module, PtxDevice};
    use std::sync::Arc;
    for m in pagedkv::ptx::ALL {
        let module = Arc::new(Module::parse(m.arch, m.ptx).unwrap());
        for (dtype, kv) in [(DType::F16, DType::F16), (DType::Bf16, DType::E4m3)] {
            let dev = PtxDevice::new(module.clone(), MathMode::Exact);
            let log = dev.log();
            let mut be =
                CpuBackend::with_device(config_kv(dtype, kv, SplitPolicy::Auto, 1), dev).unwrap();
            assert_eq!(be.name(), "cpu (PtxDevice)");
            let s = serve_and_check(&mut be, 1);
            let what = format!("{} {dtype} over {kv}", m.arch);
            assert!(s.checked > 100 && s.prefill_checked > 100, "{what}: {s:?}");
            assert!(s.swapped_out > 0 && s.swapped_in > 0, "{what}: no swap");
            let kernels: std::collections::BTreeSet<&str> =
                log.take().into_iter().map(|r| r.kernel).collect();
            assert!(s.cached_tokens > 0, "{what}: no prefix hit");
            let sfx = if kv == dtype {
                format!("{dtype}")
            } else {
                format!("{dtype}_{kv}")
            };
            let want: std::collections::BTreeSet<String> = [
                "kv_append",
                "paged_decode_attention",
                "paged_prefill_attention",
            ]
            .iter()
            .map(|k| format!("{k}_{sfx}"))
            .collect();
            let got: std::collections::BTreeSet<String> =
                kernels.iter().map(|k| k.to_string()).collect();
            assert_eq!(got, want, "{what}");
        }
    }
}

/// An fp8 cache refuses to run before its scales are set, and scales are refused for
/// other caches, for a layer that does not exist and when they are not valid.
#[test]
fn fp8_scales_are_required_and_checked() {
    let mut be = CpuBackend::new(config_kv(DType::F16, DType::E4m3, SplitPolicy::Auto, 1)).unwrap();
    let mut cache = be.alloc_cache().unwrap();
    let mut sched = Scheduler::new(SchedulerConfig {
        num_blocks: NUM_BLOCKS,
        block_size: 8,
        max_model_len: 64,
        ..SchedulerConfig::default()
    })
    .unwrap();
    sched
        .add_request(Request::new(0, vec![1, 2, 3], 2))
        .unwrap();
    let batch = sched.step().unwrap().clone();
    be.begin_step(&batch, &mut cache).unwrap();
    let k = HostTensor::full(DType::F16, &[3, 2, 64], 0.5);
    let append = |be: &mut CpuBackend,
                  cache: &mut pagedkv::host::backend::PagedCache<HostTensor>| {
        be.kv_append(pagedkv::host::backend::KvAppendArgs {
            key: k.view(),
            value: k.view(),
            cache: &mut cache.layers[0],
            group: 0,
        })
    };
    assert!(matches!(
        append(&mut be, &mut cache),
        Err(Error::InvalidArgument {
            arg: "kv_scales",
            ..
        })
    ));
    let mut bad = fp8_scales(DType::E4m3, 0);
    bad.v[1] = 0.0;
    assert!(be.set_kv_scales(&mut cache, 0, &bad).is_err());
    assert!(
        be.set_kv_scales(&mut cache, LAYERS, &fp8_scales(DType::E4m3, 0))
            .is_err()
    );
    be.set_kv_scales(&mut cache, 0, &fp8_scales(DType::E4m3, 0))
        .unwrap();
    append(&mut be, &mut cache).unwrap();
    // Scales for an f16 cache; fp8 caches under f32 queries.
    let mut f16 = CpuBackend::new(config(DType::F16, SplitPolicy::Auto, 1)).unwrap();
    let mut c16 = f16.alloc_cache().unwrap();
    assert!(matches!(
        f16.set_kv_scales(&mut c16, 0, &fp8_scales(DType::E4m3, 0)),
        Err(Error::InvalidArgument {
            arg: "kv_scales",
            ..
        })
    ));
    assert!(CpuBackend::new(config_kv(DType::F32, DType::E4m3, SplitPolicy::Auto, 1)).is_err());
}

#[test]
fn the_cpu_backend_splits_only_when_asked_and_agrees_either_way() {
    // Contexts of 300-600 tokens: long enough for partitions (at least 256 tokens).
    let mut be = CpuBackend::new(config(DType::F32, SplitPolicy::ForSms(132), 16)).unwrap();
    let s = serve_and_check(&mut be, 16);
    assert!(s.checked > 100);
    assert!(
        s.split_steps > 0,
        "planned for 132 SMs, the small batches split"
    );
}

#[test]
fn a_foreign_cache_or_wrong_rows_are_errors_not_results() {
    let mut be = CpuBackend::new(config(DType::F32, SplitPolicy::Auto, 1)).unwrap();
    let mut other = CpuBackend::new(BackendConfig::new(
        StepShape {
            num_blocks: 8,
            ..shape(DType::F32, 1)
        },
        LAYERS,
        4,
        4,
    ))
    .unwrap();
    let mut small = other.alloc_cache().unwrap();
    assert!(matches!(
        be.copy_blocks(&mut small, &[(0, 1)]),
        Err(Error::InvalidArgument { .. })
    ));
    let mut cache = be.alloc_cache().unwrap();
    assert!(be.copy_blocks(&mut cache, &[(0, NUM_BLOCKS)]).is_err());
    assert!(be.swap_out(&cache, &[(0, HOST_BLOCKS)]).is_err());
    assert!(be.swap_in(&mut cache, &[(HOST_BLOCKS, 0)]).is_err());
    // A decode before any step is planned is an error, not a launch on stale metadata.
    let q = HostTensor::full(DType::F32, &[1, 4, 64], 1.0);
    let mut out = q.clone();
    let opts = AttentionOptions::new(64);
    let e = be.decode(DecodeArgs {
        lse: None,
        opts: &opts,
        q: q.view(),
        cache: &cache.layers[0],
        sinks: None,
        out: out.view_mut(),
        group: 0,
    });
    assert!(matches!(e, Err(Error::InvalidState(_))), "{e:?}");

    // One decoding row planned: q and out of two rows are errors naming them, and the
    // output is left alone.
    let mut sched = Scheduler::new(SchedulerConfig {
        num_blocks: NUM_BLOCKS,
        block_size: 8,
        max_model_len: 64,
        ..SchedulerConfig::default()
    })
    .unwrap();
    sched.add_request(Request::new(1, vec![5; 9], 4)).unwrap();
    let prefill = sched.step().unwrap().clone();
    sched.on_step_done(&[(prefill.seqs[0].seq, 3)]).unwrap();
    let batch = sched.step().unwrap().clone();
    assert_eq!(decode_rows(&batch).count(), 1);
    be.begin_step(&batch, &mut cache).unwrap();
    let q2 = HostTensor::full(DType::F32, &[2, 4, 64], 1.0);
    let mut out2 = HostTensor::full(DType::F32, &[2, 4, 64], -3.0);
    let e = be.decode(DecodeArgs {
        lse: None,
        opts: &opts,
        q: q2.view(),
        cache: &cache.layers[0],
        sinks: None,
        out: out2.view_mut(),
        group: 0,
    });
    assert!(
        matches!(&e, Err(Error::InvalidArgument { arg: "q", .. })),
        "{e:?}"
    );
    assert!(out2.to_f64().iter().all(|&x| x == -3.0));
    // A cache of the wrong dtype for this backend.
    let mut f16 = CpuBackend::new(config(DType::F16, SplitPolicy::Auto, 1)).unwrap();
    let mut wrong = f16.alloc_cache().unwrap();
    assert!(be.begin_step(&batch, &mut wrong).is_err());
}

/// A window case: dtype, block size, window, chunk budget (`None`: whole prefills),
/// pool size and the requests (prompt length, `max_tokens`).
type WindowCase = (DType, u32, u32, Option<usize>, u32, Vec<(usize, u32)>);

fn window_cases() -> impl Strategy<Value = WindowCase> {
    (
        prop::sample::select(vec![DType::F32, DType::F16, DType::Bf16]),
        prop::sample::select(vec![8u32, 16, 32]),
        1u32..=48,
        prop::option::of(4usize..=40),
        6u32..=40,
        prop::collection::vec((1usize..=70, 1u32..=4), 1..=3),
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: common::cases(64), ..ProptestConfig::default() })]

    /// Windowed prefill, whole and chunked (random window, block size, prompts, chunk
    /// budget, dtype, pool; preemption by recompute when the pool is short): every
    /// prefilling token and every decode against dense windowed attention over the K/V
    /// its history appended (not over what the cache holds). The blocks a window
    /// releases were once released from the end of a step, and a prefill's early
    /// queries (a 32-token prompt with window 16, block 16: 31 rows) read them: NaN.
    #[test]
    fn windowed_prefill_and_decode_match_dense_windowed_attention(
        (dtype, block_size, window, budget, num_blocks, reqs) in window_cases()
    ) {
        let max_model_len = 80u32;
        let shape = StepShape {
            head_dim: 32,
            block_size,
            num_blocks,
            ..shape(dtype, 1)
        };
        let mut be = CpuBackend::new(BackendConfig::new(
            shape,
            1,
            4,
            max_model_len.div_ceil(block_size),
        ))
        .unwrap();
        let sched = SchedulerConfig {
            num_blocks,
            block_size,
            max_num_seqs: 4,
            max_tokens_per_step: budget.unwrap_or(max_model_len as usize),
            watermark: 0.0,
            sliding_window: Some(window),
            max_model_len,
            ..SchedulerConfig::default()
        };
        // Only the requests the scheduler accepts (a whole prefill of a long prompt
        // needs all its blocks at once: the pool may be too small).
        let requests: Vec<(Vec<u32>, u32)> = reqs
            .iter()
            .enumerate()
            .map(|(i, &(len, max_tokens))| {
                let prompt: Vec<u32> = (0..len as u32).map(|p| (p * 13 + i as u32 * 7) % 101).collect();
                (prompt, max_tokens)
            })
            .filter(|(prompt, max_tokens)| {
                let mut s = Scheduler::with_chunked_prefill(sched.clone(), budget.is_some()).unwrap();
                s.add_request(Request::new(0, prompt.clone(), *max_tokens)).is_ok()
            })
            .collect();
        prop_assume!(!requests.is_empty());
        let case = ServeCase {
            sched,
            chunked: budget.is_some(),
            requests,
            opts: AttentionOptions {
                window: Some(window),
                ..AttentionOptions::new(32)
            },
            sinks: window % 2 == 1, // gpt-oss: windows with sinks,
            layer_groups: None,
        };
        let s = serve_case(&mut be, &case);
        prop_assert!(s.prefill_checked > 0);
    }
}

/// The reported cases: a 32-token prompt prefilled in one step under window 16, block
/// 16 (31 NaN rows), and a 70-token prompt in chunks of 20 (rows inside the kept window
/// NaN too), every dtype: every row against dense windowed attention.
#[test]
fn the_reported_windowed_prefills_have_no_nan_rows() {
    for dtype in [DType::F32, DType::F16, DType::Bf16] {
        for (prompt, budget) in [(32usize, None), (70, Some(20usize))] {
            let shape = StepShape {
                block_size: 16,
                num_blocks: 16,
                ..shape(dtype, 1)
            };
            let mut be = CpuBackend::new(BackendConfig::new(shape, 1, 2, 8)).unwrap();
            let case = ServeCase {
                sched: SchedulerConfig {
                    num_blocks: 16,
                    block_size: 16,
                    max_num_seqs: 2,
                    max_tokens_per_step: budget.unwrap_or(128),
                    sliding_window: Some(16),
                    max_model_len: 128,
                    ..SchedulerConfig::default()
                },
                chunked: budget.is_some(),
                requests: vec![((0..prompt as u32).collect(), 3)],
                opts: AttentionOptions {
                    window: Some(16),
                    ..AttentionOptions::new(64)
                },
                sinks: false,
                layer_groups: None,
            };
            let s = serve_case(&mut be, &case);
            assert_eq!(s.prefill_checked, prompt, "{dtype} prompt {prompt}");
            assert_eq!(s.checked, 2, "{dtype} prompt {prompt}");
        }
    }
}

/// An fp8 cache with 1 or 3 KV heads (MQA, and a head count whose `[2, kv_heads]` f32
/// scales are not a multiple of 16 bytes): once every kv_append refused the layer's
/// scales ("row stride 2 must be ... a multiple of 16 bytes"). Served end to end,
/// every output against f64 attention over what the cache holds.
#[test]
fn fp8_caches_with_one_or_three_kv_heads_serve() {
    for (qh, kvh) in [(4u32, 1u32), (6, 3)] {
        let shape = StepShape {
            num_q_heads: qh,
            num_kv_heads: kvh,
            num_blocks: 32,
            kv_dtype: DType::E4m3,
            ..shape(DType::F16, 1)
        };
        let mut be = CpuBackend::new(BackendConfig::new(shape, 2, 4, 8)).unwrap();
        let case = ServeCase {
            sched: SchedulerConfig {
                num_blocks: 32,
                block_size: 8,
                max_num_seqs: 4,
                max_model_len: 64,
                ..SchedulerConfig::default()
            },
            chunked: false,
            requests: vec![((0..13).collect(), 4), ((5..30).collect(), 3)],
            opts: AttentionOptions::new(64),
            sinks: true, // 6 query heads: 24 bytes of sinks,
            layer_groups: None,
        };
        let s = serve_case(&mut be, &case);
        assert!(s.checked > 0 && s.prefill_checked > 0, "{kvh} KV heads");
    }
}

/// A backend whose swap space would be `u32::MAX` blocks once aborted in
/// `alloc_cache` (an allocation failure is an abort); now the config is refused by
/// name, and pools at most `MAX_POOL_BLOCKS` are allocated fallibly.
#[test]
fn a_backend_beyond_the_pool_cap_is_refused_by_name() {
    use pagedkv::host::block::MAX_POOL_BLOCKS;
    for (host, blocks, arg) in [
        (u32::MAX, NUM_BLOCKS, "num_host_blocks"),
        (MAX_POOL_BLOCKS + 1, NUM_BLOCKS, "num_host_blocks"),
        (0, i32::MAX as u32, "num_blocks"),
    ] {
        let mut c = config(DType::F32, SplitPolicy::Auto, 1);
        c.num_host_blocks = host;
        c.shape.num_blocks = blocks;
        match CpuBackend::new(c) {
            Err(Error::InvalidArgument { arg: a, .. }) => assert_eq!(a, arg),
            other => panic!("expected an error naming {arg}, got {:?}", other.map(drop)),
        }
    }
}

/// A batch carries the window it was scheduled with: attention without one (or with a
/// wider one) over its tables, whose blocks before the window are released, once
/// returned Ok with NaN rows; it is an error naming `window`. A window of at most the
/// batch's is fine.
#[test]
fn attention_over_a_windowed_batch_needs_its_window() {
    let mut be = CpuBackend::new(config(DType::F32, SplitPolicy::Auto, 4)).unwrap();
    let mut cache = be.alloc_cache().unwrap();
    let mut sched = Scheduler::new(SchedulerConfig {
        num_blocks: NUM_BLOCKS * 4,
        block_size: 8,
        max_model_len: 64,
        sliding_window: Some(16),
        ..SchedulerConfig::default()
    })
    .unwrap();
    sched
        .add_request(Request::new(1, (0..40).collect(), 3))
        .unwrap();
    let prefill = sched.step().unwrap().clone();
    assert_eq!(prefill.sliding_window, Some(16));
    be.begin_step(&prefill, &mut cache).unwrap();
    let k = HostTensor::full(DType::F32, &[40, 2, 64], 0.5);
    for layer in cache.layers.iter_mut() {
        be.kv_append(pagedkv::host::backend::KvAppendArgs {
            key: k.view(),
            value: k.view(),
            cache: layer,
            group: 0,
        })
        .unwrap();
    }
    sched.on_step_done(&[(prefill.seqs[0].seq, 3)]).unwrap();
    let batch = sched.step().unwrap().clone();
    be.begin_step(&batch, &mut cache).unwrap();
    let q = HostTensor::full(DType::F32, &[1, 4, 64], 1.0);
    let mut out = q.clone();
    for (window, ok) in [
        (None, false),
        (Some(17), false),
        (Some(16), true),
        (Some(8), true),
    ] {
        let opts = AttentionOptions {
            window,
            ..AttentionOptions::new(64)
        };
        let e = be.decode(DecodeArgs {
            lse: None,
            opts: &opts,
            q: q.view(),
            cache: &cache.layers[0],
            sinks: None,
            out: out.view_mut(),
            group: 0,
        });
        match e {
            Ok(()) => assert!(ok, "window {window:?} accepted"),
            Err(Error::InvalidArgument { arg, .. }) => {
                assert!(!ok, "window {window:?} refused");
                assert_eq!(arg, "window");
            }
            Err(e) => panic!("{e}"),
        }
    }
}

/// A scheduler's block size and the backend's must agree: a batch scheduled for blocks
/// of 16 tokens over a cache of blocks of 8 (slot 16 * b + i names token i of block b
/// there, token i - 8 of block 2b + 1 here) is refused by `begin_step` and by `plan`,
/// before any block moves, naming both sizes. (It once passed every check and attended
/// the wrong positions.)
#[test]
fn a_batch_of_another_block_size_is_refused() {
    let mut be = CpuBackend::new(config(DType::F32, SplitPolicy::Auto, 1)).unwrap();
    assert_eq!(be.config().shape.block_size, 8);
    let mut cache = be.alloc_cache().unwrap();
    let mut sched = Scheduler::new(SchedulerConfig {
        num_blocks: NUM_BLOCKS,
        block_size: 16,
        max_model_len: 64,
        ..SchedulerConfig::default()
    })
    .unwrap();
    sched.add_request(Request::new(1, vec![5; 9], 4)).unwrap();
    let mut batch = sched.step().unwrap().clone();
    assert_eq!(batch.block_size, 16);
    // A copy-on-write pair to run first: block 1 (one element 3.0) into block 2.
    let stride = be.config().layout().block_stride() as usize;
    cache.layers[0].key.set(stride, 3.0);
    batch.copies.push((1, 2));
    for e in [be.begin_step(&batch, &mut cache), be.plan(&batch)] {
        match e {
            Err(Error::InvalidArgument {
                arg: "batch",
                reason,
            }) => {
                assert!(
                    reason.contains("blocks of 16 tokens") && reason.contains("blocks of 8"),
                    "{reason}"
                );
            }
            e => panic!("a block-16 batch over a block-8 cache: {e:?}"),
        }
    }
    // Nothing ran: the copy did not (block 2 is still NaN), and a matching batch plans.
    assert!(cache.layers[0].key.get(2 * stride).is_nan());
    let mut same = Scheduler::new(SchedulerConfig {
        num_blocks: NUM_BLOCKS,
        block_size: 8,
        max_model_len: 64,
        ..SchedulerConfig::default()
    })
    .unwrap();
    same.add_request(Request::new(1, vec![5; 9], 4)).unwrap();
    be.begin_step(same.step().unwrap(), &mut cache).unwrap();
}

/// A burst of requests with one system prompt, all admitted in the first step: the
/// later ones share the first one's full blocks in that very step (their prefill reads
/// K/V the step's kv_append writes), and every output still matches f64 attention over
/// the K/V its history appended. (Each once prefilled the whole prompt.)
#[test]
fn a_burst_with_one_system_prompt_computes_it_once_and_reads_it_right() {
    for dtype in [DType::F32, DType::F16] {
        let shape = StepShape {
            num_blocks: 64,
            ..shape(dtype, 1)
        };
        let mut be = CpuBackend::new(BackendConfig::new(shape, 2, 8, 8)).unwrap();
        let system: Vec<u32> = (0..35).map(|t| t * 3 + 1).collect();
        let requests = (0..5u32)
            .map(|i| {
                let mut p = system.clone();
                p.extend((0..3 + i).map(|t| 200 + 10 * i + t));
                (p, 3)
            })
            .collect();
        let case = ServeCase {
            sched: SchedulerConfig {
                num_blocks: 64,
                block_size: 8,
                max_num_seqs: 8,
                max_model_len: 64,
                enable_prefix_caching: true,
                ..SchedulerConfig::default()
            },
            chunked: false,
            requests,
            opts: AttentionOptions::new(64),
            sinks: false,
            layer_groups: None,
        };
        let s = serve_case(&mut be, &case);
        // Four full blocks of the system prompt (32 tokens) shared by the four later
        // requests, in the first step.
        assert_eq!(s.cached_first_step, 4 * 32, "{dtype}");
        assert!(s.prefill_checked > 0 && s.checked > 0);
    }
}

/// A size near a type's limits, or a small one.
fn size_u32() -> impl Strategy<Value = u32> {
    prop_oneof![
        6 => 1u32..64,
        1 => Just(0u32),
        2 => (0u32..4).prop_map(|k| u32::MAX - k),
        1 => (16u32..32).prop_map(|p| 1u32 << p),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: common::cases(256), ..ProptestConfig::default() })]

    /// Every size a backend is made for near its type's limits (pool blocks, host
    /// blocks, layers, step capacity): `CpuBackend::new` and, for a small accepted one,
    /// `alloc_cache` either work or are an error naming the field; never a panic, an
    /// abort or an allocation the sizes did not ask for.
    #[test]
    fn backend_sizes_near_the_limits_are_refused_by_name_or_work(
        num_blocks in size_u32(),
        num_host_blocks in size_u32(),
        layers in prop_oneof![1usize..4, Just(0usize), Just(usize::MAX), Just(1025usize)],
        max_seqs in size_u32(),
        max_blocks in size_u32(),
        max_tokens in size_u32(),
        max_partitions in size_u32(),
    ) {
        let shape = StepShape { num_blocks, ..shape(DType::F32, 1) };
        let mut c = BackendConfig::new(shape, layers, max_seqs, max_blocks);
        c.num_host_blocks = num_host_blocks;
        c.capacity.max_tokens = max_tokens;
        c.capacity.max_partitions = max_partitions;
        match CpuBackend::new(c) {
            Err(Error::InvalidArgument { .. }) => {}
            Err(e) => prop_assert!(false, "not an argument error: {}", e),
            Ok(mut be) => {
                // Only small pools are allocated here (a valid pool of 2^24 blocks is
                // tens of GB: it would be allocated and filled).
                let bytes = c.block_bytes().unwrap() as u128
                    * (2 * layers as u128)
                    * (num_blocks as u128 + num_host_blocks as u128);
                if bytes <= 256 << 20 {
                    match be.alloc_cache() {
                        Ok(_) | Err(Error::InvalidArgument { .. }) => {}
                        Err(e) => prop_assert!(false, "{}", e),
                    }
                }
            }
        }
    }
}

/// A hybrid model (Gemma-3-like: two layers of a 24-token window for every full one,
/// 6 layers in 3 groups sharing 2 K/V tensors; gpt-oss-like sinks) served end to end:
/// prompts sharing a 34-token prefix (past the window), prefix caching on, a pool
/// small enough to swap. Every decode and prefill output of every layer, through its
/// group's tables and window, against f64 attention over what its K/V must be: a
/// layer reading another group's blocks, or a block its window released (NaN in a
/// fresh cache), fails it.
#[test]
fn a_hybrid_model_serves_every_layer_through_its_groups_tables() {
    use pagedkv::host::block::{KvSpec, LayerGroups};
    let layers: Vec<KvSpec> = (0..6)
        .map(|l| {
            if l % 3 == 2 {
                KvSpec::Full
            } else {
                KvSpec::SlidingWindow(24)
            }
        })
        .collect();
    let groups = LayerGroups::new(&layers).unwrap();
    assert_eq!((groups.specs().len(), groups.layers_per_group()), (3, 2));
    for (dtype, chunked) in [(DType::F32, false), (DType::F16, true)] {
        let mut case = common::serve::shared_prefix_case(2);
        let blocks = 3 * case.sched.num_blocks;
        case.sched.num_blocks = blocks;
        case.sched.kv_groups = groups.specs().to_vec();
        case.chunked = chunked;
        if chunked {
            case.sched.max_tokens_per_step = 24;
        }
        case.layer_groups = Some(groups.clone());
        let shape = StepShape {
            num_blocks: blocks,
            ..shape(dtype, 2)
        };
        let mut cfg = BackendConfig::for_groups(shape, &groups, 16, 128 / shape.block_size);
        cfg.num_host_blocks = HOST_BLOCKS;
        let mut be = CpuBackend::new(cfg).unwrap();
        let s = common::serve::serve_case(&mut be, &case);
        assert!(s.checked > 100 && s.prefill_checked > 100, "{dtype}: {s:?}");
        assert!(
            s.cached_tokens > 24,
            "{dtype}: no prefix hit past the window ({s:?})"
        );
        assert!(s.swapped_out > 0 || s.preempted > 0, "{dtype}: {s:?}");
    }
}

/// Speculative decoding through the backend: a verify row (a lookahead of 5) whose
/// drafts form a tree, beside a plain decode, in one step: the engine fills
/// `Batch::tree_mask`, the backend plans the prefill with the prefill rows' words, and
/// the verify row's outputs equal f64 attention under the tree (and not causal
/// attention).
#[test]
fn a_verify_row_of_drafts_as_a_tree_runs_through_the_backend() {
    use pagedkv::host::backend::{KvAppendArgs, PrefillArgs, prefill_rows};
    use pagedkv::host::ops::attention::DecodeShape;
    use pagedkv::host::ops::prefill::{PrefillInputs, tree_mask};
    use pagedkv::host::reference::paged_prefill_attention;
    for dtype in [DType::F32, DType::F16, DType::Bf16] {
        let cfg = config(dtype, SplitPolicy::Auto, 4);
        let (qh, kvh, d) = (4usize, 2usize, 64usize);
        let mut be = CpuBackend::new(cfg).unwrap();
        let mut cache = be.alloc_cache().unwrap();
        let mut sched = Scheduler::new(SchedulerConfig {
            num_blocks: cfg.shape.num_blocks,
            block_size: cfg.shape.block_size,
            max_tokens_per_step: 256,
            max_model_len: 256,
            watermark: 0.0,
            ..SchedulerConfig::default()
        })
        .unwrap();
        sched
            .add_request(Request::new(0, (0..21).collect(), 20))
            .unwrap();
        sched
            .add_request(Request::new(1, (0..13).collect(), 20))
            .unwrap();
        let mut r = 0.37f64;
        let mut noise = |n: usize| -> Vec<f64> {
            (0..n)
                .map(|_| {
                    r = (r * 3.9 * (1.0 - r)).clamp(0.01, 0.99);
                    r - 0.5
                })
                .collect()
        };
        for step in 0..2 {
            if step == 1 {
                let q = sched.running_seqs()[0];
                sched.set_lookahead(q, 5).unwrap();
            }
            let mut batch = sched.step().unwrap().clone();
            let n = batch.slot_mapping.len();
            if step == 1 {
                // Row 1 verifies its token and 5 drafts as a tree: two children of
                // the root, a chain under the second.
                assert_eq!(batch.num_decodes, 1);
                assert_eq!(batch.seqs[1].num_draft_tokens, 5);
                let parents: Vec<Option<&[i32]>> = vec![None, Some(&[-1, 0, 0, 2, 3, 3])];
                batch.tree_mask = tree_mask(&batch.qo_indptr, &parents).unwrap();
            }
            be.begin_step(&batch, &mut cache).unwrap();
            let mut kv =
                |v: Vec<f64>| be.upload(&HostTensor::from_f64(dtype, &[n, kvh, d], &v).unwrap());
            let key = kv(noise(n * kvh * d)).unwrap();
            let value = kv(noise(n * kvh * d)).unwrap();
            be.kv_append(KvAppendArgs {
                key: key.view(),
                value: value.view(),
                cache: &mut cache.layers[0],
                group: 0,
            })
            .unwrap();
            let opts = AttentionOptions::new(d as u32);
            let prows: Vec<usize> = prefill_rows(&batch).collect();
            let first = batch.seqs[prows[0]].token_offset as usize;
            let pn = n - first;
            let qv = noise(pn * qh * d);
            let q = be
                .upload(&HostTensor::from_f64(dtype, &[pn, qh, d], &qv).unwrap())
                .unwrap();
            let mut out = be
                .upload(&HostTensor::full(dtype, &[pn, qh, d], f64::NAN))
                .unwrap();
            be.prefill(PrefillArgs {
                lse: None,
                opts: &opts,
                q: q.view(),
                cache: &cache.layers[0],
                sinks: None,
                out: out.view_mut(),
                group: 0,
            })
            .unwrap();
            let got = be.download(&out).unwrap().to_f64();
            let (kc, vc) = (
                be.download(&cache.layers[0].key).unwrap(),
                be.download(&cache.layers[0].value).unwrap(),
            );
            let w = batch.max_blocks_per_seq as usize;
            let tables: Vec<i32> = prows
                .iter()
                .flat_map(|&i| batch.block_tables[i * w..(i + 1) * w].to_vec())
                .collect();
            let indptr: Vec<i32> = std::iter::once(0)
                .chain(prows.iter().scan(0, |a, &i| {
                    *a += batch.seqs[i].num_new_tokens as i32;
                    Some(*a)
                }))
                .collect();
            let lens: Vec<i32> = prows.iter().map(|&i| batch.context_lens[i]).collect();
            let shape = DecodeShape {
                num_seqs: prows.len() as u32,
                num_q_heads: qh as u32,
                num_kv_heads: kvh as u32,
                head_dim: d as u32,
                block_size: cfg.shape.block_size,
                num_blocks: cfg.shape.num_blocks,
                max_blocks_per_seq: w as u32,
            };
            let qt = HostTensor::from_f64(dtype, &[pn, qh, d], &qv).unwrap();
            let inputs = PrefillInputs {
                shape: &shape,
                opts: &opts,
                q: &qt,
                key_cache: &kc,
                value_cache: &vc,
                block_tables: &tables,
                qo_indptr: &indptr,
                context_lens: &lens,
                kv_scales: None,
                sinks: None,
                tree_mask: (step == 1).then(|| &batch.tree_mask[first..]),
            };
            let want = paged_prefill_attention(&inputs);
            let e = common::rel_l2(&got, &want);
            assert!(e <= common::tolerance(dtype), "{dtype} step {step}: {e:e}");
            if step == 1 {
                // The tree hides something: causal attention differs.
                let causal = paged_prefill_attention(&PrefillInputs {
                    tree_mask: None,
                    ..inputs
                });
                let gap = common::rel_l2(&got, &causal);
                assert!(
                    gap > 3.0 * common::tolerance(dtype),
                    "{dtype}: tree vs causal {gap:e}"
                );
            }
            let sampled: Vec<(u64, u32)> = batch.seqs.iter().map(|q| (q.seq, 3)).collect();
            sched.on_step_done(&sampled).unwrap();
        }
    }
}

//! The decode-attention host API: every bad input is an error naming the problem,
//! returned before anything runs; and the split-K planner's decisions.

use pagedkv::host::emulator::Emulator;
use pagedkv::host::ops::attention::{
    AttentionOptions, DecodeInputs, DecodeShape, SplitPlan, decode_emulated, plan, validate_plan,
};
use pagedkv::host::{DType, Error, HostTensor};

fn shape() -> DecodeShape {
    DecodeShape {
        num_seqs: 2,
        num_q_heads: 8,
        num_kv_heads: 2,
        head_dim: 64,
        block_size: 16,
        num_blocks: 8,
        max_blocks_per_seq: 4,
    }
}

struct Inputs {
    shape: DecodeShape,
    opts: AttentionOptions,
    q: HostTensor,
    kc: HostTensor,
    vc: HostTensor,
    tables: Vec<i32>,
    lens: Vec<i32>,
    out: HostTensor,
    plan: Option<SplitPlan>,
}

fn good() -> Inputs {
    let s = shape();
    let pool = [s.layout().pool_elems() as usize];
    Inputs {
        shape: s,
        opts: AttentionOptions::new(64),
        q: HostTensor::full(DType::F16, &[2, 8, 64], 0.5),
        kc: HostTensor::full(DType::F16, &pool, 0.25),
        vc: HostTensor::full(DType::F16, &pool, 0.75),
        tables: vec![0, 1, 2, 3, 4, 5, -1, -1],
        lens: vec![60, 20],
        out: HostTensor::full(DType::F16, &[2, 8, 64], f64::NAN),
        plan: None,
    }
}

fn run(i: &mut Inputs) -> Result<(), Error> {
    let p = i
        .plan
        .unwrap_or_else(|| plan(&i.shape, DType::F16, 60, 132));
    let inputs = DecodeInputs {
        shape: &i.shape,
        opts: &i.opts,
        q: &i.q,
        key_cache: &i.kc,
        value_cache: &i.vc,
        block_tables: &i.tables,
        context_lens: &i.lens,
        plan: Some(p),
        kv_scales: None,
        sinks: None,
    };
    decode_emulated(&Emulator::new(), inputs, &mut i.out).map(|_| ())
}

#[test]
fn the_good_inputs_run() {
    let mut i = good();
    run(&mut i).unwrap();
    // Constant V of 0.75 averages to 0.75 whatever the weights.
    assert!(i.out.to_f64().iter().all(|x| *x == 0.75));
}

#[test]
fn every_bad_input_is_an_error_and_out_is_untouched() {
    type Mutation = Box<dyn Fn(&mut Inputs)>;
    let cases: Vec<(&str, Mutation)> = vec![
        ("head_dim", Box::new(|i| i.shape.head_dim = 72)),
        ("block_size", Box::new(|i| i.shape.block_size = 64)),
        ("num_q_heads", Box::new(|i| i.shape.num_q_heads = 7)),
        ("num_q_heads", Box::new(|i| i.shape.num_q_heads = 1 << 17)),
        ("num_seqs", Box::new(|i| i.shape.num_seqs = 0)),
        (
            "q",
            Box::new(|i| i.q = HostTensor::full(DType::F16, &[2, 8, 32], 0.0)),
        ),
        (
            "q",
            Box::new(|i| i.q = HostTensor::full(DType::Bf16, &[2, 8, 64], 0.0)),
        ),
        (
            "out",
            Box::new(|i| i.out = HostTensor::full(DType::F16, &[1, 8, 64], 0.0)),
        ),
        (
            "key_cache",
            Box::new(|i| i.kc = HostTensor::full(DType::F16, &[100], 0.0)),
        ),
        (
            "block_tables",
            Box::new(|i| i.tables.pop().map(|_| ()).unwrap()),
        ),
        ("block_tables", Box::new(|i| i.tables[3] = 8)),
        ("block_tables", Box::new(|i| i.tables[5] = -1)),
        ("context_lens", Box::new(|i| i.lens[1] = 0)),
        ("context_lens", Box::new(|i| i.lens[0] = 65)),
        ("context_lens", Box::new(|i| i.lens.push(3))),
        ("scale", Box::new(|i| i.opts.scale = f32::NAN)),
        ("softcap", Box::new(|i| i.opts.softcap = Some(-1.0))),
        ("window", Box::new(|i| i.opts.window = Some(0))),
        (
            "alibi_slopes",
            Box::new(|i| i.opts.alibi_slopes = Some(vec![0.5; 3])),
        ),
        (
            "plan.heads_per_block",
            Box::new(|i| {
                i.plan = Some(SplitPlan {
                    heads_per_block: 5,
                    partition_tokens: 64,
                    num_partitions: 1,
                })
            }),
        ),
        (
            "plan.partition_tokens",
            Box::new(|i| {
                i.plan = Some(SplitPlan {
                    heads_per_block: 4,
                    partition_tokens: 48,
                    num_partitions: 2,
                })
            }),
        ),
        (
            "plan.num_partitions",
            Box::new(|i| {
                i.plan = Some(SplitPlan {
                    heads_per_block: 4,
                    partition_tokens: 64,
                    num_partitions: 0,
                })
            }),
        ),
    ];
    for (want, mutate) in cases {
        let mut i = good();
        mutate(&mut i);
        match run(&mut i) {
            Err(Error::InvalidArgument { arg, reason }) => {
                assert_eq!(arg, want, "{reason}");
            }
            other => panic!("{want}: expected InvalidArgument, got {other:?}"),
        }
        if i.out.len() == 2 * 8 * 64 {
            assert!(
                i.out.to_f64().iter().all(|x| x.is_nan()),
                "{want}: out written"
            );
        }
    }
}

#[test]
fn a_window_lets_freed_blocks_before_it_hold_any_id() {
    let mut i = good();
    i.opts.window = Some(20);
    // Sequence 0 has 60 tokens: with a window of 20 it reads tokens 40..60, i.e.
    // logical blocks 2 and 3 only; blocks 0 and 1 may be freed.
    i.tables[0] = -1;
    i.tables[1] = 12345;
    run(&mut i).unwrap();
}

#[test]
fn the_planner_splits_only_when_the_grid_leaves_sms_idle() {
    let llama = |seqs| DecodeShape {
        num_seqs: seqs,
        num_q_heads: 32,
        num_kv_heads: 8,
        head_dim: 128,
        block_size: 16,
        num_blocks: 1 << 16,
        max_blocks_per_seq: 2048,
    };
    // Batch 64, context 4096 on 132 SMs: 512 blocks, no split, K/V read once per group.
    let p = plan(&llama(64), DType::F16, 4096, 132);
    assert_eq!(p.num_partitions, 1);
    assert_eq!(p.heads_per_block, 4);
    // Batch 1, context 32768: 8 blocks would idle 124 SMs: split-K, filling the
    // resident slots (sm_80's bounds: one block a SM, its shared memory) without
    // starting a second wave: 17 partitions (136 blocks) would leave 4 SMs running two
    // blocks each while 128 ran one.
    let p = plan(&llama(1), DType::F16, 32768, 132);
    use pagedkv::host::ops::attention::{Arch, decode_blocks_per_sm};
    let slots = decode_blocks_per_sm(&llama(1), DType::F16, Arch::Sm80) * 132;
    assert!(8 * p.num_partitions <= slots, "{p:?}");
    assert!(
        8 * (p.num_partitions + 1) > slots - 8 * 2,
        "{p:?}: fills the wave"
    );
    assert!(p.partition_tokens >= 256 && p.partition_tokens.is_multiple_of(64));
    validate_plan(&llama(1), DType::F16, &p, 32768).unwrap();
    // Short contexts are never cut below the minimum partition.
    let p = plan(&llama(1), DType::F16, 300, 132);
    assert!(p.num_partitions <= 2, "{p:?}");
    // MQA with 64 query heads of 256 f32: a head takes a whole warp (64 chunks over 32
    // lanes), so 4 heads per block, 16 blocks per group.
    let mqa = DecodeShape {
        num_q_heads: 64,
        num_kv_heads: 1,
        head_dim: 256,
        ..llama(64)
    };
    let p = plan(&mqa, DType::F32, 1000, 132);
    assert_eq!((p.heads_per_block, p.head_chunks(&mqa)), (4, 16));
}

#[test]
fn the_planner_evens_out_the_waves_of_a_grid_over_one_wave() {
    use pagedkv::host::ops::attention::{Arch, SplitTarget, decode_blocks_per_sm};
    let shape = |seqs| DecodeShape {
        num_seqs: seqs,
        num_q_heads: 32,
        num_kv_heads: 8,
        head_dim: 128,
        block_size: 16,
        num_blocks: 1 << 16,
        max_blocks_per_seq: 256,
    };
    let h100 = SplitTarget {
        sm_count: 132,
        arch: Arch::Sm90,
    };
    // The fp8 tensor-core kernel's 168 registers on sm_90: 3 blocks a SM, 396 slots.
    assert_eq!(decode_blocks_per_sm(&shape(64), DType::E4m3, Arch::Sm90), 3);
    assert_eq!(decode_blocks_per_sm(&shape(64), DType::E4m3, Arch::Sm80), 2);
    // Batch 64: 512 blocks are 1.29 waves; unsplit, the second wave runs 116 blocks on
    // 396 slots. Three partitions make 1536 blocks, 3.9 waves.
    let p = plan(&shape(64), DType::E4m3, 4096, h100);
    assert_eq!(p.num_partitions, 3, "{p:?}");
    validate_plan(&shape(64), DType::E4m3, &p, 4096).unwrap();
    // f16 (2 blocks a SM): 512 blocks are 1.94 waves, no split evens them out better.
    assert_eq!(plan(&shape(64), DType::F16, 4096, h100).num_partitions, 1);
    // Batch 40 of fp8 (320 blocks) fits one wave of 396: no split.
    assert_eq!(plan(&shape(40), DType::E4m3, 4096, h100).num_partitions, 1);
    // With sm_80's bounds the same fp8 grid is 1.94 waves of 264: no split.
    assert_eq!(plan(&shape(64), DType::E4m3, 4096, 132).num_partitions, 1);
}

#[test]
fn the_pipeline_model_keeps_32_kib_in_flight_per_sm_at_the_flagship_shape() {
    use pagedkv::host::ops::attention::{
        Arch, decode_blocks_per_sm, decode_bytes_in_flight_per_sm,
    };
    // Batch 64, context 4096, 32:8 heads, head_dim 128, block 16: no split, so the
    // pipeline alone must keep the SMs' loads in flight (a model, not a measurement):
    // the tensor-core kernel (f16), the CUDA-core one (fp8, and head_dim 96).
    let shape = |head_dim| DecodeShape {
        num_seqs: 64,
        num_q_heads: 32,
        num_kv_heads: 8,
        head_dim,
        block_size: 16,
        num_blocks: 1 << 16,
        max_blocks_per_seq: 256,
    };
    for (head_dim, dtype) in [(128, DType::F16), (128, DType::E4m3), (96, DType::F16)] {
        for arch in [Arch::Sm80, Arch::Sm90] {
            let blocks = decode_blocks_per_sm(&shape(head_dim), dtype, arch);
            let bytes = decode_bytes_in_flight_per_sm(&shape(head_dim), dtype, arch);
            let what = format!("{dtype} head_dim {head_dim} {arch:?}");
            assert!(blocks >= 1, "{what}: {blocks} blocks per SM");
            assert!(bytes >= 32 * 1024, "{what}: {bytes} bytes in flight per SM");
        }
    }
}

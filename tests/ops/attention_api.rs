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
    // Batch 1, context 32768: 8 blocks would idle 124 SMs: split-K.
    let p = plan(&llama(1), DType::F16, 32768, 132);
    assert!(p.num_partitions >= 16, "{p:?}");
    assert!(8 * p.num_partitions >= 132, "{p:?}");
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
fn the_pipeline_model_keeps_32_kib_in_flight_per_sm_at_the_flagship_shape() {
    use pagedkv::host::ops::attention::{
        SmLimits, decode_blocks_per_sm, decode_bytes_in_flight_per_sm,
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
        for sm in [SmLimits::SM_80, SmLimits::SM_90] {
            let blocks = decode_blocks_per_sm(&shape(head_dim), dtype, &sm);
            let bytes = decode_bytes_in_flight_per_sm(&shape(head_dim), dtype, &sm);
            let what = format!("{dtype} head_dim {head_dim} {sm:?}");
            assert!(blocks >= 1, "{what}: {blocks} blocks per SM");
            assert!(bytes >= 32 * 1024, "{what}: {bytes} bytes in flight per SM");
        }
    }
}

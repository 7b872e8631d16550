#![allow(missing_docs)] // criterion's macros and this bench's helpers.
//! Kernel throughput: `cargo bench --bench kernels`.
//!
//! On a machine with an NVIDIA GPU: `paged_prefill_attention` (batch x new tokens x
//! cached prefix, TFLOP/s and % of the datasheet tensor-core peak), and
//! `paged_decode_attention` and `kv_append` over the
//! shape table (batch 1/8/64/256 × context 512/4096/32768, GQA 32/8 and MHA 32/32,
//! head_dim 128, f16 and bf16, block_size 16), timed with CUDA events after warm-up on
//! random (never zero) data, rotating between cache regions so the inputs of successive
//! launches together exceed the L2 cache. Criterion reports time and throughput from the
//! documented byte count (`ops::attention::decode_bytes`); a summary table (median time,
//! GB/s, and the ratio to a device-to-device copy measured in the same run) is printed
//! last and written as markdown to `$PAGEDKV_BENCH_REPORT` (default
//! `target/pagedkv-bench.md`). Shapes whose K+V would exceed `PAGEDKV_BENCH_MAX_GIB`
//! (default 48 GiB) are skipped and listed as such.
//!
//! Decode runs through the step path (`pagedkv::host::step`): each region's metadata is
//! planned (uploaded) once before timing, so CUDA events around back-to-back runs time
//! the kernels alone; the host's cost of one run (checks and launch, the CPU side of a
//! layer) is timed separately with a wall clock and reported in its own column, with
//! the ratio to the GPU's datasheet bandwidth next to the same-run copy ratio.
//!
//! Without a GPU the GPU benchmarks print one line saying they were skipped, and the CPU
//! benchmark (the f64 reference attention) still runs.

use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput};
use pagedkv::cuda::{CudaDevice, CudaStepDevice, DeviceTensor, device};
use pagedkv::host::ops::attention::{AttentionOptions, DecodeInputs, DecodeShape, decode_bytes};
use pagedkv::host::ops::kv_append::KvAppendInputs;
use pagedkv::host::reference::paged_decode_attention;
use pagedkv::host::step::{
    DecodeIo, PrefillIo, PrefillMeta, StepCapacity, StepMeta, StepRunner, StepShape,
};
use pagedkv::host::{DType, HostTensor};
use pagedkv::kernels::PagedLayout;
use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

const L2_BYTES: u64 = 60 << 20;

fn cpu_reference(c: &mut Criterion) {
    // Batch 4, context 512, GQA 32/8, head_dim 128, f16: the ground truth's speed.
    let shape = DecodeShape {
        num_seqs: 4,
        num_q_heads: 32,
        num_kv_heads: 8,
        head_dim: 128,
        block_size: 16,
        num_blocks: 4 * 32,
        max_blocks_per_seq: 32,
    };
    let mut r = SmallRng::seed_from_u64(1);
    let n = shape.layout().pool_elems() as usize;
    let vals: Vec<f64> = (0..n).map(|_| r.random_range(-1.0..1.0)).collect();
    let kc = HostTensor::from_f64(DType::F16, &[n], &vals).unwrap();
    let vc = kc.clone();
    let q = HostTensor::from_f64(DType::F16, &[4, 32, 128], &vals[..4 * 32 * 128]).unwrap();
    let tables: Vec<i32> = (0..4 * 32).collect();
    let lens = [512; 4];
    let opts = AttentionOptions::new(128);
    c.bench_function("cpu_reference_attention_b4_ctx512_gqa32_8_d128", |b| {
        let inputs = DecodeInputs {
            shape: &shape,
            opts: &opts,
            q: &q,
            key_cache: &kc,
            value_cache: &vc,
            block_tables: &tables,
            context_lens: &lens,
            plan: None,
            kv_scales: None,
            sinks: None,
        };
        b.iter(|| paged_decode_attention(&inputs))
    });
}

/// Fills a device tensor with random values (never zeros): a 64 MiB random chunk of
/// the tensor's dtype, repeated on the device.
fn fill_random(gpu: &CudaDevice, t: &mut DeviceTensor, r: &mut SmallRng) {
    let dtype = t.dtype();
    let chunk_elems = ((64usize << 20) / dtype.size())
        .min(t.num_bytes() / dtype.size())
        .max(1);
    let vals: Vec<f64> = (0..chunk_elems)
        .map(|_| r.random_range(-1.0..1.0))
        .collect();
    let chunk = HostTensor::from_f64(dtype, &[chunk_elems], &vals).unwrap();
    t.fill_repeat(gpu, chunk.buf().as_bytes()).unwrap();
}

struct Row {
    name: String,
    bytes: u64,
    median_ms: f64,
    /// Host time of one call (checks + launch), microseconds, where measured.
    host_us: Option<f64>,
}

/// The datasheet memory bandwidth of known GPUs, GB/s, by device name.
fn spec_gbs(name: &str) -> Option<f64> {
    let n = name.to_ascii_uppercase();
    [
        ("H200", 4800.0),
        ("H100 PCIE", 2000.0),
        ("H100", 3350.0),
        ("A100-SXM4-80GB", 2039.0),
        ("A100 80GB PCIE", 1935.0),
        ("A100", 1555.0),
        ("L40S", 864.0),
    ]
    .iter()
    .find(|(k, _)| n.contains(k))
    .map(|&(_, v)| v)
}

/// The datasheet dense f16/bf16 tensor-core peak of known GPUs, TFLOP/s (f32
/// accumulate, no sparsity), by device name.
fn spec_tflops(name: &str) -> Option<f64> {
    let n = name.to_ascii_uppercase();
    [
        ("H200", 989.0),
        ("H100 PCIE", 756.0),
        ("H100", 989.0),
        ("A100", 312.0),
        ("L40S", 362.0),
    ]
    .iter()
    .find(|(k, _)| n.contains(k))
    .map(|&(_, v)| v)
}

/// Prefill on the step path (metadata planned once): batch x new tokens x cached prefix,
/// GQA 32/8, head_dim 128, block 16; FLOPs `4 * head_dim * q_heads * Σ pairs`, where a
/// new token at position `p` attends to `p + 1` positions. Returns a markdown table.
fn prefill_benches(gpu: &CudaDevice, r: &mut SmallRng) -> String {
    let peak = spec_tflops(gpu.device_name());
    let mut md = format!(
        "| prefill shape (batch x new x cached) | dtype | GFLOP | median GPU time (ms) | TFLOP/s | % of tensor-core peak ({}) |\n|---|---|---|---|---|---|\n",
        peak.map_or("unknown GPU".to_string(), |v| format!(
            "{v:.0} TFLOP/s, datasheet"
        ))
    );
    let (qh, kvh, d) = (32u32, 8u32, 128u32);
    for dtype in [DType::F16, DType::Bf16] {
        for (batch, new, cached) in [
            (1u32, 2048u32, 0u32),
            (4, 512, 0),
            (8, 256, 1024),
            (1, 512, 8192),
            // The speed model's two prefill shapes (ptx/resources.md): gpu-check.sh
            // prints them modelled next to measured.
            (8, 2048, 0),
            (8, 512, 4096),
        ] {
            let ctx = new + cached;
            let width = ctx.div_ceil(16);
            let num_blocks = batch * width + 1;
            let layout_elems = num_blocks as u64 * kvh as u64 * 16 * d as u64;
            let mut kc = DeviceTensor::zeros(gpu, dtype, &[layout_elems as usize]).unwrap();
            let mut vc = DeviceTensor::zeros(gpu, dtype, &[layout_elems as usize]).unwrap();
            fill_random(gpu, &mut kc, r);
            fill_random(gpu, &mut vc, r);
            let mut ids: Vec<i32> = (1..num_blocks as i32).collect();
            ids.shuffle(r);
            let tables = &ids[..(batch * width) as usize];
            let lens = vec![ctx as i32; batch as usize];
            let indptr: Vec<i32> = (0..=batch).map(|i| (i * new) as i32).collect();
            let tokens = (batch * new) as usize;
            let qn = tokens * (qh * d) as usize;
            let qv: Vec<f64> = (0..qn).map(|_| r.random_range(-1.0..1.0)).collect();
            let q = DeviceTensor::from_host(gpu, &HostTensor::from_f64(dtype, &[qn], &qv).unwrap())
                .unwrap();
            let mut out = DeviceTensor::zeros(gpu, dtype, &[qn]).unwrap();
            let shape = StepShape {
                num_q_heads: qh,
                num_kv_heads: kvh,
                head_dim: d,
                block_size: 16,
                num_blocks,
                dtype,
                kv_dtype: dtype,
            };
            let cap = StepCapacity {
                max_seqs: batch,
                max_blocks_per_seq: width,
                max_tokens: tokens as u32,
                max_partitions: 1,
            };
            let mut run =
                StepRunner::new(CudaStepDevice::new(gpu), shape, cap, gpu.split_target()).unwrap();
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
                block_tables: tables,
                max_blocks_per_seq: width,
                qo_indptr: &indptr,
                context_lens: &lens,
                window: None,
            })
            .unwrap();
            let opts = AttentionOptions::new(d);
            let pairs: u64 =
                (0..new as u64).map(|i| cached as u64 + i + 1).sum::<u64>() * batch as u64;
            let flops = 4.0 * d as f64 * qh as f64 * pairs as f64;
            let ms = median_ms(gpu, 10, |_| {
                run.prefill(
                    &opts,
                    PrefillIo {
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
            });
            let tflops = flops / (ms * 1e-3) / 1e12;
            md.push_str(&format!(
                "| {batch} x {new} x {cached} | {dtype} | {:.1} | {ms:.3} | {tflops:.1} | {} |\n",
                flops / 1e9,
                peak.map_or("-".to_string(), |v| format!("{:.1}%", 100.0 * tflops / v))
            ));
        }
    }
    md
}

/// Cascade attention against flat decode on the GPU, the whole layer's decode as a
/// serving step runs it (suffix decode, shared pass and merge, or the one flat launch):
/// `rows` requests over one shared prompt of `prompt` tokens, each `own` tokens of its
/// own past it, f16, 32 query heads over 8 KV heads, head_dim 128, block 16.
fn cascade_benches(gpu: &CudaDevice, r: &mut SmallRng) -> String {
    use pagedkv::host::ops::cascade::find_groups;
    let mut md = String::from(
        "| cascade case (rows x shared prompt + own) | flat decode (ms) | cascade (ms) | flat / cascade | K/V bytes flat | K/V bytes cascade |\n|---|---|---|---|---|---|\n",
    );
    let (qh, kvh, d, bs) = (32u32, 8u32, 128u32, 16u32);
    for (rows, prompt, own) in [(64u32, 2048u32, 64u32), (256, 1024, 128), (16, 8192, 256)] {
        let ctx = prompt + own;
        let width = ctx.div_ceil(bs);
        let shared = prompt / bs;
        let own_blocks = width - shared;
        let num_blocks = shared + rows * own_blocks + 1;
        let elems = num_blocks as u64 * kvh as u64 * bs as u64 * d as u64;
        let mut kc = DeviceTensor::zeros(gpu, DType::F16, &[elems as usize]).unwrap();
        let mut vc = DeviceTensor::zeros(gpu, DType::F16, &[elems as usize]).unwrap();
        fill_random(gpu, &mut kc, r);
        fill_random(gpu, &mut vc, r);
        let mut tables = Vec::with_capacity((rows * width) as usize);
        for row in 0..rows {
            tables.extend((1..=shared).map(|b| b as i32));
            tables.extend((0..own_blocks).map(|b| (1 + shared + row * own_blocks + b) as i32));
        }
        let lens = vec![ctx as i32; rows as usize];
        let qn = (rows * qh * d) as usize;
        let qv: Vec<f64> = (0..qn).map(|_| r.random_range(-1.0..1.0)).collect();
        let q =
            DeviceTensor::from_host(gpu, &HostTensor::from_f64(DType::F16, &[qn], &qv).unwrap())
                .unwrap();
        let mut out = DeviceTensor::zeros(gpu, DType::F16, &[qn]).unwrap();
        let shape = StepShape {
            num_q_heads: qh,
            num_kv_heads: kvh,
            head_dim: d,
            block_size: bs,
            num_blocks,
            dtype: DType::F16,
            kv_dtype: DType::F16,
        };
        let cap = StepCapacity {
            max_seqs: rows,
            max_blocks_per_seq: width,
            max_tokens: 1,
            max_partitions: 256,
        };
        let meta = StepMeta {
            block_tables: &tables,
            max_blocks_per_seq: width,
            context_lens: &lens,
            slot_mapping: &[],
            window: None,
        };
        let opts = AttentionOptions::new(d);
        let mut time = |cascade: bool| {
            let mut run =
                StepRunner::new(CudaStepDevice::new(gpu), shape, cap, gpu.split_target()).unwrap();
            run.enable_cascade().unwrap();
            run.plan(&meta).unwrap();
            if cascade {
                let groups = find_groups(&tables, width, &lens, bs, 1);
                run.plan_cascade(&meta, &groups).unwrap();
            }
            median_ms(gpu, 20, |_| {
                run.decode(
                    &opts,
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
                .unwrap();
            })
        };
        let (flat, casc) = (time(false), time(true));
        let token = 2 * kvh as u64 * d as u64 * 2;
        let flat_bytes = rows as u64 * ctx as u64 * token;
        let tiles = (rows * (qh / kvh)).div_ceil(pagedkv::kernels::kernels::prefill::TILE_ROWS);
        let casc_bytes = (rows as u64 * own as u64 + tiles as u64 * prompt as u64) * token;
        md.push_str(&format!(
            "| {rows} x ({prompt} + {own}) | {flat:.3} | {casc:.3} | {:.2} | {flat_bytes} | {casc_bytes} |\n",
            flat / casc
        ));
    }
    md
}

fn median_ms(gpu: &CudaDevice, reps: usize, mut f: impl FnMut(usize)) -> f64 {
    for i in 0..3 {
        f(i);
    }
    let mut v: Vec<f64> = (0..reps)
        .map(|i| {
            gpu.time_ms(|| {
                f(i);
                Ok(())
            })
            .unwrap() as f64
        })
        .collect();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Times `iters` launches with CUDA events, for criterion's `iter_custom`.
fn timed(gpu: &CudaDevice, iters: u64, launch: &mut impl FnMut(usize)) -> Duration {
    let ms = gpu
        .time_ms(|| {
            for i in 0..iters as usize {
                launch(i);
            }
            Ok(())
        })
        .unwrap();
    Duration::from_secs_f64(ms as f64 * 1e-3)
}

fn copy_bandwidth(gpu: &CudaDevice) -> f64 {
    let n = 1usize << 30;
    let mut r = SmallRng::seed_from_u64(2);
    let mut a = DeviceTensor::zeros(gpu, DType::F16, &[n / 2]).unwrap();
    fill_random(gpu, &mut a, &mut r);
    let mut b = DeviceTensor::zeros(gpu, DType::F16, &[n / 2]).unwrap();
    let ms = median_ms(gpu, 20, |_| gpu.copy_d2d(&a, &mut b).unwrap());
    2.0 * n as f64 / (ms * 1e-3) / 1e9
}

fn gpu_benches(c: &mut Criterion, gpu: &CudaDevice) {
    let max_gib: f64 = std::env::var("PAGEDKV_BENCH_MAX_GIB")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(48.0);
    let copy_gbs = copy_bandwidth(gpu);
    let clocks = gpu.clocks_mhz().map_or("unknown".to_string(), |(sm, mem)| {
        format!("SM {sm} MHz, memory {mem} MHz")
    });
    // What the driver says of each decode entry point at head_dim 128 (f16/bf16).
    let mut kernels_md = String::from(
        "| kernel | registers (driver) | blocks/SM (driver occupancy, head_dim 128) |\n|---|---|---|\n",
    );
    for (dtype, kv) in [
        (DType::F16, None),
        (DType::Bf16, None),
        (DType::F16, Some(DType::E4m3)),
    ] {
        let geo_dtype = kv.unwrap_or(dtype);
        let suffix = kv.map_or(String::new(), |k| format!("_{k}"));
        // Block size 16 launches the `_d128` kernel, 32 the runtime-geometry one.
        for (geo, block_size) in [("", 32), ("_d128", 16)] {
            let shape = pagedkv::host::ops::attention::DecodeShape {
                num_seqs: 1,
                num_q_heads: 32,
                num_kv_heads: 8,
                head_dim: 128,
                block_size,
                num_blocks: 1024,
                max_blocks_per_seq: 64,
            };
            let smem = pagedkv::host::ops::attention::decode_kernel(&shape, geo_dtype).shared_bytes;
            let name = format!("paged_decode_attention_{dtype}{suffix}{geo}");
            let row = match gpu.kernel_info(&name, 128, smem) {
                Ok(k) => format!("| {name} | {} | {} |\n", k.registers, k.blocks_per_sm),
                Err(e) => format!("| {name} | {e} | |\n"),
            };
            kernels_md.push_str(&row);
        }
    }
    println!("clocks: {clocks}\n{kernels_md}");
    println!(
        "device-to-device copy: {copy_gbs:.0} GB/s (read + write) on {}",
        gpu.device_name()
    );
    let mut rows: Vec<Row> = Vec::new();
    let mut skipped: Vec<String> = Vec::new();
    let mut r = SmallRng::seed_from_u64(3);
    let mut g = c.benchmark_group("paged_decode_attention");
    g.sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1));
    // The cache at the queries' type, and f16 queries over an e4m3 cache (half the
    // K/V bytes; per-KV-head scales).
    for (dtype, kv_dtype) in [
        (DType::F16, DType::F16),
        (DType::Bf16, DType::Bf16),
        (DType::F16, DType::E4m3),
    ] {
        for (qh, kvh) in [(32u32, 8u32), (32, 32)] {
            for batch in [1u32, 8, 64, 256] {
                for ctx in [512u32, 4096, 32768] {
                    let types = if kv_dtype == dtype {
                        dtype.to_string()
                    } else {
                        format!("{dtype}-{kv_dtype}")
                    };
                    let name = format!("{types}/q{qh}kv{kvh}/b{batch}/ctx{ctx}");
                    let blocks_per_seq = ctx.div_ceil(16);
                    let needed = batch as u64 * blocks_per_seq as u64;
                    let block_bytes = kvh as u64 * 16 * 128 * kv_dtype.size() as u64;
                    let kv_bytes = 2 * needed * block_bytes;
                    if kv_bytes as f64 > max_gib * (1u64 << 30) as f64 {
                        skipped.push(format!(
                            "{name} (K+V {:.1} GiB > {max_gib} GiB)",
                            kv_bytes as f64 / (1u64 << 30) as f64
                        ));
                        continue;
                    }
                    // Rotate between regions so successive launches' K/V exceed 3x L2.
                    let rotations = (3 * L2_BYTES).div_ceil(kv_bytes).clamp(1, 64) as u32;
                    let num_blocks = needed as u32 * rotations + 1;
                    let shape = DecodeShape {
                        num_seqs: batch,
                        num_q_heads: qh,
                        num_kv_heads: kvh,
                        head_dim: 128,
                        block_size: 16,
                        num_blocks,
                        max_blocks_per_seq: blocks_per_seq,
                    };
                    let pool = [shape.layout().pool_elems() as usize];
                    let mut kc = DeviceTensor::zeros(gpu, kv_dtype, &pool).unwrap();
                    let mut vc = DeviceTensor::zeros(gpu, kv_dtype, &pool).unwrap();
                    fill_random(gpu, &mut kc, &mut r);
                    fill_random(gpu, &mut vc, &mut r);
                    let scales = kv_dtype.is_fp8().then(|| {
                        let s = HostTensor::full(DType::F32, &[2, kvh as usize], 1.0 / 64.0);
                        DeviceTensor::from_host(gpu, &s).unwrap()
                    });
                    let mut ids: Vec<i32> = (1..num_blocks as i32).collect();
                    ids.shuffle(&mut r);
                    let tables: Vec<Vec<i32>> =
                        ids.chunks(needed as usize).map(|c| c.to_vec()).collect();
                    let lens = vec![ctx as i32; batch as usize];
                    let qn = (batch * qh * 128) as usize;
                    let qv: Vec<f64> = (0..qn).map(|_| r.random_range(-1.0..1.0)).collect();
                    let q = DeviceTensor::from_host(
                        gpu,
                        &HostTensor::from_f64(dtype, &[qn], &qv).unwrap(),
                    )
                    .unwrap();
                    let mut out = DeviceTensor::zeros(gpu, dtype, &[qn]).unwrap();
                    let opts = AttentionOptions::new(128);
                    let step_shape = StepShape {
                        num_q_heads: qh,
                        num_kv_heads: kvh,
                        head_dim: 128,
                        block_size: 16,
                        num_blocks,
                        dtype,
                        kv_dtype,
                    };
                    let cap = StepCapacity {
                        max_seqs: batch,
                        max_blocks_per_seq: blocks_per_seq,
                        max_tokens: 1,
                        max_partitions: 256,
                    };
                    // One runner per region, each planned (metadata uploaded) once.
                    let runners: Vec<StepRunner<CudaStepDevice<'_>>> = tables
                        .iter()
                        .map(|t| {
                            let mut run = StepRunner::new(
                                CudaStepDevice::new(gpu),
                                step_shape,
                                cap,
                                gpu.split_target(),
                            )
                            .unwrap();
                            run.plan(&StepMeta {
                                block_tables: t,
                                max_blocks_per_seq: blocks_per_seq,
                                context_lens: &lens,
                                slot_mapping: &[],
                                window: None,
                            })
                            .unwrap();
                            run
                        })
                        .collect();
                    let p = runners[0].planned().unwrap().decode.unwrap().1;
                    let bytes = decode_bytes(&shape, (dtype, kv_dtype), &lens, &p);
                    let mut launch = |i: usize| {
                        runners[i % runners.len()]
                            .decode(
                                &opts,
                                DecodeIo {
                                    lse: None,
                                    q: q.view(),
                                    key_cache: kc.view(),
                                    value_cache: vc.view(),
                                    sinks: None,
                                    out: out.view_mut(),
                                    kv_scales: scales.as_ref().map(|s| s.view()),
                                    group: 0,
                                },
                            )
                            .unwrap();
                    };
                    let ms = median_ms(gpu, 30, &mut launch);
                    // The host side of one run, by wall clock over many calls.
                    let calls = 200;
                    let t0 = std::time::Instant::now();
                    for i in 0..calls {
                        launch(i);
                    }
                    let host_us = t0.elapsed().as_secs_f64() * 1e6 / calls as f64;
                    gpu.synchronize().unwrap();
                    rows.push(Row {
                        name: format!("decode {name} (parts {})", p.num_partitions),
                        bytes,
                        median_ms: ms,
                        host_us: Some(host_us),
                    });
                    g.throughput(Throughput::Bytes(bytes));
                    g.bench_function(BenchmarkId::from_parameter(&name), |b| {
                        b.iter_custom(|iters| timed(gpu, iters, &mut launch))
                    });
                }
            }
        }
    }
    g.finish();

    let mut g = c.benchmark_group("kv_append");
    g.sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1));
    for dtype in [DType::F16, DType::Bf16] {
        for kvh in [8u32, 32] {
            for tokens in [1usize, 8, 64, 256] {
                let name = format!("{dtype}/kv{kvh}/tokens{tokens}");
                let layout = PagedLayout {
                    num_blocks: 4096,
                    num_kv_heads: kvh,
                    block_size: 16,
                    head_dim: 128,
                };
                let pool = [layout.pool_elems() as usize];
                let mut kc = DeviceTensor::zeros(gpu, dtype, &pool).unwrap();
                let mut vc = DeviceTensor::zeros(gpu, dtype, &pool).unwrap();
                let row = kvh as usize * 128;
                let vals: Vec<f64> = (0..tokens * row)
                    .map(|_| r.random_range(-1.0..1.0))
                    .collect();
                let k = DeviceTensor::from_host(
                    gpu,
                    &HostTensor::from_f64(dtype, &[tokens * row], &vals).unwrap(),
                )
                .unwrap();
                let v = DeviceTensor::from_host(
                    gpu,
                    &HostTensor::from_f64(dtype, &[tokens * row], &vals).unwrap(),
                )
                .unwrap();
                let mut slots: Vec<i64> = (0..layout.num_slots() as i64).collect();
                slots.shuffle(&mut r);
                let mappings: Vec<Vec<i64>> =
                    slots.chunks(tokens).take(64).map(|c| c.to_vec()).collect();
                let bytes = 4 * (tokens * row * dtype.size()) as u64 + 8 * tokens as u64;
                let mut launch = |i: usize| {
                    gpu.kv_append(KvAppendInputs {
                        layout: &layout,
                        key: &k,
                        value: &v,
                        slot_mapping: &mappings[i % mappings.len()],
                        key_cache: &mut kc,
                        value_cache: &mut vc,
                        scales: None,
                    })
                    .unwrap();
                };
                let ms = median_ms(gpu, 30, &mut launch);
                rows.push(Row {
                    name: format!("kv_append {name}"),
                    bytes,
                    median_ms: ms,
                    host_us: None,
                });
                g.throughput(Throughput::Bytes(bytes));
                g.bench_function(BenchmarkId::from_parameter(&name), |b| {
                    b.iter_custom(|iters| timed(gpu, iters, &mut launch))
                });
            }
        }
    }
    g.finish();

    let spec = spec_gbs(gpu.device_name());
    let mut md = format!(
        "| kernel / shape | bytes | median GPU time (ms) | GB/s | % of copy ({copy_gbs:.0} GB/s) | % of spec ({}) | host µs per call |\n|---|---|---|---|---|---|---|\n",
        spec.map_or("unknown GPU".to_string(), |v| format!("{v:.0} GB/s"))
    );
    for row in &rows {
        let gbs = row.bytes as f64 / (row.median_ms * 1e-3) / 1e9;
        md.push_str(&format!(
            "| {} | {} | {:.4} | {:.0} | {:.1}% | {} | {} |\n",
            row.name,
            row.bytes,
            row.median_ms,
            gbs,
            100.0 * gbs / copy_gbs,
            spec.map_or("-".to_string(), |v| format!("{:.1}%", 100.0 * gbs / v)),
            row.host_us.map_or("-".to_string(), |u| format!("{u:.1}"))
        ));
    }
    for s in &skipped {
        md.push_str(&format!("| {s}: skipped | | | | | | |\n"));
    }
    md.push('\n');
    md.push_str(&prefill_benches(gpu, &mut r));
    md.push('\n');
    md.push_str(&cascade_benches(gpu, &mut r));
    println!("\n{md}");
    let path =
        std::env::var("PAGEDKV_BENCH_REPORT").unwrap_or_else(|_| "target/pagedkv-bench.md".into());
    let header = format!(
        "GPU: {} ({}, {} SMs, {clocks}); device-to-device copy {copy_gbs:.0} GB/s (bytes read + written / time)\n\n{kernels_md}\n",
        gpu.device_name(),
        gpu.arch(),
        gpu.sm_count()
    );
    if let Err(e) = std::fs::write(&path, header + &md) {
        eprintln!("could not write {path}: {e}");
    }
}

fn main() {
    let mut c = Criterion::default().configure_from_args();
    cpu_reference(&mut c);
    match device(0) {
        Ok(gpu) => gpu_benches(&mut c, &gpu),
        Err(e) => println!("GPU benchmarks skipped: {e}"),
    }
    c.final_summary();
}

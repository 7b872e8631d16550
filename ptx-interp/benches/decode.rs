//! The interpreter's speed: `cargo bench -p pagedkv-ptx-interp --bench decode`.
//!
//! The committed sm_90 decode kernel (f16, head_dim 128, 8 query : 2 KV heads, block
//! 16) at batch 17 with contexts of 100 to 500 tokens, through the one-shot step path
//! (`step::once::decode`) on a `PtxDevice`, one CPU core: lane-instructions the launch
//! issued per second of the whole call (runner setup, upload, launch), median of the
//! runs. The same call on the emulator is timed for comparison.

use std::sync::Arc;
use std::time::Instant;

use pagedkv_host::emulator::Emulator;
use pagedkv_host::ops::attention::{AttentionOptions, DecodeInputs, DecodeShape};
use pagedkv_host::step::{EmuDevice, once};
use pagedkv_host::{DType, HostTensor};
use pagedkv_ptx_interp::{MathMode, Module, PtxDevice};

const PTX: &str = include_str!("../../ptx/pagedkv_kernels.sm_90.ptx");

fn main() {
    let module = Arc::new(Module::parse("pagedkv_kernels.sm_90.ptx", PTX).expect("parses"));
    let shape = DecodeShape {
        num_seqs: 17,
        num_q_heads: 8,
        num_kv_heads: 2,
        head_dim: 128,
        block_size: 16,
        num_blocks: 17 * 32,
        max_blocks_per_seq: 32,
    };
    let lens: Vec<i32> = (0..17).map(|i| 100 + (i * 97) % 401).collect();
    let tables: Vec<i32> = (0..17 * 32).map(|i| (i * 7919) % (17 * 32)).collect();
    let pool = (shape.num_blocks * 2 * 16 * 128) as usize;
    let value = |i: usize| ((i * 2654435761) % 1000) as f64 / 500.0 - 1.0;
    let kc = HostTensor::from_f64(
        DType::F16,
        &[pool],
        &(0..pool).map(value).collect::<Vec<_>>(),
    )
    .unwrap();
    let vc = HostTensor::from_f64(
        DType::F16,
        &[pool],
        &(0..pool).map(|i| value(i + 7)).collect::<Vec<_>>(),
    )
    .unwrap();
    let q = HostTensor::from_f64(
        DType::F16,
        &[17, 8, 128],
        &(0..17 * 8 * 128).map(|i| value(i + 3)).collect::<Vec<_>>(),
    )
    .unwrap();
    let opts = AttentionOptions::new(128);
    let inputs = || DecodeInputs {
        shape: &shape,
        opts: &opts,
        q: &q,
        key_cache: &kc,
        value_cache: &vc,
        block_tables: &tables,
        context_lens: &lens,
        kv_scales: None,
        sinks: None,
        plan: None,
    };
    let mut out = HostTensor::full(DType::F16, &[17, 8, 128], f64::NAN);
    let mut rates = Vec::new();
    let mut times = Vec::new();
    for _ in 0..7 {
        let dev = PtxDevice::new(module.clone(), MathMode::Exact);
        let log = dev.log();
        let t = Instant::now();
        once::decode(dev, None, inputs(), &mut out).expect("decode");
        let s = t.elapsed().as_secs_f64();
        let n: u64 = log
            .take()
            .iter()
            .map(|r| r.stats.total_instructions())
            .sum();
        rates.push(n as f64 / s / 1e6);
        times.push((s, n));
    }
    rates.sort_by(f64::total_cmp);
    let mut emu = Vec::new();
    for _ in 0..3 {
        let t = Instant::now();
        once::decode(
            EmuDevice::new(Emulator::new().with_workers(1)),
            None,
            inputs(),
            &mut out,
        )
        .expect("decode");
        emu.push(t.elapsed().as_secs_f64());
    }
    emu.sort_by(f64::total_cmp);
    let (s, n) = times[0];
    println!(
        "interpreter, decode f16 batch 17 d128 (sm_90): {n} lane-instructions, median {:.0} M lane-instructions/s (range {:.0}-{:.0}; first run {:.1} ms); emulator, one worker: median {:.1} ms",
        rates[rates.len() / 2],
        rates[0],
        rates[rates.len() - 1],
        s * 1e3,
        emu[1] * 1e3
    );
}

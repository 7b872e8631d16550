//! Tokens per second of the same random-weight Llama served two ways, side by side:
//! through pagedkv (its scheduler batching every request, its paged cache, its kernels
//! in the CPU emulator) and by candle's own Llama, one request at a time with its own
//! KV cache; then checks that both produced the same tokens and logits.
//!
//! `cargo run --release -- [requests] [new_tokens] [f32|f16|bf16]` (defaults: 8
//! requests, 32 new tokens each, f32 attention) from `integrations/candle-llama`. A
//! 16-bit attention runs pagedkv's tensor-core kernels (the rest of the model stays
//! f32); its logits then differ from candle's f32 ones by the dtype's rounding.

use std::time::Instant;

use candle_transformers::models::llama::Llama;
use pagedkv::host::DType;
use pagedkv::host::scheduler::SchedulerConfig;
use pagedkv_candle_llama::engine::{Arrival, EngineConfig, serve};
use pagedkv_candle_llama::{Engine, PagedLlama, Result, reference, weights, workload};

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let requests: u64 = args.next().map(|a| a.parse()).transpose()?.unwrap_or(8);
    let new_tokens: u32 = args.next().map(|a| a.parse()).transpose()?.unwrap_or(32);
    let dtype = match args.next().as_deref() {
        None | Some("f32") => DType::F32,
        Some("f16") => DType::F16,
        Some("bf16") => DType::Bf16,
        Some(other) => return Err(format!("attention dtype {other}: f32, f16 or bf16").into()),
    };

    let cfg = weights::config(2, 512, 8, 2, 1024, 512);
    let w = weights::random(&cfg, 7)?;
    let vocab = cfg.vocab_size as u32;
    let arrivals: Vec<Arrival> = (0..requests)
        .map(|i| Arrival {
            at: 0,
            id: i,
            prompt: workload::prompt(100 + i, 16 + (i as usize * 7) % 57, vocab),
            max_tokens: new_tokens,
        })
        .collect();
    let total: usize = arrivals.iter().map(|a| a.max_tokens as usize).sum();
    println!(
        "model: {} layers, hidden {}, {} q / {} kv heads of {}, vocab {} (f32, seeded random weights; attention in {dtype})",
        cfg.num_hidden_layers,
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.hidden_size / cfg.num_attention_heads,
        cfg.vocab_size
    );
    println!(
        "workload: {requests} requests, prompts of {} to {} tokens, {new_tokens} new tokens each ({total} tokens)",
        arrivals.iter().map(|a| a.prompt.len()).min().unwrap_or(0),
        arrivals.iter().map(|a| a.prompt.len()).max().unwrap_or(0),
    );

    let sched = SchedulerConfig {
        num_blocks: 1024,
        block_size: 16,
        max_num_seqs: 64,
        max_model_len: 256,
        enable_prefix_caching: true,
        ..SchedulerConfig::default()
    };
    let model = PagedLlama::load(weights::var_builder(w.clone()), &cfg)?;
    let ec = EngineConfig {
        scheduler: sched,
        emulator_workers: 0,
        dtype,
    };
    let mut engine = Engine::on_cpu(model, &cfg, &ec)?;
    let t = Instant::now();
    let served = serve(&mut engine, &arrivals)?;
    let paged = t.elapsed().as_secs_f64();

    let llama = Llama::load(weights::var_builder(w), &cfg)?;
    let t = Instant::now();
    let want = reference::generate_all(&llama, &cfg, &arrivals)?;
    let own = t.elapsed().as_secs_f64();

    println!(
        "pagedkv (scheduler, paged cache, kernels in the emulator; {} steps): {total} tokens in {paged:.2} s = {:.0} tokens/s",
        served.steps.len(),
        total as f64 / paged
    );
    println!(
        "         of which pagedkv's kv_append, decode and prefill (emulated): {:.2} s",
        engine.copies.kernel_time.as_secs_f64()
    );
    println!(
        "candle  (its own Llama and KV cache, one request at a time):        {total} tokens in {own:.2} s = {:.0} tokens/s",
        total as f64 / own
    );
    let a = reference::compare(&served.generated, &want)?;
    println!(
        "same greedy tokens; logits: max relative error {:.1e} over {} vectors; {} tensors handed over as views, {} copied",
        a.max_relative_error, a.compared, engine.copies.borrowed, engine.copies.copied
    );
    Ok(())
}

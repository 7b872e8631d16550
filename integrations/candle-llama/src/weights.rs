//! A tiny Llama configuration and seeded random weights under
//! `candle_transformers::models::llama`'s names, so both models load the same tensors
//! through `VarBuilder::from_tensors` with nothing downloaded.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models::llama::Config;

use crate::Result;

/// A Llama of `layers` layers, hidden size `hidden`, `heads` query heads over
/// `kv_heads` KV heads (head_dim `hidden / heads`), vocabulary `vocab`, positions up
/// to `max_pos`.
pub fn config(
    layers: usize,
    hidden: usize,
    heads: usize,
    kv_heads: usize,
    vocab: usize,
    max_pos: usize,
) -> Config {
    Config {
        hidden_size: hidden,
        intermediate_size: 2 * hidden,
        vocab_size: vocab,
        num_hidden_layers: layers,
        num_attention_heads: heads,
        num_key_value_heads: kv_heads,
        use_flash_attn: false,
        rms_norm_eps: 1e-5,
        rope_theta: 10_000.0,
        bos_token_id: None,
        eos_token_id: None,
        rope_scaling: None,
        max_position_embeddings: max_pos,
        tie_word_embeddings: false,
    }
}

/// The test's model: 2 layers, hidden 256, 4 query heads of 64 over 2 KV heads,
/// vocabulary 256, 128 positions.
pub fn tiny() -> Config {
    config(2, 256, 4, 2, 256, 128)
}

/// SplitMix64: a seeded generator with no dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[-1, 1)`.
    fn uniform(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

/// Every weight of `cfg`'s Llama, named as `candle_transformers::models::llama` loads
/// them, from a generator seeded with `seed`: linear layers uniform in
/// `±sqrt(3 / fan_in)` (unit variance out for unit variance in), embeddings uniform in
/// `±1`, norm weights `1 ± 0.1`.
pub fn random(cfg: &Config, seed: u64) -> Result<HashMap<String, Tensor>> {
    let mut draw = Draw::new(seed);
    let mut t = |shape, scale, offset| draw.tensor(shape, scale, offset);
    let (h, i, v) = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size);
    let d = h / cfg.num_attention_heads;
    let (q, kv) = (cfg.num_attention_heads * d, cfg.num_key_value_heads * d);
    let lin = |fan_in: usize| (3.0 / fan_in as f32).sqrt();
    let mut w = HashMap::new();
    w.insert("model.embed_tokens.weight".into(), t((v, h), 1.0, 0.0)?);
    for l in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{l}");
        for (name, shape, scale, offset) in [
            ("self_attn.q_proj", (q, h), lin(h), 0.0),
            ("self_attn.k_proj", (kv, h), lin(h), 0.0),
            ("self_attn.v_proj", (kv, h), lin(h), 0.0),
            ("self_attn.o_proj", (h, q), lin(q), 0.0),
            ("mlp.gate_proj", (i, h), lin(h), 0.0),
            ("mlp.up_proj", (i, h), lin(h), 0.0),
            ("mlp.down_proj", (h, i), lin(i), 0.0),
            ("input_layernorm", (1, h), 0.1, 1.0),
            ("post_attention_layernorm", (1, h), 0.1, 1.0),
        ] {
            w.insert(format!("{p}.{name}.weight"), t(shape, scale, offset)?);
        }
    }
    w.insert("model.norm.weight".into(), t((1, h), 0.1, 1.0)?);
    w.insert("lm_head.weight".into(), t((v, h), lin(h), 0.0)?);
    Ok(w)
}

/// Seeded random tensors for the test models' weights.
pub(crate) struct Draw(Rng);

impl Draw {
    /// A generator seeded with `seed`.
    pub(crate) fn new(seed: u64) -> Self {
        Self(Rng(seed))
    }

    /// A `shape` tensor (`[shape.1]` when `shape.0` is 1) of `offset + scale * u`, `u`
    /// uniform in `[-1, 1)`.
    pub(crate) fn tensor(
        &mut self,
        shape: (usize, usize),
        scale: f32,
        offset: f32,
    ) -> Result<Tensor> {
        let v: Vec<f32> = (0..shape.0 * shape.1)
            .map(|_| offset + scale * self.0.uniform())
            .collect();
        let t = Tensor::from_vec(v, shape, &Device::Cpu)?;
        Ok(if shape.0 == 1 { t.squeeze(0)? } else { t })
    }
}

/// A `VarBuilder` over `weights` (f32, CPU), for either model.
pub fn var_builder(weights: HashMap<String, Tensor>) -> VarBuilder<'static> {
    VarBuilder::from_tensors(weights, DType::F32, &Device::Cpu)
}

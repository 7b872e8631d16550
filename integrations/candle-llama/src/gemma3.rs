//! [`PagedGemma3`]: `candle_transformers::models::gemma3`'s text model (same weight
//! names, same math) served through pagedkv's hybrid cache: its sliding-window layers
//! and its full-attention layers are layer groups of one pool
//! ([`LayerGroups`]), each window group holding only
//! its window, prefix caching on.
//!
//! # Windows
//! A sliding layer attends to the last `sliding_window` positions, the query's own
//! included (Hugging Face's Gemma 3; candle's rotating KV cache holds that many), in a
//! prefill as in a decode: the window groups keep `sliding_window` tokens
//! ([`PagedGemma3::layer_specs`]). [`generate`], the reference, feeds candle's model one
//! token at a time: candle 0.11.1's multi-token forward fails on the CPU (its global
//! layers' KV cache takes the transposed, non-contiguous V: "slice-set only supports
//! contiguous tensors"), and its prefill mask would also let a sliding layer see
//! `sliding_window + 1` positions, one more than its decode.
//!
//! # Scale and RoPE
//! The scores are scaled by `query_pre_attn_scalar^-0.5` and the global layers' RoPE
//! takes the configuration's scaling (gemma-3-27b: 168 against a `head_dim` of 128,
//! positions divided by 8), as Hugging Face's Gemma 3; candle 0.11.1's scales by
//! `1 / sqrt(head_dim)` and has no RoPE scaling, so the model reads a [`Gemma3Config`]
//! (from the model's `config.json`), whose [`Gemma3Config::to_candle`] gives candle's
//! configuration only where the two compute the same.
//!
//! * [`Gemma3Config`]: the configuration, read from `config.json`;
//! * [`tiny_config`] and [`random_weights`]: a small Gemma 3 and seeded random weights
//!   (no download);
//! * [`generate`]: candle's own Gemma 3, one request at a time, for the comparison.

use std::collections::HashMap;

use candle_core::{D, DType, Device, Module, Tensor};
use candle_nn::{Activation, Embedding, Linear, VarBuilder, embedding, linear_no_bias};
use candle_transformers::models::gemma3::Model;
use pagedkv::host::backend::PagedCache;
use pagedkv::host::block::{KvSpec, LayerGroups};
use pagedkv::host::ops::attention::AttentionOptions;
use pagedkv::host::scheduler::Batch;

use crate::Result;
use crate::bridge::{CandleBackend, Copies, candle_dtype};
use crate::engine::{Arrival, Generated, PagedModel, argmax};
use crate::model::StepLayout;

pub mod config;

pub use config::{Gemma3Config, LayerKind, Rope, RopeScaling};

/// Gemma's RMS norm, as candle's Gemma 3 computes it (in f32, scaled by `1 + weight`).
#[derive(Debug)]
struct GemmaNorm {
    weight: Tensor,
    eps: f64,
}

impl GemmaNorm {
    fn load(dim: usize, eps: f64, vb: VarBuilder) -> Result<Self> {
        Ok(Self {
            weight: vb.get(dim, "weight")?,
            eps,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let dim = x.dim(D::Minus1)?;
        let mean_sq = (x.sqr()?.sum_keepdim(D::Minus1)? / dim as f64)?;
        let normed = x.broadcast_div(&(mean_sq + self.eps)?.sqrt()?)?;
        Ok(normed.broadcast_mul(&(&self.weight + 1.0)?)?)
    }
}

#[derive(Debug)]
struct Layer {
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    q_norm: GemmaNorm,
    k_norm: GemmaNorm,
    gate: Linear,
    up: Linear,
    down: Linear,
    input_norm: GemmaNorm,
    post_attn_norm: GemmaNorm,
    pre_ffn_norm: GemmaNorm,
    post_ffn_norm: GemmaNorm,
    /// candle's `sliding_window` for a sliding layer.
    window: Option<u32>,
}

/// A Gemma 3 text model whose attention runs through pagedkv's hybrid cache (see the
/// module docs).
#[derive(Debug)]
pub struct PagedGemma3 {
    embed: Embedding,
    layers: Vec<Layer>,
    norm: GemmaNorm,
    groups: LayerGroups,
    /// The inverse RoPE frequencies of the sliding layers and of the global ones
    /// ([`Rope::inv_freq`]), `[1, head_dim / 2]` f32.
    local_inv_freq: Tensor,
    global_inv_freq: Tensor,
    /// `max_position_embeddings`: a position from it on is refused.
    max_positions: usize,
    /// The scores' scale, `query_pre_attn_scalar^-0.5`.
    scale: f32,
    act: Activation,
    hidden: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    final_softcap: Option<f64>,
}

/// `rope`'s inverse frequencies for `head_dim` as a `[1, head_dim / 2]` tensor.
fn inv_freq(rope: &Rope, head_dim: usize) -> Result<Tensor> {
    let f = rope.inv_freq(head_dim);
    let n = f.len();
    Ok(Tensor::from_vec(f, (1, n), &Device::Cpu)?)
}

impl PagedGemma3 {
    /// Loads the model from `vb` under `candle_transformers::models::gemma3`'s names
    /// (no attention bias, no attention soft-cap: Gemma 3's), `cfg` checked first
    /// ([`Gemma3Config::validate`]).
    pub fn load(vb: VarBuilder, cfg: &Gemma3Config) -> Result<Self> {
        cfg.validate()?;
        if cfg.attention_bias || cfg.attn_logit_softcapping.is_some() {
            return Err("attention bias and soft-cap are not supported here".into());
        }
        let (h, d) = (cfg.hidden_size, cfg.head_dim);
        let (qn, kvn) = (cfg.num_attention_heads * d, cfg.num_key_value_heads * d);
        let eps = cfg.rms_norm_eps;
        let m = vb.pp("model");
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| {
                let vb = m.pp(format!("layers.{i}"));
                let (a, p) = (vb.pp("self_attn"), vb.pp("mlp"));
                let sliding = cfg.layer_types[i] == LayerKind::Sliding;
                Ok(Layer {
                    q: linear_no_bias(h, qn, a.pp("q_proj"))?,
                    k: linear_no_bias(h, kvn, a.pp("k_proj"))?,
                    v: linear_no_bias(h, kvn, a.pp("v_proj"))?,
                    o: linear_no_bias(qn, h, a.pp("o_proj"))?,
                    q_norm: GemmaNorm::load(d, eps, a.pp("q_norm"))?,
                    k_norm: GemmaNorm::load(d, eps, a.pp("k_norm"))?,
                    gate: linear_no_bias(h, cfg.intermediate_size, p.pp("gate_proj"))?,
                    up: linear_no_bias(h, cfg.intermediate_size, p.pp("up_proj"))?,
                    down: linear_no_bias(cfg.intermediate_size, h, p.pp("down_proj"))?,
                    input_norm: GemmaNorm::load(h, eps, vb.pp("input_layernorm"))?,
                    post_attn_norm: GemmaNorm::load(h, eps, vb.pp("post_attention_layernorm"))?,
                    pre_ffn_norm: GemmaNorm::load(h, eps, vb.pp("pre_feedforward_layernorm"))?,
                    post_ffn_norm: GemmaNorm::load(h, eps, vb.pp("post_feedforward_layernorm"))?,
                    window: sliding.then_some(cfg.sliding_window as u32),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let groups = LayerGroups::new(&Self::layer_specs(cfg))?;
        Ok(Self {
            embed: embedding(cfg.vocab_size, h, m.pp("embed_tokens"))?,
            layers,
            norm: GemmaNorm::load(h, eps, m.pp("norm"))?,
            groups,
            local_inv_freq: inv_freq(&cfg.local_rope, d)?,
            global_inv_freq: inv_freq(&cfg.global_rope, d)?,
            max_positions: cfg.max_position_embeddings,
            scale: cfg.attention_scale() as f32,
            act: cfg.hidden_activation,
            hidden: h,
            heads: cfg.num_attention_heads,
            kv_heads: cfg.num_key_value_heads,
            head_dim: d,
            final_softcap: cfg.final_logit_softcapping,
        })
    }

    /// Each layer's KV spec: a sliding layer keeps `sliding_window` tokens, a global
    /// one every token.
    pub fn layer_specs(cfg: &Gemma3Config) -> Vec<KvSpec> {
        cfg.layer_types
            .iter()
            .map(|k| match k {
                LayerKind::Sliding => KvSpec::SlidingWindow(cfg.sliding_window as u32),
                LayerKind::Full => KvSpec::Full,
            })
            .collect()
    }

    /// The model's layer groups (the scheduler's `kv_groups` are their specs, the
    /// backend's config `BackendConfig::for_groups` of them).
    pub fn groups(&self) -> &LayerGroups {
        &self.groups
    }
}

impl PagedModel for PagedGemma3 {
    fn num_tensors(&self) -> usize {
        self.groups.layers_per_group()
    }

    fn forward<B: CandleBackend>(
        &self,
        be: &mut B,
        cache: &mut PagedCache<B::Tensor>,
        batch: &Batch,
        tokens: &[u32],
        opts: &AttentionOptions,
        copies: &mut Copies,
    ) -> Result<Tensor> {
        let dev = Device::Cpu;
        let StepLayout {
            decodes,
            positions,
            last,
        } = StepLayout::of(batch, tokens)?;
        let n = tokens.len();
        let (hq, hkv, d) = (self.heads, self.kv_heads, self.head_dim);
        let dtype = candle_dtype(be.config().shape.dtype)?;
        if let Some(end) = batch
            .seqs
            .iter()
            .map(|s| s.start_pos + s.num_new_tokens)
            .max()
            && end as usize > self.max_positions
        {
            return Err(format!(
                "position {} past max_position_embeddings {}",
                end - 1,
                self.max_positions
            )
            .into());
        }
        // The step's RoPE angles, `position * inv_freq` in f32 (the products candle's
        // Gemma 3 tabulates for every position up to max_position_embeddings).
        let positions = positions.to_dtype(DType::F32)?.reshape((n, 1))?;
        let angles = |inv_freq: &Tensor| -> Result<(Tensor, Tensor)> {
            let a = positions.matmul(inv_freq)?;
            Ok((a.cos()?, a.sin()?))
        };
        let (local, global) = (
            angles(&self.local_inv_freq)?,
            angles(&self.global_inv_freq)?,
        );

        let x = self.embed.forward(&Tensor::new(tokens, &dev)?)?;
        let mut x = (x * (self.hidden as f64).sqrt())?;
        for (l, layer) in self.layers.iter().enumerate() {
            let (group, tensor) = (self.groups.group_of(l), self.groups.tensor_of(l));
            let lc = &mut cache.layers[tensor];
            let (cos, sin) = if layer.window.is_some() {
                &local
            } else {
                &global
            };
            let h = layer.input_norm.forward(&x)?;
            let rope = |t: Tensor| -> Result<Tensor> {
                let heads = t.dim(1)?;
                let t = t.reshape((1, n, heads, d))?;
                Ok(candle_nn::rotary_emb::rope_thd(&t, cos, sin)?.reshape((n, heads, d))?)
            };
            let q = layer.q.forward(&h)?.reshape((n, hq, d))?;
            let k = layer.k.forward(&h)?.reshape((n, hkv, d))?;
            let q = rope(layer.q_norm.forward(&q)?)?.to_dtype(dtype)?;
            let k = rope(layer.k_norm.forward(&k)?)?.to_dtype(dtype)?;
            let v = layer.v.forward(&h)?.reshape((n, hkv, d))?.to_dtype(dtype)?;
            be.append_kv(&k, &v, (lc, group), copies)?;

            // The model's scale (not the engine's 1 / sqrt(head_dim)) and the layer's
            // window (its group's).
            let o = AttentionOptions {
                scale: self.scale,
                window: layer.window,
                ..opts.clone()
            };
            let mut pieces = Vec::with_capacity(2);
            if decodes > 0 {
                pieces.push(be.decode_q(&o, &q.narrow(0, 0, decodes)?, (lc, group), copies)?);
            }
            if decodes < n {
                let q = q.narrow(0, decodes, n - decodes)?;
                pieces.push(be.prefill_q(&o, &q, (lc, group), copies)?);
            }
            let attn = Tensor::cat(&pieces, 0)?
                .to_dtype(DType::F32)?
                .reshape((n, hq * d))?;
            let a = layer.post_attn_norm.forward(&layer.o.forward(&attn)?)?;
            let x1 = (a + &x)?;
            let hm = layer.pre_ffn_norm.forward(&x1)?;
            let mlp = (layer.gate.forward(&hm)?.apply(&self.act)? * layer.up.forward(&hm)?)?;
            let m = layer.post_ffn_norm.forward(&layer.down.forward(&mlp)?)?;
            x = (x1 + m)?;
        }
        let x = self.norm.forward(&x.index_select(&last, 0)?)?;
        let logits = x.matmul(&self.embed.embeddings().t()?)?;
        Ok(match self.final_softcap {
            None => logits,
            Some(c) => ((logits / c)?.tanh()? * c)?,
        })
    }
}

/// A small Gemma 3: 6 layers (two sliding, one global, twice), hidden 128, 4 query
/// heads of 32 over 2 KV heads, a `window`-token sliding window, vocabulary 256,
/// 512 positions; RoPE bases 10000 (local) and 1e6 (global) as Gemma 3's, unscaled,
/// and `query_pre_attn_scalar` = `head_dim`: a model candle's Gemma 3 computes too
/// ([`Gemma3Config::to_candle`]).
pub fn tiny_config(window: usize) -> Gemma3Config {
    let layers = 6;
    Gemma3Config {
        vocab_size: 256,
        hidden_size: 128,
        intermediate_size: 256,
        num_hidden_layers: layers,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 32,
        hidden_activation: Activation::GeluPytorchTanh,
        max_position_embeddings: 512,
        rms_norm_eps: 1e-6,
        attention_bias: false,
        query_pre_attn_scalar: 32.0,
        sliding_window: window,
        layer_types: (0..layers)
            .map(|i| {
                if (i + 1) % 3 > 0 {
                    LayerKind::Sliding
                } else {
                    LayerKind::Full
                }
            })
            .collect(),
        final_logit_softcapping: None,
        attn_logit_softcapping: None,
        global_rope: Rope {
            theta: 1_000_000.0,
            scaling: RopeScaling::None,
        },
        local_rope: Rope {
            theta: 10_000.0,
            scaling: RopeScaling::None,
        },
    }
}

/// Every weight of `cfg`'s Gemma 3, named as `candle_transformers::models::gemma3`
/// loads them, seeded with `seed` (as [`crate::weights::random`] draws Llama's; the
/// norms' weights `± 0.1` around 0: Gemma scales by `1 + weight`).
pub fn random_weights(cfg: &Gemma3Config, seed: u64) -> Result<HashMap<String, Tensor>> {
    let mut draw = crate::weights::Draw::new(seed);
    let (h, i, v, d) = (
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.vocab_size,
        cfg.head_dim,
    );
    let (q, kv) = (cfg.num_attention_heads * d, cfg.num_key_value_heads * d);
    let lin = |fan_in: usize| (3.0 / fan_in as f32).sqrt();
    let mut w = HashMap::new();
    w.insert(
        "model.embed_tokens.weight".into(),
        draw.tensor((v, h), 1.0, 0.0)?,
    );
    for l in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{l}");
        for (name, shape, scale, offset) in [
            ("self_attn.q_proj", (q, h), lin(h), 0.0),
            ("self_attn.k_proj", (kv, h), lin(h), 0.0),
            ("self_attn.v_proj", (kv, h), lin(h), 0.0),
            ("self_attn.o_proj", (h, q), lin(q), 0.0),
            ("self_attn.q_norm", (1, d), 0.1, 0.0),
            ("self_attn.k_norm", (1, d), 0.1, 0.0),
            ("mlp.gate_proj", (i, h), lin(h), 0.0),
            ("mlp.up_proj", (i, h), lin(h), 0.0),
            ("mlp.down_proj", (h, i), lin(i), 0.0),
            ("input_layernorm", (1, h), 0.1, 0.0),
            ("post_attention_layernorm", (1, h), 0.1, 0.0),
            ("pre_feedforward_layernorm", (1, h), 0.1, 0.0),
            ("post_feedforward_layernorm", (1, h), 0.1, 0.0),
        ] {
            w.insert(
                format!("{p}.{name}.weight"),
                draw.tensor(shape, scale, offset)?,
            );
        }
    }
    w.insert("model.norm.weight".into(), draw.tensor((1, h), 0.1, 0.0)?);
    Ok(w)
}

/// Generates `max_tokens` greedy tokens after `a.prompt` with candle's own Gemma 3, one
/// token per forward pass on candle's KV caches, the prompt's too (see the module
/// docs); the model's caches are cleared first.
pub fn generate(model: &mut Model, a: &Arrival) -> Result<Generated> {
    let dev = Device::Cpu;
    model.clear_kv_cache();
    let mut out = Generated {
        request: a.id,
        prompt: a.prompt.clone(),
        ..Generated::default()
    };
    let forward = |model: &mut Model, t: u32, pos: usize| -> Result<Vec<f32>> {
        let x = Tensor::new(&[t], &dev)?.unsqueeze(0)?;
        Ok(model.forward(&x, pos)?.flatten_all()?.to_vec1::<f32>()?)
    };
    let (last, head) = a.prompt.split_last().ok_or("an empty prompt")?;
    for (pos, &t) in head.iter().enumerate() {
        forward(model, t, pos)?;
    }
    let mut input = *last;
    for pos in (head.len()..).take(a.max_tokens as usize) {
        let logits = forward(model, input, pos)?;
        let t = argmax(&logits);
        out.tokens.push(t);
        out.logits.push(logits);
        input = t;
    }
    Ok(out)
}

//! [`PagedLlama`]: `candle_transformers::models::llama`'s model (same weight names,
//! same math) whose attention stores K and V in pagedkv's paged cache and runs on a
//! [`CandleBackend`].
//!
//! One forward pass serves a whole scheduler [`Batch`]: the new tokens of every
//! sequence (a prefill's many, a decode's one) go through the projections, RoPE and
//! MLP as one `[tokens, hidden]` matrix in f32; each layer appends every token's K and
//! V to the paged cache with the kernel, runs the decode kernel for the decoding rows
//! and the prefill kernel for the prefilling rows (causal, over the paged cache: a
//! prefix-cache hit reads the blocks another request wrote). The attention's q, K and
//! V are cast to the backend's dtype (f32, f16 or bf16) and its output back to f32:
//! the model computes no attention of its own.

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{Embedding, Linear, RmsNorm, VarBuilder, embedding, linear_no_bias, rms_norm};
use candle_transformers::models::llama::Config;
use pagedkv::host::backend::{PagedCache, decode_rows};
use pagedkv::host::ops::attention::AttentionOptions;
use pagedkv::host::scheduler::Batch;

use crate::Result;
use crate::bridge::{CandleBackend, Copies, candle_dtype};

/// What a forward pass needs of a step's layout, checked: the backend's order of a
/// step (the decoding rows first, one token each, then the prefilling rows, each row's
/// new tokens after the previous row's, as many tokens as slots).
pub(crate) struct StepLayout {
    /// Decoding rows.
    pub(crate) decodes: usize,
    /// `[tokens]` u32: each new token's position (RoPE).
    pub(crate) positions: Tensor,
    /// `[rows]` u32: each row's last new token (where its logits come from).
    pub(crate) last: Tensor,
}

impl StepLayout {
    /// The layout of `batch` with `tokens` its new tokens, or what breaks it.
    pub(crate) fn of(batch: &Batch, tokens: &[u32]) -> Result<Self> {
        let n = tokens.len();
        if n != batch.slot_mapping.len() {
            return Err(format!("{n} tokens for {} slots", batch.slot_mapping.len()).into());
        }
        let decodes = decode_rows(batch).len();
        let mut offset = 0;
        for (i, s) in batch.seqs.iter().enumerate() {
            if i < decodes && s.num_new_tokens != 1 {
                return Err(
                    format!("decoding row {}: {} new tokens", s.seq, s.num_new_tokens).into(),
                );
            }
            if s.token_offset != offset {
                return Err(format!(
                    "row {}: tokens from {}, not {offset}",
                    s.seq, s.token_offset
                )
                .into());
            }
            offset += s.num_new_tokens;
        }
        let positions: Vec<u32> = batch
            .seqs
            .iter()
            .flat_map(|s| s.start_pos..s.start_pos + s.num_new_tokens)
            .collect();
        let last: Vec<u32> = batch
            .seqs
            .iter()
            .map(|s| s.token_offset + s.num_new_tokens - 1)
            .collect();
        Ok(Self {
            decodes,
            positions: Tensor::new(positions, &Device::Cpu)?,
            last: Tensor::new(last, &Device::Cpu)?,
        })
    }
}

#[derive(Debug)]
struct Layer {
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    gate: Linear,
    up: Linear,
    down: Linear,
    norm_attn: RmsNorm,
    norm_mlp: RmsNorm,
}

/// A Llama whose attention runs through pagedkv (see the module docs).
#[derive(Debug)]
pub struct PagedLlama {
    embed: Embedding,
    layers: Vec<Layer>,
    norm: RmsNorm,
    lm_head: Linear,
    /// `[max_position_embeddings, head_dim / 2]`, as candle's `llama::Cache` makes them.
    cos: Tensor,
    sin: Tensor,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
}

impl PagedLlama {
    /// Loads the model from `vb` under `candle_transformers::models::llama`'s names
    /// (default RoPE only, untied embeddings: the test's configuration).
    pub fn load(vb: VarBuilder, cfg: &Config) -> Result<Self> {
        if cfg.rope_scaling.is_some() || cfg.tie_word_embeddings {
            return Err("rope scaling and tied embeddings are not supported here".into());
        }
        let h = cfg.hidden_size;
        let d = h / cfg.num_attention_heads;
        let (qn, kvn) = (cfg.num_attention_heads * d, cfg.num_key_value_heads * d);
        let eps = cfg.rms_norm_eps;
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| {
                let vb = vb.pp(format!("model.layers.{i}"));
                let (a, m) = (vb.pp("self_attn"), vb.pp("mlp"));
                Ok(Layer {
                    q: linear_no_bias(h, qn, a.pp("q_proj"))?,
                    k: linear_no_bias(h, kvn, a.pp("k_proj"))?,
                    v: linear_no_bias(h, kvn, a.pp("v_proj"))?,
                    o: linear_no_bias(qn, h, a.pp("o_proj"))?,
                    gate: linear_no_bias(h, cfg.intermediate_size, m.pp("gate_proj"))?,
                    up: linear_no_bias(h, cfg.intermediate_size, m.pp("up_proj"))?,
                    down: linear_no_bias(cfg.intermediate_size, h, m.pp("down_proj"))?,
                    norm_attn: rms_norm(h, eps, vb.pp("input_layernorm"))?,
                    norm_mlp: rms_norm(h, eps, vb.pp("post_attention_layernorm"))?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        // RoPE tables exactly as `llama::Cache::new` computes them.
        let inv_freq: Vec<f32> = (0..d)
            .step_by(2)
            .map(|i| 1f32 / cfg.rope_theta.powf(i as f32 / d as f32))
            .collect();
        let n = inv_freq.len();
        let inv_freq = Tensor::new(inv_freq, &Device::Cpu)?;
        let angles = Tensor::arange(0, cfg.max_position_embeddings as u32, &Device::Cpu)?
            .to_dtype(DType::F32)?
            .reshape((cfg.max_position_embeddings, 1))?
            .matmul(&inv_freq.reshape((1, n))?)?;
        Ok(Self {
            embed: embedding(cfg.vocab_size, h, vb.pp("model.embed_tokens"))?,
            layers,
            norm: rms_norm(h, eps, vb.pp("model.norm"))?,
            lm_head: linear_no_bias(h, cfg.vocab_size, vb.pp("lm_head"))?,
            cos: angles.cos()?,
            sin: angles.sin()?,
            heads: cfg.num_attention_heads,
            kv_heads: cfg.num_key_value_heads,
            head_dim: d,
        })
    }

    /// Layers.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// One forward pass over `batch` (whose `begin_step` already ran on `be`):
    /// `tokens` holds each scheduled sequence's new tokens, in batch order
    /// (`batch.slot_mapping`'s). Returns the logits after each sequence's last new
    /// token, `[batch.seqs.len(), vocab]`.
    pub fn forward<B: CandleBackend>(
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
        let cos = self.cos.index_select(&positions, 0)?;
        let sin = self.sin.index_select(&positions, 0)?;

        let mut x = self.embed.forward(&Tensor::new(tokens, &dev)?)?;
        for (layer, lc) in self.layers.iter().zip(cache.layers.iter_mut()) {
            let h = layer.norm_attn.forward(&x)?;
            let rope = |t: Tensor, heads: usize| -> Result<Tensor> {
                let t = t.reshape((1, n, heads, d))?;
                Ok(candle_nn::rotary_emb::rope_thd(&t, &cos, &sin)?.reshape((n, heads, d))?)
            };
            // The attention's inputs in the backend's dtype (a copy unless f32).
            let q = rope(layer.q.forward(&h)?, hq)?.to_dtype(dtype)?;
            let k = rope(layer.k.forward(&h)?, hkv)?.to_dtype(dtype)?;
            let v = layer.v.forward(&h)?.reshape((n, hkv, d))?.to_dtype(dtype)?;
            be.append_kv(&k, &v, (lc, 0), copies)?;

            let mut pieces = Vec::with_capacity(2);
            if decodes > 0 {
                pieces.push(be.decode_q(opts, &q.narrow(0, 0, decodes)?, (lc, 0), copies)?);
            }
            if decodes < n {
                let q = q.narrow(0, decodes, n - decodes)?;
                pieces.push(be.prefill_q(opts, &q, (lc, 0), copies)?);
            }
            let attn = Tensor::cat(&pieces, 0)?
                .to_dtype(DType::F32)?
                .reshape((n, hq * d))?;
            let x1 = (layer.o.forward(&attn)? + &x)?;
            let hm = layer.norm_mlp.forward(&x1)?;
            let mlp =
                (candle_nn::ops::silu(&layer.gate.forward(&hm)?)? * layer.up.forward(&hm)?)?;
            x = (layer.down.forward(&mlp)? + x1)?;
        }
        let x = x.index_select(&last, 0)?;
        Ok(self.lm_head.forward(&self.norm.forward(&x)?)?)
    }
}

//! [`PagedLlama`]: `candle_transformers::models::llama`'s model (same weight names,
//! same math) whose attention stores K and V in pagedkv's paged cache and runs on a
//! [`CandleBackend`].
//!
//! One forward pass serves a whole scheduler [`Batch`]: the new tokens of every
//! sequence (a prefill's many, a decode's one) go through the projections, RoPE and
//! MLP as one `[tokens, hidden]` matrix; each layer appends every token's K and V to
//! the paged cache with the kernel, runs the decode kernel for the decoding rows, and
//! computes each prefill's causal attention over K and V gathered from the cache.

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{Embedding, Linear, RmsNorm, VarBuilder, embedding, linear_no_bias, rms_norm};
use candle_transformers::models::llama::Config;
use pagedkv::host::backend::PagedCache;
use pagedkv::host::ops::attention::AttentionOptions;
use pagedkv::host::scheduler::Batch;

use crate::Result;
use crate::bridge::{CandleBackend, Copies};

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
        let n = tokens.len();
        if n != batch.slot_mapping.len() {
            return Err(format!("{n} tokens for {} slots", batch.slot_mapping.len()).into());
        }
        let (hq, hkv, d) = (self.heads, self.kv_heads, self.head_dim);
        let positions: Vec<u32> = batch
            .seqs
            .iter()
            .flat_map(|s| s.start_pos..s.start_pos + s.num_new_tokens)
            .collect();
        let positions = Tensor::new(positions, &dev)?;
        let cos = self.cos.index_select(&positions, 0)?;
        let sin = self.sin.index_select(&positions, 0)?;
        // The decoding rows' tokens (one each), in batch order.
        let decode_tokens: Vec<u32> = batch
            .seqs
            .iter()
            .filter(|s| !s.is_prefill)
            .map(|s| s.token_offset)
            .collect();
        let all_decode = decode_tokens.len() == n;
        let decode_tokens = Tensor::new(decode_tokens.as_slice(), &dev)?;
        let w = batch.max_blocks_per_seq as usize;

        let mut x = self.embed.forward(&Tensor::new(tokens, &dev)?)?;
        for (layer, lc) in self.layers.iter().zip(cache.layers.iter_mut()) {
            let h = layer.norm_attn.forward(&x)?;
            let rope = |t: Tensor, heads: usize| -> Result<Tensor> {
                let t = t.reshape((1, n, heads, d))?;
                Ok(candle_nn::rotary_emb::rope_thd(&t, &cos, &sin)?.reshape((n, heads, d))?)
            };
            let q = rope(layer.q.forward(&h)?, hq)?;
            let k = rope(layer.k.forward(&h)?, hkv)?;
            let v = layer.v.forward(&h)?.reshape((n, hkv, d))?;
            be.append_kv(&k, &v, lc, copies)?;

            let decoded = if decode_tokens.dim(0)? == 0 {
                None
            } else {
                let q = if all_decode {
                    q.clone()
                } else {
                    q.index_select(&decode_tokens, 0)?
                };
                Some(be.decode_q(opts, &q, lc, copies)?)
            };
            let mut pieces = Vec::with_capacity(batch.seqs.len());
            let mut row = 0;
            for (i, s) in batch.seqs.iter().enumerate() {
                if !s.is_prefill {
                    pieces.push(decoded.as_ref().ok_or("no decode")?.narrow(0, row, 1)?);
                    row += 1;
                    continue;
                }
                let (off, len) = (s.token_offset as usize, s.num_new_tokens as usize);
                let table = &batch.block_tables[i * w..(i + 1) * w];
                let (kc, vc) = be.gather_kv(lc, table, s.context_len as usize)?;
                let qs = q.narrow(0, off, len)?.transpose(0, 1)?.contiguous()?;
                let out = prefill_attention(
                    &qs.unsqueeze(0)?,
                    kc,
                    vc,
                    hq / hkv,
                    s.start_pos as usize,
                    d,
                )?;
                pieces.push(out.squeeze(0)?.transpose(0, 1)?);
            }
            let attn = Tensor::cat(&pieces, 0)?.reshape((n, hq * d))?;
            let x1 = (layer.o.forward(&attn)? + &x)?;
            let hm = layer.norm_mlp.forward(&x1)?;
            let mlp =
                (candle_nn::ops::silu(&layer.gate.forward(&hm)?)? * layer.up.forward(&hm)?)?;
            x = (layer.down.forward(&mlp)? + x1)?;
        }
        let last: Vec<u32> = batch
            .seqs
            .iter()
            .map(|s| s.token_offset + s.num_new_tokens - 1)
            .collect();
        let x = x.index_select(&Tensor::new(last, &dev)?, 0)?;
        Ok(self.lm_head.forward(&self.norm.forward(&x)?)?)
    }
}

/// Causal attention of a prefill's queries `q` (`[1, q_heads, len, d]`, positions
/// `start..start + len`) over the sequence's whole K and V (`[1, kv_heads, start + len,
/// d]`), in candle's Llama's order of operations.
fn prefill_attention(
    q: &Tensor,
    k: Tensor,
    v: Tensor,
    n_rep: usize,
    start: usize,
    d: usize,
) -> Result<Tensor> {
    let k = candle_transformers::utils::repeat_kv(k, n_rep)?;
    let v = candle_transformers::utils::repeat_kv(v, n_rep)?;
    let att = (q.matmul(&k.t()?)? / (d as f64).sqrt())?;
    let len = q.dim(2)?;
    let att = if len == 1 {
        att
    } else {
        let mask = candle_transformers::utils::build_causal_mask(len, start, q.device())?
            .broadcast_as(att.shape())?;
        let ninf = Tensor::new(f32::NEG_INFINITY, q.device())?.broadcast_as(att.shape())?;
        mask.where_cond(&ninf, &att)?
    };
    let att = candle_nn::ops::softmax_last_dim(&att)?;
    Ok(att.matmul(&v.contiguous()?)?)
}

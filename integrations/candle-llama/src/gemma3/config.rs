//! [`Gemma3Config`]: a Gemma 3 text model's configuration as [`PagedGemma3`] reads it,
//! from the model's `config.json` ([`Gemma3Config::from_json`]).
//!
//! candle 0.11.1's `gemma3::Config` has no RoPE scaling, and its model scales the scores
//! by `1 / sqrt(head_dim)`; Hugging Face's Gemma 3 scales them by
//! `query_pre_attn_scalar^-0.5` and applies `rope_scaling` to the global layers. The two
//! differ on gemma-3-27b (`query_pre_attn_scalar` 168, `head_dim` 128; linear RoPE
//! scaling by 8 on its global layers), so this type holds both, and
//! [`Gemma3Config::to_candle`] refuses a configuration candle's model would compute
//! differently.
//!
//! What it reads, with Hugging Face's defaults (`Gemma3TextConfig`) for what a file
//! leaves out, as the published gemma-3-27b does for most fields:
//! * a text model's config (`model_type` `gemma3_text`) or a multimodal one
//!   (`gemma3`) whose `text_config` it reads;
//! * the layers' kinds from `layer_types`, or from `sliding_window_pattern` (every
//!   `n`-th layer global, 6 by default);
//! * RoPE as transformers 4 writes it (`rope_theta` and `rope_scaling` for the global
//!   layers, `rope_local_base_freq` unscaled for the sliding ones) or as transformers 5
//!   does (`rope_parameters` keyed by `full_attention` and `sliding_attention`;
//!   `rope_scaling`, when also given, updates `full_attention`, as transformers does).
//!
//! A value it cannot serve exactly is an error naming it (a RoPE type other than
//! `default` and `linear`, bidirectional attention, a zero dimension, ...), never a
//! silently different model.
//!
//! [`PagedGemma3`]: super::PagedGemma3

use std::collections::HashMap;

use candle_nn::Activation;
use candle_transformers::models::gemma3::Config;
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

use crate::Result;

/// Which attention a layer runs (a `layer_types` entry).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerKind {
    /// `sliding_attention`: the last `sliding_window` positions, with the local RoPE.
    Sliding,
    /// `full_attention`: every position, with the global RoPE.
    Full,
}

/// How a RoPE's frequencies are scaled.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RopeScaling {
    /// `rope_type` `default`: not at all.
    None,
    /// `rope_type` `linear`: positions divided by `factor` (each inverse frequency
    /// divided by it), as transformers' `_compute_linear_scaling_rope_parameters`.
    Linear {
        /// The factor (8 for gemma-3-27b's global layers).
        factor: f64,
    },
}

/// The RoPE of one kind of layer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rope {
    /// The base (`rope_theta` for the global layers, `rope_local_base_freq` for the
    /// sliding ones).
    pub theta: f64,
    /// Its scaling.
    pub scaling: RopeScaling,
}

impl Rope {
    /// The inverse frequencies of the `head_dim / 2` rotated pairs, in f32:
    /// `1 / theta^(2i / head_dim)` as candle's Gemma 3 computes them, divided by a
    /// linear scaling's factor.
    pub fn inv_freq(&self, head_dim: usize) -> Vec<f32> {
        (0..head_dim)
            .step_by(2)
            .map(|i| {
                let f = 1f32 / self.theta.powf(i as f64 / head_dim as f64) as f32;
                match self.scaling {
                    RopeScaling::None => f,
                    RopeScaling::Linear { factor } => f / factor as f32,
                }
            })
            .collect()
    }
}

/// A Gemma 3 text model's configuration (see the module docs).
#[derive(Clone, Debug, PartialEq)]
pub struct Gemma3Config {
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Hidden size.
    pub hidden_size: usize,
    /// The MLP's inner size.
    pub intermediate_size: usize,
    /// Layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// K/V heads (a divisor of the query heads).
    pub num_key_value_heads: usize,
    /// Head dimension (even: RoPE rotates pairs).
    pub head_dim: usize,
    /// The MLP's activation (`hidden_activation`).
    pub hidden_activation: Activation,
    /// Positions the model serves (its last position is one less).
    pub max_position_embeddings: usize,
    /// The RMS norms' epsilon.
    pub rms_norm_eps: f64,
    /// Bias on the attention's projections.
    pub attention_bias: bool,
    /// The scores are scaled by `query_pre_attn_scalar^-0.5`
    /// ([`Gemma3Config::attention_scale`]), not by `head_dim^-0.5`.
    pub query_pre_attn_scalar: f64,
    /// Positions a sliding layer attends to, its own included.
    pub sliding_window: usize,
    /// Each layer's kind, `num_hidden_layers` of them.
    pub layer_types: Vec<LayerKind>,
    /// Soft-cap of the final logits.
    pub final_logit_softcapping: Option<f64>,
    /// Soft-cap of the attention scores.
    pub attn_logit_softcapping: Option<f64>,
    /// The RoPE of the full-attention layers.
    pub global_rope: Rope,
    /// The RoPE of the sliding layers.
    pub local_rope: Rope,
}

/// What a `config.json` may say, every field optional (Hugging Face's defaults fill
/// in the rest; a `null` is a field left out).
#[derive(Debug, Default)]
struct Raw {
    model_type: Option<String>,
    vocab_size: Option<usize>,
    hidden_size: Option<usize>,
    intermediate_size: Option<usize>,
    num_hidden_layers: Option<usize>,
    num_attention_heads: Option<usize>,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    hidden_activation: Option<Activation>,
    max_position_embeddings: Option<usize>,
    rms_norm_eps: Option<f64>,
    attention_bias: Option<bool>,
    query_pre_attn_scalar: Option<f64>,
    sliding_window: Option<usize>,
    layer_types: Option<Vec<String>>,
    sliding_window_pattern: Option<usize>,
    final_logit_softcapping: Option<f64>,
    attn_logit_softcapping: Option<f64>,
    rope_theta: Option<f64>,
    rope_local_base_freq: Option<f64>,
    rope_scaling: Option<RawRope>,
    rope_parameters: Option<HashMap<String, RawRope>>,
    use_bidirectional_attention: Option<bool>,
}

/// `o[key]` as a `T`, `None` when absent or `null`; an error naming `key` otherwise.
fn field<T: DeserializeOwned>(o: &Map<String, Value>, key: &str) -> Result<Option<T>> {
    match o.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => serde_json::from_value(v.clone())
            .map(Some)
            .map_err(|e| format!("gemma3 config: {key}: {e}").into()),
    }
}

impl Raw {
    /// The fields of a text config's object.
    fn of(o: &Map<String, Value>) -> Result<Self> {
        Ok(Self {
            model_type: field(o, "model_type")?,
            vocab_size: field(o, "vocab_size")?,
            hidden_size: field(o, "hidden_size")?,
            intermediate_size: field(o, "intermediate_size")?,
            num_hidden_layers: field(o, "num_hidden_layers")?,
            num_attention_heads: field(o, "num_attention_heads")?,
            num_key_value_heads: field(o, "num_key_value_heads")?,
            head_dim: field(o, "head_dim")?,
            hidden_activation: field(o, "hidden_activation")?,
            max_position_embeddings: field(o, "max_position_embeddings")?,
            rms_norm_eps: field(o, "rms_norm_eps")?,
            attention_bias: field(o, "attention_bias")?,
            query_pre_attn_scalar: field(o, "query_pre_attn_scalar")?,
            sliding_window: field(o, "sliding_window")?,
            layer_types: field(o, "layer_types")?,
            // transformers writes the pattern under either name.
            sliding_window_pattern: match field(o, "sliding_window_pattern")? {
                Some(p) => Some(p),
                None => field(o, "_sliding_window_pattern")?,
            },
            final_logit_softcapping: field(o, "final_logit_softcapping")?,
            attn_logit_softcapping: field(o, "attn_logit_softcapping")?,
            rope_theta: field(o, "rope_theta")?,
            rope_local_base_freq: field(o, "rope_local_base_freq")?,
            rope_scaling: field(o, "rope_scaling")?,
            rope_parameters: field(o, "rope_parameters")?,
            use_bidirectional_attention: field(o, "use_bidirectional_attention")?,
        })
    }
}

/// A `rope_scaling` or a `rope_parameters` entry.
#[derive(Clone, Debug, Default, Deserialize)]
struct RawRope {
    #[serde(alias = "type")]
    rope_type: Option<String>,
    factor: Option<f64>,
    rope_theta: Option<f64>,
}

impl RawRope {
    /// `self` updated by `other`'s fields (Python's `dict.update`).
    fn updated(mut self, other: &RawRope) -> RawRope {
        if other.rope_type.is_some() {
            self.rope_type.clone_from(&other.rope_type);
        }
        self.factor = other.factor.or(self.factor);
        self.rope_theta = other.rope_theta.or(self.rope_theta);
        self
    }

    /// The RoPE it describes, `theta` when it names none; `what` names it in errors.
    fn rope(&self, theta: f64, what: &str) -> Result<Rope> {
        let theta = self.rope_theta.unwrap_or(theta);
        let scaling = match self.rope_type.as_deref() {
            None | Some("default") => RopeScaling::None,
            Some("linear") => RopeScaling::Linear {
                factor: self
                    .factor
                    .ok_or_else(|| format!("{what}: a linear RoPE scaling without a factor"))?,
            },
            Some(t) => {
                return Err(format!(
                    "{what}: RoPE type {t:?} is not supported (only \"default\" and \"linear\")"
                )
                .into());
            }
        };
        Ok(Rope { theta, scaling })
    }
}

impl Gemma3Config {
    /// Reads a Gemma 3 `config.json` (a text model's, or a multimodal one's
    /// `text_config`), with Hugging Face's defaults for what it leaves out, and checks
    /// it ([`Gemma3Config::validate`]).
    pub fn from_json(json: &str) -> Result<Self> {
        let v: Value =
            serde_json::from_str(json).map_err(|e| format!("gemma3 config: not JSON: {e}"))?;
        let obj = v.as_object().ok_or("gemma3 config: not a JSON object")?;
        let outer: Option<String> = field(obj, "model_type")?;
        let text = match obj.get("text_config") {
            Some(t) => {
                if let Some(m) = outer.as_deref().filter(|m| *m != "gemma3") {
                    return Err(format!(
                        "gemma3 config: model_type {m:?} with a text_config (expected \"gemma3\")"
                    )
                    .into());
                }
                t
            }
            None if outer.as_deref() == Some("gemma3") => {
                return Err(
                    "gemma3 config: a multimodal (\"gemma3\") config without text_config".into(),
                );
            }
            None => &v,
        };
        let raw = Raw::of(
            text.as_object()
                .ok_or("gemma3 config: text_config is not a JSON object")?,
        )?;
        if let Some(m) = raw.model_type.as_deref().filter(|m| *m != "gemma3_text") {
            return Err(format!(
                "gemma3 config: model_type {m:?} is not a Gemma 3 text model (\"gemma3_text\")"
            )
            .into());
        }
        let cfg = Self::from_raw(raw)?;
        cfg.validate()?;
        Ok(cfg)
    }

    fn from_raw(r: Raw) -> Result<Self> {
        if r.use_bidirectional_attention == Some(true) {
            return Err("gemma3 config: use_bidirectional_attention is not supported (the model is causal here)".into());
        }
        let num_hidden_layers = r.num_hidden_layers.unwrap_or(26);
        let layer_types = match (&r.layer_types, r.sliding_window_pattern) {
            (Some(types), _) => types
                .iter()
                .enumerate()
                .map(|(i, t)| match t.as_str() {
                    "sliding_attention" => Ok(LayerKind::Sliding),
                    "full_attention" => Ok(LayerKind::Full),
                    other => Err(format!(
                        "gemma3 config: layer_types[{i}] is {other:?} (expected \"sliding_attention\" or \"full_attention\")"
                    )
                    .into()),
                })
                .collect::<Result<Vec<_>>>()?,
            (None, pattern) => {
                let p = pattern.unwrap_or(6);
                if p == 0 {
                    return Err("gemma3 config: sliding_window_pattern is 0".into());
                }
                (0..num_hidden_layers)
                    .map(|i| {
                        if (i + 1) % p > 0 {
                            LayerKind::Sliding
                        } else {
                            LayerKind::Full
                        }
                    })
                    .collect()
            }
        };
        // transformers 5's rope_parameters, or transformers 4's keys; rope_scaling
        // updates the full-attention entry either way.
        let (full, sliding) = match &r.rope_parameters {
            Some(p) => {
                if let Some(k) = p
                    .keys()
                    .find(|k| !matches!(k.as_str(), "full_attention" | "sliding_attention"))
                {
                    return Err(format!(
                        "gemma3 config: rope_parameters.{k} (expected full_attention and sliding_attention)"
                    )
                    .into());
                }
                let get = |k: &str| p.get(k).cloned().unwrap_or_default();
                (get("full_attention"), get("sliding_attention"))
            }
            None => (RawRope::default(), RawRope::default()),
        };
        let full = match &r.rope_scaling {
            Some(s) => full.updated(s),
            None => full,
        };
        Ok(Self {
            vocab_size: r.vocab_size.unwrap_or(262_208),
            hidden_size: r.hidden_size.unwrap_or(2304),
            intermediate_size: r.intermediate_size.unwrap_or(9216),
            num_hidden_layers,
            num_attention_heads: r.num_attention_heads.unwrap_or(8),
            num_key_value_heads: r.num_key_value_heads.unwrap_or(4),
            head_dim: r.head_dim.unwrap_or(256),
            hidden_activation: r.hidden_activation.unwrap_or(Activation::GeluPytorchTanh),
            max_position_embeddings: r.max_position_embeddings.unwrap_or(131_072),
            rms_norm_eps: r.rms_norm_eps.unwrap_or(1e-6),
            attention_bias: r.attention_bias.unwrap_or(false),
            query_pre_attn_scalar: r.query_pre_attn_scalar.unwrap_or(256.0),
            sliding_window: r.sliding_window.unwrap_or(4096),
            layer_types,
            final_logit_softcapping: r.final_logit_softcapping,
            attn_logit_softcapping: r.attn_logit_softcapping,
            global_rope: full.rope(r.rope_theta.unwrap_or(1e6), "gemma3 config: the global layers' RoPE (rope_scaling, rope_parameters.full_attention)")?,
            local_rope: sliding.rope(
                r.rope_local_base_freq.unwrap_or(1e4),
                "gemma3 config: the sliding layers' RoPE (rope_parameters.sliding_attention)",
            )?,
        })
    }

    /// Checks what the model needs of the configuration: nonzero sizes that fit the
    /// kernels' `u32`s, query heads a multiple of the K/V heads, an even head
    /// dimension, one kind per layer, and positive finite scalars (the score scale's,
    /// the RoPE bases and factors, epsilon, soft-caps).
    pub fn validate(&self) -> Result<()> {
        let sizes = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("max_position_embeddings", self.max_position_embeddings),
            ("sliding_window", self.sliding_window),
        ];
        for (name, v) in sizes {
            if v == 0 || u32::try_from(v).is_err() {
                return Err(
                    format!("gemma3 config: {name} is {v} (expected 1 to {})", u32::MAX).into(),
                );
            }
        }
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            return Err(format!(
                "gemma3 config: {} query heads over {} K/V heads (not a multiple)",
                self.num_attention_heads, self.num_key_value_heads
            )
            .into());
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(format!(
                "gemma3 config: head_dim {} is odd (RoPE rotates pairs)",
                self.head_dim
            )
            .into());
        }
        if self.layer_types.len() != self.num_hidden_layers {
            return Err(format!(
                "gemma3 config: {} layer_types for {} layers",
                self.layer_types.len(),
                self.num_hidden_layers
            )
            .into());
        }
        let positive = |name: &str, x: f64| -> Result<()> {
            if x.is_finite() && x > 0.0 {
                Ok(())
            } else {
                Err(
                    format!("gemma3 config: {name} is {x} (expected a positive finite number)")
                        .into(),
                )
            }
        };
        positive("query_pre_attn_scalar", self.query_pre_attn_scalar)?;
        for (what, rope) in [("global", &self.global_rope), ("local", &self.local_rope)] {
            positive(&format!("the {what} RoPE base"), rope.theta)?;
            if let RopeScaling::Linear { factor } = rope.scaling {
                positive(&format!("the {what} RoPE's linear factor"), factor)?;
            }
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps >= 0.0) {
            return Err(format!("gemma3 config: rms_norm_eps is {}", self.rms_norm_eps).into());
        }
        for (name, cap) in [
            ("final_logit_softcapping", self.final_logit_softcapping),
            ("attn_logit_softcapping", self.attn_logit_softcapping),
        ] {
            if let Some(c) = cap {
                positive(name, c)?;
            }
        }
        Ok(())
    }

    /// The scores' scale: `query_pre_attn_scalar^-0.5` (Hugging Face's
    /// `Gemma3Attention.scaling`).
    pub fn attention_scale(&self) -> f64 {
        self.query_pre_attn_scalar.powf(-0.5)
    }

    /// The RoPE of layers of `kind`.
    pub fn rope(&self, kind: LayerKind) -> &Rope {
        match kind {
            LayerKind::Sliding => &self.local_rope,
            LayerKind::Full => &self.global_rope,
        }
    }

    /// candle's `gemma3::Config` for the same model, for the comparison with candle's
    /// own Gemma 3; an error where candle's model would compute something else: a
    /// `query_pre_attn_scalar` other than `head_dim` (candle scales by
    /// `1 / sqrt(head_dim)`), a RoPE scaling (candle has none), or layer kinds that are
    /// not every `n`-th layer global.
    pub fn to_candle(&self) -> Result<Config> {
        self.validate()?;
        if self.query_pre_attn_scalar != self.head_dim as f64 {
            return Err(format!(
                "candle's Gemma 3 scales scores by 1/sqrt(head_dim {}), this model by query_pre_attn_scalar {}^-0.5",
                self.head_dim, self.query_pre_attn_scalar
            )
            .into());
        }
        if self.global_rope.scaling != RopeScaling::None
            || self.local_rope.scaling != RopeScaling::None
        {
            return Err("candle's Gemma 3 has no RoPE scaling".into());
        }
        let pattern = self
            .layer_types
            .iter()
            .position(|k| *k == LayerKind::Full)
            .map_or(self.num_hidden_layers + 1, |i| i + 1);
        let regular = self
            .layer_types
            .iter()
            .enumerate()
            .all(|(i, k)| (*k == LayerKind::Sliding) == ((i + 1) % pattern > 0));
        if !regular {
            return Err("candle's Gemma 3 takes every sliding_window_pattern-th layer global; these layer_types are not".into());
        }
        Ok(Config {
            attention_bias: self.attention_bias,
            head_dim: self.head_dim,
            hidden_activation: self.hidden_activation,
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
            num_attention_heads: self.num_attention_heads,
            num_hidden_layers: self.num_hidden_layers,
            num_key_value_heads: self.num_key_value_heads,
            rms_norm_eps: self.rms_norm_eps,
            rope_theta: self.global_rope.theta,
            rope_local_base_freq: self.local_rope.theta,
            vocab_size: self.vocab_size,
            final_logit_softcapping: self.final_logit_softcapping,
            attn_logit_softcapping: self.attn_logit_softcapping,
            query_pre_attn_scalar: self.head_dim,
            sliding_window: self.sliding_window,
            sliding_window_pattern: pattern,
            max_position_embeddings: self.max_position_embeddings,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The text part of google/gemma-3-27b-it's `config.json` as published
    /// (transformers 4.50): the rest is left to Hugging Face's defaults.
    const GEMMA_3_27B: &str = r#"{
      "architectures": ["Gemma3ForConditionalGeneration"],
      "boi_token_index": 255999,
      "eoi_token_index": 256000,
      "eos_token_id": [1, 106],
      "image_token_index": 262144,
      "initializer_range": 0.02,
      "mm_tokens_per_image": 256,
      "model_type": "gemma3",
      "text_config": {
        "head_dim": 128,
        "hidden_size": 5376,
        "intermediate_size": 21504,
        "model_type": "gemma3_text",
        "num_attention_heads": 32,
        "num_hidden_layers": 62,
        "num_key_value_heads": 16,
        "query_pre_attn_scalar": 168,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024
      },
      "torch_dtype": "bfloat16",
      "transformers_version": "4.50.0.dev0",
      "vision_config": {"hidden_size": 1152, "model_type": "siglip_vision_model"}
    }"#;

    #[test]
    fn gemma_3_27b_scales_by_its_scalar_and_scales_rope_on_its_global_layers() {
        let c = Gemma3Config::from_json(GEMMA_3_27B).unwrap();
        assert_eq!((c.head_dim, c.query_pre_attn_scalar), (128, 168.0));
        assert_eq!(c.attention_scale(), 168f64.powf(-0.5));
        assert_ne!(c.attention_scale(), 128f64.powf(-0.5));
        assert_eq!(
            c.global_rope,
            Rope {
                theta: 1e6,
                scaling: RopeScaling::Linear { factor: 8.0 }
            }
        );
        assert_eq!(
            c.local_rope,
            Rope {
                theta: 1e4,
                scaling: RopeScaling::None
            }
        );
        // Hugging Face's defaults for what the file leaves out.
        assert_eq!(c.vocab_size, 262_208);
        assert_eq!(c.max_position_embeddings, 131_072);
        assert_eq!(c.rms_norm_eps, 1e-6);
        assert_eq!(c.hidden_activation, Activation::GeluPytorchTanh);
        assert_eq!(c.sliding_window, 1024);
        // Every sixth layer global: 10 of 62.
        let full: Vec<usize> = (0..62)
            .filter(|&i| c.layer_types[i] == LayerKind::Full)
            .collect();
        assert_eq!(full, (1..=10).map(|k| 6 * k - 1).collect::<Vec<_>>());
        // Linear scaling divides every global inverse frequency by 8, none of the
        // local ones.
        let unscaled = Rope {
            theta: 1e6,
            scaling: RopeScaling::None,
        };
        for (s, u) in c
            .global_rope
            .inv_freq(128)
            .iter()
            .zip(unscaled.inv_freq(128))
        {
            assert_eq!(*s, u / 8.0);
        }
        // candle's Gemma 3 would compute it with the wrong scale and no scaling.
        let e = c.to_candle().unwrap_err().to_string();
        assert!(e.contains("query_pre_attn_scalar"), "{e}");
    }

    #[test]
    fn transformers_5_rope_parameters_and_layer_types_read_the_same() {
        let v5 = r#"{
          "model_type": "gemma3_text",
          "head_dim": 128, "hidden_size": 5376, "intermediate_size": 21504,
          "num_attention_heads": 32, "num_hidden_layers": 62, "num_key_value_heads": 16,
          "query_pre_attn_scalar": 168, "sliding_window": 1024,
          "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}
          },
          "layer_types": LAYERS
        }"#;
        let layers: Vec<&str> = (0..62)
            .map(|i| {
                if (i + 1) % 6 > 0 {
                    "\"sliding_attention\""
                } else {
                    "\"full_attention\""
                }
            })
            .collect();
        let v5 = v5.replace("LAYERS", &format!("[{}]", layers.join(",")));
        let want = Gemma3Config::from_json(GEMMA_3_27B).unwrap();
        assert_eq!(Gemma3Config::from_json(&v5).unwrap(), want);
        // The older spelling of the type, and rope_scaling over rope_parameters.
        let old = GEMMA_3_27B.replace("\"rope_type\": \"linear\"", "\"type\": \"linear\"");
        assert_eq!(Gemma3Config::from_json(&old).unwrap(), want);
        let both = r#"{"rope_parameters": {"full_attention": {"rope_type": "default"}},
                       "rope_scaling": {"rope_type": "linear", "factor": 4}}"#;
        assert_eq!(
            Gemma3Config::from_json(both).unwrap().global_rope.scaling,
            RopeScaling::Linear { factor: 4.0 }
        );
    }

    #[test]
    fn what_it_cannot_serve_is_an_error_that_names_it() {
        let text = |extra: &str| format!(r#"{{"model_type": "gemma3_text", {extra}}}"#);
        for (extra, names) in [
            (
                r#""rope_scaling": {"rope_type": "yarn", "factor": 8}"#,
                "yarn",
            ),
            (
                r#""rope_scaling": {"rope_type": "linear"}"#,
                "without a factor",
            ),
            (
                r#""rope_scaling": {"rope_type": "linear", "factor": 0}"#,
                "linear factor",
            ),
            (
                r#""rope_scaling": {"rope_type": "linear", "factor": -8}"#,
                "linear factor",
            ),
            (
                r#""rope_parameters": {"chunked_attention": {}}"#,
                "chunked_attention",
            ),
            (r#""query_pre_attn_scalar": 0"#, "query_pre_attn_scalar"),
            (r#""query_pre_attn_scalar": -168"#, "query_pre_attn_scalar"),
            (r#""query_pre_attn_scalar": "168""#, "query_pre_attn_scalar"),
            (r#""rope_theta": 0"#, "global RoPE base"),
            (r#""rope_local_base_freq": -1"#, "local RoPE base"),
            (r#""sliding_window_pattern": 0"#, "sliding_window_pattern"),
            (r#""layer_types": ["full_attention"]"#, "layer_types"),
            (
                r#""num_hidden_layers": 1, "layer_types": ["chunked_attention"]"#,
                "chunked_attention",
            ),
            (r#""num_attention_heads": 6"#, "not a multiple"),
            (r#""head_dim": 7"#, "head_dim"),
            (r#""hidden_size": 0"#, "hidden_size"),
            (r#""sliding_window": 0"#, "sliding_window"),
            (r#""sliding_window": 4294967296"#, "sliding_window"),
            (r#""rms_norm_eps": -1e-6"#, "rms_norm_eps"),
            (r#""final_logit_softcapping": 0"#, "final_logit_softcapping"),
            (
                r#""hidden_activation": "no_such_activation""#,
                "no_such_activation",
            ),
            (r#""use_bidirectional_attention": true"#, "bidirectional"),
        ] {
            let json = text(extra);
            let e = Gemma3Config::from_json(&json).expect_err(&json).to_string();
            assert!(e.contains(names), "{json}: {e}");
        }
        for (json, names) in [
            ("[1, 2]", "not a JSON object"),
            ("{\"model_type\": \"gemma3_text\",", "not JSON"),
            (r#"{"model_type": "llama"}"#, "llama"),
            (r#"{"model_type": "gemma3"}"#, "without text_config"),
            (r#"{"model_type": "llama", "text_config": {}}"#, "llama"),
            (r#"{"text_config": {"model_type": "gemma2"}}"#, "gemma2"),
        ] {
            let e = Gemma3Config::from_json(json).expect_err(json).to_string();
            assert!(e.contains(names), "{json}: {e}");
        }
    }

    #[test]
    fn to_candle_only_where_candle_computes_the_same() {
        let c = Gemma3Config::from_json(
            r#"{"head_dim": 32, "query_pre_attn_scalar": 32, "num_hidden_layers": 6,
                "sliding_window_pattern": 3}"#,
        )
        .unwrap();
        let k = c.to_candle().unwrap();
        assert_eq!((k.query_pre_attn_scalar, k.sliding_window_pattern), (32, 3));
        let mut scaled = c.clone();
        scaled.global_rope.scaling = RopeScaling::Linear { factor: 8.0 };
        assert!(scaled.to_candle().is_err());
        let mut scalar = c.clone();
        scalar.query_pre_attn_scalar = 42.0;
        assert!(scalar.to_candle().is_err());
        let mut irregular = c;
        irregular.layer_types[0] = LayerKind::Full;
        assert!(irregular.to_candle().is_err());
    }
}

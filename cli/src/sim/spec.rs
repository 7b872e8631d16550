//! The step-time model and its inputs: the GPU and model specs (presets, JSON model
//! files, KV bytes per token) and [`SimConfig`], the settings of a run, which turns them
//! into a KV budget, token slots and the duration of a step.

use std::path::Path;

use serde::{Deserialize, Serialize};

use pagedkv::host::block::{KvSpec, LayerGroups};

use super::{SimError, check_range, err, limits};

/// A GPU: memory, bandwidth and dense 16-bit peak.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GpuSpec {
    /// Name for the report.
    pub name: String,
    /// Device memory, GiB.
    pub memory_gib: f64,
    /// Memory bandwidth (datasheet), GB/s.
    pub bandwidth_gbs: f64,
    /// Dense 16-bit matrix peak (datasheet), TFLOP/s.
    pub tflops: f64,
}

impl GpuSpec {
    /// The presets: `a100-40gb`, `h100`, `h200` (datasheet figures).
    pub fn preset(name: &str) -> Result<Self, SimError> {
        let (memory_gib, bandwidth_gbs, tflops) = match name {
            "a100-40gb" => (40.0, 1555.0, 312.0),
            "h100" => (80.0, 3350.0, 989.0),
            "h200" => (141e9 / (1u64 << 30) as f64, 4800.0, 989.0),
            other => {
                return err(format!(
                    "--gpu: unknown preset `{other}` (one of a100-40gb, h100, h200)"
                ));
            }
        };
        Ok(Self {
            name: name.to_string(),
            memory_gib,
            bandwidth_gbs,
            tflops,
        })
    }
}

/// A model: the shapes that set KV bytes per token, and the weight size.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    /// Name for the report.
    pub name: String,
    /// Transformer layers.
    pub num_layers: u32,
    /// KV heads per layer.
    pub num_kv_heads: u32,
    /// Query heads per layer (a multiple of `num_kv_heads`); `None`: as many as KV
    /// heads. Sets how many query rows one KV head's cascade pass serves.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_q_heads: Option<u32>,
    /// Elements per head.
    pub head_dim: u32,
    /// Parameters.
    pub num_params: f64,
    /// Bytes per weight and per cached element.
    pub dtype_bytes: u32,
    /// Longest sequence (prompt + output).
    pub max_model_len: u32,
    /// Per layer, its sliding window in tokens (0: full attention): a model that mixes
    /// window and full layers (Gemma 2/3, gpt-oss), served with one block table per
    /// layer group (see `pagedkv::host::block::spec`). Empty: every layer full.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub layer_windows: Vec<u32>,
    /// Bytes of the stored weights when they take fewer than `dtype_bytes` a parameter
    /// (gpt-oss ships its experts in MXFP4); `None`: `num_params * dtype_bytes`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stored_weight_bytes: Option<f64>,
}

impl ModelSpec {
    /// The longest model name (in characters) a report prints.
    pub const MAX_NAME_CHARS: usize = 128;

    /// The presets: those of `../shared/workloads.md` (`opt-13b`, `llama-3-8b`,
    /// `llama-3-70b`) and three models that mix sliding-window and full layers, from
    /// their published Hugging Face configs (docs/cli.md cites them): `gemma-3-27b` (62
    /// layers, every sixth full, the others a 1024-token window), `gemma-3-1b` (26
    /// layers, every sixth full, a 512-token window) and `gpt-oss-120b` (36 layers
    /// alternating a 128-token window and full, MXFP4 experts: about 61 GiB of
    /// weights).
    pub fn preset(name: &str) -> Result<Self, SimError> {
        // (layers, KV heads, head_dim, parameters, max_model_len)
        let (l, kvh, hd, params, max_len) = match name {
            "opt-13b" => (40, 40, 128, 13e9, 2048),
            "llama-3-8b" => (32, 8, 128, 8.03e9, 8192),
            "llama-3-70b" => (80, 8, 128, 70.6e9, 8192),
            // (Gemma 3 27B and gpt-oss take 131072 tokens; the presets serve 32768, the
            // longest request the reports price, so that every policy, the all-full
            // comparison included, fits one such request in the budget.)
            "gemma-3-27b" => (62, 16, 128, 27.0e9, 32_768),
            "gemma-3-1b" => (26, 1, 256, 1.0e9, 32_768),
            "gpt-oss-120b" => (36, 8, 64, 116.8e9, 32_768),
            other => {
                return err(format!(
                    "--model: unknown preset `{other}` (one of {}, or a JSON file)",
                    Self::PRESETS.join(", ")
                ));
            }
        };
        // Gemma 3: layer i is global when (i + 1) % 6 == 0; gpt-oss: even layers slide.
        let layer_windows = match name {
            "gemma-3-27b" => (0..l)
                .map(|i| if (i + 1) % 6 == 0 { 0 } else { 1024 })
                .collect(),
            "gemma-3-1b" => (0..l)
                .map(|i| if (i + 1) % 6 == 0 { 0 } else { 512 })
                .collect(),
            "gpt-oss-120b" => (0..l).map(|i| if i % 2 == 0 { 128 } else { 0 }).collect(),
            _ => Vec::new(),
        };
        let q_heads = match name {
            "opt-13b" => 40,
            "llama-3-8b" | "gemma-3-27b" => 32,
            "llama-3-70b" | "gpt-oss-120b" => 64,
            _ => 4, // gemma-3-1b
        };
        Ok(Self {
            name: name.to_string(),
            num_layers: l,
            num_kv_heads: kvh,
            num_q_heads: Some(q_heads),
            head_dim: hd,
            num_params: params,
            dtype_bytes: 2,
            max_model_len: max_len,
            layer_windows,
            stored_weight_bytes: (name == "gpt-oss-120b").then_some(61.0 * (1u64 << 30) as f64),
        })
    }

    /// The preset names.
    pub const PRESETS: [&str; 6] = [
        "opt-13b",
        "llama-3-8b",
        "llama-3-70b",
        "gemma-3-27b",
        "gemma-3-1b",
        "gpt-oss-120b",
    ];

    /// The GPU a report uses for this model when `--gpu` is not given: one whose memory
    /// holds the weights with room for a KV cache (the paper's A100-40GB for the small
    /// models, an H100 for Gemma 3 27B and gpt-oss-120b).
    pub fn default_gpu(&self) -> &'static str {
        match self.name.as_str() {
            "gemma-3-27b" | "gpt-oss-120b" | "llama-3-70b" => "h100",
            _ => "a100-40gb",
        }
    }

    /// Query heads per KV head (1 without `num_q_heads`).
    pub fn query_group(&self) -> u32 {
        self.num_q_heads.map_or(1, |q| q / self.num_kv_heads.max(1))
    }

    /// Whether some layer has a sliding window (the hybrid allocator applies).
    pub fn is_hybrid(&self) -> bool {
        self.layer_windows.iter().any(|&w| w > 0)
    }

    /// The same model with every layer treated as full attention.
    pub fn all_full(&self) -> Self {
        Self {
            layer_windows: Vec::new(),
            ..self.clone()
        }
    }

    /// Each layer's KV spec.
    pub fn layer_specs(&self) -> Vec<KvSpec> {
        (0..self.num_layers as usize)
            .map(|l| match self.layer_windows.get(l) {
                Some(&w) if w > 0 => KvSpec::SlidingWindow(w),
                _ => KvSpec::Full,
            })
            .collect()
    }

    /// The model's layer groups (one for a model without windows).
    pub fn layer_groups(&self) -> Result<LayerGroups, SimError> {
        LayerGroups::new(&self.layer_specs())
            .map_err(|e| SimError(format!("--model {}: layer_windows: {e}", self.name)))
    }

    /// K and V bytes one layer keeps for one token when each element takes
    /// `element_bytes` (saturating; a checked spec never saturates).
    pub fn layer_token_bytes(&self, element_bytes: u32) -> u64 {
        2u64.saturating_mul(self.num_kv_heads as u64)
            .saturating_mul(self.head_dim as u64)
            .saturating_mul(element_bytes as u64)
    }

    /// K and V bytes a request of `tokens` tokens keeps, all layers, each layer its
    /// last `window` tokens at most (every token for a full layer), or `None` on
    /// overflow: the token states the hybrid allocator holds (less what its last
    /// blocks leave unfilled), and what a decode step reads for it.
    pub fn kv_bytes_held(&self, tokens: u64, element_bytes: u32) -> Option<u64> {
        let per_layer = 2u64
            .checked_mul(self.num_kv_heads as u64)?
            .checked_mul(self.head_dim as u64)?
            .checked_mul(element_bytes as u64)?;
        if self.layer_windows.is_empty() {
            return tokens
                .checked_mul(per_layer)?
                .checked_mul(self.num_layers as u64);
        }
        // (A checked spec has one window per layer.)
        let mut total = 0u64;
        for &w in &self.layer_windows {
            let kept = if w > 0 { tokens.min(w as u64) } else { tokens };
            total = total.checked_add(kept.checked_mul(per_layer)?)?;
        }
        Some(total)
    }

    /// Reads a JSON model config (the fields of [`ModelSpec`]; unknown fields are an
    /// error). The file is read up to 64 KiB.
    pub fn from_json_file(path: &Path) -> Result<Self, SimError> {
        use std::io::Read as _;
        const MAX_BYTES: u64 = 64 << 10;
        let at = |e: &dyn std::fmt::Display| SimError(format!("--model {}: {e}", path.display()));
        let mut text = String::new();
        std::fs::File::open(path)
            .and_then(|f| f.take(MAX_BYTES + 1).read_to_string(&mut text))
            .map_err(|e| at(&e))?;
        if text.len() as u64 > MAX_BYTES {
            return Err(at(&format!("longer than {MAX_BYTES} bytes")));
        }
        Self::from_json_str(&text).map_err(|e| at(&e))
    }

    /// Parses and checks a JSON model config (see [`ModelSpec::from_json_file`]).
    pub fn from_json_str(text: &str) -> Result<Self, SimError> {
        let m: ModelSpec = serde_json::from_str(text).map_err(|e| SimError(e.to_string()))?;
        m.check()?;
        Ok(m)
    }

    /// Checks that every field is in range and that the sizes computed from them fit;
    /// errors name the field. The name is printed in reports: at most
    /// [`MAX_NAME_CHARS`](Self::MAX_NAME_CHARS) characters, none of them a control
    /// character (a NUL or an ANSI escape from a model JSON once reached the terminal).
    pub fn check(&self) -> Result<(), SimError> {
        if let Some(c) = self.name.chars().find(|c| c.is_control()) {
            return err(format!(
                "name: \"{}\" holds the control character {c:?}: model names are printed in reports",
                self.name.escape_debug()
            ));
        }
        let chars = self.name.chars().count();
        if chars > Self::MAX_NAME_CHARS {
            return err(format!(
                "name: {chars} characters, more than {}",
                Self::MAX_NAME_CHARS
            ));
        }
        for (field, v) in [
            ("num_layers", self.num_layers),
            ("num_kv_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
            ("dtype_bytes", self.dtype_bytes),
        ] {
            if v == 0 {
                return err(format!("{field}: must be positive"));
            }
        }
        if let Some(q) = self.num_q_heads
            && (q == 0 || !q.is_multiple_of(self.num_kv_heads))
        {
            return err(format!(
                "num_q_heads: {q} is not a positive multiple of num_kv_heads {}",
                self.num_kv_heads
            ));
        }
        check_range("num_params", self.num_params, limits::NUM_PARAMS)?;
        if self.max_model_len < 2 {
            return err("max_model_len: must be at least 2");
        }
        if self.max_model_len as u64 > limits::MAX_TOKEN_SLOTS {
            return err(format!(
                "max_model_len: {} is more than the simulator's {} token slots",
                self.max_model_len,
                limits::MAX_TOKEN_SLOTS
            ));
        }
        if !self.layer_windows.is_empty() {
            if self.layer_windows.len() != self.num_layers as usize {
                return err(format!(
                    "layer_windows: {} entries for {} layers (one per layer, 0 for a full one)",
                    self.layer_windows.len(),
                    self.num_layers
                ));
            }
            LayerGroups::new(&self.layer_specs())
                .map_err(|e| SimError(format!("layer_windows: {e}")))?;
        }
        if let Some(b) = self.stored_weight_bytes {
            check_range("stored_weight_bytes", b, limits::WEIGHT_BYTES)?;
        }
        if self.checked_kv_bytes_per_token().is_none() {
            return err(format!(
                "num_layers, num_kv_heads, head_dim, dtype_bytes: 2 x {} x {} x {} x {} bytes per token overflows 64 bits",
                self.num_layers, self.num_kv_heads, self.head_dim, self.dtype_bytes
            ));
        }
        Ok(())
    }

    /// K and V bytes of one token, all layers, or `None` when that overflows `u64`.
    pub fn checked_kv_bytes_per_token(&self) -> Option<u64> {
        self.checked_kv_bytes_per_token_at(self.dtype_bytes)
    }

    /// K and V bytes of one token, all layers, when each cached element takes
    /// `element_bytes` (an fp8 cache: 1), or `None` when that overflows `u64`.
    pub fn checked_kv_bytes_per_token_at(&self, element_bytes: u32) -> Option<u64> {
        2u64.checked_mul(self.num_layers as u64)?
            .checked_mul(self.num_kv_heads as u64)?
            .checked_mul(self.head_dim as u64)?
            .checked_mul(element_bytes as u64)
    }

    /// K and V bytes of one token, all layers (saturating at `u64::MAX`; a spec that
    /// passed [`ModelSpec::check`] never saturates).
    pub fn kv_bytes_per_token(&self) -> u64 {
        self.checked_kv_bytes_per_token().unwrap_or(u64::MAX)
    }

    /// Weight bytes: `stored_weight_bytes`, else `num_params * dtype_bytes`.
    pub fn weight_bytes(&self) -> f64 {
        self.stored_weight_bytes
            .unwrap_or(self.num_params * self.dtype_bytes as f64)
    }
}

/// The element type of the KV cache (`--kv-dtype`). The weights keep the model's own
/// dtype either way; only the cache changes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum KvDtype {
    /// The model's own dtype ([`ModelSpec::dtype_bytes`]: 2 bytes, f16, for the presets).
    #[default]
    F16,
    /// One byte per element (e4m3 or e5m2: the same capacity and bytes read).
    Fp8,
}

impl KvDtype {
    /// Parses a `--kv-dtype` value: `f16`, or `fp8` (`e4m3` and `e5m2` are aliases: both
    /// take one byte); anything else is an error naming the flag.
    pub fn parse(s: &str) -> Result<Self, SimError> {
        match s {
            "f16" => Ok(Self::F16),
            "fp8" | "e4m3" | "e5m2" => Ok(Self::Fp8),
            other => err(format!(
                "--kv-dtype: unknown KV-cache dtype `{other}` (f16, or fp8; e4m3 and e5m2 mean fp8)"
            )),
        }
    }

    /// Bytes of one cached element of `model` in this dtype.
    pub fn element_bytes(self, model: &ModelSpec) -> u32 {
        match self {
            Self::F16 => model.dtype_bytes,
            Self::Fp8 => 1,
        }
    }

    /// The dtype's name for a report: `fp8`, or for the model's own dtype `f16` when it
    /// takes 2 bytes and `N-byte` otherwise (a model file may say 4).
    pub fn label(self, model: &ModelSpec) -> String {
        match (self, model.dtype_bytes) {
            (Self::Fp8, _) => "fp8".into(),
            (Self::F16, 2) => "f16".into(),
            (Self::F16, n) => format!("{n}-byte"),
        }
    }
}

/// What the KV cache of one token and of one request costs for a model: the figure
/// that makes paging matter (a request of a few thousand tokens holds hundreds of MB to
/// a few GiB). All of it computed with checked arithmetic.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct KvFootprint {
    /// Transformer layers.
    pub num_layers: u32,
    /// KV heads per layer.
    pub num_kv_heads: u32,
    /// Elements per head.
    pub head_dim: u32,
    /// Bytes per cached element.
    pub dtype_bytes: u32,
    /// K and V bytes of one token, all layers:
    /// `2 * num_layers * num_kv_heads * head_dim * dtype_bytes`.
    pub bytes_per_token: u64,
    /// The model's longest sequence (prompt + output), tokens.
    pub max_model_len: u32,
    /// One request's KV bytes at each of [`KvFootprint::REQUEST_TOKENS`] tokens.
    pub per_request: Vec<RequestKv>,
}

/// One request's KV cache at a given length.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct RequestKv {
    /// Tokens held (prompt + output so far).
    pub tokens: u64,
    /// Their K and V bytes, all layers.
    pub bytes: u64,
}

impl KvFootprint {
    /// The request lengths the report prices: 2k and 8k tokens.
    pub const REQUEST_TOKENS: [u64; 2] = [2048, 8192];

    /// The footprint of `model`, or an error naming the fields when a figure overflows
    /// 64 bits.
    pub fn of(model: &ModelSpec) -> Result<Self, SimError> {
        Self::at(model, model.dtype_bytes)
    }

    /// The footprint of `model`'s cache when each element takes `element_bytes` (an fp8
    /// cache: 1), or an error naming the fields when a figure overflows 64 bits.
    pub fn at(model: &ModelSpec, element_bytes: u32) -> Result<Self, SimError> {
        let overflow = |what: String| {
            SimError(format!(
                "--model {}: num_layers, num_kv_heads, head_dim, dtype_bytes: {what} overflows 64 bits",
                model.name
            ))
        };
        let bytes_per_token = model
            .checked_kv_bytes_per_token_at(element_bytes)
            .ok_or_else(|| overflow("the KV bytes of one token".into()))?;
        let per_request = Self::REQUEST_TOKENS
            .iter()
            .map(|&tokens| {
                bytes_per_token
                    .checked_mul(tokens)
                    .map(|bytes| RequestKv { tokens, bytes })
                    .ok_or_else(|| overflow(format!("the KV bytes of {tokens} tokens")))
            })
            .collect::<Result<_, _>>()?;
        Ok(Self {
            num_layers: model.num_layers,
            num_kv_heads: model.num_kv_heads,
            head_dim: model.head_dim,
            dtype_bytes: element_bytes,
            bytes_per_token,
            max_model_len: model.max_model_len,
            per_request,
        })
    }
}

/// How a step that holds prompt tokens is priced (`--prefill`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PrefillModel {
    /// Prompts run in a pass of their own before the step's decodes, which wait for
    /// it: the step takes the prefill pass's roofline plus the decode pass's (weights
    /// read and overhead paid twice). The 2023 systems of the paper ran this way
    /// (vLLM's scheduler ran prompt steps apart from decode steps, and the paper's Orca
    /// baselines are reimplementations on the same engine), so its figures are
    /// compared under this model: the default.
    #[default]
    Separate,
    /// Prompt tokens join the decode step's one pass (chunked prefill, as pagedkv's
    /// scheduler and current engines batch them): one roofline over all the step's
    /// tokens and K/V bytes.
    Mixed,
}

impl PrefillModel {
    /// Parses a `--prefill` value: `separate` or `mixed`; anything else is an error
    /// naming the flag.
    pub fn parse(s: &str) -> Result<Self, SimError> {
        match s {
            "separate" => Ok(Self::Separate),
            "mixed" => Ok(Self::Mixed),
            other => err(format!(
                "--prefill: unknown prefill model `{other}` (separate or mixed)"
            )),
        }
    }

    /// Its name, as the flag takes it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Separate => "separate",
            Self::Mixed => "mixed",
        }
    }
}

/// What one step processes, by kind of row: the step-time model prices the prompt
/// tokens and the decode tokens by [`PrefillModel`].
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepLoad {
    /// Prompt tokens the step computes (whole prompts, chunks, recomputed ones).
    pub prefill_tokens: u64,
    /// K/V bytes the prompt rows' attention reads.
    pub prefill_kv_bytes: f64,
    /// Decode tokens (one per decoding request).
    pub decode_tokens: u64,
    /// K/V bytes the decode rows' attention reads.
    pub decode_kv_bytes: f64,
}

/// Simulation settings beyond the workload.
#[derive(Clone, Debug, PartialEq)]
pub struct SimConfig {
    /// The GPU.
    pub gpu: GpuSpec,
    /// The model.
    pub model: ModelSpec,
    /// KV-cache budget in GiB; `None`: `gpu_memory_utilization * memory - weights`.
    pub kv_budget_gib: Option<f64>,
    /// Share of device memory the server may use (weights + KV).
    pub gpu_memory_utilization: f64,
    /// Achieved share of the datasheet bandwidth.
    pub bandwidth_efficiency: f64,
    /// Achieved share of the datasheet FLOP rate.
    pub flops_efficiency: f64,
    /// Fixed time per step, seconds.
    pub step_overhead_s: f64,
    /// Most running sequences (both kinds of policy).
    pub max_num_seqs: usize,
    /// Most tokens one step processes.
    pub max_tokens_per_step: usize,
    /// The KV cache's element type: sets KV bytes per token, hence token slots and the
    /// KV bytes a step reads; the weights keep the model's dtype.
    pub kv_dtype: KvDtype,
    /// Tokens of a system prompt every request's prompt begins with (0: none). The
    /// paged policies cache it (prefix caching) and report the K/V bytes a decode
    /// step reads with and without cascade attention.
    pub system_prompt: u32,
    /// How a step with prompt tokens is priced (default [`PrefillModel::Separate`]).
    pub prefill: PrefillModel,
    /// Most tokens (prompt + output) of the requests the paged scheduler holds at once,
    /// running or about to be admitted; a run that needs more is an error (default and
    /// most: [`limits::MAX_LIVE_TOKENS`]).
    pub max_live_tokens: u64,
}

impl SimConfig {
    /// Defaults for a GPU and model (see the module docs for the step-time model).
    pub fn new(gpu: GpuSpec, model: ModelSpec) -> Self {
        Self {
            gpu,
            model,
            kv_budget_gib: None,
            gpu_memory_utilization: 0.9,
            bandwidth_efficiency: 0.8,
            flops_efficiency: 0.5,
            step_overhead_s: 0.005,
            max_num_seqs: 256,
            max_tokens_per_step: 4096,
            kv_dtype: KvDtype::F16,
            system_prompt: 0,
            prefill: PrefillModel::default(),
            max_live_tokens: limits::MAX_LIVE_TOKENS,
        }
    }

    /// Checks the GPU, the model and the budget against [`limits`]: every figure the
    /// simulation computes from them is then finite.
    pub fn check(&self) -> Result<(), SimError> {
        check_range("--memory-gib", self.gpu.memory_gib, limits::MEMORY_GIB)?;
        check_range(
            "--bandwidth-gbs",
            self.gpu.bandwidth_gbs,
            limits::BANDWIDTH_GBS,
        )?;
        check_range("GPU tflops", self.gpu.tflops, limits::TFLOPS)?;
        self.model
            .check()
            .map_err(|e| SimError(format!("--model {}: {e}", self.model.name.escape_debug())))?;
        if let Some(g) = self.kv_budget_gib {
            check_range("--kv-budget-gib", g, limits::KV_BUDGET_GIB)?;
        }
        for (what, v) in [
            ("gpu_memory_utilization", self.gpu_memory_utilization),
            ("bandwidth_efficiency", self.bandwidth_efficiency),
            ("flops_efficiency", self.flops_efficiency),
        ] {
            if !(v > 0.0 && v <= 1.0) {
                return err(format!("{what}: {v} is not in (0, 1]"));
            }
        }
        if !(0.0..=10.0).contains(&self.step_overhead_s) {
            return err(format!(
                "step_overhead_s: {} is not in [0, 10] s",
                self.step_overhead_s
            ));
        }
        if self.max_num_seqs == 0 || self.max_tokens_per_step == 0 {
            return err("max_num_seqs and max_tokens_per_step must be positive");
        }
        if !(1..=limits::MAX_LIVE_TOKENS).contains(&self.max_live_tokens) {
            return err(format!(
                "max_live_tokens: {} is not in 1 to {}",
                self.max_live_tokens,
                limits::MAX_LIVE_TOKENS
            ));
        }
        Ok(())
    }

    /// K and V bytes of one token in the cache's dtype ([`SimConfig::kv_dtype`]),
    /// saturating at `u64::MAX` (a config that passed [`SimConfig::check`] never
    /// saturates: fp8 takes at most as many bytes as the model's dtype).
    pub fn kv_bytes_per_token(&self) -> u64 {
        self.model
            .checked_kv_bytes_per_token_at(self.kv_dtype.element_bytes(&self.model))
            .unwrap_or(u64::MAX)
    }

    /// The flag that sets the KV budget, for error messages.
    pub(super) fn budget_flag(&self) -> &'static str {
        if self.kv_budget_gib.is_some() {
            "--kv-budget-gib"
        } else {
            "--memory-gib (or --gpu)"
        }
    }

    /// The KV budget in bytes, or an error when an input is out of range
    /// ([`SimConfig::check`]) or the budget cannot hold one maximum-length request.
    pub fn kv_budget_bytes(&self) -> Result<f64, SimError> {
        self.check()?;
        let gib = (1u64 << 30) as f64;
        let b = match self.kv_budget_gib {
            Some(g) => g * gib,
            None => {
                self.gpu_memory_utilization * self.gpu.memory_gib * gib - self.model.weight_bytes()
            }
        };
        let need = self
            .model
            .kv_bytes_held(
                self.model.max_model_len as u64,
                self.kv_dtype.element_bytes(&self.model),
            )
            .unwrap_or(u64::MAX) as f64;
        if self.kv_budget_gib.is_none() && b <= 0.0 {
            // The weights alone do not fit: a negative KV budget says nothing useful.
            return err(format!(
                "{}: the weights of {} ({:.2} GiB: {:e} parameters x {} bytes) do not fit in {:.0}% of {}'s {:.2} GiB ({:.2} GiB), so nothing is left for the KV cache; use a GPU with more memory, a smaller model, or set --kv-budget-gib",
                self.budget_flag(),
                self.model.name,
                self.model.weight_bytes() / gib,
                self.model.num_params,
                self.model.dtype_bytes,
                self.gpu_memory_utilization * 100.0,
                self.gpu.name,
                self.gpu.memory_gib,
                self.gpu_memory_utilization * self.gpu.memory_gib,
            ));
        }
        if b < need {
            return err(format!(
                "{}: memory budget too small: {:.2} GiB of KV cache for {} on {} cannot hold even one {}-token request ({:.2} GiB); use a larger --gpu or --kv-budget-gib",
                self.budget_flag(),
                b / gib,
                self.model.name,
                self.gpu.name,
                self.model.max_model_len,
                need / gib
            ));
        }
        Ok(b)
    }

    /// KV token slots in the budget; an error naming the flag, the slots and the largest
    /// `--kv-budget-gib` that fits when they are more than the simulator can hold
    /// ([`limits::MAX_TOKEN_SLOTS`]). A model with sliding-window layers is checked for
    /// its paged pool too (see [`SimConfig::hybrid_pool`]): its token slots are pages of
    /// a few layers, so the same budget holds more of them.
    pub fn capacity_tokens(&self) -> Result<u64, SimError> {
        let budget = self.kv_budget_bytes()?;
        let slot = self.kv_bytes_per_token();
        let slots = (budget / slot as f64).floor();
        if slots > limits::MAX_TOKEN_SLOTS as f64 {
            return Err(self.too_many_slots(budget, slots, slot, String::new()));
        }
        if self.model.is_hybrid() {
            for p in super::Policy::ALL {
                if let super::Policy::Paged(bs) = p {
                    self.hybrid_pool(bs)?;
                }
            }
        }
        Ok(slots as u64)
    }

    /// The paged pool of a model with sliding-window layers at `block_size`: the blocks
    /// the budget holds (each a page of `layers_per_group` layers of `block_size`
    /// tokens: see `pagedkv::host::block::spec`) and the model's layer groups; an error
    /// as [`SimConfig::capacity_tokens`]'s when `blocks x block_size` token slots are
    /// more than [`limits::MAX_TOKEN_SLOTS`].
    pub fn hybrid_pool(&self, block_size: u32) -> Result<(u64, LayerGroups), SimError> {
        let budget = self.kv_budget_bytes()?;
        let groups = self.model.layer_groups()?;
        let slot = self
            .model
            .layer_token_bytes(self.kv_dtype.element_bytes(&self.model))
            .saturating_mul(groups.layers_per_group() as u64);
        let blocks = (budget / (slot as f64 * block_size.max(1) as f64)).floor();
        let slots = blocks * block_size as f64;
        if slots > limits::MAX_TOKEN_SLOTS as f64 {
            let pool = format!(
                " in its paged pool at block size {block_size} (the hybrid allocator's pages hold {} layers: {} a token slot)",
                groups.layers_per_group(),
                super::binary_size(slot)
            );
            return Err(self.too_many_slots(budget, slots, slot, pool));
        }
        Ok((blocks as u64, groups))
    }

    /// The error of a budget of `budget` bytes that is `slots` token slots of
    /// `slot_bytes` each, more than [`limits::MAX_TOKEN_SLOTS`]: in token slots
    /// throughout, with the largest `--kv-budget-gib` that fits.
    fn too_many_slots(&self, budget: f64, slots: f64, slot_bytes: u64, pool: String) -> SimError {
        let gib = (1u64 << 30) as f64;
        let fit =
            (limits::MAX_TOKEN_SLOTS as f64 * slot_bytes as f64 / gib * 100.0).floor() / 100.0;
        let element = self.kv_dtype.element_bytes(&self.model);
        let need = self
            .model
            .kv_bytes_held(self.model.max_model_len as u64, element)
            .unwrap_or(u64::MAX) as f64;
        let remedy = if fit * gib >= need {
            let mut r = format!("use --kv-budget-gib {fit:.2} or less");
            if self.kv_dtype == KvDtype::Fp8 {
                r.push_str(" (--kv-dtype fp8 doubles the token slots of a budget)");
            }
            r
        } else {
            format!(
                "and one {}-token request needs {:.2} GiB, more than that limit holds: this model cannot be simulated (a smaller max_model_len can)",
                self.model.max_model_len,
                need / gib
            )
        };
        SimError(format!(
            "{}: a KV budget of {:.2} GiB for {}{} is {slots:.0} token slots{pool}, more than the simulator's limit of {} token slots (2^24); {remedy}",
            self.budget_flag(),
            budget / gib,
            self.model.name,
            match self.kv_dtype {
                KvDtype::Fp8 => " with an fp8 cache",
                KvDtype::F16 => "",
            },
            limits::MAX_TOKEN_SLOTS
        ))
    }

    /// Duration of a step that processes `tokens` tokens and reads `kv_tokens` cached
    /// tokens' K/V (the roofline of the module docs). The K/V bytes are those of the
    /// cache's dtype (an fp8 cache reads half the bytes of an f16 one); the weights are
    /// read at the model's dtype either way.
    pub fn step_time(&self, tokens: u64, kv_tokens: u64) -> f64 {
        self.step_time_bytes(tokens, self.kv_bytes_of(kv_tokens))
    }

    /// Duration of a step with this load: one roofline over all of it
    /// ([`PrefillModel::Mixed`]), or a prefill pass and a decode pass one after the
    /// other, each its own roofline and overhead ([`PrefillModel::Separate`]; a step
    /// with only one kind of row is one pass either way).
    pub fn step_duration(&self, load: &StepLoad) -> f64 {
        let (p, d) = (load.prefill_tokens, load.decode_tokens);
        match self.prefill {
            PrefillModel::Separate if p > 0 && d > 0 => {
                self.step_time_bytes(p, load.prefill_kv_bytes)
                    + self.step_time_bytes(d, load.decode_kv_bytes)
            }
            _ => self.step_time_bytes(p + d, load.prefill_kv_bytes + load.decode_kv_bytes),
        }
    }

    /// K/V bytes of `tokens` cached tokens in the cache's dtype (a model without
    /// windows: every layer holds every token).
    pub fn kv_bytes_of(&self, tokens: u64) -> f64 {
        tokens as f64 * self.kv_bytes_per_token() as f64
    }

    /// [`step_time`](Self::step_time) of a step that reads `kv_bytes` of K/V (a
    /// hybrid model's window layers read at most their window of each sequence).
    pub fn step_time_bytes(&self, tokens: u64, kv_bytes: f64) -> f64 {
        let bytes = self.model.weight_bytes() + kv_bytes;
        let t_mem = bytes / (self.gpu.bandwidth_gbs * 1e9 * self.bandwidth_efficiency);
        let t_compute = 2.0 * self.model.num_params * tokens as f64
            / (self.gpu.tflops * 1e12 * self.flops_efficiency);
        t_mem.max(t_compute) + self.step_overhead_s
    }
}

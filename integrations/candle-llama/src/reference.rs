//! candle's own Llama (`candle_transformers::models::llama`), one request at a time
//! with its own KV cache: what [`crate::Engine`]'s logits are checked against.

use candle_core::{DType, Device, Tensor};
use candle_transformers::models::llama::{Cache, Config, Llama};

use crate::Result;
use crate::engine::{Arrival, Generated, argmax};

/// Generates `max_tokens` greedy tokens after `prompt` with candle's Llama: the
/// prompt in one forward pass, then one token per pass, on candle's KV cache.
pub fn generate(
    llama: &Llama,
    cfg: &Config,
    id: u64,
    prompt: &[u32],
    max_tokens: u32,
) -> Result<Generated> {
    let dev = Device::Cpu;
    let mut cache = Cache::new(true, DType::F32, cfg, &dev)?;
    let mut out = Generated {
        request: id,
        prompt: prompt.to_vec(),
        ..Generated::default()
    };
    let mut input = prompt.to_vec();
    let mut pos = 0;
    for _ in 0..max_tokens {
        let x = Tensor::new(input.as_slice(), &dev)?.unsqueeze(0)?;
        let logits = llama.forward(&x, pos, &mut cache)?.squeeze(0)?;
        let logits = logits.to_vec1::<f32>()?;
        pos += input.len();
        let t = argmax(&logits);
        out.tokens.push(t);
        out.logits.push(logits);
        input = vec![t];
    }
    Ok(out)
}

/// [`generate`] for every request of a workload, one after the other, by request id.
pub fn generate_all(llama: &Llama, cfg: &Config, arrivals: &[Arrival]) -> Result<Vec<Generated>> {
    let mut all = arrivals
        .iter()
        .map(|a| generate(llama, cfg, a.id, &a.prompt, a.max_tokens))
        .collect::<Result<Vec<_>>>()?;
    all.sort_by_key(|g| g.request);
    Ok(all)
}

/// `max |a - b| / max |b|`: the error of logits `a` relative to the reference `b`.
pub fn relative_error(a: &[f32], b: &[f32]) -> f32 {
    let diff = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    let scale = b.iter().map(|y| y.abs()).fold(0f32, f32::max);
    if a.len() != b.len() {
        f32::INFINITY
    } else {
        diff / scale.max(f32::MIN_POSITIVE)
    }
}

/// The comparison of an engine's outputs with the reference's.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Agreement {
    /// Logit vectors compared (one per generated token).
    pub compared: usize,
    /// The largest [`relative_error`] of any of them.
    pub max_relative_error: f32,
}

/// Compares `got` with `want` request by request: the same requests, the same greedy
/// tokens, and every step's logits; returns the largest relative error, or what
/// differs first.
pub fn compare(got: &[Generated], want: &[Generated]) -> Result<Agreement> {
    if got.len() != want.len() {
        return Err(format!("{} requests finished, {} expected", got.len(), want.len()).into());
    }
    let mut a = Agreement::default();
    for (g, w) in got.iter().zip(want) {
        if g.request != w.request || g.prompt != w.prompt {
            return Err(format!("request {} vs {}", g.request, w.request).into());
        }
        if g.tokens != w.tokens {
            return Err(format!(
                "request {}: tokens {:?}, candle's {:?}",
                g.request, g.tokens, w.tokens
            )
            .into());
        }
        for (i, (gl, wl)) in g.logits.iter().zip(&w.logits).enumerate() {
            let e = relative_error(gl, wl);
            if e.is_nan() || e > 1.0 {
                return Err(format!("request {} token {i}: relative error {e}", g.request).into());
            }
            a.max_relative_error = a.max_relative_error.max(e);
            a.compared += 1;
        }
    }
    Ok(a)
}

//! The small random transformer of `pagedkv run`: weights, the dense parts of a layer
//! (projections, residual, RMS norm) on the CPU, and greedy sampling.

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::RunConfig;

/// One layer's weights (the cache lives in the backend's `PagedCache`).
pub(super) struct Layer {
    pub(super) wq: Vec<f32>,
    pub(super) wk: Vec<f32>,
    pub(super) wv: Vec<f32>,
    pub(super) wo: Vec<f32>,
}

/// `x [n, k] @ w [k, m]`.
pub(super) fn matmul(x: &[f32], w: &[f32], k: usize, m: usize) -> Vec<f32> {
    let n = x.len() / k;
    let mut out = vec![0.0f32; n * m];
    for i in 0..n {
        for (j, xv) in x[i * k..(i + 1) * k].iter().enumerate() {
            let row = &w[j * m..(j + 1) * m];
            for (o, wv) in out[i * m..(i + 1) * m].iter_mut().zip(row) {
                *o += xv * wv;
            }
        }
    }
    out
}

fn rms_norm(x: &mut [f32], width: usize) {
    for row in x.chunks_mut(width) {
        let ms = row.iter().map(|v| v * v).sum::<f32>() / width as f32;
        let inv = 1.0 / (ms + 1e-6).sqrt();
        row.iter_mut().for_each(|v| *v *= inv);
    }
}

/// The layer's output projection, residual and normalisation: `x = norm(x + attn @ wo)`.
pub(super) fn finish_layer(x: &mut [f32], attn: &[f32], wo: &[f32], hidden: usize) {
    let o = matmul(attn, wo, hidden, hidden);
    for (xv, ov) in x.iter_mut().zip(&o) {
        *xv += ov;
    }
    rms_norm(x, hidden);
}

pub(super) fn random(r: &mut SmallRng, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| r.random_range(-1.0f32..1.0) * scale)
        .collect()
}

/// The model: an embedding, the layers' weights and an output matrix, from the
/// config's seed (the same weights for every run with that seed).
pub(super) struct Model {
    pub(super) embed: Vec<f32>,
    /// `[vocab, hidden]`: the output matrix (its own: tied to the embedding, the
    /// residual stream made every greedy token the token before it).
    pub(super) unembed: Vec<f32>,
    pub(super) layers: Vec<Layer>,
    pub(super) hidden: usize,
    /// The generator after the weights: the prompts come from it.
    pub(super) rng: SmallRng,
}

impl Model {
    pub(super) fn new(cfg: &RunConfig) -> Self {
        let (qh, kvh, d) = (
            cfg.num_q_heads as usize,
            cfg.num_kv_heads as usize,
            cfg.head_dim as usize,
        );
        let hidden = qh * d;
        let mut r = SmallRng::seed_from_u64(cfg.seed);
        let embed = random(&mut r, cfg.vocab * hidden, 1.0);
        let scale = 1.0 / (hidden as f32).sqrt();
        let layers = (0..cfg.num_layers)
            .map(|_| Layer {
                wq: random(&mut r, hidden * hidden, scale),
                wk: random(&mut r, hidden * kvh * d, scale),
                wv: random(&mut r, hidden * kvh * d, scale),
                wo: random(&mut r, hidden * hidden, scale),
            })
            .collect();
        let unembed = random(&mut r, cfg.vocab * hidden, 1.0);
        Model {
            embed,
            unembed,
            layers,
            hidden,
            rng: r,
        }
    }

    /// The hidden states `[tokens, hidden]` of `tokens`.
    pub(super) fn embed(&self, tokens: impl Iterator<Item = u32>, x: &mut Vec<f32>) {
        let h = self.hidden;
        for t in tokens {
            let t = t as usize;
            x.extend_from_slice(&self.embed[t * h..(t + 1) * h]);
        }
    }

    /// The greedy next token after hidden state `h`.
    pub(super) fn greedy(&self, h: &[f32], vocab: usize) -> u32 {
        self.greedy_margin(h, vocab).0
    }

    /// The greedy next token after hidden state `h` and its relative margin: its
    /// logit less the runner-up's, over its logit's magnitude (how far the choice is
    /// from a tie, in the units a relative error of the hidden state moves it).
    pub(super) fn greedy_margin(&self, h: &[f32], vocab: usize) -> (u32, f32) {
        let hidden = self.hidden;
        let (mut best, mut top, mut second) = (0u32, f32::NEG_INFINITY, f32::NEG_INFINITY);
        for t in 0..vocab {
            let logit = self.unembed[t * hidden..(t + 1) * hidden]
                .iter()
                .zip(h)
                .map(|(a, b)| a * b)
                .sum::<f32>();
            if logit > top {
                (second, top, best) = (top, logit, t as u32);
            } else if logit > second {
                second = logit;
            }
        }
        (best, (top - second) / top.abs().max(f32::MIN_POSITIVE))
    }
}

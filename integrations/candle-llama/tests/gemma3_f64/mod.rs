//! A Gemma 3 forward pass in plain f64 Rust, written from Hugging Face's Gemma 3 and
//! sharing no code with the model under test (no candle op, no pagedkv kernel): the
//! independent reference for what candle's own Gemma 3 cannot check, a score scale
//! of `query_pre_attn_scalar^-0.5` other than `head_dim^-0.5` and a RoPE scaled on the
//! global layers.
//!
//! It recomputes a whole sequence at once (every position's logits), causal, a
//! sliding layer seeing the last `window` positions, its own included.

use std::collections::HashMap;

use candle_core::Tensor;
use pagedkv_candle_llama::Generated;
use pagedkv_candle_llama::engine::argmax;

/// What the reference is told of a model, stated by the test, not read from the
/// configuration under test: its sizes, and the numbers that set its attention.
#[derive(Clone, Debug)]
pub struct Spec {
    pub hidden: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub vocab: usize,
    pub eps: f64,
    /// Layer `l` is global when `(l + 1) % pattern == 0`.
    pub pattern: usize,
    pub window: usize,
    /// The scores' scale.
    pub scale: f64,
    /// RoPE base and the factor its positions are divided by: sliding layers.
    pub local: (f64, f64),
    /// The same for the global layers.
    pub global: (f64, f64),
}

/// The weights, f64, by name.
pub struct Weights(HashMap<String, Vec<f64>>);

impl Weights {
    pub fn new(w: &HashMap<String, Tensor>) -> Self {
        Self(
            w.iter()
                .map(|(k, t)| {
                    let v: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
                    (k.clone(), v.into_iter().map(f64::from).collect())
                })
                .collect(),
        )
    }

    fn get(&self, name: &str) -> &[f64] {
        self.0
            .get(name)
            .unwrap_or_else(|| panic!("no weight {name}"))
    }
}

/// `w x` for `w` `[out, x.len()]`, row-major.
fn matvec(w: &[f64], x: &[f64]) -> Vec<f64> {
    w.chunks_exact(x.len())
        .map(|row| row.iter().zip(x).map(|(a, b)| a * b).sum())
        .collect()
}

/// Gemma's RMS norm: `x / sqrt(mean(x²) + eps) * (1 + w)`.
fn norm(x: &[f64], w: &[f64], eps: f64) -> Vec<f64> {
    let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let r = 1.0 / (ms + eps).sqrt();
    x.iter().zip(w).map(|(v, g)| v * r * (1.0 + g)).collect()
}

/// GELU, tanh approximation (`gelu_pytorch_tanh`).
fn gelu_tanh(x: f64) -> f64 {
    let c = (2.0 / std::f64::consts::PI).sqrt();
    0.5 * x * (1.0 + (c * (x + 0.044_715 * x * x * x)).tanh())
}

/// RoPE in place on one head (`rotate_half`: pair `i` is `(x[i], x[i + d/2])`), at
/// position `pos`, base `theta`, positions divided by `factor`.
fn rope(x: &mut [f64], pos: usize, (theta, factor): (f64, f64)) {
    let d = x.len();
    let half = d / 2;
    for i in 0..half {
        let inv_freq = theta.powf(-((2 * i) as f64) / d as f64);
        let angle = pos as f64 / factor * inv_freq;
        let (s, c) = angle.sin_cos();
        let (a, b) = (x[i], x[i + half]);
        x[i] = a * c - b * s;
        x[i + half] = b * c + a * s;
    }
}

/// Every position's logits for `tokens` (`[tokens.len()][vocab]`).
pub fn logits(s: &Spec, w: &Weights, tokens: &[u32]) -> Vec<Vec<f64>> {
    let (h, d) = (s.hidden, s.head_dim);
    let group = s.heads / s.kv_heads;
    let embed = w.get("model.embed_tokens.weight");
    // The weights are the sizes the reference was told.
    assert_eq!(embed.len(), s.vocab * h);
    assert_eq!(
        w.get("model.layers.0.mlp.gate_proj.weight").len(),
        s.intermediate * h
    );
    let mut x: Vec<Vec<f64>> = tokens
        .iter()
        .map(|&t| {
            let row = &embed[t as usize * h..(t as usize + 1) * h];
            row.iter().map(|v| v * (h as f64).sqrt()).collect()
        })
        .collect();
    for l in 0..s.layers {
        let p = |n: &str| format!("model.layers.{l}.{n}.weight");
        let sliding = (l + 1) % s.pattern != 0;
        let rope_of = if sliding { s.local } else { s.global };
        let (mut q, mut k, mut v) = (Vec::new(), Vec::new(), Vec::new());
        for (pos, xt) in x.iter().enumerate() {
            let hn = norm(xt, w.get(&p("input_layernorm")), s.eps);
            let mut qt = matvec(w.get(&p("self_attn.q_proj")), &hn);
            let mut kt = matvec(w.get(&p("self_attn.k_proj")), &hn);
            for head in qt.chunks_exact_mut(d) {
                let n = norm(head, w.get(&p("self_attn.q_norm")), s.eps);
                head.copy_from_slice(&n);
                rope(head, pos, rope_of);
            }
            for head in kt.chunks_exact_mut(d) {
                let n = norm(head, w.get(&p("self_attn.k_norm")), s.eps);
                head.copy_from_slice(&n);
                rope(head, pos, rope_of);
            }
            q.push(qt);
            k.push(kt);
            v.push(matvec(w.get(&p("self_attn.v_proj")), &hn));
        }
        for t in 0..x.len() {
            let first = if sliding {
                (t + 1).saturating_sub(s.window)
            } else {
                0
            };
            let mut attn = vec![0.0; s.heads * d];
            for hq in 0..s.heads {
                let kv = hq / group;
                let qh = &q[t][hq * d..(hq + 1) * d];
                let scores: Vec<f64> = (first..=t)
                    .map(|j| {
                        let kh = &k[j][kv * d..(kv + 1) * d];
                        s.scale * qh.iter().zip(kh).map(|(a, b)| a * b).sum::<f64>()
                    })
                    .collect();
                let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|x| (x - m).exp()).collect();
                let z: f64 = e.iter().sum();
                let out = &mut attn[hq * d..(hq + 1) * d];
                for (j, p) in (first..=t).zip(&e) {
                    let vh = &v[j][kv * d..(kv + 1) * d];
                    for (o, vv) in out.iter_mut().zip(vh) {
                        *o += p / z * vv;
                    }
                }
            }
            let a = matvec(w.get(&p("self_attn.o_proj")), &attn);
            let a = norm(&a, w.get(&p("post_attention_layernorm")), s.eps);
            let x1: Vec<f64> = x[t].iter().zip(&a).map(|(u, v)| u + v).collect();
            let hm = norm(&x1, w.get(&p("pre_feedforward_layernorm")), s.eps);
            let gate = matvec(w.get(&p("mlp.gate_proj")), &hm);
            let up = matvec(w.get(&p("mlp.up_proj")), &hm);
            let inner: Vec<f64> = gate
                .iter()
                .zip(&up)
                .map(|(g, u)| gelu_tanh(*g) * u)
                .collect();
            let m = matvec(w.get(&p("mlp.down_proj")), &inner);
            let m = norm(&m, w.get(&p("post_feedforward_layernorm")), s.eps);
            x[t] = x1.iter().zip(&m).map(|(u, v)| u + v).collect();
        }
    }
    x.iter()
        .map(|xt| matvec(embed, &norm(xt, w.get("model.norm.weight"), s.eps)))
        .collect()
}

/// The reference's [`Generated`] for the tokens another model generated after
/// `prompt`: its logits before each of them (teacher forcing) and its own greedy
/// token from each, to compare with `reference::compare`.
pub fn follow(s: &Spec, w: &Weights, got: &Generated) -> Generated {
    let mut seq = got.prompt.clone();
    seq.extend(&got.tokens[..got.tokens.len().saturating_sub(1)]);
    let all = logits(s, w, &seq);
    let logits: Vec<Vec<f32>> = all[got.prompt.len() - 1..]
        .iter()
        .map(|row| row.iter().map(|&v| v as f32).collect())
        .collect();
    Generated {
        request: got.request,
        prompt: got.prompt.clone(),
        tokens: logits.iter().map(|row| argmax(row)).collect(),
        logits,
    }
}

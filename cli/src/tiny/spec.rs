//! Speculative decoding in `pagedkv run --spec K`: a toy draft model (the run's model
//! with every weight perturbed), greedy drafts of up to `K` tokens a step, and the
//! greedy acceptance rule.
//!
//! The draft runs on the CPU in f32 with a dense cache of its own per sequence (the
//! tokens it has seen and their K/V per layer), which catches up with the
//! sequence's history before it drafts and is cut back to what the target accepted:
//! its state after a step is exactly what the accepted tokens give. The target (the
//! run's model on the paged cache) verifies each verify row's token and drafts in one
//! pass through the prefill kernels; greedy acceptance keeps the drafts while each
//! equals the target's greedy token at the position before it, then the target's own
//! token (a correction, or a bonus when every draft held).

use std::collections::HashMap;

use pagedkv::host::ops::attention::AttentionOptions;
use pagedkv::host::reference::{DenseInputs, dense_decode_attention};
use pagedkv::host::scheduler::SeqId;
use rand::SeedableRng;
use rand::rngs::SmallRng;

use super::RunConfig;
use super::model::{Layer, Model, finish_layer, matmul, random};

/// The most draft tokens a step of `pagedkv run --spec` verifies per sequence.
pub const MAX_SPEC: u32 = 16;

/// How far the draft's weights are from the target's: each is `w + PERTURBATION * u`,
/// `u` uniform in `[-1, 1]` times the weight's scale.
pub const PERTURBATION: f32 = 0.15;

/// The draft model: the target's weights, perturbed.
pub(super) struct Draft {
    model: Model,
    /// Per sequence: the tokens the draft has seen and their K and V per layer.
    seqs: HashMap<SeqId, DraftSeq>,
}

#[derive(Default)]
struct DraftSeq {
    tokens: Vec<u32>,
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
}

impl Draft {
    /// The draft of `target` (perturbed with a generator seeded from the run's seed).
    pub(super) fn new(target: &Model, cfg: &RunConfig) -> Self {
        let mut r = SmallRng::seed_from_u64(cfg.seed ^ 0xd4af);
        let hidden = target.hidden;
        let scale = 1.0 / (hidden as f32).sqrt();
        let mut perturb = |w: &[f32], s: f32| -> Vec<f32> {
            let u = random(&mut r, w.len(), PERTURBATION * s);
            w.iter().zip(u).map(|(a, b)| a + b).collect()
        };
        let layers = target
            .layers
            .iter()
            .map(|l| Layer {
                wq: perturb(&l.wq, scale),
                wk: perturb(&l.wk, scale),
                wv: perturb(&l.wv, scale),
                wo: perturb(&l.wo, scale),
            })
            .collect();
        let unembed = perturb(&target.unembed, 1.0);
        Draft {
            model: Model {
                embed: target.embed.clone(),
                unembed,
                layers,
                hidden,
                rng: SmallRng::seed_from_u64(0),
            },
            seqs: HashMap::new(),
        }
    }

    /// Up to `k` greedy drafts after `history` (the sequence's tokens, the last one
    /// not yet computed by the target): the draft's cache is cut back to its longest
    /// prefix of `history`, catches up, then drafts.
    pub(super) fn propose(
        &mut self,
        cfg: &RunConfig,
        opts: &AttentionOptions,
        seq: SeqId,
        history: &[u32],
        k: usize,
    ) -> Vec<u32> {
        let layers = self.model.layers.len();
        let st = self.seqs.entry(seq).or_insert_with(|| DraftSeq {
            tokens: Vec::new(),
            k: vec![Vec::new(); layers],
            v: vec![Vec::new(); layers],
        });
        let keep = st
            .tokens
            .iter()
            .zip(history)
            .take_while(|(a, b)| a == b)
            .count();
        let kv = (cfg.num_kv_heads * cfg.head_dim) as usize;
        st.tokens.truncate(keep);
        for (kl, vl) in st.k.iter_mut().zip(&mut st.v) {
            kl.truncate(keep * kv);
            vl.truncate(keep * kv);
        }
        let mut h = Vec::new();
        for &t in &history[keep..] {
            h = forward(&self.model, cfg, opts, st, t);
        }
        let mut drafts = Vec::with_capacity(k);
        for i in 0..k {
            let d = self.model.greedy(&h, cfg.vocab);
            drafts.push(d);
            if i + 1 < k {
                h = forward(&self.model, cfg, opts, st, d);
            }
        }
        drafts
    }

    /// Forgets a finished sequence.
    pub(super) fn forget(&mut self, seq: SeqId) {
        self.seqs.remove(&seq);
    }
}

/// One token through the draft: its K and V join the sequence's cache; returns its
/// hidden state after the last layer.
fn forward(
    m: &Model,
    cfg: &RunConfig,
    opts: &AttentionOptions,
    st: &mut DraftSeq,
    tok: u32,
) -> Vec<f32> {
    let hidden = m.hidden;
    let (qh, kvh, d) = (
        cfg.num_q_heads as usize,
        cfg.num_kv_heads as usize,
        cfg.head_dim as usize,
    );
    let mut x = Vec::with_capacity(hidden);
    m.embed(std::iter::once(tok), &mut x);
    for (li, layer) in m.layers.iter().enumerate() {
        let q = matmul(&x, &layer.wq, hidden, hidden);
        st.k[li].extend(matmul(&x, &layer.wk, hidden, kvh * d));
        st.v[li].extend(matmul(&x, &layer.wv, hidden, kvh * d));
        let f64s = |v: &[f32]| v.iter().map(|&a| a as f64).collect::<Vec<_>>();
        let attn = dense_decode_attention(&DenseInputs {
            q: &f64s(&q),
            k: &f64s(&st.k[li]),
            v: &f64s(&st.v[li]),
            num_q_heads: qh,
            num_kv_heads: kvh,
            head_dim: d,
            opts,
            sinks: None,
        });
        let attn: Vec<f32> = attn.iter().map(|&a| a as f32).collect();
        finish_layer(&mut x, &attn, &layer.wo, hidden);
    }
    st.tokens.push(tok);
    x
}

/// Greedy acceptance: `greedy[i]` is the target's greedy token after position
/// `start + i` of a verify row (its token and `drafts`); the drafts are kept while
/// each equals the target's token before it, then the target's token there. Returns
/// the tokens the row keeps (the accepted drafts, then one of the target's).
pub(super) fn accept(drafts: &[u32], greedy: &[u32]) -> Vec<u32> {
    let j = drafts
        .iter()
        .zip(greedy)
        .take_while(|(d, g)| d == g)
        .count();
    let mut out = drafts[..j].to_vec();
    out.push(greedy[j]);
    out
}

#[cfg(test)]
mod tests {
    use super::accept;

    #[test]
    fn acceptance_keeps_the_matching_prefix_then_the_targets_token() {
        assert_eq!(accept(&[5, 6, 7], &[5, 6, 7, 8]), vec![5, 6, 7, 8]);
        assert_eq!(accept(&[5, 9, 7], &[5, 6, 7, 8]), vec![5, 6]);
        assert_eq!(accept(&[1, 2], &[3, 2, 4]), vec![3]);
        assert_eq!(accept(&[], &[4]), vec![4]);
    }
}

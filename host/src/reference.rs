//! CPU references: the ground truth the kernels are tested against.
//!
//! Deliberately straightforward code that accumulates in `f64`:
//! * [`dense_decode_attention`]: one sequence's decode attention over contiguous K/V;
//! * [`paged_decode_attention`]: the same for a batch, walking each sequence's block
//!   table token by token to find every K and V row in the paged cache;
//! * [`paged_prefill_attention`]: many query tokens per sequence, causal;
//! * [`dense_decode_lse`], [`paged_decode_lse`], [`paged_prefill_lse`]: the
//!   log-sum-exp (base 2) of those softmaxes, as the kernels write it;
//! * [`merge_states`]: partial outputs and their log-sum-exp merged into one;
//! * [`gather`]: a sequence's K/V rows copied out of the paged cache, contiguous, so
//!   the paged reference can be checked against the dense one;
//! * [`kv_append`]: write tokens into their slots.
//!
//! Inputs are read through [`HostTensor::get`], so 16-bit inputs are the exact values the
//! kernels see; only the kernels' own arithmetic (f32, fast exp2) and output rounding
//! separate their results from these.

use crate::ops::attention::{AttentionOptions, DecodeInputs, DecodeShape};
use crate::ops::scales::KvScales;
use crate::tensor::HostTensor;
use pagedkv_kernels::PagedLayout;

/// The inputs of [`dense_decode_attention`]: one query token over `ctx` contiguous
/// tokens, by name.
#[derive(Clone, Copy, Debug)]
pub struct DenseInputs<'a> {
    /// `[num_q_heads, head_dim]`.
    pub q: &'a [f64],
    /// `[ctx, num_kv_heads, head_dim]`.
    pub k: &'a [f64],
    /// `[ctx, num_kv_heads, head_dim]`.
    pub v: &'a [f64],
    /// Query heads (a multiple of `num_kv_heads`).
    pub num_q_heads: usize,
    /// KV heads.
    pub num_kv_heads: usize,
    /// Elements per head vector.
    pub head_dim: usize,
    /// Scale, window, soft-cap, ALiBi.
    pub opts: &'a AttentionOptions,
    /// `[num_q_heads]`: attention-sink logits, or `None` (see
    /// [`DecodeInputs::sinks`]).
    pub sinks: Option<&'a [f32]>,
}

/// Decode attention of one query token over `ctx` contiguous tokens.
///
/// * Query head `h` attends with KV head `h / (num_q_heads / num_kv_heads)`.
/// * With a sink `σ_h`, `exp(σ_h)` joins head `h`'s softmax denominator.
/// * Returns `[num_q_heads, head_dim]`.
pub fn dense_decode_attention(inputs: &DenseInputs<'_>) -> Vec<f64> {
    dense(inputs).0
}

/// The log-sum-exp of [`dense_decode_attention`]'s softmax per query head, in base 2
/// as the kernels write it: `log2(Σ_t exp(x_t) + exp(σ_h))` over the attended tokens'
/// scores `x_t` (natural units) and the sink, if any; `-inf` over nothing. Returns
/// `[num_q_heads]`.
pub fn dense_decode_lse(inputs: &DenseInputs<'_>) -> Vec<f64> {
    dense(inputs).1
}

/// The output and the log-sum-exp (base 2) of one query token's attention.
fn dense(inputs: &DenseInputs<'_>) -> (Vec<f64>, Vec<f64>) {
    let &DenseInputs {
        q,
        k,
        v,
        num_q_heads,
        num_kv_heads,
        head_dim,
        opts,
        sinks,
    } = inputs;
    let ctx = k.len() / (num_kv_heads * head_dim);
    let group = num_q_heads / num_kv_heads;
    let first = match opts.window {
        Some(w) if (w as usize) < ctx => ctx - w as usize,
        _ => 0,
    };
    let mut out = vec![0.0; num_q_heads * head_dim];
    let mut lse = vec![f64::NEG_INFINITY; num_q_heads];
    for h in 0..num_q_heads {
        let kvh = h / group;
        let row = |t: usize| (t * num_kv_heads + kvh) * head_dim;
        let scores: Vec<f64> = (first..ctx)
            .map(|t| {
                let dot: f64 = (0..head_dim)
                    .map(|d| q[h * head_dim + d] * k[row(t) + d])
                    .sum();
                let mut s = dot * opts.scale as f64;
                if let Some(cap) = opts.softcap {
                    s = cap as f64 * (s / cap as f64).tanh();
                }
                if let Some(slopes) = &opts.alibi_slopes {
                    s += slopes[h] as f64 * (t as f64 - (ctx - 1) as f64);
                }
                s
            })
            .collect();
        let sink = sinks.map(|s| s[h] as f64);
        let m = scores
            .iter()
            .cloned()
            .chain(sink)
            .fold(f64::NEG_INFINITY, f64::max);
        if m == f64::NEG_INFINITY {
            continue; // no scores: output 0, log-sum-exp -inf
        }
        let w: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
        let sum: f64 = w.iter().sum::<f64>() + sink.map_or(0.0, |s| (s - m).exp());
        lse[h] = (m + sum.ln()) * std::f64::consts::LOG2_E;
        for (i, t) in (first..ctx).enumerate() {
            for d in 0..head_dim {
                out[h * head_dim + d] += w[i] / sum * v[row(t) + d];
            }
        }
    }
    (out, lse)
}

/// The merge of attention states: `num_states` partial outputs of each row (`v`,
/// `[num_rows, num_states, num_heads, head_dim]`, each normalised over its own keys)
/// and their log-sum-exp (`lse`, `[num_rows, num_states, num_heads]`, base 2; `-inf`
/// for a part of no keys, whose `v` is ignored), merged into the output over all the
/// parts' keys, with the sink `sinks[h]` (natural units) joining each head's
/// denominator once. A NaN or `+inf` part makes its head's output and log-sum-exp NaN. Returns `([num_rows, num_heads, head_dim], [num_rows,
/// num_heads])`: the outputs and their log-sum-exp.
pub fn merge_states(
    v: &[f64],
    lse: &[f64],
    (num_states, num_heads, head_dim): (usize, usize, usize),
    sinks: Option<&[f32]>,
) -> (Vec<f64>, Vec<f64>) {
    let rows = lse.len() / (num_states * num_heads).max(1);
    let mut out = vec![0.0; rows * num_heads * head_dim];
    let mut lse_out = vec![f64::NEG_INFINITY; rows * num_heads];
    for r in 0..rows {
        for h in 0..num_heads {
            let at = |i: usize| (r * num_states + i) * num_heads + h;
            let sink = sinks.map(|s| s[h] as f64 * std::f64::consts::LOG2_E);
            let m = (0..num_states)
                .map(|i| lse[at(i)])
                .chain(sink)
                .fold(f64::NEG_INFINITY, f64::max);
            // A NaN or +inf log-sum-exp poisons the head (f64::max would skip a NaN).
            if (0..num_states).any(|i| lse[at(i)].is_nan() || lse[at(i)] == f64::INFINITY) {
                lse_out[r * num_heads + h] = f64::NAN;
                let o = (r * num_heads + h) * head_dim;
                out[o..o + head_dim].fill(f64::NAN);
                continue;
            }
            if m == f64::NEG_INFINITY {
                continue;
            }
            let w: Vec<f64> = (0..num_states).map(|i| (lse[at(i)] - m).exp2()).collect();
            let sum = w.iter().sum::<f64>() + sink.map_or(0.0, |s| (s - m).exp2());
            lse_out[r * num_heads + h] = m + sum.log2();
            for (i, &wi) in w.iter().enumerate() {
                if wi == 0.0 {
                    continue;
                }
                for d in 0..head_dim {
                    out[(r * num_heads + h) * head_dim + d] += wi / sum * v[at(i) * head_dim + d];
                }
            }
        }
    }
    (out, lse_out)
}

/// Physical block of token `t` of sequence `seq`.
fn block_of(block_tables: &[i32], shape: &DecodeShape, seq: usize, t: usize) -> u32 {
    block_tables[seq * shape.max_blocks_per_seq as usize + t / shape.block_size as usize] as u32
}

/// Sequence `seq`'s K and V rows gathered from the paged cache: `[ctx, num_kv_heads,
/// head_dim]` each, token by token through the block table (the stored values: an
/// fp8 cache's are before its scales).
pub fn gather(
    shape: &DecodeShape,
    key_cache: &HostTensor,
    value_cache: &HostTensor,
    block_tables: &[i32],
    ctx: usize,
    seq: usize,
) -> (Vec<f64>, Vec<f64>) {
    gather_from(
        shape,
        (key_cache, value_cache),
        None,
        block_tables,
        seq,
        (0, ctx),
    )
}

/// As [`gather`], for tokens `first..ctx` only; rows before `first` are zero (their
/// blocks may have been freed by a sliding window and are never read). With `scales`
/// (an fp8 cache) each value is the stored one times its KV head's scale: the values
/// the kernels compute with.
fn gather_from(
    shape: &DecodeShape,
    (key_cache, value_cache): (&HostTensor, &HostTensor),
    scales: Option<&KvScales>,
    block_tables: &[i32],
    seq: usize,
    (first, ctx): (usize, usize),
) -> (Vec<f64>, Vec<f64>) {
    let l = shape.layout();
    let (kvh, d) = (shape.num_kv_heads as usize, shape.head_dim as usize);
    let mut k = vec![0.0; ctx * kvh * d];
    let mut v = vec![0.0; ctx * kvh * d];
    for t in first..ctx {
        let phys = block_of(block_tables, shape, seq, t);
        for h in 0..kvh {
            let src = l.offset(phys, h as u32, t as u32 % shape.block_size) as usize;
            let (ks, vs) = scales.map_or((1.0, 1.0), |s| (s.k[h] as f64, s.v[h] as f64));
            for e in 0..d {
                k[(t * kvh + h) * d + e] = key_cache.get(src + e) * ks;
                v[(t * kvh + h) * d + e] = value_cache.get(src + e) * vs;
            }
        }
    }
    (k, v)
}

/// Decode attention for a batch over the paged cache: for every sequence, walk its
/// block table token by token (only the tokens its window attends to), then compute as
/// [`dense_decode_attention`]. Returns `[num_seqs, num_q_heads, head_dim]`.
pub fn paged_decode_attention(inputs: &DecodeInputs<'_, HostTensor>) -> Vec<f64> {
    paged_decode(inputs).0
}

/// The log-sum-exp (base 2) of [`paged_decode_attention`]'s softmax, as
/// [`dense_decode_lse`]: `[num_seqs, num_q_heads]`.
pub fn paged_decode_lse(inputs: &DecodeInputs<'_, HostTensor>) -> Vec<f64> {
    paged_decode(inputs).1
}

fn paged_decode(inputs: &DecodeInputs<'_, HostTensor>) -> (Vec<f64>, Vec<f64>) {
    let &DecodeInputs {
        shape,
        opts,
        q,
        key_cache,
        value_cache,
        block_tables,
        context_lens,
        kv_scales,
        sinks,
        plan: _,
    } = inputs;
    let (qh, kvh, d) = (
        shape.num_q_heads as usize,
        shape.num_kv_heads as usize,
        shape.head_dim as usize,
    );
    let mut out = Vec::with_capacity(shape.num_seqs as usize * qh * d);
    let mut lse = Vec::with_capacity(shape.num_seqs as usize * qh);
    for (seq, &len) in context_lens
        .iter()
        .enumerate()
        .take(shape.num_seqs as usize)
    {
        let ctx = len as usize;
        let first = match opts.window {
            Some(w) if (w as usize) < ctx => ctx - w as usize,
            _ => 0,
        };
        let (k, v) = gather_from(
            shape,
            (key_cache, value_cache),
            kv_scales,
            block_tables,
            seq,
            (first, ctx),
        );
        let qs: Vec<f64> = (0..qh * d).map(|i| q.get(seq * qh * d + i)).collect();
        let (o, l) = dense(&DenseInputs {
            q: &qs,
            k: &k,
            v: &v,
            num_q_heads: qh,
            num_kv_heads: kvh,
            head_dim: d,
            opts,
            sinks,
        });
        out.extend(o);
        lse.extend(l);
    }
    (out, lse)
}

/// Writes token `i`'s K and V rows (`(key, value)`, `[num_tokens, num_kv_heads,
/// head_dim]` each) into slot `slot_mapping[i]` of `(key_cache, value_cache)`; negative
/// slots are skipped. With `scales` (an fp8 cache) each element is stored as `x /
/// scale` of its KV head, the division in `f32` as the kernel does it.
pub fn kv_append(
    layout: &PagedLayout,
    (key, value): (&HostTensor, &HostTensor),
    slot_mapping: &[i64],
    (key_cache, value_cache): (&mut HostTensor, &mut HostTensor),
    scales: Option<&KvScales>,
) {
    let (kvh, d) = (layout.num_kv_heads as usize, layout.head_dim as usize);
    let scaled = |x: f64, s: Option<&Vec<f32>>, h: usize| match s {
        Some(s) => ((x as f32) / s[h]) as f64,
        None => x,
    };
    for (i, &slot) in slot_mapping.iter().enumerate() {
        if slot < 0 {
            continue;
        }
        for h in 0..kvh {
            let dst = layout.slot_offset(slot as u64, h as u32) as usize;
            for e in 0..d {
                let src = (i * kvh + h) * d + e;
                key_cache.set(dst + e, scaled(key.get(src), scales.map(|s| &s.k), h));
                value_cache.set(dst + e, scaled(value.get(src), scales.map(|s| &s.v), h));
            }
        }
    }
}

/// Prefill attention for a batch over the paged cache: for every sequence `s` and each
/// of its new tokens `i` (at position `context_lens[s] - qo_len + i`), dense attention
/// over the positions up to its own, as [`dense_decode_attention`] computes for a
/// context that ends there. Returns `[qo_indptr[num_seqs], num_q_heads, head_dim]`.
pub fn paged_prefill_attention(
    inputs: &crate::ops::prefill::PrefillInputs<'_, HostTensor>,
) -> Vec<f64> {
    paged_prefill(inputs).0
}

/// The log-sum-exp (base 2) of [`paged_prefill_attention`]'s softmax, as
/// [`dense_decode_lse`]: `[qo_indptr[num_seqs], num_q_heads]`.
pub fn paged_prefill_lse(inputs: &crate::ops::prefill::PrefillInputs<'_, HostTensor>) -> Vec<f64> {
    paged_prefill(inputs).1
}

fn paged_prefill(
    inputs: &crate::ops::prefill::PrefillInputs<'_, HostTensor>,
) -> (Vec<f64>, Vec<f64>) {
    let sh = inputs.shape;
    let (qh, kvh, d) = (
        sh.num_q_heads as usize,
        sh.num_kv_heads as usize,
        sh.head_dim as usize,
    );
    let row = qh * d;
    let mut out = Vec::new();
    let mut lse = Vec::new();
    for s in 0..sh.num_seqs as usize {
        let (q0, q1) = (
            inputs.qo_indptr[s] as usize,
            inputs.qo_indptr[s + 1] as usize,
        );
        let ctx = inputs.context_lens[s] as usize;
        let first = match inputs.opts.window {
            Some(w) if ctx - (q1 - q0) + 1 > w as usize => ctx - (q1 - q0) + 1 - w as usize,
            _ => 0,
        };
        let (k, v) = gather_from(
            sh,
            (inputs.key_cache, inputs.value_cache),
            inputs.kv_scales,
            inputs.block_tables,
            s,
            (first, ctx),
        );
        let span0 = ctx - (q1 - q0);
        for (i, tok) in (q0..q1).enumerate() {
            let end = (span0 + i + 1) * kvh * d;
            let q: Vec<f64> = (0..row).map(|e| inputs.q.get(tok * row + e)).collect();
            // A tree mask keeps the cached positions and the new tokens whose bit
            // (their distance back) is set, or 64 or more back.
            let (k, v) = match inputs.tree_mask {
                None => (k[..end].to_vec(), v[..end].to_vec()),
                Some(m) => {
                    let pos = |j: usize| j / (kvh * d);
                    let keep = |j: usize| {
                        let p = pos(j);
                        let dist = span0 + i - p;
                        p < span0 || dist >= 64 || (m[tok] >> dist) & 1 != 0
                    };
                    let pick = |x: &[f64]| -> Vec<f64> {
                        (0..end).filter(|&j| keep(j)).map(|j| x[j]).collect()
                    };
                    (pick(&k), pick(&v))
                }
            };
            let (o, l) = dense(&DenseInputs {
                q: &q,
                k: &k,
                v: &v,
                num_q_heads: qh,
                num_kv_heads: kvh,
                head_dim: d,
                opts: inputs.opts,
                sinks: inputs.sinks,
            });
            out.extend(o);
            lse.extend(l);
        }
    }
    (out, lse)
}

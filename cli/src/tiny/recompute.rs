//! The run without a KV cache: every step recomputes every token of every scheduled
//! sequence through every layer (K and V of the whole history, the O(n²) way) and
//! attends over all of it with the prefill kernel. The paged cache is only scratch space
//! here: each step rewrites the positions it reads.

use pagedkv::host::HostTensor;
use pagedkv::host::backend::{AsView, AttentionBackend, KvAppendArgs, PagedCache, PrefillArgs};
use pagedkv::host::scheduler::Batch;

use super::driver::{StepCtx, to_host};
use super::model::{finish_layer, matmul};

/// `batch` with every sequence's whole history as its new tokens: one prefill from
/// position 0, every position's slot in its block table. A slot two sequences share
/// (a prefix-cache block) is written once: both compute the same K/V for it.
fn whole_history(batch: &Batch) -> Batch {
    let block_size = batch.block_size;
    let mut full = batch.clone();
    let w = batch.max_blocks_per_seq as usize;
    full.slot_mapping.clear();
    full.num_decodes = 0; // every row prefills
    let mut written = std::collections::HashSet::new();
    let mut offset = 0;
    for (i, s) in full.seqs.iter_mut().enumerate() {
        s.is_prefill = true;
        s.start_pos = 0;
        s.num_new_tokens = s.context_len;
        s.token_offset = offset;
        offset += s.context_len;
        let row = &batch.block_tables[i * w..(i + 1) * w];
        full.slot_mapping.extend((0..s.context_len).map(|p| {
            let slot =
                row[(p / block_size) as usize] as i64 * block_size as i64 + (p % block_size) as i64;
            if written.insert(slot) { slot } else { -1 }
        }));
    }
    full
}

/// One step without a cache; returns the hidden states of the step's new tokens
/// (`[slot_mapping.len(), hidden]`, row by row).
pub(super) fn step<B: AttentionBackend>(
    be: &mut B,
    cache: &mut PagedCache<B::Tensor>,
    batch: &Batch,
    c: StepCtx<'_>,
) -> Result<(Vec<f32>, u64), Box<dyn std::error::Error>> {
    let cfg = c.cfg;
    let (qh, kvh, d) = (
        cfg.num_q_heads as usize,
        cfg.num_kv_heads as usize,
        cfg.head_dim as usize,
    );
    let hidden = c.model.hidden;
    let full = whole_history(batch);
    be.begin_step(&full, cache)?;
    let n = full.slot_mapping.len();
    let mut x = Vec::with_capacity(n * hidden);
    for q in &full.seqs {
        let toks = c.sched.tokens(q.seq)?;
        c.model.embed(toks.range(0, q.context_len as usize), &mut x);
    }
    let w = batch.max_blocks_per_seq as usize;
    for (li, layer) in c.model.layers.iter().enumerate() {
        let q = matmul(&x, &layer.wq, hidden, hidden);
        let k = matmul(&x, &layer.wk, hidden, kvh * d);
        let v = matmul(&x, &layer.wv, hidden, kvh * d);
        let key = be.upload(&to_host(cfg.dtype, &[n, kvh, d], &k)?)?;
        let value = be.upload(&to_host(cfg.dtype, &[n, kvh, d], &v)?)?;
        let lc = &mut cache.layers[li];
        be.kv_append(KvAppendArgs {
            key: key.view(),
            value: value.view(),
            cache: lc,
            group: 0,
        })?;
        let qt = to_host(cfg.dtype, &[n, qh, d], &q)?;
        let qd = be.upload(&qt)?;
        let mut out = be.upload(&HostTensor::full(cfg.dtype, &[n, qh, d], f64::NAN))?;
        be.prefill(PrefillArgs {
            lse: None,
            opts: c.opts,
            q: qd.view(),
            cache: lc,
            sinks: None,
            out: out.view_mut(),
            group: 0,
        })?;
        let outv = be.download(&out)?.to_f64();
        if li == 0 {
            // The first sequence's last token against dense attention.
            let (kc, vc) = (be.download(&lc.key)?, be.download(&lc.value)?);
            let s = &full.seqs[0];
            let t = (s.context_len - 1) as usize;
            let qs: Vec<f64> = (0..hidden).map(|e| qt.get(t * hidden + e)).collect();
            let got = &outv[t * hidden..(t + 1) * hidden];
            let row = &batch.block_tables[..w];
            c.check.one(
                cfg,
                c.opts,
                (&kc, &vc),
                row,
                s.context_len as usize,
                &qs,
                got,
            );
        }
        let attn: Vec<f32> = outv.iter().map(|&a| a as f32).collect();
        finish_layer(&mut x, &attn, &layer.wo, hidden);
    }
    // The hidden states of the step's new tokens (each row's positions
    // `start_pos..context_len` of its whole history).
    let mut out = Vec::with_capacity(batch.slot_mapping.len() * hidden);
    for (q, f) in batch.seqs.iter().zip(&full.seqs) {
        for j in 0..q.num_new_tokens {
            let t = (f.token_offset + q.start_pos + j) as usize;
            out.extend_from_slice(&x[t * hidden..(t + 1) * hidden]);
        }
    }
    Ok((out, n as u64))
}

//! The cached run: each step computes only the new tokens; K/V of earlier tokens come
//! from the paged cache (`kv_append`, then decode and prefill attention through it).

use pagedkv::host::HostTensor;
use pagedkv::host::backend::{
    AsView, AttentionBackend, DecodeArgs, KvAppendArgs, PagedCache, PrefillArgs, decode_rows,
    prefill_rows,
};
use pagedkv::host::scheduler::Batch;

use super::driver::{StepCtx, to_host};
use super::model::{finish_layer, matmul};

/// One step of the cached run; returns the hidden states of the step's new tokens
/// (`[slot_mapping.len(), hidden]`, row by row: a verify row's are its last token's
/// and its drafts').
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
    be.begin_step(batch, cache)?;
    let n_new = batch.slot_mapping.len();
    // Hidden states of every new token, sequence by sequence.
    let mut x = Vec::with_capacity(n_new * hidden);
    for q in &batch.seqs {
        let toks = c.sched.tokens(q.seq)?;
        // A verify row: the token sampled last step, then its drafts.
        let end = (q.start_pos + q.num_new_tokens - q.num_draft_tokens) as usize;
        c.model.embed(toks.range(q.start_pos as usize, end), &mut x);
        if q.num_draft_tokens > 0 {
            let drafts = c.drafts.get(&q.seq).ok_or("a verify row without drafts")?;
            c.model.embed(drafts.iter().copied(), &mut x);
        }
    }
    let decode: Vec<usize> = decode_rows(batch).collect();
    let prefill: Vec<usize> = prefill_rows(batch).collect();
    let w = batch.max_blocks_per_seq as usize;
    for (li, layer) in c.model.layers.iter().enumerate() {
        let q = matmul(&x, &layer.wq, hidden, hidden);
        let k = matmul(&x, &layer.wk, hidden, kvh * d);
        let v = matmul(&x, &layer.wv, hidden, kvh * d);
        let key = be.upload(&to_host(cfg.dtype, &[n_new, kvh, d], &k)?)?;
        let value = be.upload(&to_host(cfg.dtype, &[n_new, kvh, d], &v)?)?;
        let lc = &mut cache.layers[li];
        be.kv_append(KvAppendArgs {
            key: key.view(),
            value: value.view(),
            cache: lc,
            group: 0,
        })?;
        let mut attn = vec![0.0f32; n_new * hidden];
        // Decoding sequences: the paged decode kernel over the cache.
        let mut qrows: Vec<f32> = Vec::with_capacity(decode.len() * hidden);
        for &i in &decode {
            let o = batch.seqs[i].token_offset as usize * hidden;
            qrows.extend_from_slice(&q[o..o + hidden]);
        }
        let qt = to_host(cfg.dtype, &[decode.len(), qh, d], &qrows)?;
        let mut outv = Vec::new();
        if !decode.is_empty() {
            let qd = be.upload(&qt)?;
            let nan = HostTensor::full(cfg.dtype, &[decode.len(), qh, d], f64::NAN);
            let mut out = be.upload(&nan)?;
            be.decode(DecodeArgs {
                lse: None,
                opts: c.opts,
                q: qd.view(),
                cache: lc,
                sinks: None,
                out: out.view_mut(),
                group: 0,
            })?;
            outv = be.download(&out)?.to_f64();
            for (j, &i) in decode.iter().enumerate() {
                let o = batch.seqs[i].token_offset as usize * hidden;
                for e in 0..hidden {
                    attn[o + e] = outv[j * hidden + e] as f32;
                }
            }
        }
        // Prefilling sequences: the paged prefill kernel, each new token over its
        // sequence's cache up to itself.
        let mut pq: Vec<f32> = Vec::new();
        let mut pout = Vec::new();
        if !prefill.is_empty() {
            for &i in &prefill {
                let sq = &batch.seqs[i];
                let o = sq.token_offset as usize * hidden;
                pq.extend_from_slice(&q[o..o + sq.num_new_tokens as usize * hidden]);
            }
            let n = pq.len() / hidden;
            let qd = be.upload(&to_host(cfg.dtype, &[n, qh, d], &pq)?)?;
            let nan = HostTensor::full(cfg.dtype, &[n, qh, d], f64::NAN);
            let mut out = be.upload(&nan)?;
            be.prefill(PrefillArgs {
                lse: None,
                opts: c.opts,
                q: qd.view(),
                cache: lc,
                sinks: None,
                out: out.view_mut(),
                group: 0,
            })?;
            pout = be.download(&out)?.to_f64();
            let mut j = 0;
            for &i in &prefill {
                let sq = &batch.seqs[i];
                let o = sq.token_offset as usize * hidden;
                let len = sq.num_new_tokens as usize * hidden;
                for e in 0..len {
                    attn[o + e] = pout[j + e] as f32;
                }
                j += len;
            }
        }
        if li == 0 {
            // Check a sample of layer 0's outputs against dense attention over the
            // gathered cache (the only copy of the cache to the host).
            let (kc, vc) = (be.download(&lc.key)?, be.download(&lc.value)?);
            for (j, &i) in decode.iter().enumerate().take(cfg.verify_per_step) {
                let qs: Vec<f64> = (0..hidden).map(|e| qt.get(j * hidden + e)).collect();
                let row = &batch.block_tables[i * w..(i + 1) * w];
                let got = &outv[j * hidden..(j + 1) * hidden];
                let upto = batch.context_lens[i] as usize;
                c.check.one(cfg, c.opts, (&kc, &vc), row, upto, &qs, got);
            }
            // The first and the last new token of the first prefilling sequence.
            if let Some(&i) = prefill.first() {
                let sq = &batch.seqs[i];
                let row = &batch.block_tables[i * w..(i + 1) * w];
                let n = sq.num_new_tokens as usize;
                for t in [0, n - 1] {
                    let (a, b) = (t * hidden, (t + 1) * hidden);
                    // The query as the kernel saw it (rounded to the dtype).
                    let qs = to_host(cfg.dtype, &[hidden], &pq[a..b])?.to_f64();
                    let upto = sq.start_pos as usize + t + 1;
                    c.check
                        .one(cfg, c.opts, (&kc, &vc), row, upto, &qs, &pout[a..b]);
                }
            }
        }
        finish_layer(&mut x, &attn, &layer.wo, hidden);
    }
    Ok((x, n_new as u64))
}

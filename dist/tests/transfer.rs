//! KV block transfer for disaggregated prefill, over the in-process transport: a
//! prefill instance computes a prompt and exports its full blocks; a decode instance
//! imports them and serves the request as a prefix hit, its decode outputs equal to
//! one instance that did everything, bit for bit. A dropped, late or corrupted
//! transfer, or one that fails an import check, makes the decode instance recompute
//! the prompt (same outputs), and registers nothing.

use std::time::Duration;

mod common;
use common::{MODEL, Rank, input_tokens, sampled_token, scheduler};

use pagedkv_dist::ShardSpec;
use pagedkv_dist::transfer::{
    BlockExport, Fault, InProcess, LayoutDescriptor, Outcome, RequestTokens, Transfer,
    TransferEndpoint, TransferError, encode_export, receive_and_import,
};
use pagedkv_host::scheduler::{Request, Scheduler};

const OUTPUT: u32 = 6;

/// Request `id`'s prompt: 3 full blocks and 5 tokens.
fn prompt(id: u64) -> Vec<u32> {
    (0..53).map(|p| (id as u32 * 101 + p * 17) % 1000).collect()
}

fn endpoint(rank: &Rank) -> TransferEndpoint {
    TransferEndpoint {
        descriptor: LayoutDescriptor::of(
            pagedkv_host::backend::AttentionBackend::config(&rank.be),
            ShardSpec::WHOLE,
            MODEL,
            Vec::new(),
        ),
    }
}

/// Serves request `id` to completion on `(s, rank)`: each step's outputs, and how many
/// prompt tokens its first step found cached.
fn serve(s: &mut Scheduler, rank: &mut Rank, id: u64) -> (Vec<Vec<f32>>, u32) {
    s.add_request(Request::new(id, prompt(id), OUTPUT)).unwrap();
    let mut outs = Vec::new();
    let mut cached = None;
    while !s.is_idle() {
        let batch = s.step().unwrap().clone();
        cached.get_or_insert(batch.seqs[0].num_cached_tokens);
        let tokens = input_tokens(s, &batch);
        outs.push(rank.step(&batch, &tokens));
        let sampled: Vec<(u64, u32)> = batch
            .seqs
            .iter()
            .map(|q| (q.seq, sampled_token(q.request, q.context_len)))
            .collect();
        s.on_step_done(&sampled).unwrap();
    }
    (outs, cached.unwrap())
}

/// The prefill instance: computes request `id`'s prompt (one step, the first token)
/// and exports its blocks.
fn prefill_and_export(id: u64) -> BlockExport {
    let (mut s, mut rank) = (scheduler(), Rank::new(ShardSpec::WHOLE));
    s.add_request(Request::new(id, prompt(id), 1)).unwrap();
    let batch = s.step().unwrap().clone();
    let tokens = input_tokens(&s, &batch);
    rank.step(&batch, &tokens);
    // (Its blocks stay cached after the request finishes.)
    s.on_step_done(&[(batch.seqs[0].seq, 1)]).unwrap();
    let p = prompt(id);
    let req = RequestTokens {
        request: id,
        tokens: &p,
        salt: None,
    };
    let ep = endpoint(&rank);
    let e = ep.export(&s, &mut rank.be, &rank.cache, req).unwrap();
    assert_eq!(e.blocks.len(), 3, "3 full blocks of 53 tokens");
    e
}

/// A fresh decode instance waits at most `timeout` for request `id`'s export on `t`
/// and imports it: the instance and the outcome.
fn decode_side(t: &mut InProcess, id: u64, timeout: Duration) -> (Scheduler, Rank, Outcome) {
    let (mut s, mut rank) = (scheduler(), Rank::new(ShardSpec::WHOLE));
    let out = receive(t, id, timeout, &mut s, &mut rank);
    (s, rank, out)
}

/// `(s, rank)` waits at most `timeout` for request `id`'s export on `t` and imports it.
fn receive(
    t: &mut InProcess,
    id: u64,
    timeout: Duration,
    s: &mut Scheduler,
    rank: &mut Rank,
) -> Outcome {
    let p = prompt(id);
    let req = RequestTokens {
        request: id,
        tokens: &p,
        salt: None,
    };
    let ep = endpoint(rank);
    receive_and_import(&ep, t, timeout, (s, &mut rank.be, &mut rank.cache), req)
}

/// Decode outputs of the steps after the first (the first computes the prompt, all of
/// it or the part not imported).
fn decodes(outs: &[Vec<f32>]) -> &[Vec<f32>] {
    &outs[1..]
}

fn same(a: &[Vec<f32>], b: &[Vec<f32>]) -> bool {
    a.len() == b.len()
        && a.iter().zip(b).all(|(x, y)| {
            x.len() == y.len() && x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits())
        })
}

#[test]
fn imported_blocks_are_prefix_hits_and_decode_as_in_one_instance() {
    let (want, cached) = serve(&mut scheduler(), &mut Rank::new(ShardSpec::WHOLE), 1);
    assert_eq!(cached, 0);

    let mut t = InProcess::default();
    t.send(encode_export(prefill_and_export(1)).unwrap())
        .unwrap();
    let (mut s, mut rank, out) = decode_side(&mut t, 1, Duration::from_secs(5));
    assert_eq!(out, Outcome::Imported { blocks: 3 });
    let (got, cached) = serve(&mut s, &mut rank, 1);
    assert_eq!(cached, 48, "the imported blocks are prefix hits");
    assert!(same(decodes(&got), decodes(&want)), "decode outputs differ");
}

/// Each fault: the decode instance says why, recomputes the prompt (no hit) and
/// decodes as one instance does; a late export is dropped when it turns up.
#[test]
fn dropped_late_and_corrupted_transfers_are_recomputed() {
    let (want, _) = serve(&mut scheduler(), &mut Rank::new(ShardSpec::WHOLE), 1);
    for (fault, reason) in [
        (Fault::Drop, "no export of request 1"),
        (Fault::Late, "no export of request 1"),
        (Fault::Corrupt, "checksum"),
    ] {
        let mut t = InProcess::default();
        t.faults.push_back(fault);
        t.send(encode_export(prefill_and_export(1)).unwrap())
            .unwrap();
        let (mut s, mut rank, out) = decode_side(&mut t, 1, Duration::from_millis(50));
        match &out {
            Outcome::Recomputed { reason: r } => assert!(r.contains(reason), "{fault:?}: {r}"),
            o => panic!("{fault:?}: {o:?}"),
        }
        assert!(
            out.to_string()
                .starts_with("KV transfer not used, recomputing the prompt")
        );
        let (got, cached) = serve(&mut s, &mut rank, 1);
        assert_eq!(cached, 0, "{fault:?}: nothing was registered");
        assert!(same(&got, &want), "{fault:?}: outputs differ");
        if fault == Fault::Late {
            // The late export turns up before the next request's, and is dropped.
            t.send(encode_export(prefill_and_export(2)).unwrap())
                .unwrap();
            let out = receive(&mut t, 2, Duration::from_secs(5), &mut s, &mut rank);
            assert_eq!(out, Outcome::Imported { blocks: 3 });
        }
    }
}

/// An export that fails a check is refused, naming what failed, and nothing is
/// registered or held: another model, other fp8 scales, bytes that fail their
/// checksum, another request's tokens, names under another salt.
#[test]
fn an_import_that_fails_a_check_registers_nothing() {
    let good = prefill_and_export(1);
    let p = prompt(1);
    let mut cases: Vec<(BlockExport, RequestTokens<'_>, &str)> = Vec::new();
    let req = RequestTokens {
        request: 1,
        tokens: &p,
        salt: None,
    };
    let mut e = good.clone();
    e.descriptor.model = "another model".into();
    cases.push((e, req, "model"));
    let mut e = good.clone();
    e.descriptor.kv_scales = vec![1.0; 4];
    cases.push((e, req, "kv_scales"));
    let mut e = good.clone();
    e.blocks[1].data[7] ^= 1;
    cases.push((e, req, "checksum"));
    let mut e = good.clone();
    e.blocks[2].tokens[0] += 1;
    cases.push((e, req, "other tokens"));
    let salted = RequestTokens {
        salt: Some(9),
        ..req
    };
    cases.push((good.clone(), salted, "salt"));
    let mut e = good.clone();
    e.request = 5;
    cases.push((e, req, "request 5"));
    for (export, req, want) in cases {
        let (mut s, mut rank) = (scheduler(), Rank::new(ShardSpec::WHOLE));
        let free = s.kv().device().num_free();
        let ep = endpoint(&rank);
        let err: TransferError = ep
            .import(&mut s, &mut rank.be, &mut rank.cache, req, &export)
            .unwrap_err();
        assert!(err.to_string().contains(want), "{want}: {err}");
        assert_eq!(s.kv().device().num_free(), free, "{want}: blocks held");
        let names = s.block_names(req.tokens, req.salt);
        assert!(s.cached_blocks(&names).is_empty(), "{want}: registered");
    }
    // And the good one imports.
    let (mut s, mut rank) = (scheduler(), Rank::new(ShardSpec::WHOLE));
    let ep = endpoint(&rank);
    assert_eq!(
        ep.import(&mut s, &mut rank.be, &mut rank.cache, req, &good)
            .unwrap(),
        3
    );
}

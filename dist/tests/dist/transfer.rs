//! KV block transfer for disaggregated prefill, over the in-process transport: a
//! prefill instance computes a prompt and exports its full blocks; a decode instance
//! imports them and serves the request as a prefix hit, its decode outputs equal to
//! one instance that did everything, bit for bit. A dropped, late or corrupted
//! transfer, or one that fails an import check, makes the decode instance recompute
//! the prompt (same outputs), and registers nothing.

use std::time::{Duration, Instant};

use crate::common::disagg::{
    at, decodes, endpoint, prefill_and_export, prompt, receive, same, serve,
};
use crate::common::{Rank, scheduler};

use pagedkv_dist::ShardSpec;
use pagedkv_dist::transfer::{
    BlockExport, Fault, InProcess, Instance, Outcome, RequestTokens, Transfer, TransferError,
    encode_export,
};
use pagedkv_host::scheduler::Scheduler;

/// A fresh decode instance waits at most `timeout` for request `id`'s export on `t`
/// and imports it: the instance and the outcome.
fn decode_side(t: &mut InProcess, id: u64, timeout: Duration) -> (Scheduler, Rank, Outcome) {
    let (mut s, mut rank) = (scheduler(), Rank::new(ShardSpec::WHOLE));
    let out = receive(t, id, timeout, &mut s, &mut rank);
    (s, rank, out)
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
        let err: TransferError = ep.import(at(&mut s, &mut rank), req, &export).unwrap_err();
        assert!(err.to_string().contains(want), "{want}: {err}");
        assert_eq!(s.kv().device().num_free(), free, "{want}: blocks held");
        let names = s.block_names(req.tokens, req.salt);
        assert!(
            s.cached_blocks(&names).unwrap().is_empty(),
            "{want}: registered"
        );
    }
    // And the good one imports.
    let (mut s, mut rank) = (scheduler(), Rank::new(ShardSpec::WHOLE));
    let ep = endpoint(&rank);
    assert_eq!(ep.import(at(&mut s, &mut rank), req, &good).unwrap(), 3);
}

/// A write that fails after the blocks are reserved (here: a cache of another shape
/// than the backend's) aborts the reservation: nothing named, nothing held.
#[test]
fn a_failed_write_aborts_the_reservation() {
    let good = prefill_and_export(1);
    let p = prompt(1);
    let req = RequestTokens {
        request: 1,
        tokens: &p,
        salt: None,
    };
    let (mut s, mut rank) = (scheduler(), Rank::new(ShardSpec::WHOLE));
    let mut half = Rank::new(ShardSpec::new(0, 2).unwrap());
    let free = s.kv().device().num_free();
    let ep = endpoint(&rank);
    let wrong = Instance {
        sched: &mut s,
        be: &mut rank.be,
        cache: &mut half.cache,
    };
    let err = ep.import(wrong, req, &good).unwrap_err();
    assert!(matches!(err, TransferError::Host(_)), "{err}");
    assert_eq!(s.kv().device().num_free(), free, "blocks held");
    let names = s.block_names(&p, None);
    assert!(s.cached_blocks(&names).unwrap().is_empty(), "registered");
}

/// A transport with a backlog of `left` late exports of another request, each ready
/// at once and taking 10 ms to read, then nothing.
struct Backlog {
    frame: Vec<u8>,
    left: usize,
}

impl Transfer for Backlog {
    fn send(&mut self, _: Vec<u8>) -> Result<(), TransferError> {
        Ok(())
    }

    fn recv(&mut self, timeout: Duration) -> Result<Option<Vec<u8>>, TransferError> {
        if self.left == 0 {
            std::thread::sleep(timeout);
            return Ok(None);
        }
        self.left -= 1;
        std::thread::sleep(Duration::from_millis(10));
        Ok(Some(self.frame.clone()))
    }
}

/// Exports of other requests that keep arriving do not hold `receive_and_import` past
/// its deadline: with 50 ms it returns within a second (it ran until the backlog of
/// 300 ran out, 3 s), recomputing, and says how many it dropped.
#[test]
fn exports_of_other_requests_do_not_hold_the_receiver_past_its_deadline() {
    let mut late = prefill_and_export(2);
    late.blocks.clear();
    let mut t = Backlog {
        frame: encode_export(late).unwrap(),
        left: 300,
    };
    let (mut s, mut rank) = (scheduler(), Rank::new(ShardSpec::WHOLE));
    let start = Instant::now();
    let out = receive(&mut t, 1, Duration::from_millis(50), &mut s, &mut rank);
    let took = start.elapsed();
    assert!(
        took < Duration::from_secs(1),
        "{took:?} for a 50 ms deadline ({out})"
    );
    match &out {
        Outcome::Recomputed { reason } => {
            assert!(reason.contains("no export of request 1"), "{reason}");
            assert!(reason.contains("other requests dropped"), "{reason}");
        }
        o => panic!("{o:?}"),
    }
}

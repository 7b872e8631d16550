//! Disaggregated prefill's test helpers: a prefill instance that exports a request's
//! blocks, a decode instance that receives and imports them, and a serving loop.

use std::time::Duration;

use pagedkv_dist::ShardSpec;
use pagedkv_dist::transfer::{
    BlockExport, Instance, LayoutDescriptor, Outcome, RequestTokens, Transfer, TransferEndpoint,
    receive_and_import,
};
use pagedkv_host::backend::CpuBackend;
use pagedkv_host::scheduler::{Request, Scheduler};

use super::{MODEL, Rank, input_tokens, sampled, scheduler};

pub const OUTPUT: u32 = 6;

/// Request `id`'s prompt: 3 full blocks and 5 tokens.
pub fn prompt(id: u64) -> Vec<u32> {
    (0..53).map(|p| (id as u32 * 101 + p * 17) % 1000).collect()
}

/// The endpoint of `rank`'s backend.
pub fn endpoint(rank: &Rank) -> TransferEndpoint {
    TransferEndpoint::new(LayoutDescriptor::of(
        pagedkv_host::backend::AttentionBackend::config(&rank.be),
        ShardSpec::WHOLE,
        MODEL,
        Vec::new(),
    ))
}

/// `(s, rank)` as an [`Instance`].
pub fn at<'a>(s: &'a mut Scheduler, rank: &'a mut Rank) -> Instance<'a, CpuBackend> {
    Instance {
        sched: s,
        be: &mut rank.be,
        cache: &mut rank.cache,
    }
}

/// Serves request `id` to completion on `(s, rank)`: each step's outputs, and how many
/// prompt tokens its first step found cached.
pub fn serve(s: &mut Scheduler, rank: &mut Rank, id: u64) -> (Vec<Vec<f32>>, u32) {
    s.add_request(Request::new(id, prompt(id), OUTPUT)).unwrap();
    let mut outs = Vec::new();
    let mut cached = None;
    while !s.is_idle() {
        let batch = s.step().unwrap().clone();
        cached.get_or_insert(batch.seqs[0].num_cached_tokens);
        let tokens = input_tokens(s, &batch);
        outs.push(rank.step(&batch, &tokens));
        s.on_step_done(&sampled(&batch)).unwrap();
    }
    (outs, cached.unwrap())
}

/// The prefill instance: computes request `id`'s prompt (one step, the first token)
/// and exports its blocks.
pub fn prefill_and_export(id: u64) -> BlockExport {
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
    let e = ep.export(at(&mut s, &mut rank), req).unwrap();
    assert_eq!(e.blocks.len(), 3, "3 full blocks of 53 tokens");
    e
}

/// `(s, rank)` waits at most `timeout` for request `id`'s export on `t` and imports it.
pub fn receive<T: Transfer>(
    t: &mut T,
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
    receive_and_import(&ep, t, timeout, at(s, rank), req)
}

/// Decode outputs of the steps after the first (the first computes the prompt, all of
/// it or the part not imported).
pub fn decodes(outs: &[Vec<f32>]) -> &[Vec<f32>] {
    &outs[1..]
}

pub fn same(a: &[Vec<f32>], b: &[Vec<f32>]) -> bool {
    a.len() == b.len()
        && a.iter().zip(b).all(|(x, y)| {
            x.len() == y.len() && x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits())
        })
}

//! The scheduler at a batch large enough for its look-ahead prefetching (2048
//! sequences and up, where `step()` and `on_step_done()` prefetch the sequences a few
//! rows ahead and what a committing sequence reads): every slot, block-table row,
//! token history and prefix-cache registration is still exact. The look-ahead only
//! hints the CPU's caches; this checks (in a debug build, with overflow checks) that
//! its index arithmetic never panics and never disturbs the state. The small-batch
//! model tests are in `host/tests/scheduling/scheduler.rs`.

use std::collections::HashMap;

use pagedkv_host::scheduler::{Request, Scheduler, SchedulerConfig, SeqId};

/// The token "sampled" for `seq` at `step`: different for every sequence and step, so
/// a token recorded for the wrong sequence or out of order shows.
fn token(seq: SeqId, step: u32) -> u32 {
    (seq as u32).wrapping_mul(2_654_435_761) ^ step.wrapping_mul(40_503)
}

#[test]
fn a_2500_sequence_batch_keeps_exact_slots_tokens_and_cache_registrations() {
    let n = 2500u64;
    let bs = 16u32;
    let mut s = Scheduler::new(SchedulerConfig {
        num_blocks: n as u32 * 8 + 64,
        block_size: bs,
        max_num_seqs: n as usize,
        max_tokens_per_step: 1 << 20,
        max_model_len: 256,
        watermark: 0.0,
        enable_prefix_caching: true,
        ..SchedulerConfig::default()
    })
    .unwrap();
    // Prompts of 20 to 35 tokens, so the sequences cross block boundaries at
    // different steps; all distinct, so every full block is a new cache entry.
    let mut expected: HashMap<SeqId, Vec<u32>> = HashMap::new();
    for i in 0..n {
        let prompt: Vec<u32> = (0..20 + (i % 16) as u32)
            .map(|t| i as u32 * 1000 + t)
            .collect();
        let seq = s.add_request(Request::new(i, prompt.clone(), 64)).unwrap();
        expected.insert(seq, prompt);
    }
    let w = s.config().max_model_len.div_ceil(bs) as usize;
    let mut sampled = Vec::with_capacity(n as usize);
    for step in 0..40u32 {
        let b = s.step().unwrap();
        assert_eq!(b.seqs.len(), n as usize, "step {step}");
        for (row, q) in b.seqs.iter().enumerate() {
            assert_eq!(b.context_lens[row] as u32, q.context_len);
            // Every position the step computes has the slot its row's table says.
            for k in 0..q.num_new_tokens {
                let pos = q.start_pos + k;
                let block = b.block_tables[row * w + (pos / bs) as usize];
                assert!(block > 0, "seq {} pos {pos}: null block", q.seq);
                assert_eq!(
                    b.slot_mapping[(q.token_offset + k) as usize],
                    block as i64 * bs as i64 + (pos % bs) as i64,
                    "seq {} pos {pos}",
                    q.seq
                );
            }
        }
        sampled.clear();
        sampled.extend(b.seqs.iter().map(|q| (q.seq, token(q.seq, step))));
        for &(q, t) in &sampled {
            expected.get_mut(&q).unwrap().push(t);
        }
        assert!(
            s.on_step_done(&sampled).unwrap().is_empty(),
            "nobody finishes"
        );
    }
    // Histories exact; every full block committed and registered, once.
    let mut full_blocks = 0;
    for (&q, tokens) in &expected {
        assert_eq!(s.tokens(q).unwrap(), *tokens, "seq {q}");
        let table = s.block_table(q).unwrap();
        assert_eq!(table.num_tokens() as usize, tokens.len() - 1);
        assert_eq!(table.hashes().len() as u32, table.num_tokens() / bs);
        full_blocks += table.hashes().len();
    }
    assert_eq!(s.kv().device().num_cached(), full_blocks);
}

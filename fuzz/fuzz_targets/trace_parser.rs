//! The simulator's JSONL trace parser on arbitrary bytes: it returns a workload or an
//! error naming the line, never panics, never allocates without bound, and a workload
//! it accepts keeps every promise the simulator relies on.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pagedkv_cli::sim::{Workload, limits};

fuzz_target!(|data: &[u8]| {
    let (head, body) = data.split_at(data.len().min(2));
    // The model's maximum length: 2 ..= 65537, from the first two bytes.
    let max_len = 2 + head.iter().fold(0u32, |a, &b| a << 8 | b as u32);
    match Workload::read_trace(body, max_len) {
        Ok(w) => {
            assert!(!w.requests.is_empty() && w.requests.len() <= limits::MAX_REQUESTS);
            for pair in w.requests.windows(2) {
                assert!(pair[0].arrival_s <= pair[1].arrival_s, "not sorted");
            }
            for r in &w.requests {
                assert!((0.0..=limits::MAX_ARRIVAL_S).contains(&r.arrival_s));
                assert!(r.prompt_len >= 1 && r.output_len >= 1);
                assert!(r.prompt_len as u64 + r.output_len as u64 <= max_len as u64);
            }
        }
        Err(e) => assert!(e.0.starts_with("trace"), "an error that names nothing: {e}"),
    }
});

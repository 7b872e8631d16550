//! The simulator's model JSON on arbitrary text: a spec or an error, never a panic; an
//! accepted spec's sizes never overflow, and the budget built from it is a number or an
//! error naming a flag, never NaN, infinity or a wrapped pool.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pagedkv_cli::sim::{GpuSpec, ModelSpec, SimConfig, limits};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(m) = ModelSpec::from_json_str(text) else {
        return;
    };
    assert!(m.checked_kv_bytes_per_token().is_some());
    assert!(m.weight_bytes().is_finite());
    for gpu in ["a100-40gb", "h100", "h200"] {
        let cfg = SimConfig::new(GpuSpec::preset(gpu).unwrap(), m.clone());
        match cfg.capacity_tokens() {
            Ok(slots) => {
                // (A hybrid model's budget need only hold one request whose window
                // layers keep their window: its full-attention slots may be fewer.)
                assert!(
                    (slots >= m.max_model_len as u64 || m.is_hybrid())
                        && slots <= limits::MAX_TOKEN_SLOTS
                );
                assert!(cfg.step_time(1, slots).is_finite());
            }
            Err(e) => assert!(e.0.contains("--"), "an error that names no flag: {e}"),
        }
    }
});

/* The C test program: drives the scheduler, the prefix cache, the CPU reference
 * attention and the error paths through the C ABI, printing what it sees. The Rust
 * test (capi/tests/c_abi/c_program.rs) checks the output. */
#include <math.h>
#include <stdio.h>
#include <string.h>
#include "pagedkv.h"

#define CHECK(call)                                                                  \
    do {                                                                             \
        pagedkv_status st_ = (call);                                                 \
        if (st_ != PAGEDKV_OK) {                                                     \
            printf("FAIL %s = %d: %s\n", #call, (int)st_, pagedkv_last_error_message()); \
            return 1;                                                                \
        }                                                                            \
    } while (0)

static void report(const char *what, pagedkv_status st) {
    printf("error %s status=%d message=%s\n", what, (int)st, pagedkv_last_error_message());
}

/* Runs steps until idle, sampling token 1000 + step; returns the steps taken. */
static int run_to_completion(pagedkv_scheduler *s, uint64_t *finished) {
    int steps = 0;
    uint32_t idle = 0;
    *finished = 0;
    while (pagedkv_is_idle(s, &idle) == PAGEDKV_OK && !idle) {
        pagedkv_batch b;
        if (pagedkv_step(s, &b) != PAGEDKV_OK || b.num_seqs == 0 || b.num_seqs > 64) return -1;
        pagedkv_sampled out[64];
        for (uint64_t i = 0; i < b.num_seqs; i++) {
            out[i].seq = b.seqs[i].seq;
            out[i].token = 1000u + (uint32_t)steps;
            out[i].reserved = 0;
        }
        uint64_t done = 0;
        if (pagedkv_on_step_done(s, out, b.num_seqs, &done) != PAGEDKV_OK) return -1;
        *finished += done;
        steps++;
    }
    return steps;
}

int main(void) {
    printf("version %s\n", pagedkv_version());

    pagedkv_scheduler_config cfg;
    CHECK(pagedkv_scheduler_config_default(&cfg));
    cfg.num_blocks = 64;
    cfg.block_size = 16;
    cfg.max_model_len = 512;
    cfg.enable_prefix_caching = 1;
    pagedkv_scheduler *s = NULL;
    CHECK(pagedkv_scheduler_create(&cfg, &s));

    /* Three requests to completion, tokens fed back. */
    uint32_t p0[20], p1[33], p2[7];
    for (uint32_t i = 0; i < 33; i++) {
        if (i < 20) p0[i] = i;
        p1[i] = 100 + i;
        if (i < 7) p2[i] = 200 + i;
    }
    pagedkv_request r = {.id = 1, .prompt = p0, .prompt_len = 20, .max_tokens = 5, .stop_token = -1};
    uint64_t seq0, seq1, seq2;
    CHECK(pagedkv_add_request(s, &r, &seq0));
    r.id = 2; r.prompt = p1; r.prompt_len = 33; r.max_tokens = 8;
    CHECK(pagedkv_add_request(s, &r, &seq1));
    r.id = 3; r.prompt = p2; r.prompt_len = 7; r.max_tokens = 3;
    CHECK(pagedkv_add_request(s, &r, &seq2));

    /* One step by hand: check the batch arrays. */
    pagedkv_batch b;
    CHECK(pagedkv_step(s, &b));
    printf("first step seqs=%llu slots=%llu max_blocks=%u ctx=%d,%d,%d\n",
           (unsigned long long)b.num_seqs, (unsigned long long)b.num_slots,
           b.max_blocks_per_seq, b.context_lens[0], b.context_lens[1], b.context_lens[2]);
    pagedkv_sampled first[3];
    for (int i = 0; i < 3; i++) {
        first[i].seq = b.seqs[i].seq;
        first[i].token = 999;
        first[i].reserved = 0;
    }
    uint64_t done = 0;
    CHECK(pagedkv_on_step_done(s, first, 3, &done));
    uint64_t finished = 0;
    int steps = run_to_completion(s, &finished);
    printf("completed steps=%d finished=%llu\n", steps + 1, (unsigned long long)(finished + done));

    /* The same 33-token prompt again: its two full blocks come from the prefix cache. */
    r.id = 4; r.prompt = p1; r.prompt_len = 33; r.max_tokens = 2;
    uint64_t seq3;
    CHECK(pagedkv_add_request(s, &r, &seq3));
    CHECK(pagedkv_step(s, &b));
    printf("prefix hit start_pos=%u new_tokens=%u\n", b.seqs[0].start_pos, b.seqs[0].num_new_tokens);
    pagedkv_sampled one = {.seq = b.seqs[0].seq, .token = 5, .reserved = 0};
    CHECK(pagedkv_on_step_done(s, &one, 1, NULL));
    uint64_t len = 0;
    CHECK(pagedkv_seq_tokens(s, seq3, NULL, 0, &len));
    uint32_t toks[64];
    CHECK(pagedkv_seq_tokens(s, seq3, toks, 64, &len));
    printf("seq tokens len=%llu last=%u\n", (unsigned long long)len, toks[len - 1]);
    run_to_completion(s, &finished);
    pagedkv_metrics m;
    CHECK(pagedkv_get_metrics(s, &m));
    printf("metrics prefix_hit_tokens=%llu blocks_used=%u\n",
           (unsigned long long)m.prefix_hit_tokens, m.blocks_used);

    /* Error paths. */
    report("null_handle", pagedkv_abort(NULL, 1));
    report("unknown_request", pagedkv_abort(s, 999));
    report("done_without_step", pagedkv_on_step_done(s, NULL, 0, NULL));
    r.id = 9; r.prompt_len = 0;
    report("empty_prompt", pagedkv_add_request(s, &r, &seq3));
    report("null_out", pagedkv_step(s, NULL));
    CHECK(pagedkv_scheduler_destroy(s));
    report("use_after_destroy", pagedkv_abort(s, 1));
    report("double_destroy", pagedkv_scheduler_destroy(s));
    cfg.block_size = 12;
    report("bad_config", pagedkv_scheduler_create(&cfg, &s));

    /* The CPU reference attention on a small paged cache: the Rust test recomputes it
     * from the same formulas and compares. */
    pagedkv_decode_shape sh = {.num_seqs = 2, .num_q_heads = 4, .num_kv_heads = 2,
                               .head_dim = 64, .block_size = 16, .num_blocks = 6,
                               .max_blocks_per_seq = 3, .reserved = 0};
    static float kc[6 * 2 * 16 * 64], vc[6 * 2 * 16 * 64], q[2 * 4 * 64], out[2 * 4 * 64];
    for (int i = 0; i < 6 * 2 * 16 * 64; i++) {
        kc[i] = (float)sin(0.37 * i);
        vc[i] = (float)cos(0.11 * i);
    }
    for (int i = 0; i < 2 * 4 * 64; i++) q[i] = (float)sin(0.5 * i + 1.0);
    int32_t tables[6] = {0, 4, 2, 5, 1, 3};
    int32_t lens[2] = {37, 20};
    CHECK(pagedkv_reference_decode_attention(&sh, 0.125f, q, 512, kc, vc, 6 * 2 * 16 * 64,
                                             tables, 6, lens, 2, out, 512));
    printf("attention");
    for (int i = 0; i < 512; i++) printf(" %.9g", out[i]);
    printf("\n");
    lens[1] = 49; /* beyond the 3 blocks of 16 in its table row */
    report("context_too_long", pagedkv_reference_decode_attention(&sh, 0.125f, q, 512, kc, vc,
                                             6 * 2 * 16 * 64, tables, 6, lens, 2, out, 512));
    report("wrong_length", pagedkv_reference_decode_attention(&sh, 0.125f, q, 511, kc, vc,
                                             6 * 2 * 16 * 64, tables, 6, lens, 2, out, 512));

    /* The merge of attention states: one row, 2 heads of 32, two parts; head 0's
     * second part saw no keys (-inf: its NaN outputs are never read). */
    pagedkv_merge_shape msh = {.num_rows = 1, .num_states = 2, .num_heads = 2, .head_dim = 32};
    static float mv[2 * 2 * 32], mout[2 * 32];
    for (int i = 0; i < 2 * 2 * 32; i++) mv[i] = i < 64 ? 1.0f : 3.0f;
    for (int i = 64; i < 96; i++) mv[i] = NAN;
    float mlse[4] = {1.0f, 1.0f, -INFINITY, 3.0f}, mlse_out[2];
    CHECK(pagedkv_merge_states(&msh, mv, 128, mlse, 4, NULL, 0, mout, 64, mlse_out, 2));
    printf("merge out=%.6g,%.6g lse=%.6g,%.6g\n", mout[0], mout[32], mlse_out[0], mlse_out[1]);
    report("merge_wrong_lse", pagedkv_merge_states(&msh, mv, 128, mlse, 3, NULL, 0, mout, 64,
                                                   NULL, 0));

    /* kv_append: one good call, one with a slot outside the cache. */
    static float kk[3 * 2 * 64], vv[3 * 2 * 64];
    for (int i = 0; i < 3 * 2 * 64; i++) { kk[i] = (float)i; vv[i] = -(float)i; }
    int64_t slots[3] = {5, -1, 40};
    CHECK(pagedkv_reference_kv_append(6, 2, 16, 64, kk, vv, 3, slots, kc, vc, 6 * 2 * 16 * 64));
    /* slot 40 = block 2, offset 8; head 1 starts 16*64 elements into the block. */
    printf("append k=%g v=%g\n", kc[2 * 2 * 16 * 64 + 1 * 16 * 64 + 8 * 64 + 3], vc[5 * 64 + 1]);
    slots[2] = 6 * 16;
    report("slot_outside", pagedkv_reference_kv_append(6, 2, 16, 64, kk, vv, 3, slots, kc, vc,
                                                       6 * 2 * 16 * 64));
    /* The CUDA backend: on a machine without a GPU, a clear error. */
    pagedkv_cuda_backend *gpu = NULL;
    pagedkv_status cst = pagedkv_cuda_backend_create(0, &gpu);
    report("cuda_create", cst);
    if (cst == PAGEDKV_OK) {
        CHECK(pagedkv_cuda_synchronize(gpu));
        CHECK(pagedkv_cuda_backend_destroy(gpu));
    }
    /* On a caller's stream (NULL: the default stream): the same answer. */
    gpu = NULL;
    cst = pagedkv_cuda_backend_create_on_stream(0, NULL, &gpu);
    report("cuda_create_on_stream", cst);
    if (cst == PAGEDKV_OK) {
        CHECK(pagedkv_cuda_synchronize(gpu));
        CHECK(pagedkv_cuda_backend_destroy(gpu));
    }
    report("cuda_null_backend", pagedkv_cuda_synchronize(NULL));
    report("cuda_strided_null_backend",
           pagedkv_cuda_decode_attention_strided(NULL, NULL, 0, 1.0f, 0, 0, 0, 0, NULL, 0, NULL,
                                                 0, 0, 0));
    /* fp8 caches: per-KV-head scales calibrated on the CPU (kk, vv: 3 tokens of 2 heads
     * of 64), and the fp8 calls' checks of types and scales, which come before the
     * backend's. */
    float ks[2] = {-1.0f, -1.0f}, vs[2] = {-1.0f, -1.0f};
    CHECK(pagedkv_kv_scales_calibrate(PAGEDKV_E4M3, 2, 64, kk, vv, 3, ks, vs));
    printf("fp8 scales %.9g %.9g %.9g %.9g\n", ks[0], ks[1], vs[0], vs[1]);
    pagedkv_kv_scales sc = {.k = ks, .v = vs, .len = 2};
    report("fp8_f32_queries", pagedkv_cuda_kv_append_fp8(NULL, 6, 2, 16, 64, PAGEDKV_F32,
                                                         PAGEDKV_E4M3, &sc, 0, 0, 3, slots,
                                                         0, 0));
    report("fp8_null_scales", pagedkv_cuda_kv_append_fp8(NULL, 6, 2, 16, 64, PAGEDKV_BF16,
                                                         PAGEDKV_E5M2, NULL, 0, 0, 3, slots,
                                                         0, 0));
    sc.len = 1;
    report("fp8_scales_len",
           pagedkv_cuda_decode_attention_fp8(NULL, &sh, PAGEDKV_F16, PAGEDKV_E4M3, &sc, 0.125f,
                                             0, 0, 0, tables, 6, lens, 2, 0));
    sc.len = 2;
    float zero[2] = {1.0f, 0.0f};
    sc.v = zero;
    report("fp8_zero_scale",
           pagedkv_cuda_decode_attention_fp8(NULL, &sh, PAGEDKV_F16, PAGEDKV_E4M3, &sc, 0.125f,
                                             0, 0, 0, tables, 6, lens, 2, 0));
    sc.v = vs;
    report("fp8_null_backend",
           pagedkv_cuda_decode_attention_fp8(NULL, &sh, PAGEDKV_F16, PAGEDKV_E4M3, &sc, 0.125f,
                                             0, 0, 0, tables, 6, lens, 2, 0));
    printf("ok\n");
    return 0;
}

/* Minimal use of pagedkv from C: one request through the scheduler to completion.
 * docs/c.md shows this file; capi/tests/c_abi/c_program.rs compiles and runs it. */
#include <stdio.h>
#include "pagedkv.h"

int main(void) {
    pagedkv_scheduler_config cfg;
    pagedkv_scheduler *s = NULL;
    if (pagedkv_scheduler_config_default(&cfg) != PAGEDKV_OK) return 1;
    cfg.num_blocks = 64;
    cfg.max_model_len = 512;
    if (pagedkv_scheduler_create(&cfg, &s) != PAGEDKV_OK) {
        fprintf(stderr, "create: %s\n", pagedkv_last_error_message());
        return 1;
    }
    uint32_t prompt[5] = {1, 2, 3, 4, 5};
    pagedkv_request req = {.id = 7, .prompt = prompt, .prompt_len = 5, .max_tokens = 3,
                           .stop_token = -1};
    uint64_t seq = 0;
    if (pagedkv_add_request(s, &req, &seq) != PAGEDKV_OK) {
        fprintf(stderr, "add: %s\n", pagedkv_last_error_message());
        return 1;
    }
    uint32_t idle = 0;
    while (pagedkv_is_idle(s, &idle) == PAGEDKV_OK && !idle) {
        pagedkv_batch b;
        if (pagedkv_step(s, &b) != PAGEDKV_OK) return 1;
        /* Here an engine runs kv_append and paged_decode_attention with b.block_tables,
         * b.context_lens and b.slot_mapping, then samples one token per sequence. */
        pagedkv_sampled out[16];
        for (uint64_t i = 0; i < b.num_seqs; i++) {
            out[i].seq = b.seqs[i].seq;
            out[i].token = 42;
            out[i].reserved = 0;
        }
        if (pagedkv_on_step_done(s, out, b.num_seqs, NULL) != PAGEDKV_OK) return 1;
    }
    pagedkv_metrics m;
    pagedkv_get_metrics(s, &m);
    printf("finished after %llu steps\n", (unsigned long long)m.steps);
    pagedkv_scheduler_destroy(s);
    return 0;
}

/* Hostile use of the C ABI (issue #13): destroy racing calls from other threads, a
 * count that disagrees with the library's state, a panic inside a call, a layout whose
 * size overflows. Prints one line per check; the Rust test (capi/tests/c_abi/c_program.rs)
 * checks them and that nothing reached stderr, and scripts/sanitize-c.sh runs it under
 * AddressSanitizer and UndefinedBehaviorSanitizer.
 *
 * Linked against a library built with the `testing` feature (pagedkv_testing_panic). */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "pagedkv.h"

/* Test-only entry point of the `testing` feature (not in pagedkv.h). */
pagedkv_status pagedkv_testing_panic(pagedkv_scheduler *s);

#define CALLERS 3
#define DESTROYS 400

static _Atomic(pagedkv_scheduler *) current;
static atomic_int stop;
static atomic_long calls_ok, refused_destroyed, refused_busy, other_errors, unexpected;
static atomic_long destroy_busy;

static pagedkv_scheduler *make(void) {
    pagedkv_scheduler_config cfg;
    pagedkv_scheduler *s = NULL;
    if (pagedkv_scheduler_config_default(&cfg) != PAGEDKV_OK) return NULL;
    cfg.num_blocks = 64;
    cfg.max_model_len = 256;
    if (pagedkv_scheduler_create(&cfg, &s) != PAGEDKV_OK) return NULL;
    return s;
}

/* Sorts a status from a racing call: OK, refused (destroyed or busy), an ordinary error
 * the call may give on a live scheduler, or unexpected (a panic, a wrong message). */
static void tally(pagedkv_status st, int ordinary_ok) {
    if (st == PAGEDKV_OK) {
        atomic_fetch_add(&calls_ok, 1);
    } else if (st == PAGEDKV_ERR_INVALID_STATE &&
               strstr(pagedkv_last_error_message(), "destroyed or never created")) {
        atomic_fetch_add(&refused_destroyed, 1);
    } else if (st == PAGEDKV_ERR_INVALID_STATE &&
               strstr(pagedkv_last_error_message(), "inside a call")) {
        atomic_fetch_add(&refused_busy, 1);
    } else if (ordinary_ok && st != PAGEDKV_ERR_PANIC) {
        atomic_fetch_add(&other_errors, 1);
    } else {
        printf("unexpected status=%d message=%s\n", (int)st, pagedkv_last_error_message());
        atomic_fetch_add(&unexpected, 1);
    }
}

/* Calls that read nothing the library owns (the batch arrays die with the scheduler,
 * so reading them while another thread destroys it would be this program's bug). */
static void *caller(void *arg) {
    uint64_t id = (uint64_t)(uintptr_t)arg << 40;
    uint32_t prompt[4] = {1, 2, 3, 4};
    while (!atomic_load(&stop)) {
        pagedkv_scheduler *s = atomic_load(&current);
        uint32_t idle = 0;
        tally(pagedkv_is_idle(s, &idle), 0);
        pagedkv_metrics m;
        tally(pagedkv_get_metrics(s, &m), 0);
        pagedkv_request r = {.id = ++id, .prompt = prompt, .prompt_len = 4, .max_tokens = 2,
                             .stop_token = -1};
        uint64_t seq = 0;
        tally(pagedkv_add_request(s, &r, &seq), 1);
        pagedkv_batch b;
        tally(pagedkv_step(s, &b), 1);
        tally(pagedkv_on_step_done(s, NULL, 0, NULL), 1);
        uint32_t toks[8];
        uint64_t len = 0;
        tally(pagedkv_seq_tokens(s, seq, toks, 8, &len), 1);
        tally(pagedkv_abort(s, id), 1);
    }
    return NULL;
}

/* Destroys the current scheduler while the callers use it, DESTROYS times, publishing
 * a fresh one after each; also destroys each old handle a second time. */
static int race(void) {
    atomic_store(&current, make());
    if (!atomic_load(&current)) return 1;
    pthread_t t[CALLERS];
    for (int i = 0; i < CALLERS; i++)
        if (pthread_create(&t[i], NULL, caller, (void *)(uintptr_t)(i + 1)) != 0) return 1;
    int destroyed = 0;
    while (destroyed < DESTROYS) {
        pagedkv_scheduler *s = atomic_load(&current);
        pagedkv_status st = pagedkv_scheduler_destroy(s);
        if (st == PAGEDKV_OK) {
            destroyed++;
            /* Callers holding `s` now get "destroyed" until they load the new one. */
            for (int k = 0; k < 50; k++) sched_yield();
            if (pagedkv_scheduler_destroy(s) != PAGEDKV_ERR_INVALID_STATE) {
                printf("double destroy was not refused\n");
                atomic_fetch_add(&unexpected, 1);
            }
            atomic_store(&current, make());
        } else if (st == PAGEDKV_ERR_INVALID_STATE &&
                   strstr(pagedkv_last_error_message(), "inside a call")) {
            atomic_fetch_add(&destroy_busy, 1);
        } else {
            printf("destroy: unexpected status=%d message=%s\n", (int)st,
                   pagedkv_last_error_message());
            atomic_fetch_add(&unexpected, 1);
            break;
        }
        sched_yield();
    }
    atomic_store(&stop, 1);
    for (int i = 0; i < CALLERS; i++) pthread_join(t[i], NULL);
    /* Every thread has stopped: the last one is idle. */
    if (pagedkv_scheduler_destroy(atomic_load(&current)) != PAGEDKV_OK) return 1;
    printf("race destroys=%d ok=%s refused=%s unexpected=%ld\n", destroyed,
           atomic_load(&calls_ok) > 0 ? "yes" : "no",
           atomic_load(&refused_destroyed) + atomic_load(&refused_busy) +
                       atomic_load(&destroy_busy) > 0
               ? "yes"
               : "no",
           atomic_load(&unexpected));
    /* Counts vary run to run: for people, not for the test. */
    printf("race counts ok=%ld destroyed=%ld busy=%ld destroy_busy=%ld other=%ld\n",
           atomic_load(&calls_ok), atomic_load(&refused_destroyed), atomic_load(&refused_busy),
           atomic_load(&destroy_busy), atomic_load(&other_errors));
    return 0;
}

static void report(const char *what, pagedkv_status st) {
    printf("check %s status=%d message=%s\n", what, (int)st, pagedkv_last_error_message());
}

/* on_step_done's n against the last step's sequences, before reading `sampled`. */
static int step_done_counts(void) {
    pagedkv_scheduler *s = make();
    if (!s) return 1;
    uint32_t prompt[3] = {7, 8, 9};
    pagedkv_request r = {.id = 1, .prompt = prompt, .prompt_len = 3, .max_tokens = 4,
                         .stop_token = -1};
    uint64_t seq = 0;
    if (pagedkv_add_request(s, &r, &seq) != PAGEDKV_OK) return 1;
    r.id = 2;
    if (pagedkv_add_request(s, &r, &seq) != PAGEDKV_OK) return 1;
    pagedkv_batch b;
    if (pagedkv_step(s, &b) != PAGEDKV_OK || b.num_seqs != 2) return 1;
    /* Exactly num_seqs entries on the heap: reading one more is a heap overflow. */
    pagedkv_sampled *out = malloc(b.num_seqs * sizeof *out);
    if (!out) return 1;
    for (uint64_t i = 0; i < b.num_seqs; i++) {
        out[i].seq = b.seqs[i].seq;
        out[i].token = 42;
        out[i].reserved = 0;
    }
    report("n_one_more", pagedkv_on_step_done(s, out, b.num_seqs + 1, NULL));
    report("n_huge", pagedkv_on_step_done(s, out, UINT64_MAX, NULL));
    report("n_fewer", pagedkv_on_step_done(s, out, b.num_seqs - 1, NULL));
    uint64_t done = 7;
    report("n_right", pagedkv_on_step_done(s, out, b.num_seqs, &done));
    report("n_again", pagedkv_on_step_done(s, out, b.num_seqs, NULL));
    free(out);
    return pagedkv_scheduler_destroy(s) != PAGEDKV_OK;
}

/* prompt_len against max_model_len (256) before the prompt is read: a 4-token stack
 * buffer with prompt_len far beyond it (the 2^20 one once read 4 MiB past it). */
static int prompt_len_first(void) {
    pagedkv_scheduler *s = make();
    if (!s) return 1;
    uint32_t prompt[4] = {1, 2, 3, 4};
    const uint64_t lens[4] = {4096, 4097, 2000, 1u << 20};
    for (int i = 0; i < 4; i++) {
        pagedkv_request r = {.id = 1, .prompt = prompt, .prompt_len = lens[i],
                             .max_tokens = 1, .stop_token = -1};
        uint64_t seq = 0;
        char what[32];
        snprintf(what, sizeof what, "prompt_len_%d", i);
        report(what, pagedkv_add_request(s, &r, &seq));
    }
    /* 255 + 1 = max_model_len: read, and accepted. */
    pagedkv_request r = {.id = 2, .prompt = prompt, .prompt_len = 4, .max_tokens = 252,
                         .stop_token = -1};
    uint64_t seq = 0;
    report("prompt_len_fits", pagedkv_add_request(s, &r, &seq));
    return pagedkv_scheduler_destroy(s) != PAGEDKV_OK;
}

/* Every refusal before the prompt is read, not only max_model_len's (issue #49): with
 * max_model_len 4096 over a pool of 63 usable blocks of 16 (1008 tokens), a 2000-token
 * prompt_len over a 4-token stack buffer is refused for the pool's size, and a
 * duplicate id with a prompt_len that would fit is refused for the id, both without
 * reading past the buffer (each once read 8000 or 4000 bytes beyond it). */
static int prompt_refusals_first(void) {
    pagedkv_scheduler_config cfg;
    pagedkv_scheduler *s = NULL;
    if (pagedkv_scheduler_config_default(&cfg) != PAGEDKV_OK) return 1;
    cfg.num_blocks = 64;
    cfg.max_model_len = 4096;
    if (pagedkv_scheduler_create(&cfg, &s) != PAGEDKV_OK) return 1;
    uint32_t prompt[4] = {1, 2, 3, 4};
    uint64_t seq = 0;
    pagedkv_request big = {.id = 1, .prompt = prompt, .prompt_len = 2000, .max_tokens = 1,
                           .stop_token = -1};
    report("prompt_pool", pagedkv_add_request(s, &big, &seq));
    pagedkv_request ok = {.id = 5, .prompt = prompt, .prompt_len = 4, .max_tokens = 1,
                          .stop_token = -1};
    if (pagedkv_add_request(s, &ok, &seq) != PAGEDKV_OK) return 1;
    pagedkv_request dup = {.id = 5, .prompt = prompt, .prompt_len = 1000, .max_tokens = 1,
                           .stop_token = -1};
    report("prompt_dup_id", pagedkv_add_request(s, &dup, &seq));
    return pagedkv_scheduler_destroy(s) != PAGEDKV_OK;
}

/* A step's arrays stay as they were until the next step, whatever on_step_done and
 * abort do in between (a row that leaves moved the last one into its place, in the
 * arrays the caller still held). */
static int batch_stays(void) {
    pagedkv_scheduler *s = make();
    if (!s) return 1;
    uint32_t prompt[20];
    for (int i = 0; i < 20; i++) prompt[i] = (uint32_t)(i + 1);
    for (uint64_t id = 1; id <= 4; id++) {
        /* Request 1 finishes at its prefill; 2 is aborted; 3 and 4 run on. */
        pagedkv_request r = {.id = id, .prompt = prompt, .prompt_len = 4 * id,
                             .max_tokens = id == 1 ? 1 : 8, .stop_token = -1};
        uint64_t seq = 0;
        if (pagedkv_add_request(s, &r, &seq) != PAGEDKV_OK) return 1;
    }
    pagedkv_batch b;
    if (pagedkv_step(s, &b) != PAGEDKV_OK || b.num_seqs != 4) return 1;
    uint64_t n = b.num_seqs * b.max_blocks_per_seq;
    int32_t tables[4 * 16], lens[4];
    if (n > 4 * 16) return 1;
    memcpy(tables, b.block_tables, n * sizeof *tables);
    memcpy(lens, b.context_lens, b.num_seqs * sizeof *lens);
    pagedkv_sampled out[4];
    for (uint64_t i = 0; i < b.num_seqs; i++)
        out[i] = (pagedkv_sampled){.seq = b.seqs[i].seq, .token = 42, .reserved = 0};
    uint64_t done = 0;
    if (pagedkv_on_step_done(s, out, b.num_seqs, &done) != PAGEDKV_OK || done != 1) return 1;
    if (pagedkv_abort(s, 2) != PAGEDKV_OK) return 1;
    int same = memcmp(tables, b.block_tables, n * sizeof *tables) == 0 &&
               memcmp(lens, b.context_lens, b.num_seqs * sizeof *lens) == 0;
    printf("check batch_stays same=%s\n", same ? "yes" : "no");
    /* The next step has the two rows left. */
    if (pagedkv_step(s, &b) != PAGEDKV_OK) return 1;
    printf("check batch_next rows=%llu\n", (unsigned long long)b.num_seqs);
    return pagedkv_scheduler_destroy(s) != PAGEDKV_OK;
}

/* Pools beyond the library's cap (MAX_POOL_BLOCKS, 2^24): an error naming the field,
 * not an allocation failure that aborts the process. */
static void pool_caps(void) {
    const struct {
        const char *what;
        uint32_t blocks, host;
    } cases[] = {
        {"pool_host_max", 64, UINT32_MAX - 1},
        {"pool_host_2e28", 64, 1u << 28},
        {"pool_blocks_i32", INT32_MAX, 0},
    };
    for (int i = 0; i < 3; i++) {
        pagedkv_scheduler_config cfg;
        pagedkv_scheduler_config_default(&cfg);
        cfg.num_blocks = cases[i].blocks;
        cfg.num_host_blocks = cases[i].host;
        pagedkv_scheduler *s = NULL;
        pagedkv_status st = pagedkv_scheduler_create(&cfg, &s);
        report(cases[i].what, st);
        if (st == PAGEDKV_OK) pagedkv_scheduler_destroy(s);
    }
}

/* pagedkv_reset_prefix_cache: refused while a request runs, done once idle. */
static int reset_cache(void) {
    pagedkv_scheduler *s = make();
    if (!s) return 1;
    uint32_t prompt[40];
    for (int i = 0; i < 40; i++) prompt[i] = (uint32_t)i;
    pagedkv_request r = {.id = 1, .prompt = prompt, .prompt_len = 40, .max_tokens = 2,
                         .stop_token = -1};
    uint64_t seq = 0;
    if (pagedkv_add_request(s, &r, &seq) != PAGEDKV_OK) return 1;
    pagedkv_batch b;
    pagedkv_sampled one = {.seq = seq, .token = 1, .reserved = 0};
    if (pagedkv_step(s, &b) != PAGEDKV_OK) return 1;
    report("reset_in_step", pagedkv_reset_prefix_cache(s));
    if (pagedkv_on_step_done(s, &one, 1, NULL) != PAGEDKV_OK) return 1;
    report("reset_running", pagedkv_reset_prefix_cache(s));
    if (pagedkv_step(s, &b) != PAGEDKV_OK || pagedkv_on_step_done(s, &one, 1, NULL)) return 1;
    report("reset_idle", pagedkv_reset_prefix_cache(s));
    return pagedkv_scheduler_destroy(s) != PAGEDKV_OK;
}

int main(void) {
    pool_caps();
    if (reset_cache() != 0) {
        printf("reset setup failed\n");
        return 1;
    }
    if (prompt_len_first() != 0) {
        printf("prompt_len setup failed\n");
        return 1;
    }
    if (prompt_refusals_first() != 0) {
        printf("prompt_refusals setup failed\n");
        return 1;
    }
    if (batch_stays() != 0) {
        printf("batch_stays setup failed\n");
        return 1;
    }
    if (race() != 0) {
        printf("race setup failed\n");
        return 1;
    }
    if (step_done_counts() != 0) {
        printf("step_done setup failed\n");
        return 1;
    }

    /* A panic inside a call: an error code and a message, nothing printed; the handle
     * refuses further calls but can be destroyed. */
    pagedkv_scheduler *s = make();
    if (!s) return 1;
    report("panic", pagedkv_testing_panic(s));
    uint32_t idle = 0;
    report("after_panic", pagedkv_is_idle(s, &idle));
    report("destroy_after_panic", pagedkv_scheduler_destroy(s));

    /* 2^31 blocks x 2^20 heads x 32 tokens x 256 dims: 2^64 elements per cache, which
     * wraps to 0 in u64. It must be refused, not validated as an empty cache. */
    float k[1] = {0}, v[1] = {0}, kc[1] = {0}, vc[1] = {0};
    int64_t slots[1] = {0};
    report("huge_layout", pagedkv_reference_kv_append(1u << 31, 1u << 20, 32, 256, k, v, 0,
                                                      slots, kc, vc, 0));
    pagedkv_decode_shape sh = {.num_seqs = 1, .num_q_heads = 1u << 20,
                               .num_kv_heads = 1u << 20, .head_dim = 256, .block_size = 32,
                               .num_blocks = 1u << 31, .max_blocks_per_seq = 1,
                               .reserved = 0};
    int32_t table[1] = {0}, lens[1] = {1};
    float q[1] = {0}, o[1] = {0};
    report("huge_shape", pagedkv_reference_decode_attention(&sh, 1.0f, q, 1, kc, vc, 0, table,
                                                            1, lens, 1, o, 1));
    printf("ok\n");
    return 0;
}

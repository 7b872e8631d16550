/*
 * pagedkv.h: the C ABI of pagedkv, a paged KV-cache backend for LLM serving.
 *
 * Link with libpagedkv_c.a (plus -lpthread -ldl -lm) or libpagedkv_c.so, both built by
 * `cargo build --release -p pagedkv-capi` into target/release/.
 *
 * Conventions
 * - Every function returns a pagedkv_status; PAGEDKV_OK is 0. After a failure,
 *   pagedkv_last_error_message() describes it (per thread).
 * - Pointers the caller passes are borrowed for the call only; the library keeps none.
 *   Null where a pointer is required is PAGEDKV_ERR_NULL.
 * - Handles (pagedkv_scheduler*, pagedkv_cuda_backend*) are owned by the library:
 *   create, use, destroy once. A destroyed handle, or a call on a handle already inside
 *   a call (re-entrance, or two threads at once), is PAGEDKV_ERR_INVALID_STATE, never
 *   undefined behaviour as far as the library can detect it. (It cannot tell a
 *   destroyed handle from a newer one the allocator placed at the same address: do not
 *   use a handle after destroying it.)
 * - Destroy racing another call on the same handle (from another thread) is safe:
 *   whichever takes the library's handle lock first wins. If the call got in first,
 *   destroy returns PAGEDKV_ERR_INVALID_STATE ("... is inside a call ...: it was not
 *   destroyed"), the handle stays alive, and the caller must destroy it again once the
 *   call has returned. If destroy got in first, the call returns
 *   PAGEDKV_ERR_INVALID_STATE ("... handle was destroyed or never created") without
 *   touching the handle. Destroy never waits and never frees a handle in use. Memory the
 *   library owns (a pagedkv_batch's arrays) dies with the handle: reading it after, or
 *   while, another thread destroys the scheduler is the caller's bug.
 * - Sizes computed from arguments (a layout's or a shape's element counts) use checked
 *   arithmetic: one that overflows is PAGEDKV_ERR_INVALID_ARGUMENT naming the argument.
 *   Counts the library can check against its own state (shapes, the last step's
 *   sequences) are checked before any caller buffer is read.
 * - No panic crosses the boundary: an internal bug is PAGEDKV_ERR_PANIC, with the panic
 *   message (and where it happened) in pagedkv_last_error_message(). The library never
 *   prints to stdout or stderr, not even then. A handle whose call panicked refuses all
 *   further calls (PAGEDKV_ERR_INVALID_STATE, "an earlier call on it panicked") except
 *   destroy.
 * - Fixed-width types only; every struct is laid out as declared (a test checks the
 *   Rust side matches this header field by field).
 *
 * Stability
 * The version of this header is PAGEDKV_VERSION_MAJOR.MINOR.PATCH (below); the linked
 * library's is pagedkv_version(). Check at start-up that their MAJOR and, before 1.0,
 * MINOR agree.
 * - A PATCH version changes nothing a caller can see here: no signature, struct
 *   layout, enum value or meaning.
 * - Before 1.0, a MINOR version may add functions, add struct fields in place of
 *   reserved ones, and change what a function or field means or how a struct is laid
 *   out. pagedkv_batch is expected to change (hybrid models, cascade, speculative
 *   decoding). Status codes are never reused, and a function is never removed
 *   without being listed.
 * - From 1.0 on, semantic versioning: any incompatible change is a MAJOR version.
 * Every change of meaning or layout is listed here, with the version that made it:
 * - 0.2: pagedkv_request.priority: a LOWER value is more urgent (vLLM's convention),
 *   under the priority policy; in 0.1 a higher value was. Preemption now takes the
 *   least urgent running request first (it took the newest).
 * - 0.2: pagedkv_batch: its arrays stay unchanged until the next pagedkv_step() (in
 *   0.1 pagedkv_on_step_done() and pagedkv_abort() moved rows in them).
 * - 0.2: pool sizes are capped at 2^24 blocks (num_blocks, num_host_blocks).
 * - 0.2: rows of one batch may share blocks another row of the step writes (prompts
 *   that begin alike, admitted together): kv_append the whole step before attention.
 * - 0.2 (additions): layer groups, pagedkv_scheduler_create_groups(),
 *   pagedkv_batch_group() and pagedkv_group_tables; pagedkv_batch is unchanged (it is
 *   group 0's).
 * - 0.2 (additions): the merge of attention states, pagedkv_merge_shape,
 *   pagedkv_merge_states() and pagedkv_cuda_merge_states().
 * - 0.2 (additions): speculative decoding, pagedkv_set_lookahead(),
 *   pagedkv_on_step_done_accepted() and pagedkv_accepted;
 *   pagedkv_scheduled_seq.num_draft_tokens in place of its reserved 0.
 * - 0.2 (additions): pagedkv_batch.block_size in place of its reserved 0.
 */
#ifndef PAGEDKV_H
#define PAGEDKV_H

/* The version of the library this header declares (see Stability above). */
#define PAGEDKV_VERSION_MAJOR 0
#define PAGEDKV_VERSION_MINOR 2
#define PAGEDKV_VERSION_PATCH 0
#define PAGEDKV_VERSION_STRING "0.2.0"

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Result of every call. */
typedef enum pagedkv_status {
    PAGEDKV_OK = 0,                   /* success */
    PAGEDKV_ERR_NULL = 1,             /* a required pointer was null */
    PAGEDKV_ERR_INVALID_ARGUMENT = 2, /* an argument is out of range or inconsistent */
    PAGEDKV_ERR_OUT_OF_BLOCKS = 3,    /* the block pool is full */
    PAGEDKV_ERR_UNKNOWN_ID = 4,       /* a request or sequence id names nothing live */
    PAGEDKV_ERR_INVALID_STATE = 5,    /* destroyed handle, re-entrance, call order */
    PAGEDKV_ERR_CUDA = 6,             /* CUDA failure, or no CUDA driver or device */
    PAGEDKV_ERR_PANIC = 7             /* an internal bug was caught; please report it */
} pagedkv_status;

/* The message of the last failed call on this thread ("" after a success). Valid until
 * the next pagedkv call on this thread. Never null. */
const char *pagedkv_last_error_message(void);

/* The library version, "MAJOR.MINOR.PATCH". Static, never null. */
const char *pagedkv_version(void);

/* ---------------------------------------------------------------------------------- */
/* Scheduler: block pool, block tables, continuous batching                             */
/* ---------------------------------------------------------------------------------- */

/* An opaque scheduler (its block pool, block tables and queues). */
typedef struct pagedkv_scheduler pagedkv_scheduler;

/* Scheduler settings. Start from pagedkv_scheduler_config_default(). */
typedef struct pagedkv_scheduler_config {
    uint32_t num_blocks;            /* device blocks (2..2^24); block 0 is the null block */
    uint32_t block_size;            /* tokens per block: 8, 16 or 32 */
    uint32_t num_host_blocks;       /* host blocks for swapping (at most 2^24); 0: recompute */
    uint32_t max_model_len;         /* longest sequence (prompt + output) */
    uint64_t max_num_seqs;          /* most running sequences */
    uint64_t max_tokens_per_step;   /* most tokens per step; at least max_model_len */
    double watermark;               /* fraction of blocks admission keeps free, [0, 1) */
    uint32_t preempt_by_swap;       /* 1: preempt by swap; 0: by recompute */
    uint32_t priority_policy;       /* 1: waiting queue by priority then FCFS; 0: FCFS */
    uint32_t enable_prefix_caching; /* 1: reuse cached full blocks of matching prefixes */
    uint32_t sliding_window;        /* attend to the last N tokens; 0: no window */
} pagedkv_scheduler_config;

/* A generation request. */
typedef struct pagedkv_request {
    uint64_t id;              /* caller-chosen, unique among live requests */
    const uint32_t *prompt;   /* prompt_len token ids, borrowed for the call */
    uint64_t prompt_len;      /* at least 1 */
    uint32_t max_tokens;      /* tokens to generate at most, at least 1 */
    int64_t stop_token;       /* finish when sampled; -1: none */
    int32_t priority;         /* lower first under the priority policy (since 0.2) */
    uint32_t has_cache_salt;  /* 1: cache_salt keeps this prefix cache apart */
    uint64_t cache_salt;
} pagedkv_request;

/* One sequence's part of a step. */
typedef struct pagedkv_scheduled_seq {
    uint64_t seq;            /* sequence id */
    uint64_t request;        /* its request id */
    uint32_t is_prefill;     /* 1: prefill (several new tokens); 0: decode (one) or
                              * a verify row (after the decodes; see
                              * pagedkv_set_lookahead) */
    uint32_t start_pos;      /* position of its first new token */
    uint32_t num_new_tokens; /* new tokens this step */
    uint32_t context_len;    /* tokens in its cache after this step */
    uint32_t token_offset;   /* offset of its first new token in slot_mapping */
    uint32_t num_draft_tokens; /* since 0.2: drafts a verify row checks (its
                                * num_new_tokens = num_draft_tokens + 1), else 0 */
} pagedkv_scheduled_seq;

/* A step's batch: device-ready arrays. The library owns them; they stay valid, and
 * unchanged, until the next pagedkv_step() or pagedkv_scheduler_destroy() on the same
 * scheduler: pagedkv_on_step_done() and pagedkv_abort() in between (a sequence that
 * finishes or is aborted) leave them as they were. Rows may read blocks another row
 * of the same step writes (prompts that begin alike, admitted in one step, share the
 * first one's full blocks at once): in each layer, kv_append every new token (the
 * whole slot_mapping) before that layer's attention of any row. */
typedef struct pagedkv_batch {
    uint64_t num_seqs;                   /* scheduled sequences; 0: nothing could run */
    const pagedkv_scheduled_seq *seqs;   /* [num_seqs]; seqs[i] owns row i below */
    uint32_t max_blocks_per_seq;         /* row length of block_tables */
    uint32_t block_size;                 /* tokens per block of the tables and slots
                                            (the scheduler's): pass the same to every
                                            kernel call of the step */
    const int32_t *block_tables;         /* [num_seqs, max_blocks_per_seq], 0-padded */
    const int32_t *context_lens;         /* [num_seqs] */
    uint64_t num_slots;                  /* new tokens this step */
    const int64_t *slot_mapping;         /* [num_slots]; -1: do not store */
    uint64_t num_copies;
    const uint32_t *copies;              /* [num_copies, 2] (src, dst): before the kernels */
    uint64_t num_swap_out;
    const uint32_t *swap_out;            /* [num_swap_out, 2] (device, host): first */
    uint64_t num_swap_in;
    const uint32_t *swap_in;             /* [num_swap_in, 2] (host, device): after swap-outs */
} pagedkv_batch;

/* One layer group's block tables and slot mapping of the last step (a scheduler made
 * with pagedkv_scheduler_create_groups(): models that mix sliding-window and
 * full-attention layers). Rows and tokens as the batch's; valid, and unchanged, as
 * long as the batch's arrays. */
typedef struct pagedkv_group_tables {
    const int32_t *block_tables;  /* [num_seqs, max_blocks_per_seq], 0-padded (and 0
                                     before the group's window) */
    const int64_t *slot_mapping;  /* [num_slots]: the new tokens' slots in this group's
                                     blocks; -1: do not store */
    uint32_t sliding_window;      /* the group's window in tokens; 0: full attention */
    uint32_t reserved;            /* 0 */
} pagedkv_group_tables;

/* The token sampled for one scheduled sequence. */
typedef struct pagedkv_sampled {
    uint64_t seq;
    uint32_t token;
    uint32_t reserved; /* 0 */
} pagedkv_sampled;

/* Counters and gauges after the last step. */
typedef struct pagedkv_metrics {
    uint64_t steps;
    uint32_t blocks_used;        /* blocks held by sequences */
    uint32_t blocks_free;        /* free blocks, cached ones included */
    uint32_t blocks_cached_free; /* free blocks still holding a reusable prefix */
    uint32_t reserved;           /* 0 */
    double kv_utilization;       /* tokens stored / slots of held blocks */
    uint64_t running;            /* request groups running */
    uint64_t waiting;            /* request groups waiting */
    uint64_t swapped;            /* request groups swapped out */
    uint64_t preempted_recompute;
    uint64_t preempted_swap;
    uint64_t prefix_queried_tokens;
    uint64_t prefix_hit_tokens;
} pagedkv_metrics;

/* Fills *out with the defaults: 1024 blocks of 16 tokens, no swap, FCFS, no prefix
 * caching, no window, max_model_len 4096, 256 sequences, 8192 tokens per step. */
pagedkv_status pagedkv_scheduler_config_default(pagedkv_scheduler_config *out);

/* Creates a scheduler from *config (validated: an invalid config is
 * PAGEDKV_ERR_INVALID_ARGUMENT). On success *out owns a new handle; release it with
 * pagedkv_scheduler_destroy(). */
pagedkv_status pagedkv_scheduler_create(const pagedkv_scheduler_config *config,
                                        pagedkv_scheduler **out);

/* Creates a scheduler for a model of layer groups (since 0.2): group_windows[g] is
 * group g's sliding window in tokens, 0 for full attention, 1 to 64 groups sharing
 * the pool (config->sliding_window must be 0). A block id then names token slots in
 * the layers of one group only; each group keeps its own block table per sequence, a
 * window group only its window's blocks; a prefix hit is what every group serves.
 * Each step's batch carries group 0's tables (as pagedkv_batch's), the others through
 * pagedkv_batch_group(). copies, swap_out and swap_in are blocks of the one pool: run
 * them on every K/V tensor. */
pagedkv_status pagedkv_scheduler_create_groups(const pagedkv_scheduler_config *config,
                                               const uint32_t *group_windows,
                                               uint64_t num_groups, pagedkv_scheduler **out);

/* Destroys the scheduler and everything it owns, batch arrays included. Destroying
 * the same handle twice is PAGEDKV_ERR_INVALID_STATE. While another call on s runs (on
 * another thread, or re-entrantly) this is PAGEDKV_ERR_INVALID_STATE and s stays alive:
 * see "Destroy racing another call" above. */
pagedkv_status pagedkv_scheduler_destroy(pagedkv_scheduler *s);

/* Queues a request (the prompt is copied). *out_seq receives its sequence id. An empty
 * prompt, zero max_tokens, a duplicate id, or a request that could never fit the pool
 * or max_model_len is PAGEDKV_ERR_INVALID_ARGUMENT. Every one of these checks comes
 * before req->prompt is read: a refused request never reads its prompt, so prompt_len
 * may be anything then (the message ends "(nothing was read)"). */
pagedkv_status pagedkv_add_request(pagedkv_scheduler *s, const pagedkv_request *req,
                                   uint64_t *out_seq);

/* Ends a request wherever it is (waiting, running, swapped) and frees its blocks.
 * An unknown id is PAGEDKV_ERR_UNKNOWN_ID. Not allowed between a step and its
 * pagedkv_on_step_done() (PAGEDKV_ERR_INVALID_STATE). */
pagedkv_status pagedkv_abort(pagedkv_scheduler *s, uint64_t request_id);

/* Plans the next step into *out (see pagedkv_batch for the arrays' lifetime).
 * Feed the sampled tokens back with pagedkv_on_step_done() before the next step. */
pagedkv_status pagedkv_step(pagedkv_scheduler *s, pagedkv_batch *out);

/* Layer group `group`'s tables of the last step into *out (since 0.2; group 0's are
 * the batch's own). A group the scheduler does not have is
 * PAGEDKV_ERR_INVALID_ARGUMENT. */
pagedkv_status pagedkv_batch_group(pagedkv_scheduler *s, uint32_t group,
                                   pagedkv_group_tables *out);

/* What one scheduled sequence keeps of a step (pagedkv_on_step_done_accepted): its
 * next num_tokens tokens of the call's tokens array. */
typedef struct pagedkv_accepted {
    uint64_t seq;
    uint32_t num_tokens; /* 0 to its num_new_tokens (a prefill row: exactly 1) */
    uint32_t reserved;   /* 0 */
} pagedkv_accepted;

/* Takes one sampled token per scheduled sequence of the last step (n entries, each
 * scheduled sequence exactly once; otherwise nothing changes and an error says why).
 * n is compared with the last step's num_seqs before sampled is read: a different n is
 * PAGEDKV_ERR_INVALID_ARGUMENT, and a call with no step waiting for its tokens (none
 * yet, an empty batch, or already done) is PAGEDKV_ERR_INVALID_STATE. sampled may be
 * null only when n is 0. *out_finished (may be null) receives how many sequences
 * finished (stop token or max_tokens); their blocks are already free. */
pagedkv_status pagedkv_on_step_done(pagedkv_scheduler *s, const pagedkv_sampled *sampled,
                                    uint64_t n, uint64_t *out_finished);

/* Speculative decoding (since 0.2). Sets how many draft tokens sequence seq asks to
 * verify in each of its decode steps from the next pagedkv_step() on (0: plain
 * decodes; at most 63). Its decode then is a verify row: slots for the token sampled
 * last step and up to k drafts (fewer when the step's budget or the free blocks run
 * short: drafts never preempt), after the decodes, causal within the row. An unknown
 * sequence is PAGEDKV_ERR_UNKNOWN_ID, k > 63 PAGEDKV_ERR_INVALID_ARGUMENT, a call
 * between a step and its on_step_done PAGEDKV_ERR_INVALID_STATE. */
pagedkv_status pagedkv_set_lookahead(pagedkv_scheduler *s, uint64_t seq, uint32_t k);

/* Takes what every sequence of the last step keeps (since 0.2): rows[i] names a
 * scheduled sequence and how many of tokens are its own, in order: the accepted
 * drafts, then the token sampled after them (num_tokens 0 rolls the row back: its
 * slots are freed, nothing of it is cached). n is checked against the last step's
 * num_seqs before rows is read, and the rows' counts' sum against num_tokens before
 * tokens is read.
 * A stop token or max_tokens among a row's tokens ends it there. Otherwise as
 * pagedkv_on_step_done(). */
pagedkv_status pagedkv_on_step_done_accepted(pagedkv_scheduler *s,
                                             const pagedkv_accepted *rows, uint64_t n,
                                             const uint32_t *tokens, uint64_t num_tokens,
                                             uint64_t *out_finished);

/* Drops every cached prefix (after a weight update the cached blocks' K/V is stale, yet
 * a prefix hit would serve it). PAGEDKV_ERR_INVALID_STATE, nothing changed, while any
 * request runs or is swapped out (their blocks are in use: finish or abort them first;
 * waiting requests are fine), or between a step and its pagedkv_on_step_done(). */
pagedkv_status pagedkv_reset_prefix_cache(pagedkv_scheduler *s);

/* *out_idle = 1 when nothing waits, runs or is swapped out, else 0. */
pagedkv_status pagedkv_is_idle(pagedkv_scheduler *s, uint32_t *out_idle);

/* The metrics as of the last step. */
pagedkv_status pagedkv_get_metrics(pagedkv_scheduler *s, pagedkv_metrics *out);

/* Copies up to cap token ids of live sequence seq (prompt first) into out, and its
 * total token count into *out_len. Call with cap = 0 (out may be null) to ask the
 * length. An unknown or finished sequence is PAGEDKV_ERR_UNKNOWN_ID. */
pagedkv_status pagedkv_seq_tokens(pagedkv_scheduler *s, uint64_t seq, uint32_t *out,
                                  uint64_t cap, uint64_t *out_len);

/* ---------------------------------------------------------------------------------- */
/* CPU reference kernels (f32 buffers, f64 arithmetic): the ground truth               */
/* ---------------------------------------------------------------------------------- */

/* Shapes of a decode-attention call. */
typedef struct pagedkv_decode_shape {
    uint32_t num_seqs;           /* sequences, one query token each */
    uint32_t num_q_heads;        /* a multiple of num_kv_heads */
    uint32_t num_kv_heads;
    uint32_t head_dim;           /* 32, 64, 80, 96, 112, 128 or 256 */
    uint32_t block_size;         /* 8, 16 or 32 */
    uint32_t num_blocks;         /* blocks in the cache */
    uint32_t max_blocks_per_seq; /* row length of block_tables */
    uint32_t reserved;           /* 0 */
} pagedkv_decode_shape;

/* Paged decode attention on the CPU. q, out: [num_seqs, num_q_heads, head_dim];
 * key_cache, value_cache: [num_blocks, num_kv_heads, block_size, head_dim] (cache_len
 * elements each); block_tables: [num_seqs, max_blocks_per_seq]; context_lens:
 * [num_seqs], each 1..max_blocks_per_seq*block_size. Each *_len is the buffer's element
 * count and must match the shapes; every block id a sequence reads must be in the
 * cache. Any mismatch is PAGEDKV_ERR_INVALID_ARGUMENT and out is left untouched; the
 * lengths are checked against the shape before any buffer is read. */
pagedkv_status pagedkv_reference_decode_attention(
    const pagedkv_decode_shape *shape, float scale, const float *q, uint64_t q_len,
    const float *key_cache, const float *value_cache, uint64_t cache_len,
    const int32_t *block_tables, uint64_t block_tables_len, const int32_t *context_lens,
    uint64_t context_lens_len, float *out, uint64_t out_len);

/* kv_append on the CPU: writes token i's K and V rows (key, value: [num_tokens,
 * num_kv_heads, head_dim]) into slot slot_mapping[i] of the caches ([num_blocks,
 * num_kv_heads, block_size, head_dim], cache_len elements each); negative slots are
 * skipped. A slot outside the cache or written twice is PAGEDKV_ERR_INVALID_ARGUMENT
 * and the caches are left untouched. */
pagedkv_status pagedkv_reference_kv_append(uint32_t num_blocks, uint32_t num_kv_heads,
                                           uint32_t block_size, uint32_t head_dim,
                                           const float *key, const float *value,
                                           uint64_t num_tokens, const int64_t *slot_mapping,
                                           float *key_cache, float *value_cache,
                                           uint64_t cache_len);

/* ---------------------------------------------------------------------------------- */
/* CUDA backend on caller-supplied device pointers                                     */
/* ---------------------------------------------------------------------------------- */

/* Every kv_append and decode function below is one-shot: each call plans a step of its
 * own (validates the metadata, allocates and uploads it, launches, frees in stream
 * order), through the same launch code as the library's step path. Convenient; an
 * engine's per-layer loop pays those allocations and uploads on every call. */

/* Element type of device buffers (passed as int32_t). E4M3 and E5M2 (OCP fp8, one byte)
 * are cache types only: a cache of them serves f16 or bf16 queries through the _fp8
 * functions below, with one K and one V scale per KV head (pagedkv_kv_scales). Any
 * other value, or an fp8 type where queries, outputs or new K/V are meant, is
 * PAGEDKV_ERR_INVALID_ARGUMENT. */
typedef enum pagedkv_dtype {
    PAGEDKV_F16 = 0,
    PAGEDKV_BF16 = 1,
    PAGEDKV_F32 = 2,
    PAGEDKV_E4M3 = 3, /* fp8 e4m3, finite to +-448, no infinity: cache type only */
    PAGEDKV_E5M2 = 4  /* fp8 e5m2, finite to +-57344: cache type only */
} pagedkv_dtype;

/* The per-KV-head scales of an fp8 cache: K element b of KV head h stands for
 * decode(b) * k[h], V likewise with v[h]; kv_append stores encode(x / k[h]) (rounded to
 * nearest even, saturated to the format's finite range). Host memory, read during the
 * call only. */
typedef struct pagedkv_kv_scales {
    const float *k; /* [len]: K scale of each KV head, finite and > 0 */
    const float *v; /* [len]: V scale of each KV head, finite and > 0 */
    uint64_t len;   /* elements of k and of v: the number of KV heads */
} pagedkv_kv_scales;

/* Calibrates an fp8 cache's scales on the CPU: per KV head, the largest magnitude of
 * its elements in keys (values), over num_tokens rows of [num_kv_heads, head_dim] f32,
 * divided by cache_dtype's largest finite value (448 for E4M3, 57344 for E5M2); 1 for a
 * head that is all zeros. out_k and out_v receive num_kv_heads floats each, written
 * only on success (for one scale per tensor, use the largest of them for every head).
 * A cache_dtype that is not fp8, zero heads or head_dim, a non-finite input, or a size
 * that overflows is PAGEDKV_ERR_INVALID_ARGUMENT; a null pointer, PAGEDKV_ERR_NULL. */
pagedkv_status pagedkv_kv_scales_calibrate(int32_t cache_dtype, uint32_t num_kv_heads,
                                           uint32_t head_dim, const float *keys,
                                           const float *values, uint64_t num_tokens,
                                           float *out_k, float *out_v);

/* An opaque CUDA backend: a context on one device, a stream, the loaded kernels. */
typedef struct pagedkv_cuda_backend pagedkv_cuda_backend;

/* Creates a backend on device `ordinal` with the PTX embedded in the library (sm_90 PTX
 * on compute capability 9.x and newer, sm_80 on 8.x). The driver is loaded at run time:
 * without one, or without a device, this is PAGEDKV_ERR_CUDA with the message
 * "no CUDA driver found ..." or "no CUDA device: ...". Release with
 * pagedkv_cuda_backend_destroy(). */
pagedkv_status pagedkv_cuda_backend_create(int32_t ordinal, pagedkv_cuda_backend **out);

/* As pagedkv_cuda_backend_create(), but every copy and launch of the backend goes to
 * `stream` (a CUstream / cudaStream_t of device `ordinal`'s primary context, owned by
 * the caller and kept alive until the backend is destroyed), so pagedkv's work orders
 * with the caller's. NULL: the context's default stream. */
pagedkv_status pagedkv_cuda_backend_create_on_stream(int32_t ordinal, void *stream,
                                                     pagedkv_cuda_backend **out);

/* Waits for the backend's stream, then destroys it. Twice is
 * PAGEDKV_ERR_INVALID_STATE; so is a destroy while another call on b runs (b stays
 * alive), as for pagedkv_scheduler_destroy(). */
pagedkv_status pagedkv_cuda_backend_destroy(pagedkv_cuda_backend *b);

/* Waits for all work the backend has queued. */
pagedkv_status pagedkv_cuda_synchronize(pagedkv_cuda_backend *b);

/* kv_append on the GPU. key, value, key_cache, value_cache are device pointers
 * (CUdeviceptr) the caller owns, in the backend's context: key/value [num_tokens,
 * num_kv_heads, head_dim], caches [num_blocks, num_kv_heads, block_size, head_dim], all
 * of `dtype`. slot_mapping is host memory (num_tokens entries, negative: skip),
 * validated before the launch. Asynchronous on the backend's stream: the caller keeps
 * the buffers alive and unused until pagedkv_cuda_synchronize(). `dtype` is F16, BF16
 * or F32; an fp8 one is PAGEDKV_ERR_INVALID_ARGUMENT (fp8 caches: the _fp8 functions). */
pagedkv_status pagedkv_cuda_kv_append(pagedkv_cuda_backend *b, uint32_t num_blocks,
                                      uint32_t num_kv_heads, uint32_t block_size,
                                      uint32_t head_dim, int32_t dtype, uint64_t key,
                                      uint64_t value, uint64_t num_tokens,
                                      const int64_t *slot_mapping, uint64_t key_cache,
                                      uint64_t value_cache);

/* Paged decode attention on the GPU. q, out: device [num_seqs, num_q_heads, head_dim];
 * key_cache, value_cache: device [num_blocks, num_kv_heads, block_size, head_dim]; all
 * of `dtype`. block_tables ([num_seqs, max_blocks_per_seq]) and context_lens
 * ([num_seqs]) are host memory, validated before anything is launched (the batch's
 * arrays from pagedkv_step() fit as they are). Split-K is planned from the device.
 * Asynchronous on the backend's stream, like pagedkv_cuda_kv_append(). `dtype` as
 * there: F16, BF16 or F32. */
pagedkv_status pagedkv_cuda_decode_attention(pagedkv_cuda_backend *b,
                                             const pagedkv_decode_shape *shape,
                                             int32_t dtype, float scale, uint64_t q,
                                             uint64_t key_cache, uint64_t value_cache,
                                             const int32_t *block_tables,
                                             uint64_t block_tables_len,
                                             const int32_t *context_lens,
                                             uint64_t context_lens_len, uint64_t out);

/* kv_append into a cache of another type than the new K/V: as pagedkv_cuda_kv_append(),
 * with key and value of `dtype` (f16 or bf16) and the caches of `cache_dtype`. For an
 * fp8 cache (PAGEDKV_E4M3, PAGEDKV_E5M2), `scales` holds num_kv_heads K and V scales
 * and each element is stored as encode(x / scale); a cache of `dtype` itself takes
 * scales NULL (the same as pagedkv_cuda_kv_append()). The types and the scales are
 * checked first, before the backend handle, and nothing is launched when they fail:
 * an fp8 `dtype`, an fp8 cache under f32, scales for an unscaled cache, scales->len
 * other than num_kv_heads (checked before the arrays are read), or a scale that is not
 * finite and > 0 is PAGEDKV_ERR_INVALID_ARGUMENT; NULL scales (or scales->k, scales->v)
 * for an fp8 cache is PAGEDKV_ERR_NULL. */
pagedkv_status pagedkv_cuda_kv_append_fp8(pagedkv_cuda_backend *b, uint32_t num_blocks,
                                          uint32_t num_kv_heads, uint32_t block_size,
                                          uint32_t head_dim, int32_t dtype,
                                          int32_t cache_dtype,
                                          const pagedkv_kv_scales *scales, uint64_t key,
                                          uint64_t value, uint64_t num_tokens,
                                          const int64_t *slot_mapping, uint64_t key_cache,
                                          uint64_t value_cache);

/* Paged decode attention over a cache of another type than the queries: as
 * pagedkv_cuda_decode_attention(), with q and out of `dtype` (f16 or bf16) and the
 * caches of `cache_dtype`. For an fp8 cache, `scales` holds shape->num_kv_heads K and
 * V scales and the kernels read element b of KV head h as decode(b) * scales->k[h] (V
 * likewise); a cache of `dtype` itself takes scales NULL. shape, then the types and the
 * scales are checked first, before the backend handle, as for
 * pagedkv_cuda_kv_append_fp8(). */
pagedkv_status pagedkv_cuda_decode_attention_fp8(
    pagedkv_cuda_backend *b, const pagedkv_decode_shape *shape, int32_t dtype,
    int32_t cache_dtype, const pagedkv_kv_scales *scales, float scale, uint64_t q,
    uint64_t key_cache, uint64_t value_cache, const int32_t *block_tables,
    uint64_t block_tables_len, const int32_t *context_lens, uint64_t context_lens_len,
    uint64_t out);

/* Decode attention on the GPU like pagedkv_cuda_decode_attention(), with q and out as
 * rows q_row_stride / out_row_stride elements apart (0: dense, num_q_heads * head_dim),
 * so q can be a view into a fused QKV projection: q spans (num_seqs - 1) * q_row_stride
 * + num_q_heads * head_dim elements, out likewise. A stride is at least num_q_heads *
 * head_dim and a multiple of 16 bytes, and every device pointer is 16-byte aligned
 * (the kernels move 16-byte vectors), or the call is PAGEDKV_ERR_INVALID_ARGUMENT
 * naming it: never a misaligned-address fault. Asynchronous on the backend's stream.
 * It runs through the step path, which does not serve fp8 caches yet: an fp8 dtype is
 * PAGEDKV_ERR_INVALID_ARGUMENT (use pagedkv_cuda_decode_attention_fp8()). */
pagedkv_status pagedkv_cuda_decode_attention_strided(
    pagedkv_cuda_backend *b, const pagedkv_decode_shape *shape, int32_t dtype, float scale,
    uint64_t q, uint64_t q_row_stride, uint64_t key_cache, uint64_t value_cache,
    const int32_t *block_tables, uint64_t block_tables_len, const int32_t *context_lens,
    uint64_t context_lens_len, uint64_t out, uint64_t out_row_stride);

/* ---------------------------------------------------------------------------------- */
/* The merge of attention states                                                       */
/* ---------------------------------------------------------------------------------- */

/* Partial attention outputs of the same query rows over disjoint sets of keys (a shared
 * prefix and each row's own suffix, split-K partitions, ...), each normalised over its
 * own keys and given with its log-sum-exp in base 2 (log2 of the sum of exp of the
 * natural-unit scores: what the library's decode and prefill write), merged into the
 * attention over all their keys. A part of no keys has lse -INFINITY and its outputs
 * are never read. Attention sinks (one logit per head, natural units) join once, here:
 * the parts must be computed without them. */
typedef struct pagedkv_merge_shape {
    uint32_t num_rows;   /* 1..65535 */
    uint32_t num_states; /* partial states per row, at least 1 */
    uint32_t num_heads;
    uint32_t head_dim;   /* 32, 64, 80, 96, 112, 128 or 256 */
} pagedkv_merge_shape;

/* The merge on the CPU (the library's kernel, emulated), f32 host buffers: v
 * [num_rows, num_states, num_heads, head_dim]; lse [num_rows, num_states, num_heads];
 * sinks [num_heads] or NULL with sinks_len 0; out [num_rows, num_heads, head_dim];
 * lse_out [num_rows, num_heads] (the merged log-sum-exp) or NULL with lse_out_len 0.
 * Each *_len is the buffer's element count and must match the shape, checked before
 * anything is read; on any error the outputs are left untouched. The outputs must not
 * overlap the inputs. */
pagedkv_status pagedkv_merge_states(const pagedkv_merge_shape *shape, const float *v,
                                    uint64_t v_len, const float *lse, uint64_t lse_len,
                                    const float *sinks, uint64_t sinks_len, float *out,
                                    uint64_t out_len, float *lse_out, uint64_t lse_out_len);

/* The merge on the GPU, on device buffers: v and out of dtype (PAGEDKV_F16, _BF16 or
 * _F32), lse and lse_out f32 (lse_out 0: not written), every pointer 16-byte aligned,
 * the outputs overlapping no input; sinks is host memory as above. Asynchronous on the
 * backend's stream. */
pagedkv_status pagedkv_cuda_merge_states(pagedkv_cuda_backend *b,
                                         const pagedkv_merge_shape *shape, int32_t dtype,
                                         uint64_t v, uint64_t lse, const float *sinks,
                                         uint64_t sinks_len, uint64_t out, uint64_t lse_out);

#ifdef __cplusplus
}
#endif

#endif /* PAGEDKV_H */

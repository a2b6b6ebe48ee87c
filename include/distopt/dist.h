/* distopt — distributed optimizers: the registry's optimizers on
 * tensor-parallel and ZeRO-sharded parameters, bitwise equal to the
 * single-device reference (docs/distributed.md).
 *
 * Plugins (ColossalAI's booster names), all one mechanism over (tp, dp, zero):
 *   ddp     tp = 1, zero 0: averaged all-reduce of gradients, full-replica step
 *   zero    tp = 1, zero 1 (all-reduce, step the shard, all-gather parameters)
 *           or 2 (reduce-scatter instead of all-reduce)
 *   hybrid  tp ≥ 1 × dp ≥ 1, zero 0, 1 or 2
 *   fsdp    zero 3: parameters stay sharded between steps (gathered on demand)
 *   gemini  zero 3 over chunks of packed tensors (chunk_elems)
 *   moe_hybrid  hybrid (zero 0-2) with expert parallelism: each expert's
 *           parameters on one ep rank's expert-data-parallel group (ep, moe_dp,
 *           experts; docs/distributed.md "MoE-Hybrid")
 *
 * Layout. Each parameter has a logical shape and a tensor-parallel role
 * (Megatron's names; ColossalAI's code inverts them):
 *   DOPT_TP_REPLICATED  every TP rank holds the whole tensor (LayerNorm, biases
 *                       of row-parallel layers, anything not split)
 *   DOPT_TP_COLUMN      split along dim -2 (dim 0 of a 1-D tensor): the output
 *                       dim of a column-parallel linear weight [out, in], a
 *                       vocab-parallel embedding [vocab, hidden], a
 *                       column-parallel bias [out]
 *   DOPT_TP_ROW         split along dim -1: the input dim of a row-parallel
 *                       linear weight [out, in] (≥ 2-D tensors only)
 * A TP split that does not divide evenly is uneven, not padded: TP rank r
 * holds base + (r < rem) rows/columns (base = n / tp, rem = n % tp), possibly
 * none. With ZeRO the TP-local tensor is flattened, zero-padded to a multiple
 * of dp and split evenly (ColossalAI LowLevelZero); padding never enters a
 * statistic or a count.
 *
 * Usage on every rank (collective calls marked [C]):
 *   build the plain optimizer from the registry with the *logical* initial
 *   parameters (dopt_optim_create/add_group/add_param);
 *   dopt_dist_create(plain, &cfg, roles, &d)                [C]
 *   per micro-batch: dopt_dist_backward(d, local_grads)      (TP-local gradients)
 *   dopt_dist_step(d, &info)                                [C]
 *   dopt_dist_gather_param / _gather_state / _gather_work   [C]
 */
#ifndef DISTOPT_DIST_H
#define DISTOPT_DIST_H

#include <stddef.h>
#include <stdint.h>

#include "distopt/device.h"
#include "distopt/layout.h"
#include "distopt/dpsum.h"
#include "distopt/optim.h"
#include "distopt/transport.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct dopt_dist_optim dopt_dist_optim;

typedef struct dopt_dist_config {
  uint32_t struct_size;
  uint32_t version;
  const char *plugin;       /* "ddp", "zero", "hybrid", "fsdp", "gemini", "moe_hybrid" (dopt_dist_plugin_at) */
  int zero_stage;           /* 0..3 (see the plugin list) */
  dopt_transport tp;        /* this rank's tensor-parallel group */
  dopt_transport dp;        /* this rank's data-parallel (= ZeRO) group */
  const dopt_device *device; /* NULL: dopt_device_cpu() */
  double max_grad_norm;     /* global gradient-norm clipping; 0 = off */
  int skip_nonfinite;       /* skip the whole step when any gradient is NaN/Inf */
  /* v2: the step's statistics are reduced in buckets of consecutive
   * parameters whose step frames (scratch the step keeps between its
   * reduction phases, about one fp32 copy of the local shard for Adafactor,
   * CAME and LAMB) add up to at most this many bytes, estimated from the
   * logical sizes; each bucket costs one collective per transport and phase.
   * 0: all parameters in one bucket (fewest collectives, most memory). */
  size_t bucket_bytes;
  /* v3: how the data-parallel gradient sum is computed (distopt/dpsum.h):
   * 1 or 2 = exact on a shared fixed-point grid with that many int64 words
   * per element, summed by the transport's integer SUM (any reduction order
   * gives the same bits; 2·words × the fp32 traffic); 0 = the fp32 sum in the
   * transport's order (bitwise with the reference only in rank order). */
  int dp_sum_words;
  /* v3: 1 = the result does not depend on how the global batch is split
   * into dp ranks × micro-batches: every micro-batch gradient is kept until
   * the step (memory: micro-batches × the TP-local gradient per rank) and put
   * on the shared grid itself, so the sum is over all dp·micro micro-batch
   * gradients exactly, whatever their grouping. Needs dp_sum_words ≥ 1. */
  int batch_invariant;
  /* v4: pipeline stages (docs/distributed.md "Pipeline stages"). pp is this rank's pipeline group: the ranks
   * of every stage with this rank's tp and dp ranks, ordered by stage (pp.rank is this rank's stage; size 0
   * or 1: no pipeline, every parameter on this rank's stage). stages[i] is parameter i's stage in
   * [0, pp.size) (NULL: all on stage 0; read during dopt_dist_create only). A rank holds, reduces and steps
   * only its stage's parameters, each stage a tp × dp × ZeRO grid of its own; what spans the model is
   * reduced over pp as well: the non-finite skip, the clipping norm, step counts, counters, the replica
   * checks, gathers and checkpoints. */
  dopt_transport pp;
  const int *stages;
  /* v5: Gemini's chunks (plugin "gemini", zero_stage 3; docs/distributed.md "Gemini: chunked ZeRO"): each
   * TP rank's blocks, in parameter order, packed into chunks of chunk_elems elements (rounded up to a
   * multiple of dp) as ColossalAI's ChunkManager packs tensors: a block joins the open chunk when it fits,
   * else opens the next one; a block larger than a chunk has a chunk of its own (its size rounded up to a
   * multiple of dp). Every chunk is split evenly over dp, so a rank's shard starts and ends inside blocks
   * and holds pieces of several; optimizer states are sharded the same way. 0 with every other plugin. */
  size_t chunk_elems;
  /* v6: MoE-Hybrid (plugin "moe_hybrid"; docs/distributed.md "MoE-Hybrid"), as ColossalAI's
   * MoeHybridParallelPlugin with ep inside dp: dp = moe_dp · ep, dp rank = moe_dp rank · ep + ep rank.
   * experts[i] is parameter i's expert id in [0, num_experts) or -1 for a dense parameter (NULL: all dense;
   * read during dopt_dist_create only). Expert e lives on ep rank r when e is in r's run of the experts: the
   * first num_experts mod ep ranks hold one more (ep rank r holds [r·base + min(r, rem), …)). An expert
   * parameter is held only by the ranks of its ep rank (the others see an empty block, as another stage's
   * parameter), replicated over moe_dp and ZeRO-sharded within it; its gradient is summed exactly over moe_dp
   * only and averaged over moe_dp · micro-batches. ep: this rank's expert-parallel group (the ranks with its
   * stage, tp and moe_dp ranks, ordered by ep rank); moe_dp: its expert-data-parallel group (its stage, tp and
   * ep ranks, ordered by moe_dp rank). ep size 0 or 1: no expert parallelism (moe_dp is dp).
   * experts[i] = DOPT_DIST_EXPERT_STACK: parameter i is a stack of every expert along dimension 0 (ndim >= 3,
   * shape[0] = num_experts, any TP role within the experts). Each ep rank steps and keeps the states of its
   * experts' slices only, ZeRO-sharded over its moe_dp ranks (zero 1 or 2; the shards are exact ranges of the
   * TP block, so the exact dp sum and the dp transport's all_to_allv are needed); its gradient (the whole TP
   * block, as a dense parameter's) counts only for the rank's own experts (the others' slices are taken as
   * zeros: no tokens reached them), summed exactly over dp and divided by moe_dp · micro-batches; its fp32
   * values and gradient buffer stay whole TP blocks on every rank, as a dense parameter's up to ZeRO-2. */
  dopt_transport ep;
  dopt_transport moe_dp;
  const int *experts;
  int num_experts;
} dopt_dist_config;

#define DOPT_DIST_CONFIG_VERSION 6
#define DOPT_DIST_EXPERT_STACK (-2)
#define DOPT_DIST_CONFIG_V1_SIZE ((uint32_t)offsetof(dopt_dist_config, bucket_bytes))
#define DOPT_DIST_CONFIG_V2_SIZE ((uint32_t)offsetof(dopt_dist_config, dp_sum_words))
#define DOPT_DIST_CONFIG_V3_SIZE ((uint32_t)offsetof(dopt_dist_config, pp))
#define DOPT_DIST_CONFIG_V4_SIZE ((uint32_t)offsetof(dopt_dist_config, chunk_elems))
#define DOPT_DIST_CONFIG_V5_SIZE ((uint32_t)offsetof(dopt_dist_config, ep))
#define DOPT_DIST_BUCKET_BYTES_DEFAULT ((size_t)64 << 20)
#define DOPT_DIST_CONFIG_INIT \
  { sizeof(dopt_dist_config), DOPT_DIST_CONFIG_VERSION, "hybrid", 0, {0}, {0}, NULL, 0.0, 1, \
    DOPT_DIST_BUCKET_BYTES_DEFAULT, DOPT_DP_SUM_DEFAULT_WORDS, 0, {0}, NULL, 0, {0}, {0}, NULL, 0 }

/* MoE-Hybrid: the ep rank that holds expert e of num_experts over ep ranks (the first num_experts mod ep ranks
 * hold one more; ep rank r holds a contiguous run of expert ids). -1 when an argument is out of range. */
DOPT_API int dopt_dist_expert_rank(int expert, int num_experts, int ep);

/* One plugin (ColossalAI's booster names: ddp, zero, hybrid, fsdp, gemini, moe_hybrid) and the layouts it
 * allows: the one table the library's check and the CLI read. */
typedef struct dopt_dist_plugin {
  const char *name;
  int tp_one;                         /* 1: tp must be 1 */
  int zero_lo, zero_hi, zero_implied; /* the ZeRO stages it allows; the one a tool implies when none is given */
  const char *hint;                   /* where the layouts it refuses are */
} dopt_dist_plugin;

/* The i-th plugin (0 ≤ i; NULL past the last), and the plugin of that name (NULL: unknown). */
DOPT_API const dopt_dist_plugin *dopt_dist_plugin_at(int i);
DOPT_API const dopt_dist_plugin *dopt_dist_plugin_find(const char *name);
/* 1 when plugin p allows tp and zero (p NULL: 0). */
DOPT_API int dopt_dist_plugin_allows(const dopt_dist_plugin *p, int tp, int zero);

/* Checks that (plugin, tp, dp, zero) is one of the plugins' layouts (the table above); the message names the
 * plugin, what it needs and where the refused layout is. */
DOPT_API dopt_status dopt_dist_check_layout(const char *plugin, int tp, int dp, int zero);

/* Converts a plain registry optimizer (its groups, hyperparameters and
 * parameters with their logical initial values) into its distributed
 * version on this rank (ColossalAI's cast_to_distributed + setup_distributed).
 * roles[i] is parameter i's TP role (NULL: all replicated). The plain
 * optimizer is only read; it must outlive nothing. [C] */
DOPT_API dopt_status dopt_dist_create(const dopt_optim *plain, const dopt_dist_config *cfg, const dopt_tp_role *roles,
                                      dopt_dist_optim **out);
DOPT_API void dopt_dist_destroy(dopt_dist_optim *d);

/* This rank's TP-local block of parameter i: its shape (the logical shape
 * with the split dim cut) and the offsets of the block in the logical
 * [b, h, w] view. Gradients passed to dopt_dist_backward have this shape. */
DOPT_API dopt_status dopt_dist_local_shape(const dopt_dist_optim *d, int param, int *ndim, int64_t *shape,
                                           size_t *numel);

/* This rank's piece of parameter i in the layout description (distopt/layout.h, docs/layout.md): its TP block
 * as a block of the logical tensor's split dimension (ndim−2 for COLUMN, ndim−1 for ROW, 0 for a 1-D COLUMN
 * tensor; none when replicated) and the flat range of that block whose averaged gradient this rank keeps after
 * the dp sum and steps (piecewise: its ZeRO shard, the whole block at zero 0; owner mode: the whole block on
 * the owner's dp row). len 0: the rank holds none of it (an uneven split, a shard of padding, not the owner,
 * another stage's or ep rank's parameter). Stage is −1 without a pipeline, expert −1 for a dense parameter. Over all ranks the pieces obey the
 * layout rule (dopt_layout_cover: TP-replicated and zero-0 pieces are replicas). */
DOPT_API dopt_status dopt_dist_layout(const dopt_dist_optim *d, int param, dopt_layout_piece *out);

/* Adds one micro-batch of this rank's TP-local gradients (host memory,
 * grads[i] per parameter) to the accumulators: the first gradient after a
 * step is copied, the next ones added in order (g0 + g1 + ...). grads[i] NULL:
 * no gradient in this micro-batch (torch's .grad untouched). A parameter that
 * no rank gave a gradient since the last step is skipped by the step exactly
 * as the reference skips a NULL gradient; a rank without one where others
 * have one contributes zeros (DDP's unused parameters). */
DOPT_API dopt_status dopt_dist_backward(dopt_dist_optim *d, const float *const *grads);

/* Where this rank's TP-local gradient of parameter i for the next micro-batch may be written in place (as DDP's
 * gradient_as_bucket_view): its accumulator (dopt_dist_local_shape's numel floats), when the next
 * dopt_dist_backward is the first since the step, micro-batches are summed (not batch invariant), the device's
 * buffers are host memory and this rank holds the parameter; else *out = NULL and the caller passes a buffer of
 * its own. A gradient handed to dopt_dist_backward at this address is taken where it is (no copy); the buffer may
 * be written until that call, and not after it. */
DOPT_API dopt_status dopt_dist_grad_buffer(dopt_dist_optim *d, int param, float **out);

typedef struct dopt_dist_step_info {
  int skipped;        /* 1: a non-finite gradient; nothing was updated */
  double grad_norm;   /* global norm of the averaged gradients, before clipping */
  int micro_batches;  /* accumulated micro-batches this step used */
} dopt_dist_step_info;

/* One optimizer step over the accumulated micro-batches: sum the gradients
 * over dp (exactly, or in the transport's order: dp_sum_words) and divide by
 * dp·micro_batches, check finiteness,
 * clip, step every parameter's piece, re-gather parameters (zero 1/2). [C] */
DOPT_API dopt_status dopt_dist_step(dopt_dist_optim *d, dopt_dist_step_info *info);
/* Train or evaluation mode (dopt_optim_set_mode, distributed): every rank moves its pieces of every parameter that
 * has stepped, and ZeRO 1/2 all-gather the new weights; a collective call of every rank. The step is refused in
 * evaluation mode. DOPT_ERR_UNSUPPORTED: an optimizer without modes, a device whose memory is not the host's. */
DOPT_API dopt_status dopt_dist_set_mode(dopt_dist_optim *d, int eval);
DOPT_API int dopt_dist_get_mode(const dopt_dist_optim *d);
DOPT_API int64_t dopt_dist_skipped_steps(const dopt_dist_optim *d);

/* Whether every rank holds the same `bytes` bytes (e.g. digests of what each
 * rank gathered: its own replica of every tensor) as world rank 0. On return,
 * on every rank, *rank is the lowest world rank ((stage · dp + dp rank) · tp +
 * tp rank) whose bytes differ from rank 0's, with *offset the first differing byte, or -1
 * when all agree. bytes ≤ 2^31, the same on every rank. [C] */
DOPT_API dopt_status dopt_dist_check_replicas(dopt_dist_optim *d, const void *mine, size_t bytes, int *rank,
                                              size_t *offset);
/* Collectives this rank issued for step statistics (norms, RMS, row/column
 * means, clipping) since creation: with batching O(buckets × transports ×
 * phases) per step, independent of the number of parameters. */
DOPT_API int64_t dopt_dist_stat_collectives(const dopt_dist_optim *d);

/* The whole logical parameter / working bf16 copy / state tensor (by
 * upstream key) of parameter i, assembled in host memory on every rank, or
 * in DOPT_DIST_GATHER_LEAD mode on the lead only. With pipeline stages it is
 * assembled in its stage and broadcast over pp from there (lead mode: each
 * stage's lead forwards it through a host buffer of its size). [C] */
DOPT_API dopt_status dopt_dist_gather_param(dopt_dist_optim *d, int param, float *out);
DOPT_API dopt_status dopt_dist_gather_work(dopt_dist_optim *d, int param, uint16_t *out);
DOPT_API dopt_status dopt_dist_gather_state(dopt_dist_optim *d, int param, const char *key, void *out);
/* Where the gathers deliver (the same mode on every rank): DOPT_DIST_GATHER_ALL
 * (the default) every rank; DOPT_DIST_GATHER_LEAD only the lead, the rank
 * that is rank 0 of its TP and of its DP group (world rank 0 in the Megatron
 * layout): the others send their pieces, may pass out NULL and hold no
 * logical-size buffer. Needs both transports' all_to_allv (DOPT_ERR_UNSUPPORTED
 * otherwise, the mode unchanged); owner-mode states still reach every rank. */
enum { DOPT_DIST_GATHER_ALL = 0, DOPT_DIST_GATHER_LEAD = 1 };
DOPT_API dopt_status dopt_dist_set_gather(dopt_dist_optim *d, int mode);
/* A run of lead-mode gathers read in place (called on every rank: collective).
 * Where the device is the CPU and the TP and DP transports read by reference
 * (all_to_allv_view: the simulator), without pipeline stages or expert
 * parallelism, begin hands the lead a table of where every rank holds each
 * parameter's fp32 values, bf16 copy and elementwise states (one exchange of
 * addresses over dp, then over tp); the gathers until end then copy each
 * piece once, from where it lies, into the lead's out and are no collective
 * (the other ranks return at once; blockwise and owner-mode states stay
 * collective); end releases the pieces (one barrier per group). In between
 * nothing may change what the ranks hold (dopt_dist_step and dopt_dist_load
 * fail with DOPT_ERR_STATE). Elsewhere, and in DOPT_DIST_GATHER_ALL mode, both
 * return at once and every gather stays its own collective. [C] */
DOPT_API dopt_status dopt_dist_gather_begin(dopt_dist_optim *d);
DOPT_API dopt_status dopt_dist_gather_end(dopt_dist_optim *d);
/* 1 on the lead (TP rank 0 and DP rank 0 of stage 0: world rank 0), else 0. */
DOPT_API int dopt_dist_is_lead(const dopt_dist_optim *d);
/* The replica check on what each rank holds: every piece that several ranks
 * hold (a parameter's fp32 values and bf16 copy below ZeRO-3 over dp, every
 * piece of a TP-replicated tensor over tp, the states that are not
 * elementwise everywhere, elementwise ones at ZeRO 0 over dp) against the same
 * piece on DP rank 0 and on TP rank 0, by SHA-256 of the held bytes: one
 * digest per held piece (the owner-mode states, held once, are not compared)
 * and two broadcasts of the digests, no logical-size buffer. Where a group's
 * transport reads by reference (all_to_allv_view: one address space) and the
 * device is the CPU, that group compares the held bytes themselves with
 * memcmp against its rank 0's, digesting nothing. On return, on
 * every rank: *rank the lowest world rank ((stage · dp + dp rank) · tp + tp rank) whose copy
 * differs (-1: none), *param its parameter and name (cap bytes) "p", "p/bf16"
 * or "p/<state key>". [C] */
DOPT_API dopt_status dopt_dist_check_held(dopt_dist_optim *d, int *rank, int *param, char *name, size_t cap);
/* The logical size in bytes of parameter i's state `key` (what gather_state writes). */
DOPT_API dopt_status dopt_dist_state_bytes(const dopt_dist_optim *d, int param, const char *key, size_t *bytes);
DOPT_API dopt_status dopt_dist_get_step(const dopt_dist_optim *d, int param, int64_t *step);
/* This rank's counters of parameter i (dopt_counters, distopt/optim.h): its
 * piece's counts; held: it holds a piece it steps; primary: that piece is its
 * first copy (a TP-replicated tensor's repeats over tp, a piecewise one's at
 * ZeRO 0 over dp), so a SUM counter's total is the sum over primaries. */
DOPT_API dopt_status dopt_dist_counters(const dopt_dist_optim *d, int param, dopt_counters *out);
typedef struct dopt_counter_diff {
  int param;           /* -1: every count equals the reference's */
  int counter;         /* dopt_counter id (dopt_counter_name) */
  int rank;            /* the world rank whose EACH count differs; -1: a SUM counter's total over the pieces */
  int64_t reference, distributed;
} dopt_counter_diff;
/* The counts of every parameter since the previous check (the step, or the
 * steps, taken since) against the reference's: ref is [np · DOPT_NCOUNTERS]
 * (row-major: the reference's `total` now minus at the previous check), read on
 * world rank 0 (the others may pass NULL). EACH counters must equal it on
 * every rank that holds a piece, SUM counters in total over the primary
 * pieces. *out, on every rank: the first difference by parameter, counter,
 * rank, or param -1. [C] */
DOPT_API dopt_status dopt_dist_check_counters(dopt_dist_optim *d, const int64_t *ref, dopt_counter_diff *out);

/* Checkpoints (docs/checkpoints.md). Save: every rank writes the pieces it
 * holds — its TP block or ZeRO range of each parameter, bf16 copy and
 * elementwise state; replicated and whole states once — to its own file of a
 * new generation of ckpt_dir; rank 0 writes the index last and makes the
 * generation visible. global_step < 0: steps + skipped steps. `plain` is the
 * optimizer d was created from (its groups, hyperparameters, names). Load: any
 * checkpoint of the same optimizer, hyperparameters and parameters, written
 * in any layout or by the single-device reference (dopt_optim_save); every
 * rank checks the metadata and every checksum before anything is loaded, and
 * all ranks fail together. Parameters, bf16 copies, states, step counts, the
 * optimizer's step clock (LISA's schedule) and the skipped-step count. [C] */
DOPT_API dopt_status dopt_dist_save(dopt_dist_optim *d, const dopt_optim *plain, const char *ckpt_dir,
                                    int64_t global_step);
DOPT_API dopt_status dopt_dist_load(dopt_dist_optim *d, const dopt_optim *plain, const char *path);

/* Bytes this rank holds: parameters (incl. masters/working copies), optimizer
 * states, gradient buffers. */
typedef struct dopt_dist_memory {
  size_t param_bytes, state_bytes, grad_bytes;
} dopt_dist_memory;
DOPT_API dopt_status dopt_dist_memory_usage(const dopt_dist_optim *d, dopt_dist_memory *out);


#ifdef __cplusplus
}
#endif
#endif

/* The options of a comparison (compare.h): defaults, parameter groups, the dp-sum names, what each plugin
 * allows and implies (the library's table), and the checks of a whole set before a run (harness.h). */
#include <errno.h>
#include <fnmatch.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "compare.h"
#include "distopt/cuda.h"
#include "distopt/dpsum.h"
#include "distopt/launch.h"
#include "distopt/mpi.h"
#include "distopt/safetensors.h"
#include "distopt/sim.h"
#include "files.h"
#include "internal.h"
#include "model.h"
#include "registry.h"
#include "verify.h"
#include "harness.h"

void cmp_options_default(cmp_options *o) {
  memset(o, 0, sizeof *o);
  snprintf(o->optimizer, sizeof o->optimizer, "adafactor");
  snprintf(o->plugin, sizeof o->plugin, "hybrid");
  o->tp = 2;
  o->dp = 2;
  o->zero = 2;
  o->pp = 1;
  o->ep = 1;
  o->steps = 100;
  o->micro = 1;
  snprintf(o->source, sizeof o->source, "synthetic");
  o->seed = 1;
  snprintf(o->backend, sizeof o->backend, "sim");
  snprintf(o->device, sizeof o->device, "cpu");
  o->dp_sum_words = DOPT_DP_SUM_DEFAULT_WORDS;
  o->resume_zero = -1;
  o->max_tp = 4;
  o->max_dp = 4;
  o->max_pp = 1;
}

dopt_status cmp_parse_layers_per_stage(const char *v, cmp_options *o) {
  int n = 0;
  const char *at = v;
  while (1) {
    char *end;
    errno = 0;
    const long x = strtol(at, &end, 10);
    if (end == at || errno || x < 1 || x > 1000000)
      return dopt__fail(DOPT_ERR_INVALID_ARG, "'%.64s': expected layer counts >= 1 separated by commas", v);
    if (n == CMP_PP_MAX) return dopt__fail(DOPT_ERR_INVALID_ARG, "more than %d stages", CMP_PP_MAX);
    o->layers_per_stage[n++] = (int)x;
    if (*end == '\0') break;
    if (*end != ',') return dopt__fail(DOPT_ERR_INVALID_ARG, "'%.64s': expected layer counts >= 1 separated by commas", v);
    at = end + 1;
  }
  o->nlps = n;
  return DOPT_OK;
}

dopt_status cmp_options_add_group(cmp_options *o, const char *glob, size_t glob_len, const char *hp) {
  if (o->ngroups >= CMP_MAX_GROUPS)
    return dopt__fail(DOPT_ERR_INVALID_ARG, "groups: more than %d groups", CMP_MAX_GROUPS);
  if (glob_len >= CMP_GLOB_MAX)
    return dopt__fail(DOPT_ERR_INVALID_ARG, "group %d: params pattern of %zu bytes (at most %d)", o->ngroups + 1,
                      glob_len, CMP_GLOB_MAX - 1);
  if (strlen(hp) >= CMP_GROUP_HP_MAX)
    return dopt__fail(DOPT_ERR_INVALID_ARG, "group %d: hyperparameters of %zu bytes (at most %d)", o->ngroups + 1,
                      strlen(hp), CMP_GROUP_HP_MAX - 1);
  const int n = o->ngroups;
  if ((n & (n - 1)) == 0) { /* 0, 1, 2, 4, ...: grow to the next power of two */
    cmp_group *g = realloc(o->groups, (size_t)(n ? 2 * n : 1) * sizeof *g);
    if (!g) return dopt__fail(DOPT_ERR_NO_MEMORY, "groups: %d groups", n + 1);
    o->groups = g;
  }
  memcpy(o->groups[n].glob, glob, glob_len);
  o->groups[n].glob[glob_len] = '\0';
  memcpy(o->groups[n].hp, hp, strlen(hp) + 1);
  o->ngroups = n + 1;
  return DOPT_OK;
}

void cmp_options_free(cmp_options *o) {
  free(o->groups);
  o->groups = NULL;
  o->ngroups = 0;
}

static const char *const DP_SUM_NAMES[] = {"rank-order", "exact", "exact2"};

int cmp_parse_dp_sum(const char *name) {
  for (int w = 0; w <= DOPT_DP_SUM_WORDS_MAX; w++)
    if (strcmp(name, DP_SUM_NAMES[w]) == 0) return w;
  return -1;
}

const char *cmp_dp_sum_name(int words) {
  return words >= 0 && words <= DOPT_DP_SUM_WORDS_MAX ? DP_SUM_NAMES[words] : "?";
}

uint64_t cmp_declared_ulp(const char *optimizer) {
  (void)optimizer; /* adamw, adafactor, came, lamb: every statistic is exact */
  return 0;
}

/* ---- plugins and the layouts they imply ---------------------------------------------- */

/* What each plugin allows and implies: the library's table (dopt_dist_plugin_find, the one dopt_dist_check_layout
 * judges by). */
void cmp_plugin_names(char *buf, size_t cap) {
  size_t at = 0;
  buf[0] = '\0';
  for (int i = 0; dopt_dist_plugin_at(i) && at < cap; i++) {
    const char *sep = i == 0 ? "" : dopt_dist_plugin_at(i + 1) ? ", " : " or ";
    int k = snprintf(buf + at, cap - at, "%s%s", sep, dopt_dist_plugin_at(i)->name);
    at += k > 0 ? (size_t)k : 0;
  }
}

const char *cmp_layout_plugin(int tp, int zero) {
  if (zero == 3) return "fsdp";
  if (tp == 1) return zero == 0 ? "ddp" : "zero";
  return "hybrid";
}

/* How the user spelled a given value: the YAML key when the file gave it, else the option. */
static const char *spelled(const cmp_options *o, unsigned bit) {
  static const struct {
    unsigned bit;
    const char *cli, *yaml;
  } N[] = {{CMP_GIVEN_PLUGIN, "--plugin", "plugin.type"},
           {CMP_GIVEN_TP, "--tp", "plugin.tp"},
           {CMP_GIVEN_ZERO, "--zero", "plugin.zero"},
           {CMP_GIVEN_RESUME_PLUGIN, "--resume-plugin", "checkpoint.resume.type"},
           {CMP_GIVEN_RESUME_TP, "--resume-tp", "checkpoint.resume.tp"},
           {CMP_GIVEN_RESUME_ZERO, "--resume-zero", "checkpoint.resume.zero"}};
  for (size_t k = 0; k < sizeof N / sizeof N[0]; k++)
    if (N[k].bit == bit) return (o->given_yaml & bit) ? N[k].yaml : N[k].cli;
  return "?";
}

/* One line: "--plugin ddp contradicts --zero 2: plugin ddp implies zero 0 (allowed: zero 0; hint)". */
static dopt_status contradiction(const cmp_options *o, unsigned pbit, const dopt_dist_plugin *r, unsigned vbit, int value,
                                 int is_tp) {
  char allowed[32] = "tp 1"; /* else every zero stage the plugin allows: "zero 0, 1 or 2" */
  for (int z = r->zero_lo, at = 0; !is_tp && z <= r->zero_hi; z++) {
    const char *sep = z == r->zero_lo ? "zero " : z == r->zero_hi ? " or " : ", ";
    at += snprintf(allowed + at, sizeof allowed - (size_t)at, "%s%d", sep, z);
  }
  return dopt__fail(DOPT_ERR_INVALID_ARG, "%s %s contradicts %s %d: plugin %s implies %s %d (allowed: %s; %s)",
                    spelled(o, pbit), r->name, spelled(o, vbit), value, r->name, is_tp ? "tp" : "zero",
                    is_tp ? 1 : r->zero_implied, allowed, r->hint);
}

static dopt_status unknown_plugin(const cmp_options *o, unsigned bit, const char *name) {
  char names[128];
  cmp_plugin_names(names, sizeof names);
  return dopt__fail(DOPT_ERR_NOT_FOUND, "%s '%s': unknown plugin (expected %s)", spelled(o, bit), name, names);
}

dopt_status cmp_apply_plugin(cmp_options *o) {
  DOPT_CHECK_ARG(o != NULL, "cmp_apply_plugin: o=NULL");
  cmp_options x = *o;
  const unsigned g = x.given;
  /* the first layout */
  const dopt_dist_plugin *r = dopt_dist_plugin_find(x.plugin);
  if (!r) return unknown_plugin(o, CMP_GIVEN_PLUGIN, x.plugin);
  if (g & CMP_GIVEN_PLUGIN) {
    if ((g & CMP_GIVEN_TP) && r->tp_one && x.tp != 1)
      return contradiction(o, CMP_GIVEN_PLUGIN, r, CMP_GIVEN_TP, x.tp, 1);
    if ((g & CMP_GIVEN_ZERO) && (x.zero < r->zero_lo || x.zero > r->zero_hi))
      return contradiction(o, CMP_GIVEN_PLUGIN, r, CMP_GIVEN_ZERO, x.zero, 0);
  } else if (!dopt_dist_plugin_allows(r, (g & CMP_GIVEN_TP) ? x.tp : 1, (g & CMP_GIVEN_ZERO) ? x.zero : r->zero_implied)) {
    /* no plugin given: the default (hybrid) unless the values given need another */
    const int ztp = (g & CMP_GIVEN_TP) ? x.tp : 2, zz = (g & CMP_GIVEN_ZERO) ? x.zero : r->zero_implied;
    r = dopt_dist_plugin_find(cmp_layout_plugin(ztp, zz));
    snprintf(x.plugin, sizeof x.plugin, "%s", r->name);
  }
  if (!(g & CMP_GIVEN_TP) && r->tp_one) x.tp = 1;
  if (!(g & CMP_GIVEN_ZERO)) x.zero = r->zero_implied;
  /* the resume layout: given values, else the first layout's where its plugin allows them */
  const int rp_given = (g & CMP_GIVEN_RESUME_PLUGIN) || x.resume_plugin[0];
  const int rtp_given = (g & CMP_GIVEN_RESUME_TP) || x.resume_tp > 0;
  const int rz_given = (g & CMP_GIVEN_RESUME_ZERO) || x.resume_zero >= 0;
  const int rtp = rtp_given ? x.resume_tp : x.tp, rz = rz_given ? x.resume_zero : x.zero;
  const dopt_dist_plugin *rr = r;
  if (rp_given) {
    rr = dopt_dist_plugin_find(x.resume_plugin);
    if (!rr) return unknown_plugin(o, CMP_GIVEN_RESUME_PLUGIN, x.resume_plugin);
    if (rtp_given && rr->tp_one && rtp != 1)
      return contradiction(o, CMP_GIVEN_RESUME_PLUGIN, rr, CMP_GIVEN_RESUME_TP, rtp, 1);
    if (rz_given && (rz < rr->zero_lo || rz > rr->zero_hi))
      return contradiction(o, CMP_GIVEN_RESUME_PLUGIN, rr, CMP_GIVEN_RESUME_ZERO, rz, 0);
  } else if (!dopt_dist_plugin_allows(rr, rtp, rz)) {
    /* no resume plugin given: the first layout's, unless the resume values given need another */
    rr = dopt_dist_plugin_find(cmp_layout_plugin(rtp, rz));
    snprintf(x.resume_plugin, sizeof x.resume_plugin, "%s", rr->name);
  }
  if (!rtp_given && rr->tp_one && x.tp != 1) x.resume_tp = 1;
  if (!rz_given && (x.zero < rr->zero_lo || x.zero > rr->zero_hi)) x.resume_zero = rr->zero_implied;
  *o = x;
  return DOPT_OK;
}


/* --pp with the plugin: only hybrid has a pipeline (ColossalAI's HybridParallelPlugin pp_size). */
static dopt_status check_pp(const char *plugin, int pp, int tp, int dp, const char *what) {
  DOPT_CHECK_ARG(pp >= 1 && pp <= CMP_PP_MAX && (long)pp * tp * dp <= 64,
                 "%spp=%d tp=%d dp=%d: pp >= 1, pp*tp*dp <= 64", what, pp, tp, dp);
  (void)plugin; /* stages are a layer partition under any plugin: hybrid and moe_hybrid have ColossalAI's pp_size,
                   fsdp with stages is torchtitan's PP + FSDP, and the library steps gemini and ddp/zero with them */
  return DOPT_OK;
}

/* --ep with the plugin: expert parallelism is moe_hybrid's, over ep ranks that divide dp. */
static dopt_status check_ep(const char *plugin, int ep, int dp, const char *what) {
  DOPT_CHECK_ARG(ep >= 1 && ep <= 64, "%sep=%d outside [1, 64]", what, ep);
  DOPT_CHECK_ARG(ep == 1 || strcmp(plugin, "moe_hybrid") == 0,
                 "%sep=%d needs plugin moe_hybrid (ColossalAI's MoeHybridParallelPlugin ep_size), not '%s'", what, ep,
                 plugin);
  DOPT_CHECK_ARG(dp % ep == 0, "%sep=%d must divide dp=%d (moe_dp = dp / ep)", what, ep, dp);
  return DOPT_OK;
}

dopt_status ce_check_options(const cmp_options *o) {
  DOPT_CHECK_ARG(o->tp >= 1 && o->dp >= 1 && o->tp * o->dp <= 64, "tp=%d dp=%d: each >= 1, tp*dp <= 64", o->tp, o->dp);
  DOPT_TRY(check_pp(o->plugin, o->pp, o->tp, o->dp, ""));
  DOPT_TRY(check_ep(o->plugin, o->ep, o->dp, ""));
  DOPT_CHECK_ARG(o->nlps == 0 || o->nlps == o->pp, "layers_per_stage: %d stages given, pp=%d", o->nlps, o->pp);
  DOPT_CHECK_ARG(o->chunk_size == 0 || strcmp(o->plugin, "gemini") == 0,
                 "chunk_size=%zu is Gemini's chunk: it needs plugin gemini, not '%s'", o->chunk_size, o->plugin);
  DOPT_CHECK_ARG(o->resume_chunk_size == 0 || o->checkpoint_at > 0,
                 "resume chunk_size=%zu: there is no resume (checkpoint_at)", o->resume_chunk_size);
  DOPT_CHECK_ARG(o->checkpoint_at > 0 || (!(o->given & (CMP_GIVEN_RESUME_PLUGIN | CMP_GIVEN_RESUME_TP |
                                                         CMP_GIVEN_RESUME_DP | CMP_GIVEN_RESUME_ZERO)) &&
                                          o->resume_pp == 0 && o->resume_ep == 0),
                 "a resume layout (resume-plugin/-tp/-dp/-zero/-pp/-ep) is given but there is no resume "
                 "(checkpoint_at)");
  DOPT_CHECK_ARG(!o->start_over || (o->checkpoint_at > 0 && o->checkpoint_dir[0]),
                 "start_over: it empties a checkpoint_dir that checkpoint_at saves into (none given)");
  if (strcmp(o->plugin, "gemini") == 0 && o->dp > 1)
    DOPT_CHECK_ARG(o->dp_sum_words >= 1, "plugin gemini: --dp-sum rank-order cannot reduce chunks whose shards cut "
                   "through tensors (the exact sum exchanges exact counts)");
  if (o->ranks != 0 && o->ranks != o->pp * o->tp * o->dp)
    return dopt__fail(DOPT_ERR_INVALID_ARG, "ranks=%d but pp x tp x dp = %d x %d x %d = %d", o->ranks, o->pp, o->tp,
                      o->dp, o->pp * o->tp * o->dp);
  DOPT_CHECK_ARG(o->steps >= 1 && o->steps <= 1000000, "steps=%d must be in [1, 1e6]", o->steps);
  DOPT_CHECK_ARG(o->micro >= 1 && o->micro <= 1024, "accumulation=%d must be in [1, 1024]", o->micro);
  DOPT_CHECK_ARG(o->max_grad_norm >= 0 && isfinite(o->max_grad_norm), "max_grad_norm=%g must be >= 0", o->max_grad_norm);
  DOPT_TRY(dopt_dist_check_layout(o->plugin, o->tp, o->dp, o->zero));
  if (o->checkpoint_at != 0) {
    DOPT_CHECK_ARG(o->checkpoint_at >= 1 && o->checkpoint_at < o->steps,
                   "checkpoint_at=%d must be in [1, steps=%d)", o->checkpoint_at, o->steps);
    DOPT_CHECK_ARG(strcmp(o->backend, "nccl") != 0, "checkpoint_at: backend nccl: a save and resume inside one "
                   "compare runs on the simulator or under MPI");
    cmp_options ob; /* the resume layout, as cmp_run completes it */
    cmp_resume_options(o, &ob);
    if (strcmp(o->backend, "mpi") == 0) { /* the same processes save and resume, into a folder they all see */
      DOPT_CHECK_ARG(ob.pp * ob.tp * ob.dp == o->pp * o->tp * o->dp,
                     "checkpoint_at: backend mpi resumes in the processes mpirun started: the resume layout pp x tp x "
                     "dp = %d x %d x %d must be as many as %d x %d x %d", ob.pp, ob.tp, ob.dp, o->pp, o->tp, o->dp);
      DOPT_CHECK_ARG(o->checkpoint_dir[0], "checkpoint_at: backend mpi needs checkpoint_dir (--checkpoint-dir): a "
                     "folder every process sees");
      DOPT_CHECK_ARG(!o->start_over, "start_over: backend mpi: every process would empty the folder (empty it before "
                     "mpirun, or use the simulator)");
    }
    const char *rpl = ob.plugin;
    DOPT_CHECK_ARG(ob.tp * ob.dp <= 64, "resume: tp=%d dp=%d: tp*dp <= 64", ob.tp, ob.dp);
    DOPT_TRY(check_pp(rpl, ob.pp, ob.tp, ob.dp, "resume: "));
    DOPT_TRY(check_ep(rpl, ob.ep, ob.dp, "resume: "));
    DOPT_CHECK_ARG(o->resume_chunk_size == 0 || strcmp(rpl, "gemini") == 0,
                   "resume: chunk_size=%zu needs the resume plugin gemini, not '%s'", o->resume_chunk_size, rpl);
    DOPT_TRY(dopt_dist_check_layout(rpl, ob.tp, ob.dp, ob.zero));
  }
  if (strcmp(o->backend, "sim") != 0 && strcmp(o->backend, "nccl") != 0 && strcmp(o->backend, "mpi") != 0)
    return dopt__fail(DOPT_ERR_INVALID_ARG, "backend '%s' (sim, nccl or mpi)", o->backend);
  if (strcmp(o->device, "cpu") != 0 && strcmp(o->device, "cuda") != 0)
    return dopt__fail(DOPT_ERR_INVALID_ARG, "device '%s' (cpu or cuda)", o->device);
  if (strcmp(o->backend, "nccl") == 0 && strcmp(o->device, "cuda") != 0)
    return dopt__fail(DOPT_ERR_INVALID_ARG, "backend nccl needs --device cuda (NCCL moves device buffers)");
  if (strcmp(o->backend, "mpi") == 0 && strcmp(o->device, "cpu") != 0)
    return dopt__fail(DOPT_ERR_INVALID_ARG, "backend mpi runs on --device cpu (the MPI transport moves host buffers)");
  if (strcmp(o->backend, "mpi") == 0 && !dopt_mpi_available())
    return dopt__fail(DOPT_ERR_UNSUPPORTED, "backend mpi: distopt was built without MPI (DOPT_MPI=OFF or no MPI found)");
  if (strcmp(o->device, "cuda") == 0) {
    const char *why = "";
    if (dopt_cuda_device_count(&why) == 0)
      return dopt__fail(DOPT_ERR_UNSUPPORTED, "--device cuda: no CUDA device available (%s)", why);
  }
  const dopt_optim_impl *im = dopt_find_impl(o->optimizer);
  if (!im) {
    dopt_optim *probe;
    return dopt_optim_create(o->optimizer, NULL, &probe); /* the registry's message */
  }
  (void)im; /* every optimizer is distributed: piecewise, or whole on an owner rank */
  return DOPT_OK;
}

/* (compare.h) Another stage count: the default layer split; a Gemini resume: its chunk, else the first layout's. */
void cmp_resume_options(const cmp_options *o, cmp_options *ob) {
  *ob = *o;
  snprintf(ob->plugin, sizeof ob->plugin, "%s", o->resume_plugin[0] ? o->resume_plugin : o->plugin);
  ob->tp = o->resume_tp > 0 ? o->resume_tp : o->tp;
  ob->dp = o->resume_dp > 0 ? o->resume_dp : o->dp;
  ob->zero = o->resume_zero >= 0 ? o->resume_zero : o->zero;
  ob->pp = o->resume_pp > 0 ? o->resume_pp : strcmp(ob->plugin, "hybrid") == 0 ? o->pp : 1; /* no stages: pp 1 */
  ob->ep = o->resume_ep > 0 ? o->resume_ep : strcmp(ob->plugin, "moe_hybrid") == 0 ? o->ep : 1;
  ob->resume_ep = 0;
  ob->chunk_size = strcmp(ob->plugin, "gemini") != 0 ? 0 : o->resume_chunk_size ? o->resume_chunk_size : o->chunk_size;
  ob->resume_chunk_size = 0;
  if (ob->pp != o->pp) ob->nlps = 0;
  ob->ranks = 0;
}

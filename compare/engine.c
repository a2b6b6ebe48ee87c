/* The equivalence engine of `distopt compare` (compare/compare.h).
 *
 * One simulated world of tp·dp rank threads runs the distributed optimizer;
 * world rank 0 also steps the single-device reference in lockstep, on the
 * averaged gradient (each DP rank's micro-batches summed in order, the dp
 * sum of those — exact in any reduction order by default, or fp32 in rank
 * order — and one division by dp·micro), then every rank takes part in gathering the logical
 * parameters and states, and rank 0 measures the differences. */
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
  char allowed[32];
  if (is_tp) snprintf(allowed, sizeof allowed, "tp 1");
  else if (r->zero_lo == r->zero_hi) snprintf(allowed, sizeof allowed, "zero %d", r->zero_lo);
  else snprintf(allowed, sizeof allowed, "zero %d or %d", r->zero_lo, r->zero_hi);
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

/* ---- gradient sources -------------------------------------------------------------- */

/* A small transformer: vocab-parallel embedding, column/row-parallel
 * linears, replicated norms; sizes divide neither 3 nor 4. Three layers
 * ("layers.N." names, so that LISA samples them: n_layers 2 of 3 at its
 * defaults, one frozen every interval) between the embedding and the norm
 * and head, which are always trained. */
static const cmp_param SYNTH[] = {
    {"embed.weight", 2, {50, 32}, DOPT_TP_COLUMN},
    {"layers.0.attn.qkv.weight", 2, {96, 32}, DOPT_TP_COLUMN},
    {"layers.0.attn.out.weight", 2, {32, 32}, DOPT_TP_ROW},
    {"layers.1.mlp.fc1.weight", 2, {70, 32}, DOPT_TP_COLUMN},
    {"layers.1.mlp.fc1.bias", 1, {70}, DOPT_TP_COLUMN},
    {"layers.2.mlp.fc2.weight", 2, {32, 70}, DOPT_TP_ROW},
    {"layers.2.mlp.fc2.bias", 1, {32}, DOPT_TP_REPLICATED},
    {"norm.weight", 1, {32}, DOPT_TP_REPLICATED},
    {"head.scale", 2, {1, 32}, DOPT_TP_REPLICATED},
};

/* A recording (docs/verify.md) read as a trace: one reader (one open file per rank) shared by the
 * rank threads, so every read goes through the lock. */
typedef struct rec_source {
  vr_reader rd;
  pthread_mutex_t mu;
} rec_source;

typedef struct source {
  int np;
  cmp_param *p;        /* [np] */
  size_t *numel;       /* [np] */
  float **init;        /* [np]: the initial values, whole (the shared template's data) */
  dopt_st_file *trace; /* a single-file trace (NULL: none) */
  rec_source *rec;     /* a recording (NULL: none); neither: synthetic */
  int shards;          /* trace or recording (1): shards per step; 0: synthetic */
  uint64_t seed;
  int fast;            /* --model: the vectorised generator (synth_fast) */
  float **trig;        /* fast: [np], per parameter its [rows] sin(0.7 r + 0.3), [rows] sin(0.45 r + 1.1),
                          [w] cos(0.4 c), [w] cos(1.3 c + 0.5) as floats (rows = b · h, dopt_piece_full) */
  int *expert;         /* [np] the expert id of a parameter named "experts.<e>." (cmp_expert_of), else -1 */
  int nexperts;        /* the largest id + 1 (0: a dense model) */
} source;

static uint64_t mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/* The synthetic generators' key of (seed, parameter, step, shard). */
static uint64_t synth_key(const source *s, int i, int step, int shard) {
  return mix(s->seed ^ mix(((uint64_t)i << 48) ^ ((uint64_t)step << 20) ^ (uint64_t)shard));
}

/* Low rank plus noise, heavy-tailed rows, ~6% exact zeros; a pure function of
 * (seed, parameter, step, shard, element). Writes the block of rows
 * [h0, h0 + hl) x columns [w0, w0 + wl) of every leading index (the tensor
 * as [b, h, w], dopt_piece_full) in row-major order: a TP block, or the
 * whole tensor (0, h, 0, w). The sines and cosines are taken per row and per
 * column (the same values as per element), so a block costs O(its size). */
static void synth_block(const source *s, int i, int step, int shard, size_t h0, size_t hl, size_t w0, size_t wl,
                        float *out) {
  const cmp_param *p = &s->p[i];
  dopt_piece pc;
  dopt_piece_full(p->ndim, p->shape, &pc);
  const uint64_t key = synth_key(s, i, step, shard);
  double a = (double)(mix(key) >> 11) * 0x1.0p-53 - 0.5, b = (double)(mix(key + 1) >> 11) * 0x1.0p-53 - 0.5;
  enum { CHUNK = 256 };
  double cs[CHUNK];
  const double bm[3] = {b * (double)0, b * (double)1, b * (double)2}; /* b · ((row + col) mod 3) */
  const uint64_t step_k = 0x9E3779B97F4A7C15ull; /* the hash input advances by this per element */
  for (size_t j0 = 0; j0 < wl; j0 += CHUNK) {
    const size_t jn = wl - j0 < CHUNK ? wl - j0 : CHUNK;
    for (size_t j = 0; j < jn; j++) cs[j] = cos(0.4 * (double)(w0 + j0 + j));
    for (size_t bi = 0; bi < pc.b; bi++)
      for (size_t r = 0; r < hl; r++) {
        const size_t row = bi * pc.h + h0 + r, col0 = w0 + j0; /* of the tensor as [rows, w] */
        const double sr = a * sin(0.7 * (double)row + 0.3), heavy = (row % 5 == 1) ? 8.0 : 1.0;
        float *o = out + (bi * hl + r) * wl + j0;
        uint64_t hk = key + step_k * (row * pc.w + col0 + 2); /* key + step_k · (k + 2), k the flat index */
        size_t m3 = (row + col0) % 3;
        for (size_t j = 0; j < jn; j++, hk += step_k, m3 = m3 == 2 ? 0 : m3 + 1) {
          const uint64_t h = mix(hk);
          double u = 0;
          for (int q = 0; q < 4; q++) u += (double)((h >> (16 * q)) & 0xffff) / 65536.0;
          const double lowrank = sr * cs[j] + bm[m3];
          const double v = 0.05 * heavy * (lowrank + 0.5 * (u - 2.0));
          o[j] = (h >> 60) == 0 ? 0.0f : (float)v;
        }
      }
  }
}

/* --model's generator: the same kind of values (rank 2 plus noise, heavy-tailed rows, 1/16 exact zeros), a pure
 * function of (seed, parameter, step, shard, element) in 32-bit integer hashing and fp32 arithmetic that the
 * compiler vectorises (about 0.3 ns per element here against 5 for synth_block's 64-bit hash in double): a
 * 64-rank compare generates dp · accumulation gradients per step twice, once for the reference. Same block
 * layout as synth_block. */
static inline uint32_t hash32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  return x ^ (x >> 16);
}

static inline __attribute__((always_inline)) void synth_fast_body(const source *s, int i, int step, int shard,
                                                                  size_t h0, size_t hl, size_t w0, size_t wl,
                                                                  float *out) {
  const cmp_param *p = &s->p[i];
  dopt_piece pc;
  dopt_piece_full(p->ndim, p->shape, &pc);
  const uint64_t key = synth_key(s, i, step, shard);
  const uint32_t k32 = (uint32_t)key;
  const float a = (float)((double)(mix(key + 1) >> 11) * 0x1.0p-53 - 0.5),
              b = (float)((double)(mix(key + 2) >> 11) * 0x1.0p-53 - 0.5);
  const size_t rows = pc.b * pc.h;
  const float *sa = s->trig[i], *sb = sa + rows, *ca = sb + rows + w0, *cb = sa + 2 * rows + pc.w + w0;
  enum { CHUNK = 256 }; /* the hash's base is taken per 256 columns, as it always was (the same values) */
  for (size_t bi = 0; bi < pc.b; bi++)
    for (size_t r = 0; r < hl; r++) {
      const size_t row = bi * pc.h + h0 + r;
      const float ra = a * sa[row], rb = b * sb[row];
      const float scale = (row % 5 == 1) ? 0.4f : 0.05f;
      for (size_t j0 = 0; j0 < wl; j0 += CHUNK) {
        const size_t jn = wl - j0 < CHUNK ? wl - j0 : CHUNK;
        const uint32_t base = (uint32_t)(row * pc.w + w0 + j0) ^ (uint32_t)((row * pc.w) >> 32) * 0x9e3779b9u;
        float *o = out + (bi * hl + r) * wl + j0;
        const float *ka = ca + j0, *kb = cb + j0;
        for (size_t j = 0; j < jn; j++) {
          const uint32_t h = hash32((base + (uint32_t)j) ^ k32);
          const float u = (float)(int32_t)((h & 0xffffu) + ((h >> 12) & 0xffffu)) * 0x1.0p-16f; /* [0, 2) */
          const float v = scale * (ra * ka[j] + rb * kb[j] + 0.5f * (u - 1.0f));
          uint32_t vb;
          memcpy(&vb, &v, sizeof vb);
          vb &= 0u - (uint32_t)((h >> 28) != 0); /* +0 for 1 in 16 (a select without a branch) */
          memcpy(&o[j], &vb, sizeof vb);
        }
      }
    }
}

/* The fast generator's per-row and per-column factors of parameter i (s->trig[i]): O(rows + w), taken once
 * instead of per block, shard and step (they were 2 sines per row and 2 cosines per column of every block). */
static dopt_status synth_trig(source *s, int i) {
  dopt_piece pc;
  dopt_piece_full(s->p[i].ndim, s->p[i].shape, &pc);
  const size_t rows = pc.b * pc.h;
  float *t = malloc((2 * rows + 2 * pc.w + 1) * sizeof *t);
  if (!t) return dopt__fail(DOPT_ERR_NO_MEMORY, "synthetic parameter '%s': %zu x %zu factors", s->p[i].name, rows, pc.w);
  for (size_t r = 0; r < rows; r++)
    t[r] = (float)sin(0.7 * (double)r + 0.3), t[rows + r] = (float)sin(0.45 * (double)r + 1.1);
  for (size_t c = 0; c < pc.w; c++)
    t[2 * rows + c] = (float)cos(0.4 * (double)c), t[2 * rows + pc.w + c] = (float)cos(1.3 * (double)c + 0.5);
  s->trig[i] = t;
  return DOPT_OK;
}

typedef void (*synth_fn)(const source *s, int i, int step, int shard, size_t h0, size_t hl, size_t w0, size_t wl,
                         float *out);
typedef struct synth_variant {
  const char *name;
  synth_fn fn;
  int (*has)(void); /* whether this CPU runs it */
} synth_variant;

static void synth_fast_portable(const source *s, int i, int step, int shard, size_t h0, size_t hl, size_t w0,
                                size_t wl, float *out) {
  synth_fast_body(s, i, step, shard, h0, hl, w0, wl, out);
}

/* 32-bit lane multiplies need SSE4.1 or AVX2: the body compiled for AVX2 and for AVX-512 at its full width (GCC
 * keeps 256-bit vectors unless told otherwise) too, chosen at run time (the same bits: elementwise IEEE fp32, no
 * contraction; cmp_synth_variants_differ); no ifunc, which sanitizers cannot run before they start */
#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
__attribute__((target("avx2"))) static void synth_fast_avx2(const source *s, int i, int step, int shard, size_t h0,
                                                            size_t hl, size_t w0, size_t wl, float *out) {
  synth_fast_body(s, i, step, shard, h0, hl, w0, wl, out);
}
__attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,prefer-vector-width=512"))) static void
synth_fast_avx512(const source *s, int i, int step, int shard, size_t h0, size_t hl, size_t w0, size_t wl, float *out) {
  synth_fast_body(s, i, step, shard, h0, hl, w0, wl, out);
}
static int has_avx512(void) {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
}
static int has_avx2(void) { return __builtin_cpu_supports("avx2"); }
/* the vector variants, the preferred first */
static const synth_variant SYNTH_VECTOR[] = {{"avx512", synth_fast_avx512, has_avx512},
                                             {"avx2", synth_fast_avx2, has_avx2}};
enum { NSYNTH_VECTOR = 2 };
#else
static const synth_variant SYNTH_VECTOR[1] = {{NULL, NULL, NULL}};
enum { NSYNTH_VECTOR = 0 };
#endif

static void synth_fast(const source *s, int i, int step, int shard, size_t h0, size_t hl, size_t w0, size_t wl,
                       float *out) {
  for (int v = 0; v < NSYNTH_VECTOR; v++)
    if (SYNTH_VECTOR[v].has()) {
      SYNTH_VECTOR[v].fn(s, i, step, shard, h0, hl, w0, wl, out);
      return;
    }
  synth_fast_portable(s, i, step, shard, h0, hl, w0, wl, out);
}

/* The whole tensor's synthetic gradient. */
static void synth_grad(const source *s, int i, int step, int shard, float *out) {
  dopt_piece pc;
  dopt_piece_full(s->p[i].ndim, s->p[i].shape, &pc);
  (s->fast ? synth_fast : synth_block)(s, i, step, shard, 0, pc.h, 0, pc.w, out);
}

/* A trace's gradient of parameter `name` at step t (1-based), shard sh. */
static void grad_key(char *key, size_t cap, int t, int sh, const char *name) {
  snprintf(key, cap, "grad/%d/%d/%s", t, sh, name);
}

/* The gradient of parameter i for (step, shard): from the trace, the recording (shard 0: the whole
 * step's gradient, assembled from its source pieces) or synthetic. */
static dopt_status shard_grad(const source *s, int i, int step, int shard, float *out) {
  if (s->rec) {
    int present = 0;
    pthread_mutex_lock(&s->rec->mu);
    dopt_status st = vr_reader_grad(&s->rec->rd, i, step, out, &present);
    if (st != DOPT_OK) st = dopt__fail(st, "%s", s->rec->rd.err);
    else if (!present)
      st = dopt__fail(DOPT_ERR_UNSUPPORTED, "%s: step %d: parameter '%s' has no recorded gradient (grad was None); "
                                            "compare needs every parameter's gradient at every step",
                      s->rec->rd.index_path, step, s->p[i].name);
    pthread_mutex_unlock(&s->rec->mu);
    (void)shard;
    return st;
  }
  if (!s->trace) {
    synth_grad(s, i, step, shard, out);
    return DOPT_OK;
  }
  char key[200];
  grad_key(key, sizeof key, step, shard, s->p[i].name);
  return dopt_st_read_f32(s->trace, key, out, s->numel[i]);
}

static dopt_status parse_roles(source *s, const char *roles) {
  for (int i = 0; i < s->np; i++) s->p[i].role = DOPT_TP_REPLICATED;
  if (!roles) return DOPT_OK;
  char *copy = strdup(roles), *save = NULL;
  dopt_status st = DOPT_OK;
  for (char *tok = strtok_r(copy, ",", &save); tok && st == DOPT_OK; tok = strtok_r(NULL, ",", &save)) {
    char *colon = strrchr(tok, ':');
    if (!colon) {
      st = dopt__fail(DOPT_ERR_FORMAT, "trace metadata tp_roles: '%s' is not name:role", tok);
      break;
    }
    *colon = '\0';
    int found = 0;
    for (int i = 0; i < s->np; i++) {
      if (strcmp(s->p[i].name, tok) != 0) continue;
      found = 1;
      if (strcmp(colon + 1, "column") == 0) s->p[i].role = DOPT_TP_COLUMN;
      else if (strcmp(colon + 1, "row") == 0) s->p[i].role = DOPT_TP_ROW;
      else if (strcmp(colon + 1, "replicated") != 0)
        st = dopt__fail(DOPT_ERR_FORMAT, "trace metadata tp_roles: role '%s' of '%s' (column, row, replicated)",
                        colon + 1, tok);
    }
    if (!found && st == DOPT_OK) st = dopt__fail(DOPT_ERR_FORMAT, "trace metadata tp_roles: no parameter '%s'", tok);
  }
  free(copy);
  return st;
}

/* Room for n parameters (s->np stays: the loaders count up as they fill). */
static dopt_status source_reserve(source *s, int n) {
  if (n > CMP_MAX_PARAMS) return dopt__fail(DOPT_ERR_UNSUPPORTED, "%d parameters, more than compare's limit of %d", n, CMP_MAX_PARAMS);
  const size_t c = n > 0 ? (size_t)n : 1;
  s->p = calloc(c, sizeof *s->p);
  s->numel = calloc(c, sizeof *s->numel);
  s->init = calloc(c, sizeof *s->init);
  if (!s->p || !s->numel || !s->init) return dopt__fail(DOPT_ERR_NO_MEMORY, "compare: %d parameters", n);
  return DOPT_OK;
}

static void source_free(source *s) {
  for (int i = 0; s->init && i < s->np; i++) free(s->init[i]);
  for (int i = 0; s->trig && i < s->np; i++) free(s->trig[i]);
  free(s->trig);
  free(s->expert);
  free(s->p);
  free(s->numel);
  free(s->init);
  dopt_st_free(s->trace);
  if (s->rec) {
    vr_reader_close(&s->rec->rd);
    pthread_mutex_destroy(&s->rec->mu);
    free(s->rec);
  }
  memset(s, 0, sizeof *s);
}

/* A recording's directory, or its index.json (by name), rather than a single-file trace. */
int cmp_trace_is_recording(const char *path) {
  struct stat sb;
  if (stat(path, &sb) == 0 && S_ISDIR(sb.st_mode)) return 1;
  const char *base = strrchr(path, '/');
  return strcmp(base ? base + 1 : path, "index.json") == 0;
}

/* --trace on a recording (docs/verify.md): its parameters (TP roles replicated: a recording has
 * none), one shard per step (the recorded gradient is the whole step's, so dp and accumulation are
 * 1), its steps; the gradients are read through the reader a block per rank at a time. */
static dopt_status load_recording(const cmp_options *o, source *s) {
  const char *tp = o->trace_path;
  s->rec = calloc(1, sizeof *s->rec);
  if (!s->rec) return dopt__fail(DOPT_ERR_NO_MEMORY, "%s: the recording's reader", tp);
  if (pthread_mutex_init(&s->rec->mu, NULL) != 0) {
    free(s->rec);
    s->rec = NULL;
    return dopt__fail(DOPT_ERR_NO_MEMORY, "%s: the recording's lock", tp);
  }
  vr_reader *rd = &s->rec->rd;
  dopt_status st = vr_reader_open(rd, tp);
  if (st != DOPT_OK) return dopt__fail(st, "%s", rd->err);
  const vr_index *ix = &rd->ix;
  s->shards = 1;
  if (o->steps > ix->steps)
    return dopt__fail(DOPT_ERR_INVALID_ARG, "steps=%d but %s records %ld steps", o->steps, rd->index_path, ix->steps);
  const int rdp = o->checkpoint_at > 0 && o->resume_dp > 0 ? o->resume_dp : o->dp;
  if (o->dp != 1 || rdp != 1)
    return dopt__fail(DOPT_ERR_INVALID_ARG,
                      "%sdp=%d with a recording (%s): its gradient of a step is the whole step's (1 shard per step), "
                      "so dp must be 1",
                      o->dp != 1 ? "" : "resume ", o->dp != 1 ? o->dp : rdp, tp);
  if (o->micro != 1)
    return dopt__fail(DOPT_ERR_INVALID_ARG,
                      "accumulation=%d with a recording (%s): its gradient of a step is the whole step's (leave "
                      "accumulation out or set it to 1)", o->micro, tp);
  if ((st = source_reserve(s, ix->nparams)) != DOPT_OK) return dopt__fail(st, "%s: %s", rd->index_path, dopt_last_error());
  for (int i = 0; i < ix->nparams; i++) {
    const vr_param *vp = &ix->params[i];
    cmp_param *p = &s->p[i];
    if (strlen(vp->name) >= sizeof p->name)
      return dopt__fail(DOPT_ERR_UNSUPPORTED, "%s: params[%d].name '%.60s...': longer than compare's limit of %zu bytes",
                        rd->index_path, i, vp->name, sizeof p->name - 1);
    memcpy(p->name, vp->name, strlen(vp->name) + 1); /* fits: checked above */
    p->ndim = vp->ndim;
    memcpy(p->shape, vp->shape, sizeof p->shape);
    p->role = DOPT_TP_REPLICATED;
    s->numel[i] = (size_t)vp->numel;
    s->init[i] = malloc((s->numel[i] ? s->numel[i] : 1) * sizeof(float));
    s->np = i + 1;
    if (!s->init[i])
      return dopt__fail(DOPT_ERR_NO_MEMORY, "%s: parameter '%s' (%zu elements)", rd->index_path, p->name, s->numel[i]);
    if ((st = vr_reader_init(rd, i, s->init[i])) != DOPT_OK) return dopt__fail(st, "%s", rd->err);
  }
  return DOPT_OK;
}

/* A trace's count metadata (shards, steps): a whole decimal number in 1..INT_MAX. */
static dopt_status trace_count(const char *path, const char *key, const char *v, int *out) {
  char *end = NULL;
  errno = 0;
  long n = strtol(v, &end, 10);
  if (errno != 0 || end == v || *end != '\0' || n < 1 || n > INT_MAX)
    return dopt__fail(DOPT_ERR_FORMAT, "%s: metadata %s='%.40s' (a whole number in 1..%d)", path, key, v, INT_MAX);
  *out = (int)n;
  return DOPT_OK;
}

/* Every gradient the run reads, grad/<step>/<shard>/<param> for steps 1..o->steps, is in the trace
 * with its parameter's element count: checked up front, so the buffers sized by the shard count
 * (compare's dp·micro parts) are bounded by what the file holds, not by its metadata. */
static dopt_status trace_has_grads(const cmp_options *o, const source *s) {
  const uint64_t need = (uint64_t)s->shards * (uint64_t)o->steps * (uint64_t)s->np;
  if (need > (uint64_t)dopt_st_count(s->trace))
    return dopt__fail(DOPT_ERR_FORMAT,
                      "%s: %d shards x %d steps x %d parameters need %llu gradient tensors, the file holds %d",
                      o->trace_path, s->shards, o->steps, s->np, (unsigned long long)need, dopt_st_count(s->trace));
  for (int t = 1; t <= o->steps; t++)
    for (int sh = 0; sh < s->shards; sh++)
      for (int i = 0; i < s->np; i++) {
        char key[200];
        grad_key(key, sizeof key, t, sh, s->p[i].name);
        dopt_st_tensor g;
        DOPT_TRY(dopt_st_find(s->trace, key, &g));
        if (g.numel != s->numel[i])
          return dopt__fail(DOPT_ERR_FORMAT, "%s: tensor '%s' has %zu elements, its parameter %zu", o->trace_path,
                            key, g.numel, s->numel[i]);
      }
  return DOPT_OK;
}

static dopt_status load_source(const cmp_options *o, source *s) {
  memset(s, 0, sizeof *s);
  s->seed = o->seed;
  if (strcmp(o->source, "synthetic") == 0) {
    cmp_model m;
    if (o->model[0]) DOPT_TRY(cmp_model_parse(o->model, &m));
    const int n = o->model[0] ? cmp_model_ntensors(&m) : (int)(sizeof SYNTH / sizeof SYNTH[0]);
    DOPT_TRY(source_reserve(s, n));
    s->fast = o->model[0] != 0;
    if (s->fast && !(s->trig = calloc((size_t)n, sizeof *s->trig)))
      return dopt__fail(DOPT_ERR_NO_MEMORY, "compare: %d parameters", n);
    for (int i = 0; i < n; i++) {
      if (o->model[0]) {
        cmp_model_tensor t;
        cmp_model_tensor_at(&m, i, &t);
        cmp_param *p = &s->p[i];
        memcpy(p->name, t.name, sizeof p->name);
        p->ndim = t.ndim;
        memcpy(p->shape, t.shape, sizeof t.shape);
        p->role = t.role;
      } else {
        s->p[i] = SYNTH[i];
      }
      s->numel[i] = dopt_numel(s->p[i].ndim, s->p[i].shape);
      s->init[i] = malloc(s->numel[i] * sizeof(float));
      s->np = i + 1;
      if (!s->init[i]) return dopt__fail(DOPT_ERR_NO_MEMORY, "synthetic parameter '%s' (%zu elements)", s->p[i].name, s->numel[i]);
      if (s->fast) DOPT_TRY(synth_trig(s, i));
      for (size_t k = 0; k < s->numel[i]; k++)
        s->init[i][k] = (float)(((double)(mix(o->seed * 7919 + (uint64_t)i * 1000003 + k) >> 11) * 0x1.0p-53 - 0.5) * 0.2);
    }
    return DOPT_OK;
  }
  if (strcmp(o->source, "trace") != 0)
    return dopt__fail(DOPT_ERR_INVALID_ARG, "gradients source '%s' (synthetic or trace)", o->source);
  if (!o->trace_path[0]) return dopt__fail(DOPT_ERR_INVALID_ARG, "gradients source trace needs a path");
  if (cmp_trace_is_recording(o->trace_path)) return load_recording(o, s);
  DOPT_TRY(dopt_st_open(o->trace_path, &s->trace)); /* the header; each gradient is read when a step needs it */
  const char *params = dopt_st_meta(s->trace, "params"), *steps = dopt_st_meta(s->trace, "steps"),
             *shards = dopt_st_meta(s->trace, "shards");
  if (!params || !steps || !shards)
    return dopt__fail(DOPT_ERR_FORMAT, "%s: not a gradient trace (metadata params, steps, shards)", o->trace_path);
  int nsteps = 0;
  DOPT_TRY(trace_count(o->trace_path, "shards", shards, &s->shards));
  DOPT_TRY(trace_count(o->trace_path, "steps", steps, &nsteps));
  if (o->steps > nsteps)
    return dopt__fail(DOPT_ERR_INVALID_ARG, "steps=%d but %s records %d steps", o->steps, o->trace_path, nsteps);
  if (s->shards % o->dp != 0)
    return dopt__fail(DOPT_ERR_INVALID_ARG, "dp=%d does not divide the %d shards per step of %s", o->dp, s->shards,
                      o->trace_path);
  if (o->micro != 1 && o->micro != s->shards / o->dp) /* the trace's shards are the micro-batches */
    return dopt__fail(DOPT_ERR_INVALID_ARG,
                      "accumulation=%d with a trace: its %d shards per step over dp=%d are %d micro-batches per rank "
                      "(leave accumulation out or set it to %d)",
                      o->micro, s->shards, o->dp, s->shards / o->dp, s->shards / o->dp);
  long ncomma = 1;
  for (const char *c = params; *c; c++) ncomma += *c == ',';
  dopt_status st = source_reserve(s, ncomma > CMP_MAX_PARAMS ? CMP_MAX_PARAMS + 1 : (int)ncomma);
  if (st != DOPT_OK) return dopt__fail(st, "%s: metadata params: %s", o->trace_path, dopt_last_error());
  char *copy = strdup(params), *save = NULL;
  if (!copy) return dopt__fail(DOPT_ERR_NO_MEMORY, "%s: metadata params", o->trace_path);
  for (char *tok = strtok_r(copy, ",", &save); tok && st == DOPT_OK; tok = strtok_r(NULL, ",", &save)) {
    cmp_param *p = &s->p[s->np];
    snprintf(p->name, sizeof p->name, "%s", tok);
    char key[200];
    snprintf(key, sizeof key, "init/%s", tok);
    dopt_st_tensor t;
    if ((st = dopt_st_find(s->trace, key, &t)) != DOPT_OK) break;
    p->ndim = t.ndim;
    memcpy(p->shape, t.shape, sizeof p->shape);
    s->numel[s->np] = t.numel;
    s->init[s->np] = malloc((t.numel ? t.numel : 1) * sizeof(float));
    if (!s->init[s->np]) st = dopt__fail(DOPT_ERR_NO_MEMORY, "%s", o->trace_path);
    else st = dopt_st_read_f32(s->trace, key, s->init[s->np], t.numel);
    s->np++;
  }
  free(copy);
  DOPT_TRY(st);
  DOPT_TRY(trace_has_grads(o, s));
  return parse_roles(s, dopt_st_meta(s->trace, "tp_roles"));
}

int cmp_synth_variants_differ(const char *model, char *ran, size_t cap) {
  if (cap) ran[0] = '\0';
  cmp_options o;
  cmp_options_default(&o);
  if (snprintf(o.model, sizeof o.model, "%s", model) >= (int)sizeof o.model) return -1;
  source s;
  if (load_source(&o, &s) != DOPT_OK) {
    source_free(&s);
    return -1;
  }
  size_t maxn = 1;
  for (int i = 0; i < s.np; i++) maxn = s.numel[i] > maxn ? s.numel[i] : maxn;
  float *a = malloc(maxn * sizeof *a), *b = malloc(maxn * sizeof *b);
  int differ = a && b ? 0 : -1;
  for (int v = 0; differ >= 0 && v < NSYNTH_VECTOR; v++) {
    if (!SYNTH_VECTOR[v].has()) continue;
    size_t len = strlen(ran);
    if (cap > len) snprintf(ran + len, cap - len, "%s%s", len ? " " : "", SYNTH_VECTOR[v].name);
    for (int i = 0; i < s.np; i++) {
      dopt_piece pc;
      dopt_piece_full(s.p[i].ndim, s.p[i].shape, &pc);
      for (int q = 0; q < 10; q++) { /* the whole tensor, then 3 x 3 blocks (TP blocks of either split) */
        const size_t r = q == 0 ? 0 : (size_t)(q - 1) / 3, c = q == 0 ? 0 : (size_t)(q - 1) % 3, n = q == 0 ? 1 : 3;
        const size_t h0 = pc.h * r / n, hl = pc.h * (r + 1) / n - h0, w0 = pc.w * c / n, wl = pc.w * (c + 1) / n - w0;
        const size_t bytes = pc.b * hl * wl * sizeof(float);
        memset(a, 0xa5, bytes ? bytes : 1), memset(b, 0x5a, bytes ? bytes : 1);
        SYNTH_VECTOR[v].fn(&s, i, 3 + q, 2 * q + 1, h0, hl, w0, wl, a);
        synth_fast_portable(&s, i, 3 + q, 2 * q + 1, h0, hl, w0, wl, b);
        differ += memcmp(a, b, bytes) != 0;
      }
    }
  }
  free(a);
  free(b);
  source_free(&s);
  return differ;
}

/* Micro-batch m of DP rank d: synthetic shard index d·micro + m; a trace's
 * shards are split evenly over the DP ranks. */
static int shard_of(const cmp_options *o, const source *s, int d, int m) {
  return d * (s->shards > 0 ? s->shards / o->dp : o->micro) + m;
}
static int micro_of(const cmp_options *o, const source *s) { return s->shards > 0 ? s->shards / o->dp : o->micro; }

int cmp_expert_of(const char *name) {
  for (const char *at = strstr(name, "experts."); at; at = strstr(at + 1, "experts.")) {
    if (at != name && at[-1] != '.') continue; /* a whole name component */
    const char *q = at + 8;
    long e = 0;
    int nd = 0;
    while (*q >= '0' && *q <= '9' && nd < 6) e = e * 10 + (*q++ - '0'), nd++;
    if (nd > 0 && nd < 6 && *q == '.') return (int)e;
  }
  return -1;
}

int cmp_stack_of(const char *name, int ndim) {
  if (ndim < 3) return 0;
  for (const char *at = strstr(name, "experts."); at; at = strstr(at + 1, "experts."))
    if ((at == name || at[-1] == '.') && !(at[8] >= '0' && at[8] <= '9') && at[8] != '\0') return 1;
  return 0;
}

/* Every parameter's expert id (cmp_expert_of; a stack: DOPT_DIST_EXPERT_STACK) and the count of experts (the
 * largest id + 1, or the stacks' leading size); with moe (a layout of plugin moe_hybrid) a stack whose leading
 * size is another count is one line (elsewhere the stacks stay dense tensors). */
static dopt_status plan_experts(source *s, int moe, const char *stacks) {
  s->expert = malloc((s->np > 0 ? (size_t)s->np : 1) * sizeof *s->expert);
  if (!s->expert) return dopt__fail(DOPT_ERR_NO_MEMORY, "compare: experts of %d parameters", s->np);
  s->nexperts = 0;
  int first = -1; /* the first stack */
  for (int i = 0; i < s->np; i++) {
    s->expert[i] = cmp_expert_of(s->p[i].name);
    if (s->expert[i] >= s->nexperts) s->nexperts = s->expert[i] + 1;
    const int stack = stacks[0] ? s->p[i].ndim >= 3 && fnmatch(stacks, s->p[i].name, 0) == 0
                                : cmp_stack_of(s->p[i].name, s->p[i].ndim);
    if (s->expert[i] < 0 && stack) {
      s->expert[i] = DOPT_DIST_EXPERT_STACK;
      if (first < 0) first = i;
    }
  }
  if (first < 0) return DOPT_OK;
  const int64_t E = s->p[first].shape[0];
  int bad = -1; /* a stack of another count than the first's or the separate experts' */
  for (int i = 0; i < s->np && bad < 0; i++)
    if (s->expert[i] == DOPT_DIST_EXPERT_STACK && (s->p[i].shape[0] != E || E > 65536 || (s->nexperts && s->nexperts != E)))
      bad = i;
  if (bad >= 0 && moe)
    return dopt__fail(DOPT_ERR_INVALID_ARG, "plugin moe_hybrid: expert stack '%s' has %lld experts (dimension 0), "
                      "'%s' %lld, the separate experts %d: one count of experts (at most 65536)", s->p[bad].name,
                      (long long)s->p[bad].shape[0], s->p[first].name, (long long)E, s->nexperts);
  for (int i = 0; bad >= 0 && i < s->np; i++) /* not a moe layout: the stacks are dense tensors anyway */
    if (s->expert[i] == DOPT_DIST_EXPERT_STACK) s->expert[i] = -1;
  if (bad < 0) s->nexperts = (int)E;
  return DOPT_OK;
}

/* Whether o's layout splits experts (plugin moe_hybrid), and parameter i's dp group there: the dp ranks that
 * hold it and sum its gradient (dense: all; an expert's: those of its ep rank, d mod ep == its ep rank). */
static int moe_of(const cmp_options *o, const source *s) {
  return strcmp(o->plugin, "moe_hybrid") == 0 && s->nexperts > 0;
}
static int holds_param(const cmp_options *o, const source *s, int i, int d) {
  if (!moe_of(o, s) || s->expert[i] < 0) return 1; /* dense, or a stack: every rank has its TP block */
  return d % o->ep == dopt_dist_expert_rank(s->expert[i], s->nexperts, o->ep);
}

/* moe_hybrid, a stack split over ep: what dp rank d's gradient g (logical, [numel]) contributes: its own ep rank's
 * experts' slices (the others zero, as the library takes them); the number of dp ranks each element's expert is
 * on is moe_dp. */
static int ep_stack(const cmp_options *o, const source *s, int i) {
  return moe_of(o, s) && o->ep > 1 && s->expert[i] == DOPT_DIST_EXPERT_STACK;
}
static void own_experts_only(const cmp_options *o, const source *s, int i, int d, float *g) {
  const size_t per = s->numel[i] / (size_t)s->nexperts;
  for (int f = 0; f < s->nexperts; f++)
    if (dopt_dist_expert_rank(f, s->nexperts, o->ep) != d % o->ep) memset(g + (size_t)f * per, 0, per * sizeof *g);
}

/* A layout that splits stacks over ep: zero 1 or 2 and the exact dp sum (their shards are exact ranges). */
static dopt_status check_stacks(const cmp_options *o, const source *s, const char *what) {
  int stacks = 0;
  for (int i = 0; i < s->np; i++) stacks += ep_stack(o, s, i);
  if (!stacks) return DOPT_OK;
  DOPT_CHECK_ARG(o->zero >= 1 && o->dp_sum_words >= 1, "%s%d expert stacks split over ep=%d need zero 1 or 2 and the "
                 "exact dp sum (got zero %d, dp sum %s): their shards are exact ranges of each ep rank's experts", what,
                 stacks, o->ep, o->zero, cmp_dp_sum_name(o->dp_sum_words));
  return DOPT_OK;
}

/* ---- the optimizer on one rank ---------------------------------------------------------- */

/* The plain optimizer of the source's parameters. data [np]: each parameter's own copy of its initial
 * values (the reference steps on them); data NULL: the source's own (a template that is never stepped:
 * dopt_dist_create, save and load only read it, so the rank threads share one). work [np]: the bf16
 * working copies (with o->bf16; NULL otherwise). */
/* dist: the distributed side's template (cmp_options.dist_impl when a test plants one) */
static dopt_status build_plain(const cmp_options *o, const source *s, int dist, float **data, uint16_t **work,
                               dopt_optim **out) {
  dopt_optim *opt;
  DOPT_TRY(dist && o->dist_impl ? dopt__optim_create_impl(o->dist_impl, o->hparams, &opt)
                                 : dopt_optim_create(o->optimizer, o->hparams, &opt));
  int *gid = calloc((size_t)o->ngroups + 1, sizeof *gid);
  dopt_status st = gid ? DOPT_OK : dopt__fail(DOPT_ERR_NO_MEMORY, "compare: %d groups", o->ngroups);
  for (int g = 0; g < o->ngroups && st == DOPT_OK; g++) st = dopt_optim_add_group(opt, o->groups[g].hp, &gid[g]);
  for (int i = 0; i < s->np && st == DOPT_OK; i++) {
    int group = 0;
    for (int g = 0; g < o->ngroups; g++)
      if (fnmatch(o->groups[g].glob, s->p[i].name, 0) == 0) {
        group = gid[g];
        break;
      }
    float *vals = s->init[i];
    if (data) {
      data[i] = vals = malloc((s->numel[i] ? s->numel[i] : 1) * sizeof(float));
      if (!vals) {
        st = dopt__fail(DOPT_ERR_NO_MEMORY, "parameter '%s'", s->p[i].name);
        break;
      }
      memcpy(vals, s->init[i], s->numel[i] * sizeof(float));
    }
    work[i] = NULL;
    dopt_param_config pc = DOPT_PARAM_CONFIG_INIT;
    pc.name = s->p[i].name;
    pc.ndim = s->p[i].ndim;
    memcpy(pc.shape, s->p[i].shape, sizeof pc.shape);
    pc.data = vals;
    pc.layer = dopt_layer_from_name(s->p[i].name); /* LISA */
    if (o->bf16) {
      work[i] = malloc(s->numel[i] * sizeof(uint16_t));
      if (!work[i]) {
        st = dopt__fail(DOPT_ERR_NO_MEMORY, "parameter '%s'", s->p[i].name);
        break;
      }
      for (size_t k = 0; k < s->numel[i]; k++) work[i][k] = dopt_f32_to_bf16(vals[k]);
      pc.dtype = DOPT_BF16;
      pc.master = vals;
      pc.data = work[i];
    }
    st = dopt_optim_add_param(opt, group, &pc, NULL);
  }
  free(gid);
  if (st != DOPT_OK) {
    dopt_optim_destroy(opt);
    return st;
  }
  *out = opt;
  return DOPT_OK;
}

static uint64_t ulp_distance(float a, float b) {
  if (a != a || b != b) return UINT64_MAX; /* one NaN: as far apart as it gets (two: measure's NaN = NaN) */
  int32_t ia, ib;
  memcpy(&ia, &a, sizeof ia);
  memcpy(&ib, &b, sizeof ib);
  int64_t oa = ia < 0 ? (int64_t)INT32_MIN - ia : ia, ob = ib < 0 ? (int64_t)INT32_MIN - ib : ib;
  int64_t d = oa - ob;
  return (uint64_t)(d < 0 ? -d : d);
}

/* Records the difference of one tensor after step t (1-based). */
static void measure(cmp_tensor_stat *ts, int t, const float *ref, const float *got, size_t n) {
  double mabs = 0;
  uint64_t mulp = 0, nans = 0;
  enum { RUN = 1024 };
  for (size_t k0 = 0; k0 < n; k0 += RUN) {
    const size_t k1 = n - k0 < RUN ? n : k0 + RUN;
    if (memcmp(ref + k0, got + k0, (k1 - k0) * sizeof(float)) == 0) { /* equal bytes (the usual case) */
      unsigned c = 0;
      for (size_t k = k0; k < k1; k++) c += ref[k] != ref[k]; /* its NaN pairs */
      nans += c;
      continue;
    }
    for (size_t k = k0; k < k1; k++) {
      if (ref[k] != ref[k] && got[k] != got[k]) { /* NaN = NaN, counted apart (docs/nan-policy.md) */
        nans++;
        continue;
      }
      if (memcmp(&ref[k], &got[k], sizeof(float)) == 0) continue;
      double d = fabs((double)ref[k] - (double)got[k]);
      if (!(d <= mabs)) mabs = d; /* NaN: kept as NaN */
      uint64_t u = ulp_distance(ref[k], got[k]);
      if (u == 0) u = 1; /* +0 vs -0 */
      mulp = u > mulp ? u : mulp;
    }
  }
  ts->abs_per_step[t - 1] = mabs;
  ts->ulp_per_step[t - 1] = mulp;
  if (nans > ts->nan_pairs) ts->nan_pairs = nans;
  if (!(mabs <= ts->max_abs)) ts->max_abs = mabs;
  if (mulp > ts->max_ulp) ts->max_ulp = mulp;
  if (mulp > 0 && ts->first_diff == 0) ts->first_diff = t;
}

/* A state the distributed side holds in another size, or not at all (its layout differs: a wrong state
 * decision), after step t: every element differs (ULP column UINT64_MAX, abs +inf); a finding, not an error. */
static void measure_mismatch(cmp_tensor_stat *ts, int t) {
  ts->abs_per_step[t - 1] = INFINITY;
  ts->ulp_per_step[t - 1] = UINT64_MAX;
  ts->max_abs = INFINITY;
  ts->max_ulp = UINT64_MAX;
  if (ts->first_diff == 0) ts->first_diff = t;
}

/* Records the difference of a non-fp32 state (8-bit codes, int8 weights,
 * quantised projectors) after step t: byte for byte; the "ULP" column counts
 * the differing bytes and the abs column stays 0. */
static void measure_bytes(cmp_tensor_stat *ts, int t, const void *ref, const void *got, size_t bytes) {
  const unsigned char *a = ref, *b = got;
  uint64_t diff = 0;
  for (size_t k = 0; k < bytes; k++) diff += a[k] != b[k];
  ts->abs_per_step[t - 1] = 0;
  ts->ulp_per_step[t - 1] = diff;
  if (diff > ts->max_ulp) ts->max_ulp = diff;
  if (diff > 0 && ts->first_diff == 0) ts->first_diff = t;
}

typedef struct run_ctx {
  const cmp_options *o;
  const dopt_device *dev; /* NULL: the CPU */
  const source *s;
  cmp_result *r;
  cmp_progress_fn progress;
  void *user;
  double t0;
  const dopt_transport *measure_world; /* backend mpi: every rank measures; merged over this world */
  /* --checkpoint-at: the steps this world runs, where it saves or loads */
  int t_first, t_last;          /* 1 and o->steps without a checkpoint */
  const char *save_dir;         /* save after t_last */
  const char *load_dir;         /* load before t_first */
  const cmp_options *replay;    /* the options of the steps before t_first: the lead's reference replays them */
  int save_failed;              /* rank 0: writing the checkpoint failed (a full disk): the run's failure */
  const dopt_optim *plain;      /* the template every rank thread reads (NULL: each process builds its own) */
  const int *stages;            /* [np] every parameter's pipeline stage in this world's layout (plan_stages) */
} run_ctx;

/* Backend mpi: every rank stepped its own reference and measured its own
 * gathered tensors; one all_reduce MAX (I64) over the world merges them, so
 * rank 0 reports a difference seen by any rank. Keys, all exact: a double
 * >= 0 (or a NaN, sign bit cleared) orders like its bits as an int64 (a NaN
 * wins); a ULP count as itself (UINT64_MAX, a NaN mismatch: INT64_MAX); the
 * first divergent step as -step (none: INT64_MIN), so MAX is the earliest.
 * The skip counters come from collectives and must agree on every rank. */
static int64_t abs_key(double d) {
  int64_t k;
  memcpy(&k, &d, sizeof k);
  return k & INT64_MAX;
}
static double key_abs(int64_t k) {
  double d;
  memcpy(&d, &k, sizeof d);
  return d;
}
static int64_t ulp_key(uint64_t u) { return u > (uint64_t)INT64_MAX ? INT64_MAX : (int64_t)u; }
static uint64_t key_ulp(int64_t k) { return k == INT64_MAX ? UINT64_MAX : (uint64_t)k; }

static dopt_status merge_measurements(const dopt_transport *w, cmp_result *r, int steps) {
  const size_t per = 4 + 2 * (size_t)steps, n = (size_t)r->ntensors * per + 4, us = (size_t)steps;
  int64_t *v = malloc(n * sizeof *v);
  if (!v) return dopt__fail(DOPT_ERR_NO_MEMORY, "backend mpi: %zu measurement words", n);
  for (int k = 0; k < r->ntensors; k++) {
    const cmp_tensor_stat *t = &r->t[k];
    int64_t *b = v + (size_t)k * per;
    b[0] = abs_key(t->max_abs);
    b[1] = ulp_key(t->max_ulp);
    b[2] = t->first_diff ? -(int64_t)t->first_diff : INT64_MIN;
    for (size_t q = 0; q < us; q++) {
      b[3 + q] = abs_key(t->abs_per_step[q]);
      b[3 + us + q] = ulp_key(t->ulp_per_step[q]);
    }
    b[3 + 2 * us] = ulp_key(t->nan_pairs);
  }
  int64_t *sk = v + n - 4; /* max and -min of each counter */
  sk[0] = r->skipped_ref, sk[1] = -r->skipped_ref, sk[2] = r->skipped_dist, sk[3] = -r->skipped_dist;
  dopt_status st = w->ops->all_reduce(w->comm, v, v, n, DOPT_I64, DOPT_MAX);
  for (int k = 0; st == DOPT_OK && k < r->ntensors; k++) {
    cmp_tensor_stat *t = &r->t[k];
    const int64_t *b = v + (size_t)k * per;
    t->max_abs = key_abs(b[0]);
    t->max_ulp = key_ulp(b[1]);
    t->first_diff = b[2] == INT64_MIN ? 0 : (int)-b[2];
    for (size_t q = 0; q < us; q++) {
      t->abs_per_step[q] = key_abs(b[3 + q]);
      t->ulp_per_step[q] = key_ulp(b[3 + us + q]);
    }
    t->nan_pairs = key_ulp(b[3 + 2 * us]);
  }
  if (st == DOPT_OK && (sk[0] != -sk[1] || sk[2] != -sk[3]))
    st = dopt__fail(DOPT_ERR_MISMATCH, "backend mpi: the ranks disagree on skipped steps (reference %lld..%lld, "
                    "distributed %lld..%lld)", (long long)-sk[1], (long long)sk[0], (long long)-sk[3], (long long)sk[2]);
  if (st == DOPT_OK) r->skipped_ref = sk[0], r->skipped_dist = sk[2];
  free(v);
  return st;
}

double cmp_now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* This rank's TP block (dopt_tp_block, the library's rule) of a logical tensor [b, h, w] into blk. */
static void tp_slice(const cmp_param *p, int tp, int r, const float *full, float *blk) {
  dopt_piece pc;
  dopt_tp_block(p->ndim, p->shape, p->role, tp, r, &pc);
  for (size_t bi = 0; bi < pc.b; bi++)
    for (size_t i = 0; i < pc.hl; i++)
      memcpy(blk + (bi * pc.hl + i) * pc.wl, full + (bi * pc.h + pc.h0 + i) * pc.w + pc.w0, pc.wl * sizeof(float));
}

/* The reference's gradient for step t: each DP rank's micro-batches summed
 * in order, the dp sum of those (exact, or fp32 in rank order:
 * dopt_dp_sum), one division by dp·micro; batch invariant: the exact sum of
 * all dp·micro micro-batch gradients. moe_hybrid: an expert's over the dp
 * ranks of its ep rank only (its moe_dp group), divided by moe_dp·micro.
 * acc: [dp · micro · max numel]. */
static dopt_status reference_grads(const cmp_options *o, const source *s, int t, float **avg, float *acc, float *g,
                                   int *nonfinite) {
  const int micro = micro_of(o, s);
  const float **pv = malloc((size_t)o->dp * (size_t)micro * sizeof *pv);
  if (!pv) return dopt__fail(DOPT_ERR_NO_MEMORY, "compare: %d x %d gradient parts", o->dp, micro);
  dopt_status st = DOPT_OK;
  *nonfinite = 0;
  for (int i = 0; i < s->np; i++) {
    size_t n = s->numel[i];
    int np = 0, nd = 0; /* parts; the dp ranks that hold the parameter (moe_hybrid: an expert's moe_dp group) */
    for (int d = 0; d < o->dp; d++) {
      if (!holds_param(o, s, i, d)) continue;
      nd++;
      if (o->batch_invariant) { /* every micro-batch gradient is a part of its own */
        for (int m = 0; m < micro; m++) {
          float *a = acc + (size_t)np * n;
          if ((st = shard_grad(s, i, t, shard_of(o, s, d, m), a)) != DOPT_OK) goto done;
          if (ep_stack(o, s, i)) own_experts_only(o, s, i, d, a);
          pv[np++] = a;
        }
        continue;
      }
      float *a = acc + (size_t)np * n;
      for (int m = 0; m < micro; m++) {
        if ((st = shard_grad(s, i, t, shard_of(o, s, d, m), g)) != DOPT_OK) goto done;
        for (size_t k = 0; k < n; k++) a[k] = m == 0 ? g[k] : a[k] + g[k];
      }
      if (ep_stack(o, s, i)) own_experts_only(o, s, i, d, a);
      pv[np++] = a;
    }
    if ((st = dopt_dp_sum(pv, np, o->dp_sum_words, n, avg[i])) != DOPT_OK) goto done;
    const float denom = (float)((double)(ep_stack(o, s, i) ? o->dp / o->ep : nd) * (double)micro);
    for (size_t k = 0; k < n; k++) {
      avg[i][k] = avg[i][k] / denom;
      *nonfinite |= !isfinite(avg[i][k]);
    }
  }
done:
  free(pv);
  return st;
}

/* The final digests (docs/digest.md): on the lead after the last step, each
 * gathered distributed tensor goes into dg and the reference's own into rdg,
 * under the plan's name and in its order. A parameter and its bf16 copy are
 * described by the plan's layout on both sides. */
static dopt_status digest_both(dopt_digest *dg, dopt_digest *rdg, const cmp_tensor_stat *t, const void *got,
                               const void *ref, size_t bytes) {
  DOPT_TRY(dopt_digest_tensor(dg, t->name, t->dtype, t->ndim, t->shape, got, bytes));
  return dopt_digest_tensor(rdg, t->name, t->dtype, t->ndim, t->shape, ref, bytes);
}

/* A parameter's step count, "<p>/step" (an I64 scalar, as `distopt run` writes it). */
static dopt_status digest_steps(int64_t ds, int64_t rs, const char *pname, dopt_digest *dg, dopt_digest *rdg) {
  char name[96];
  snprintf(name, sizeof name, "%s/step", pname);
  DOPT_TRY(dopt_digest_tensor(dg, name, DOPT_I64, 0, NULL, &ds, sizeof ds));
  return dopt_digest_tensor(rdg, name, DOPT_I64, 0, NULL, &rs, sizeof rs);
}

/* One step of the reference on the lead: the averaged gradient of step t (o's
 * layout), skip on a non-finite one, clipping, the step. */
static dopt_status reference_step(const cmp_options *o, const source *s, int t, dopt_optim *ref, float **avg,
                                  float *acc, float *g, int *skipped) {
  int bad = 0;
  DOPT_TRY(reference_grads(o, s, t, avg, acc, g, &bad));
  *skipped = bad;
  if (bad) return DOPT_OK;
  if (o->max_grad_norm > 0) {
    double *ss = malloc((size_t)s->np * sizeof *ss);
    if (!ss) return dopt__fail(DOPT_ERR_NO_MEMORY, "compare: %d squared sums", s->np);
    for (int i = 0; i < s->np; i++) ss[i] = dopt_xsum_sq(avg[i], s->numel[i]);
    float coef = dopt_clip_coef(ss, s->np, o->max_grad_norm, NULL);
    free(ss);
    for (int i = 0; i < s->np; i++)
      for (size_t k = 0; k < s->numel[i]; k++) avg[i][k] = avg[i][k] * coef;
  }
  return dopt_optim_step(ref, (const float *const *)avg);
}

/* One rank's run on its TP and DP transports (either backend). */
/* The reference's counts since the previous call, per parameter and counter (step: [np · DOPT_NCOUNTERS],
 * or NULL); prev holds the totals of the previous call. */
static dopt_status reference_counts(const dopt_optim *ref, int np, int64_t *prev, int64_t *step) {
  for (int i = 0; i < np; i++) {
    dopt_counters c = DOPT_COUNTERS_INIT;
    DOPT_TRY(dopt_optim_counters(ref, i, &c));
    int64_t *pv = prev + (size_t)i * DOPT_NCOUNTERS;
    for (int k = 0; k < DOPT_NCOUNTERS; k++) {
      if (step) step[(size_t)i * DOPT_NCOUNTERS + (size_t)k] = c.total[k] - pv[k];
      pv[k] = c.total[k];
    }
  }
  return DOPT_OK;
}

/* Adds step t's reference counts to the run's totals, and t to the refresh steps when a projector refreshed. */
static dopt_status note_counts(cmp_result *r, int t, int np, const int64_t *step) {
  int refreshed = 0;
  for (int i = 0; i < np; i++)
    for (int k = 0; k < DOPT_NCOUNTERS; k++) {
      const int64_t v = step[(size_t)i * DOPT_NCOUNTERS + (size_t)k];
      r->event_totals[k] += v;
      refreshed |= k == DOPT_COUNTER_REFRESHES && v > 0;
    }
  if (!refreshed) return DOPT_OK;
  int *n = realloc(r->refresh_steps, ((size_t)r->nrefresh + 1) * sizeof *n);
  if (!n) return dopt__fail(DOPT_ERR_NO_MEMORY, "compare: %d refresh steps", r->nrefresh + 1);
  r->refresh_steps = n;
  r->refresh_steps[r->nrefresh++] = t;
  return DOPT_OK;
}

/* The pipeline stage of every parameter (docs/distributed.md "Pipeline stages"): the decoder layers (names
 * with "layers.N.", L = the largest N + 1) in pp contiguous runs, as ColossalAI's Policy.distribute_layers:
 * L / pp each, and the L mod pp extra layers one each to the stages from pp/2 - (L mod pp)/2 on; or as
 * layers_per_stage says. A parameter without a layer number goes to the first stage before the first
 * layer's parameters (the embeddings), else to the last (the final norm, the head). */
void cmp_layers_per_stage(long L, int pp, long *per) {
  for (int k = 0; k < pp; k++) per[k] = L / pp;
  for (long k = pp / 2 - (L % pp) / 2, e = k + L % pp; k < e; k++) per[k]++;
}

static dopt_status plan_stages(const cmp_options *o, const source *s, int *stage) {
  long L = 0;
  int first = -1;
  for (int i = 0; i < s->np; i++) {
    const long n = dopt_layer_from_name(s->p[i].name); /* LISA's rule too */
    if (n >= 0 && first < 0) first = i;
    if (n + 1 > L) L = n + 1;
  }
  for (int i = 0; i < s->np; i++) stage[i] = 0;
  if (o->pp == 1) return DOPT_OK;
  if (L < o->pp)
    return dopt__fail(DOPT_ERR_INVALID_ARG, "pp=%d: the model has %ld decoder layers (parameters named "
                      "'layers.N.'); each stage needs one", o->pp, L);
  long per[CMP_PP_MAX], sum = 0;
  if (o->nlps)
    for (int k = 0; k < o->pp; k++) per[k] = o->layers_per_stage[k];
  else
    cmp_layers_per_stage(L, o->pp, per);
  for (int k = 0; k < o->pp; k++) sum += per[k];
  if (sum != L)
    return dopt__fail(DOPT_ERR_INVALID_ARG, "layers_per_stage: %ld layers in all, the model has %ld", sum, L);
  for (int i = 0; i < s->np; i++) {
    const long n = dopt_layer_from_name(s->p[i].name);
    if (n < 0) {
      stage[i] = first < 0 || i < first ? 0 : o->pp - 1;
      continue;
    }
    long at = 0;
    int k = 0;
    while (k < o->pp - 1 && n >= at + per[k]) at += per[k++];
    stage[i] = k;
  }
  return DOPT_OK;
}

/* One rank's groups (either backend): tp, dp, pp, and moe_hybrid's ep and moe_dp (size 1: none). */
typedef struct rank_groups {
  dopt_transport tp, dp, pp, ep, mdp;
} rank_groups;

static dopt_status rank_run(run_ctx *x, int rank, const rank_groups *rg) {
  const cmp_options *o = x->o;
  const source *s = x->s;
  cmp_result *r = x->r;
  dopt_dist_config cfg = DOPT_DIST_CONFIG_INIT;
  cfg.plugin = o->plugin;
  cfg.zero_stage = o->zero;
  cfg.max_grad_norm = o->max_grad_norm;
  cfg.dp_sum_words = o->dp_sum_words;
  cfg.batch_invariant = o->batch_invariant;
  cfg.device = x->dev;
  cfg.tp = rg->tp;
  cfg.dp = rg->dp;
  cfg.pp = rg->pp;
  if (moe_of(o, s)) { /* the experts (named experts.<e>.) over ep */
    cfg.ep = rg->ep;
    cfg.moe_dp = rg->mdp;
    cfg.experts = s->expert;
    cfg.num_experts = s->nexperts;
  }
  cfg.chunk_elems = strcmp(o->plugin, "gemini") == 0 ? (o->chunk_size ? o->chunk_size : CMP_GEMINI_CHUNK_DEFAULT) : 0;
  /* the lead steps the reference and measures: rank 0, or every rank with backend mpi */
  const int lead = rank == 0 || x->measure_world != NULL, np = s->np, micro = micro_of(o, s);
  /* per parameter: the reference's values, averaged gradient and bf16 copy (lead); this rank's TP block
   * of the gradient; the bf16 copies of an own template (without a shared one) */
  const size_t npc = np > 0 ? (size_t)np : 1;
  float **rdata = calloc(npc, sizeof *rdata), **avg = calloc(npc, sizeof *avg), **loc = calloc(npc, sizeof *loc);
  uint16_t **work = calloc(npc, sizeof *work), **rwork = calloc(npc, sizeof *rwork);
  dopt_tp_role *roles = calloc(npc, sizeof *roles);
  const int *stage = x->stages;
  const float **gp = calloc(npc, sizeof *gp); /* the gradients passed: this stage's parameters' blocks */
  const dopt_optim *plain = x->plain;
  dopt_optim *own = NULL, *ref = NULL;
  dopt_dist_optim *d = NULL;
  dopt_digest *dg = NULL, *rdg = NULL; /* the lead's final digests: distributed, reference */
  size_t maxn = 1;
  for (int i = 0; i < np; i++) maxn = s->numel[i] > maxn ? s->numel[i] : maxn;
  size_t parts = (size_t)o->dp * (size_t)micro_of(o, s);
  if (x->replay && (size_t)x->replay->dp * (size_t)micro_of(x->replay, s) > parts)
    parts = (size_t)x->replay->dp * (size_t)micro_of(x->replay, s);
  /* whole-tensor buffers (the largest tensor): a recording's gradient before it is sliced (synthetic and
   * trace gradients come as this rank's block); the lead's reference gradients (acc: every dp part),
   * gathers and bf16 measurements */
  const int sliced = s->rec != NULL, whole = lead || sliced; /* a recording's gradient is read whole */
  float *full = whole ? malloc(maxn * sizeof(float)) : NULL, *acc = lead ? malloc(parts * maxn * sizeof(float)) : NULL;
  /* the gathers deliver to the lead only (each rank measures with backend mpi: to every rank) */
  const int to_lead = x->measure_world == NULL;
  float *got = lead ? malloc(maxn * sizeof(float)) : NULL;
  uint16_t *wgot = o->bf16 && lead ? malloc(maxn * sizeof(uint16_t)) : NULL;
  float *wf = o->bf16 && lead ? malloc(2 * maxn * sizeof(float)) : NULL;
  /* every rank's step counters against rank 0's (dopt_dist_check_replicas; the held pieces: check_held) */
  const size_t repn = (size_t)np * sizeof(int64_t);
  unsigned char *rep = calloc(repn ? repn : 1, 1);
  /* the lead's reference counters: totals at the previous step, and this step's counts */
  const size_t ncnt = (size_t)np * DOPT_NCOUNTERS;
  int64_t *cprev = lead ? calloc(2 * ncnt + 1, sizeof *cprev) : NULL, *cstep = cprev ? cprev + ncnt : NULL;
  void *sgot = NULL; /* the lead's gathered state */
  size_t sgot_cap = 0;
  dopt_status st = rdata && avg && loc && work && rwork && roles && gp && (full || !whole) && (acc || !lead) &&
                           (got || !lead) && (wgot || !o->bf16 || !lead) && (wf || !o->bf16 || !lead) && rep &&
                           (cprev || !lead)
                       ? DOPT_OK
                       : dopt__fail(DOPT_ERR_NO_MEMORY, "compare buffers: %zu elements x %zu parts and %zu digest bytes",
                                    maxn, parts, repn);
  if (st == DOPT_OK && !plain) { /* no shared template (a process per rank): this process's own */
    st = build_plain(o, s, 1, NULL, work, &own);
    plain = own;
  }
  for (int i = 0; st == DOPT_OK && i < np; i++) roles[i] = s->p[i].role;
  cfg.stages = stage;
  if (st == DOPT_OK) st = dopt_dist_create(plain, &cfg, roles, &d);
  if (st == DOPT_OK && to_lead) st = dopt_dist_set_gather(d, DOPT_DIST_GATHER_LEAD);
  if (st == DOPT_OK && lead) st = build_plain(o, s, 0, rdata, rwork, &ref);
  /* The reference steps on the lead while the other ranks wait for its
   * gather: in the simulator they sleep (condition variables), so it may use
   * every core; other ranks' processes may busy-poll (MPI, NCCL), so there
   * it keeps to one thread unless told otherwise. The bits are the same. */
  if (st == DOPT_OK && lead) st = dopt_optim_set_threads(ref, o->threads ? o->threads
                                                               : strcmp(o->backend, "sim") == 0 ? 0 : 1);
  for (int i = 0; st == DOPT_OK && i < np; i++) {
    int ndim;
    int64_t shape[DOPT_MAX_DIMS];
    size_t lnumel = 0;
    st = dopt_dist_local_shape(d, i, &ndim, shape, &lnumel); /* this rank's TP block */
    if (st != DOPT_OK) break;
    loc[i] = malloc((lnumel ? lnumel : 1) * sizeof(float));
    if (lead) avg[i] = malloc((s->numel[i] ? s->numel[i] : 1) * sizeof(float));
    if (!loc[i] || (lead && !avg[i]))
      st = dopt__fail(DOPT_ERR_NO_MEMORY, "compare buffers: parameter '%s' (%zu elements)", s->p[i].name, s->numel[i]);
  }
  /* this rank's parameters: its stage's, and with moe_hybrid of the experts its ep rank's only */
  for (int i = 0; st == DOPT_OK && i < np; i++)
    gp[i] = (stage[i] == cfg.pp.rank || cfg.pp.size <= 1) && holds_param(o, s, i, cfg.dp.rank) ? loc[i] : NULL;
  /* resumed: the distributed optimizer loads the checkpoint; the reference
   * replays the steps before it in the saving layout (the uninterrupted run) */
  if (st == DOPT_OK && x->load_dir) st = dopt_dist_load(d, plain, x->load_dir);
  for (int t = 1; st == DOPT_OK && lead && x->replay && t < x->t_first; t++) {
    int bad = 0;
    st = reference_step(x->replay, s, t, ref, avg, acc, full, &bad); /* its skips were counted before the save */
  }
  if (st == DOPT_OK && lead) st = reference_counts(ref, np, cprev, NULL); /* the replayed steps' counts: not compared */
  for (int t = x->t_first; t <= x->t_last && st == DOPT_OK; t++) {
    /* distributed: this rank's micro-batches, then the step */
    for (int m = 0; m < micro && st == DOPT_OK; m++) {
      for (int i = 0; i < np && st == DOPT_OK; i++) {
        if (!gp[i]) continue; /* another stage's parameter */
        const int sh = shard_of(o, s, cfg.dp.rank, m);
        dopt_piece pc;
        dopt_tp_block(s->p[i].ndim, s->p[i].shape, s->p[i].role, o->tp, cfg.tp.rank, &pc);
        if (sliced) { /* a recording: read whole, then sliced */
          st = shard_grad(s, i, t, sh, full);
          tp_slice(&s->p[i], o->tp, cfg.tp.rank, full, loc[i]);
        } else if (s->trace) { /* a trace: this rank's block alone, from the file */
          char key[200];
          grad_key(key, sizeof key, t, sh, s->p[i].name);
          st = dopt_st_read_f32_block(s->trace, key, pc.b, pc.h, pc.w, pc.h0, pc.hl, pc.w0, pc.wl, loc[i]);
        } else { /* synthetic: only this rank's block */
          (s->fast ? synth_fast : synth_block)(s, i, t, sh, pc.h0, pc.hl, pc.w0, pc.wl, loc[i]);
        }
      }
      if (st == DOPT_OK) st = dopt_dist_backward(d, gp);
    }
    dopt_dist_step_info info;
    if (st == DOPT_OK) st = dopt_dist_step(d, &info);
    if (st == DOPT_OK && info.skipped && lead) r->skipped_dist++;
    /* reference, in lockstep on rank 0 */
    if (st == DOPT_OK && lead) {
      int bad = 0;
      st = reference_step(o, s, t, ref, avg, acc, full, &bad);
      if (st == DOPT_OK && bad) r->skipped_ref++;
    }
    /* every parameter's counters against the reference's (collective) */
    if (st == DOPT_OK && lead) st = reference_counts(ref, np, cprev, cstep);
    if (st == DOPT_OK && lead) st = note_counts(r, t, np, cstep);
    dopt_counter_diff df;
    if (st == DOPT_OK) st = dopt_dist_check_counters(d, cstep, &df);
    if (st == DOPT_OK && lead && df.param >= 0 && r->events_step == 0) {
      r->events_step = t, r->events_rank = df.rank, r->events_counter = df.counter;
      r->events_ref = df.reference, r->events_dist = df.distributed;
      snprintf(r->events_param, sizeof r->events_param, "%s", s->p[df.param].name);
    }
    /* gather (collective) and measure on rank 0; after the last step it also digests */
    const int last = lead && t == o->steps;
    if (st == DOPT_OK && last) st = dopt_digest_create(&dg);
    if (st == DOPT_OK && last) st = dopt_digest_create(&rdg);
    int ti = 0;
    /* lead mode on the simulator: the lead reads every rank's pieces in place, no collective per tensor */
    if (st == DOPT_OK) st = dopt_dist_gather_begin(d);
    for (int i = 0; i < np && st == DOPT_OK; i++) {
      st = dopt_dist_gather_param(d, i, got);
      if (st == DOPT_OK && lead) measure(&r->t[ti], t, rdata[i], got, s->numel[i]);
      if (st == DOPT_OK && last) st = digest_both(dg, rdg, &r->t[ti], got, rdata[i], s->numel[i] * sizeof(float));
      ti++;
      if (o->bf16 && st == DOPT_OK) {
        st = dopt_dist_gather_work(d, i, wgot);
        if (st == DOPT_OK && lead) {
          for (size_t k = 0; k < s->numel[i]; k++) {
            wf[k] = dopt_bf16_to_f32(rwork[i][k]);
            wf[maxn + k] = dopt_bf16_to_f32(wgot[k]);
          }
          measure(&r->t[ti], t, wf, wf + maxn, s->numel[i]);
        }
        if (st == DOPT_OK && last) st = digest_both(dg, rdg, &r->t[ti], wgot, rwork[i], s->numel[i] * sizeof(uint16_t));
        ti++;
      }
      /* its states, in the order plan_tensors listed them */
      size_t pl = strlen(s->p[i].name);
      while (st == DOPT_OK && ti < r->ntensors && r->t[ti].is_state && strncmp(r->t[ti].name, s->p[i].name, pl) == 0 &&
             r->t[ti].name[pl] == '/') {
        const char *name = r->t[ti].name + pl + 1;
        size_t sbytes = 0;
        st = dopt_dist_state_bytes(d, i, name, &sbytes);
        /* absent: the distributed layout has no such state (the same on every rank: none gathers it); its
         * digest lacks the tensor, the reference's has it */
        const int absent = st == DOPT_ERR_NOT_FOUND;
        if (absent) st = DOPT_OK;
        if (st == DOPT_OK && !absent && lead && (sbytes > sgot_cap || !sgot)) { /* grown, kept: no allocation per step */
          void *nb = realloc(sgot, sbytes ? sbytes : 1);
          if (!nb) st = dopt__fail(DOPT_ERR_NO_MEMORY, "state '%s' (%zu bytes)", name, sbytes);
          else sgot = nb, sgot_cap = sbytes;
        }
        if (st == DOPT_OK && !absent) st = dopt_dist_gather_state(d, i, name, lead ? sgot : NULL);
        const cmp_tensor_stat *pt = &r->t[ti]; /* the distributed side has no state views: the plan's layout */
        if (st == DOPT_OK && last && !absent) {
          const int64_t flat[1] = {(int64_t)sbytes}; /* another size than the plan's: its bytes, as they are */
          st = sbytes == dopt_numel(pt->ndim, pt->shape) * dopt_dtype_size(pt->dtype)
                   ? dopt_digest_tensor(dg, pt->name, pt->dtype, pt->ndim, pt->shape, sgot, sbytes)
                   : dopt_digest_tensor(dg, pt->name, DOPT_U8, 1, flat, sgot, sbytes);
        }
        int found = 0;
        for (int q = 0; st == DOPT_OK && lead && q < dopt_optim_num_states(ref, i); q++) {
          dopt_state_view v;
          if (dopt_optim_state(ref, i, q, &v) != DOPT_OK || strcmp(v.name, name) != 0) continue;
          found = 1;
          if (absent || v.bytes != sbytes) measure_mismatch(&r->t[ti], t);
          else if (v.dtype == DOPT_F32) measure(&r->t[ti], t, v.data, sgot, v.bytes / sizeof(float));
          else measure_bytes(&r->t[ti], t, v.data, sgot, v.bytes);
          if (st == DOPT_OK && last) st = dopt_digest_tensor(rdg, pt->name, v.dtype, v.ndim, v.shape, v.data, v.bytes);
        }
        /* a state the reference does not hold yet (a parameter never stepped: LISA's frozen layers) is its declared
         * initial value, zeros (alloc_states): the distributed one is measured against those, and both digests
         * cover the same tensors */
        if (st == DOPT_OK && lead && !found) {
          void *zeros = calloc(1, sbytes ? sbytes : 1);
          if (!zeros) st = dopt__fail(DOPT_ERR_NO_MEMORY, "state '%s' (%zu bytes)", name, sbytes);
          else if (absent) measure_mismatch(&r->t[ti], t);
          else if (pt->dtype == DOPT_F32) measure(&r->t[ti], t, zeros, sgot, sbytes / sizeof(float));
          else measure_bytes(&r->t[ti], t, zeros, sgot, sbytes);
          if (st == DOPT_OK && last && !absent)
            st = dopt_digest_tensor(rdg, pt->name, pt->dtype, pt->ndim, pt->shape, zeros, sbytes);
          free(zeros);
        }
        ti++;
      }
      /* the step counter: this rank's into the replica bytes; the lead's against the reference */
      int64_t ds = 0, rs = 0;
      if (st == DOPT_OK) st = dopt_dist_get_step(d, i, &ds);
      if (st == DOPT_OK) memcpy(rep + (size_t)i * sizeof ds, &ds, sizeof ds);
      if (st == DOPT_OK && lead) st = dopt_optim_get_step(ref, i, &rs);
      if (st == DOPT_OK && lead && ds != rs && r->counter_step == 0) {
        r->counter_step = t;
        snprintf(r->counter_param, sizeof r->counter_param, "%s", s->p[i].name);
        r->counter_ref = rs;
        r->counter_dist = ds;
      }
      if (st == DOPT_OK && last) st = digest_steps(ds, rs, s->p[i].name, dg, rdg);
    }
    { /* after a failure too: the other ranks wait in its releases */
      const dopt_status se = dopt_dist_gather_end(d);
      if (st == DOPT_OK) st = se;
    }
    /* every rank's copies against the other holders' (the lead compared its gathered ones with the
     * reference): each held piece by digest, then the step counters against rank 0's */
    int drank = -1, dparam = -1;
    char dname[sizeof r->drift_tensor];
    size_t doff = 0;
    if (st == DOPT_OK) st = dopt_dist_check_held(d, &drank, &dparam, dname, sizeof dname);
    if (st == DOPT_OK && lead && drank >= 0 && r->drift_step == 0) {
      r->drift_step = t;
      r->drift_rank = drank;
      snprintf(r->drift_tensor, sizeof r->drift_tensor, "%s", dname);
    }
    if (st == DOPT_OK) st = dopt_dist_check_replicas(d, rep, repn, &drank, &doff);
    if (st == DOPT_OK && lead && drank >= 0 && r->drift_step == 0) {
      r->drift_step = t;
      r->drift_rank = drank;
      snprintf(r->drift_tensor, sizeof r->drift_tensor, "%s/step", s->p[doff / sizeof(int64_t)].name);
    }
    if (st == DOPT_OK && last) st = dopt_digest_final(dg, NULL, r->digest);
    if (st == DOPT_OK && last) st = dopt_digest_final(rdg, NULL, r->ref_digest);
    if (st == DOPT_OK && lead) {
      r->steps = t;
      uint64_t worst = 0;
      for (int k = 0; k < r->ntensors; k++) worst = r->t[k].max_ulp > worst ? r->t[k].max_ulp : worst;
      if (x->progress) x->progress(t, o->steps, cmp_now_s() - x->t0, worst, x->user);
    }
  }
  if (st == DOPT_OK && x->save_dir) {
    st = dopt_dist_save(d, plain, x->save_dir, x->t_last);
    if (st != DOPT_OK && rank == 0) x->save_failed = 1; /* every rank fails with it (the save agrees) */
  }
  if (st == DOPT_OK && x->measure_world) st = merge_measurements(x->measure_world, r, o->steps);
  for (int i = 0; i < np; i++) {
    if (work) free(work[i]);
    if (rdata) free(rdata[i]);
    if (rwork) free(rwork[i]);
    if (avg) free(avg[i]);
    if (loc) free(loc[i]);
  }
  free(work);
  free(rdata);
  free(rwork);
  free(avg);
  free(loc);
  free(roles);
  free(gp);
  free(full);
  free(acc);
  free(got);
  free(wgot);
  free(wf);
  free(rep);
  free(cprev);
  free(sgot);
  dopt_digest_destroy(dg);
  dopt_digest_destroy(rdg);
  dopt_dist_destroy(d);
  dopt_optim_destroy(own);
  dopt_optim_destroy(ref);
  return st;
}

/* World rank r's coordinates (dopt_rank_coords_of: the library's rule, ep inside dp as ColossalAI's
 * MoeHybridParallelPlugin): the colours of its tp, dp, pp, ep and moe_dp groups (c[5]), each the index of the
 * group among the world's groups of that kind. */
enum { G_TP, G_DP, G_PP, G_EP, G_MDP, NGROUPS };
static void group_colours(const cmp_options *o, int r, int *c) {
  const dopt_rank_coords x = dopt_rank_coords_of(r, o->tp, o->dp, o->ep);
  c[G_TP] = x.stage * o->dp + x.dp;
  c[G_DP] = x.stage * o->tp + x.tp;
  c[G_PP] = x.dp * o->tp + x.tp;
  c[G_EP] = (x.stage * (o->dp / o->ep) + x.moe_dp) * o->tp + x.tp;
  c[G_MDP] = (x.stage * o->ep + x.ep) * o->tp + x.tp;
}

/* The groups split from the world (sim: labelled) that this layout has: tp and dp always, pp with stages, ep and
 * moe_dp with expert parallelism. */
static int has_group(const cmp_options *o, int g) {
  return g == G_TP || g == G_DP || (g == G_PP && o->pp > 1) || ((g == G_EP || g == G_MDP) && o->ep > 1);
}
static const char *const GROUP_LABEL[NGROUPS] = {"tp", "dp", "pp", "ep", "moe_dp"};
static dopt_transport *group_slot(rank_groups *rg, int g) {
  return g == G_TP ? &rg->tp : g == G_DP ? &rg->dp : g == G_PP ? &rg->pp : g == G_EP ? &rg->ep : &rg->mdp;
}
static const rank_groups NO_GROUPS = {{NULL, NULL, 0, 1}, {NULL, NULL, 0, 1}, {NULL, NULL, 0, 1}, {NULL, NULL, 0, 1},
                                      {NULL, NULL, 0, 1}};

static dopt_status rank_body(dopt_sim_comm *world, int rank, void *user) {
  run_ctx *x = user;
  rank_groups rg = NO_GROUPS;
  int c[NGROUPS];
  group_colours(x->o, rank, c);
  for (int g = 0; g < NGROUPS; g++) {
    if (!has_group(x->o, g)) continue;
    dopt_sim_comm *sc;
    DOPT_TRY(dopt_sim_comm_split_labeled(world, c[g], rank, GROUP_LABEL[g], &sc));
    DOPT_TRY(dopt_sim_transport(sc, group_slot(&rg, g)));
  }
  return rank_run(x, rank, &rg);
}

static void plan_layout(cmp_tensor_stat *t, dopt_dtype dt, int ndim, const int64_t *shape) {
  t->dtype = dt;
  t->ndim = ndim;
  memcpy(t->shape, shape, sizeof t->shape);
}

/* The tensors measured: per parameter, the parameter, its bf16 working copy
 * (with bf16), then every state of the optimizer's layout. */
static dopt_status plan_tensors(const cmp_options *o, const source *s, cmp_result *r) {
  uint16_t **work = calloc(s->np > 0 ? (size_t)s->np : 1, sizeof *work);
  if (!work) return dopt__fail(DOPT_ERR_NO_MEMORY, "compare: %d parameters", s->np);
  dopt_optim *opt;
  dopt_status bs = build_plain(o, s, 0, NULL, work, &opt); /* on the source's values: only its states are made */
  if (bs != DOPT_OK) {
    for (int i = 0; i < s->np; i++) free(work[i]);
    free(work);
    return bs;
  }
  int cap = s->np * (2 + DOPT_MAX_STATES), n = 0;
  r->t = calloc((size_t)cap, sizeof *r->t);
  dopt_status st = r->t ? DOPT_OK : dopt__fail(DOPT_ERR_NO_MEMORY, "compare results: %d tensors", cap);
  for (int i = 0; i < s->np && st == DOPT_OK; i++) {
    st = dopt_optim_init_state(opt, i);
    snprintf(r->t[n].name, sizeof r->t[0].name, "%s", s->p[i].name);
    plan_layout(&r->t[n++], DOPT_F32, s->p[i].ndim, s->p[i].shape);
    if (o->bf16) {
      snprintf(r->t[n].name, sizeof r->t[0].name, "%s/bf16", s->p[i].name);
      plan_layout(&r->t[n], DOPT_BF16, s->p[i].ndim, s->p[i].shape);
      r->t[n++].is_state = 0;
    }
    for (int k = 0; st == DOPT_OK && k < dopt_optim_num_states(opt, i); k++) {
      dopt_state_view v;
      st = dopt_optim_state(opt, i, k, &v);
      snprintf(r->t[n].name, sizeof r->t[0].name, "%s/%s", s->p[i].name, v.name);
      plan_layout(&r->t[n], v.dtype, v.ndim, v.shape);
      r->t[n++].is_state = 1;
    }
  }
  r->ntensors = n;
  for (int k = 0; k < n && st == DOPT_OK; k++) {
    r->t[k].abs_per_step = calloc((size_t)o->steps, sizeof(double));
    r->t[k].ulp_per_step = calloc((size_t)o->steps, sizeof(uint64_t));
    if (!r->t[k].abs_per_step || !r->t[k].ulp_per_step)
      st = dopt__fail(DOPT_ERR_NO_MEMORY, "compare results: %d steps of tensor '%s'", o->steps, r->t[k].name);
  }
  dopt_optim_destroy(opt);
  for (int i = 0; i < s->np; i++) free(work[i]);
  free(work);
  return st;
}

/* --pp with the plugin: only hybrid has a pipeline (ColossalAI's HybridParallelPlugin pp_size). */
static dopt_status check_pp(const char *plugin, int pp, int tp, int dp, const char *what) {
  DOPT_CHECK_ARG(pp >= 1 && pp <= CMP_PP_MAX && (long)pp * tp * dp <= 64,
                 "%spp=%d tp=%d dp=%d: pp >= 1, pp*tp*dp <= 64", what, pp, tp, dp);
  DOPT_CHECK_ARG(pp == 1 || strcmp(plugin, "hybrid") == 0,
                 "%spp=%d needs plugin hybrid (ColossalAI's HybridParallelPlugin pp_size), not '%s'", what, pp, plugin);
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

static dopt_status check_options(const cmp_options *o) {
  DOPT_CHECK_ARG(o->tp >= 1 && o->dp >= 1 && o->tp * o->dp <= 64, "tp=%d dp=%d: each >= 1, tp*dp <= 64", o->tp, o->dp);
  DOPT_TRY(check_pp(o->plugin, o->pp, o->tp, o->dp, ""));
  DOPT_TRY(check_ep(o->plugin, o->ep, o->dp, ""));
  DOPT_CHECK_ARG(o->nlps == 0 || o->nlps == o->pp, "layers_per_stage: %d stages given, pp=%d", o->nlps, o->pp);
  DOPT_CHECK_ARG(o->chunk_size == 0 || strcmp(o->plugin, "gemini") == 0,
                 "chunk_size=%zu is Gemini's chunk: it needs plugin gemini, not '%s'", o->chunk_size, o->plugin);
  DOPT_CHECK_ARG(o->resume_chunk_size == 0 || o->checkpoint_at > 0,
                 "resume chunk_size=%zu: there is no resume (checkpoint_at)", o->resume_chunk_size);
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
    DOPT_CHECK_ARG(strcmp(o->backend, "sim") == 0, "checkpoint_at: backend '%s' (only sim resumes in another layout)",
                   o->backend);
    const int tp = o->resume_tp > 0 ? o->resume_tp : o->tp, dp = o->resume_dp > 0 ? o->resume_dp : o->dp;
    const int pp = o->resume_pp > 0 ? o->resume_pp : o->pp;
    const char *rpl = o->resume_plugin[0] ? o->resume_plugin : o->plugin;
    DOPT_CHECK_ARG(tp * dp <= 64, "resume: tp=%d dp=%d: tp*dp <= 64", tp, dp);
    DOPT_TRY(check_pp(rpl, pp, tp, dp, "resume: "));
    DOPT_TRY(check_ep(rpl, o->resume_ep > 0 ? o->resume_ep : strcmp(rpl, "moe_hybrid") == 0 ? o->ep : 1, dp,
                      "resume: "));
    DOPT_CHECK_ARG(o->resume_chunk_size == 0 || strcmp(rpl, "gemini") == 0,
                   "resume: chunk_size=%zu needs the resume plugin gemini, not '%s'", o->resume_chunk_size, rpl);
    DOPT_TRY(dopt_dist_check_layout(rpl, tp, dp, o->resume_zero >= 0 ? o->resume_zero : o->zero));
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

/* The NCCL backend: this process is one rank of a launcher's world
 * (torchrun, mpirun, srun) of tp·dp processes, one GPU each (local rank). */
static dopt_status run_nccl(run_ctx *x) {
  const cmp_options *o = x->o;
  dopt_nccl_comm *world = NULL, *gc[NGROUPS] = {NULL};
  dopt_status st = dopt_nccl_init_env(120000, &world);
  dopt_transport wt;
  rank_groups rg = NO_GROUPS;
  if (st == DOPT_OK) st = dopt_nccl_transport(world, &wt);
  if (st == DOPT_OK && wt.size != o->pp * o->tp * o->dp)
    st = dopt__fail(DOPT_ERR_INVALID_ARG, "backend nccl: the launcher started %d ranks but pp x tp x dp = %d x %d x %d = %d",
                    wt.size, o->pp, o->tp, o->dp, o->pp * o->tp * o->dp);
  int c[NGROUPS] = {0};
  if (st == DOPT_OK) group_colours(o, wt.rank, c);
  for (int g = 0; st == DOPT_OK && g < NGROUPS; g++)
    if (has_group(o, g)) {
      st = dopt_nccl_split(world, c[g], wt.rank, &gc[g]);
      if (st == DOPT_OK) st = dopt_nccl_transport(gc[g], group_slot(&rg, g));
    }
  if (st == DOPT_OK) {
    x->r->rank = wt.rank;
    st = rank_run(x, wt.rank, &rg);
  }
  if (st != DOPT_OK) { /* peers fail instead of waiting; every communicator, so that none finalises for minutes */
    for (int g = NGROUPS - 1; g >= 0; g--)
      if (gc[g]) dopt_nccl_abort(gc[g]);
    if (world) dopt_nccl_abort(world);
  }
  for (int g = NGROUPS - 1; g >= 0; g--) dopt_nccl_destroy(gc[g]);
  dopt_nccl_destroy(world);
  return st;
}

/* The MPI backend: this process is one rank of an mpirun world of tp·dp
 * processes on the CPU device, split into TP and DP groups as run_nccl does.
 * Every rank steps the reference and measures what it gathered; the
 * measurements are merged over the world (merge_measurements). MPI stays
 * initialised: the caller finalises it (dopt_mpi_finalize), or on an error
 * aborts the job (dopt_mpi_abort) so that no peer waits for its timeout. */
static dopt_status run_mpi(run_ctx *x) {
  const cmp_options *o = x->o;
  dopt_mpi_comm *world = NULL, *gc[NGROUPS] = {NULL};
  dopt_status st = dopt_mpi_init(120000, &world);
  dopt_transport wt;
  rank_groups rg = NO_GROUPS;
  if (st == DOPT_OK) st = dopt_mpi_transport(world, &wt);
  if (st == DOPT_OK && wt.size != o->pp * o->tp * o->dp)
    st = dopt__fail(DOPT_ERR_INVALID_ARG, "backend mpi: mpirun started %d processes but pp x tp x dp = %d x %d x %d = %d",
                    wt.size, o->pp, o->tp, o->dp, o->pp * o->tp * o->dp);
  int c[NGROUPS] = {0};
  if (st == DOPT_OK) group_colours(o, wt.rank, c);
  for (int g = 0; st == DOPT_OK && g < NGROUPS; g++)
    if (has_group(o, g)) {
      st = dopt_mpi_split(world, c[g], wt.rank, &gc[g]);
      if (st == DOPT_OK) st = dopt_mpi_transport(gc[g], group_slot(&rg, g));
    }
  if (st == DOPT_OK) {
    x->r->rank = wt.rank;
    x->measure_world = &wt;
    st = rank_run(x, wt.rank, &rg);
    x->measure_world = NULL;
  }
  for (int g = NGROUPS - 1; g >= 0; g--) dopt_mpi_destroy(gc[g]);
  dopt_mpi_destroy(world);
  return st;
}

/* The simulator backend: x->o's tp·dp rank threads in one world. */
static dopt_status run_sim(run_ctx *x) {
  const cmp_options *o = x->o;
  dopt_sim_config sc = DOPT_SIM_CONFIG_INIT;
  sc.nranks = o->pp * o->tp * o->dp;
  sc.timeout_ms = 120000; /* rank 0 runs the reference between collectives */
  sc.mode = o->ring_order ? DOPT_SIM_ORDER_RING : DOPT_SIM_ORDER_RANK;
  sc.memops = x->dev ? dopt_cuda_sim_memops() : NULL; /* device buffers on one GPU */
  sc.copy_exchanges = o->copy_exchanges;
  dopt_sim_world *w = NULL;
  dopt_status st = dopt_sim_world_create(&sc, &w);
  if (st == DOPT_OK) {
    dopt_status rs[64];
    st = dopt_sim_launch(w, rank_body, x, rs);
    for (int k = 0; st == DOPT_OK && k < sc.nranks; k++)
      if (rs[k] != DOPT_OK) st = dopt__fail(rs[k], "rank %d: %s", k, dopt_sim_world_rank_error(w, k));
  }
  dopt_sim_world_destroy(w);
  return st;
}

/* --checkpoint-dir, or a fresh directory under $TMPDIR (left for inspection). */
static dopt_status checkpoint_dir(const cmp_options *o, char *dir, size_t cap) {
  if (o->checkpoint_dir[0]) {
    snprintf(dir, cap, "%s", o->checkpoint_dir);
    return DOPT_OK;
  }
  const char *tmp = getenv("TMPDIR");
  int w = snprintf(dir, cap, "%s/distopt-ckpt-XXXXXX", tmp && tmp[0] ? tmp : "/tmp");
  if (w < 0 || (size_t)w >= cap) return dopt__fail(DOPT_ERR_INVALID_ARG, "TMPDIR is too long (%d characters)", w);
  if (!mkdtemp(dir)) return dopt__fail(DOPT_ERR_IO, "checkpoint directory '%s': %s", dir, strerror(errno));
  return DOPT_OK;
}

/* The layout the steps after --checkpoint-at run in: each resume value given, else the first layout's (another
 * stage count: the default layer split; a Gemini resume: its chunk, else the first layout's). */
static void resume_options(const cmp_options *o, cmp_options *ob) {
  *ob = *o;
  snprintf(ob->plugin, sizeof ob->plugin, "%s", o->resume_plugin[0] ? o->resume_plugin : o->plugin);
  ob->tp = o->resume_tp > 0 ? o->resume_tp : o->tp;
  ob->dp = o->resume_dp > 0 ? o->resume_dp : o->dp;
  ob->zero = o->resume_zero >= 0 ? o->resume_zero : o->zero;
  ob->pp = o->resume_pp > 0 ? o->resume_pp : o->pp;
  ob->ep = o->resume_ep > 0 ? o->resume_ep : strcmp(ob->plugin, "moe_hybrid") == 0 ? o->ep : 1;
  ob->resume_ep = 0;
  ob->chunk_size = strcmp(ob->plugin, "gemini") != 0 ? 0 : o->resume_chunk_size ? o->resume_chunk_size : o->chunk_size;
  ob->resume_chunk_size = 0;
  if (ob->pp != o->pp) ob->nlps = 0;
  ob->ranks = 0;
}

dopt_status cmp_run(const cmp_options *o, cmp_result *r, cmp_progress_fn progress, void *user) {
  memset(r, 0, sizeof *r);
  DOPT_TRY(check_options(o));
  source s;
  dopt_status st = load_source(o, &s);
  if (st == DOPT_OK)
    st = plan_experts(&s,
                      strcmp(o->plugin, "moe_hybrid") == 0 ||
                          (o->checkpoint_at > 0 &&
                           strcmp(o->resume_plugin[0] ? o->resume_plugin : o->plugin, "moe_hybrid") == 0),
                      o->expert_stacks);
  if (st == DOPT_OK) st = plan_tensors(o, &s, r); /* also validates hyperparameters and groups */
  cmp_options ob; /* the resume layout (--checkpoint-at) */
  resume_options(o, &ob);
  if (st == DOPT_OK) st = check_stacks(o, &s, "");
  if (st == DOPT_OK && o->checkpoint_at > 0) st = check_stacks(&ob, &s, "resume: ");
  /* every parameter's stage in both layouts, before any rank starts (a refusal is one line, no rank prefix) */
  int *stages = st == DOPT_OK ? calloc(2 * (s.np > 0 ? (size_t)s.np : 1), sizeof *stages) : NULL;
  if (st == DOPT_OK && !stages) st = dopt__fail(DOPT_ERR_NO_MEMORY, "compare: stages of %d parameters", s.np);
  int *rstages = stages ? stages + (s.np > 0 ? s.np : 1) : NULL;
  if (st == DOPT_OK) st = plan_stages(o, &s, stages);
  if (st == DOPT_OK && o->checkpoint_at > 0 && plan_stages(&ob, &s, rstages) != DOPT_OK)
    st = dopt__fail(DOPT_ERR_INVALID_ARG, "resume: %s", dopt_last_error());
  if (st == DOPT_OK) r->micro = micro_of(o, &s);
  dopt_device *dev = NULL;
  int devno = 0; /* backend nccl: the local rank's GPU, local rank mod devices (as dopt_nccl_init_env) */
  if (st == DOPT_OK && strcmp(o->backend, "nccl") == 0) {
    dopt_launch_env env;
    st = dopt_launch_env_parse(NULL, NULL, &env);
    int ndev = dopt_cuda_device_count(NULL);
    devno = ndev > 0 ? dopt_launch_device(env.local_rank, ndev) : env.local_rank; /* srun --gpus-per-task 1: 0 */
  }
  if (st == DOPT_OK && strcmp(o->device, "cuda") == 0) st = dopt_device_cuda(devno, &dev);
  run_ctx x = {o, dev, &s, r, progress, user, cmp_now_s(), NULL, 1, o->steps, NULL, NULL, NULL, 0, NULL, stages};
  /* the simulator's rank threads share one template on the source's values (with bf16: its copies) */
  dopt_optim *tmpl = NULL;
  uint16_t **twork = st == DOPT_OK ? calloc(s.np > 0 ? (size_t)s.np : 1, sizeof *twork) : NULL;
  if (st == DOPT_OK && !twork) st = dopt__fail(DOPT_ERR_NO_MEMORY, "compare: %d parameters", s.np);
  if (st == DOPT_OK && strcmp(o->backend, "sim") == 0) st = build_plain(o, &s, 1, NULL, twork, &tmpl);
  x.plain = tmpl;
  if (st == DOPT_OK && strcmp(o->backend, "nccl") == 0) {
    st = run_nccl(&x);
    r->seconds = cmp_now_s() - x.t0;
  } else if (st == DOPT_OK && strcmp(o->backend, "mpi") == 0) {
    st = run_mpi(&x);
    r->seconds = cmp_now_s() - x.t0;
  } else if (st == DOPT_OK && o->checkpoint_at > 0) {
    /* steps 1..K in the layout of o, saved; K+1..steps in the resume layout ob, loaded */
    char dir[600];
    st = checkpoint_dir(o, dir, sizeof dir);
    if (st == DOPT_OK) st = dopt__mkdir_p(dir); /* a folder that cannot be made: said before the steps run */
    x.t_last = o->checkpoint_at;
    x.save_dir = dir;
    if (st == DOPT_OK) st = run_sim(&x);
    run_ctx y = x;
    y.o = &ob;
    y.t_first = o->checkpoint_at + 1;
    y.t_last = o->steps;
    y.save_dir = NULL;
    y.load_dir = dir;
    y.replay = o;
    y.stages = rstages;
    if (st == DOPT_OK) st = run_sim(&y);
    r->seconds = cmp_now_s() - x.t0;
  } else if (st == DOPT_OK) {
    st = run_sim(&x);
    r->seconds = cmp_now_s() - x.t0;
  }
  dopt_optim_destroy(tmpl);
  free(stages);
  for (int i = 0; twork && i < s.np; i++) free(twork[i]);
  free(twork);
  dopt_device_cuda_destroy(dev);
  source_free(&s);
  if (st != DOPT_OK) {
    cmp_result_free(r);
    r->run_failed = x.save_failed;
    return st;
  }
  r->declared_ulp = cmp_declared_ulp(o->optimizer);
  r->equivalent = r->skipped_ref == r->skipped_dist;
  for (int k = 0; k < r->ntensors; k++) r->equivalent &= r->t[k].max_ulp <= r->declared_ulp;
  r->equivalent &= r->drift_step == 0 && r->counter_step == 0 && r->events_step == 0;
  return DOPT_OK;
}

void cmp_result_free(cmp_result *r) {
  for (int k = 0; k < r->ntensors; k++) {
    free(r->t[k].abs_per_step);
    free(r->t[k].ulp_per_step);
  }
  free(r->t);
  free(r->refresh_steps);
  memset(r, 0, sizeof *r);
}

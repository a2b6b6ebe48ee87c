/* The gradient sources of a comparison (harness.h): the synthetic model and its generators, a trace, a
 * recording; the shards and micro-batches each data-parallel rank takes, the experts and expert stacks. */
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
void ce_synth_block(const source *s, int i, int step, int shard, size_t h0, size_t hl, size_t w0, size_t wl,
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
 * compiler vectorises (about 0.3 ns per element here against 5 for ce_synth_block's 64-bit hash in double): a
 * 64-rank compare generates dp · accumulation gradients per step twice, once for the reference. Same block
 * layout as ce_synth_block. */
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

void ce_synth_fast(const source *s, int i, int step, int shard, size_t h0, size_t hl, size_t w0, size_t wl,
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
  (s->fast ? ce_synth_fast : ce_synth_block)(s, i, step, shard, 0, pc.h, 0, pc.w, out);
}

/* A trace's gradient of parameter `name` at step t (1-based), shard sh. */
void ce_grad_key(char *key, size_t cap, int t, int sh, const char *name) {
  snprintf(key, cap, "grad/%d/%d/%s", t, sh, name);
}

/* The gradient of parameter i for (step, shard): from the trace, the recording (shard 0: the whole
 * step's gradient, assembled from its source pieces) or synthetic. */
dopt_status ce_shard_grad(const source *s, int i, int step, int shard, float *out) {
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
  ce_grad_key(key, sizeof key, step, shard, s->p[i].name);
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

void ce_source_free(source *s) {
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
        ce_grad_key(key, sizeof key, t, sh, s->p[i].name);
        dopt_st_tensor g;
        DOPT_TRY(dopt_st_find(s->trace, key, &g));
        if (g.numel != s->numel[i])
          return dopt__fail(DOPT_ERR_FORMAT, "%s: tensor '%s' has %zu elements, its parameter %zu", o->trace_path,
                            key, g.numel, s->numel[i]);
      }
  return DOPT_OK;
}

dopt_status ce_load_source(const cmp_options *o, source *s) {
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
  if (ce_load_source(&o, &s) != DOPT_OK) {
    ce_source_free(&s);
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
  ce_source_free(&s);
  return differ;
}

/* Micro-batch m of DP rank d: synthetic shard index d·micro + m; a trace's
 * shards are split evenly over the DP ranks. */
int ce_shard_of(const cmp_options *o, const source *s, int d, int m) {
  return d * (s->shards > 0 ? s->shards / o->dp : o->micro) + m;
}
int ce_micro_of(const cmp_options *o, const source *s) { return s->shards > 0 ? s->shards / o->dp : o->micro; }

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
dopt_status ce_plan_experts(source *s, int moe, const char *stacks) {
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
int ce_moe_of(const cmp_options *o, const source *s) {
  return strcmp(o->plugin, "moe_hybrid") == 0 && s->nexperts > 0;
}
int ce_holds_param(const cmp_options *o, const source *s, int i, int d) {
  if (!ce_moe_of(o, s) || s->expert[i] < 0) return 1; /* dense, or a stack: every rank has its TP block */
  return d % o->ep == dopt_dist_expert_rank(s->expert[i], s->nexperts, o->ep);
}

/* moe_hybrid, a stack split over ep: what dp rank d's gradient g (logical, [numel]) contributes: its own ep rank's
 * experts' slices (the others zero, as the library takes them); the number of dp ranks each element's expert is
 * on is moe_dp. */
int ce_ep_stack(const cmp_options *o, const source *s, int i) {
  return ce_moe_of(o, s) && o->ep > 1 && s->expert[i] == DOPT_DIST_EXPERT_STACK;
}
void ce_own_experts_only(const cmp_options *o, const source *s, int i, int d, float *g) {
  const size_t per = s->numel[i] / (size_t)s->nexperts;
  for (int f = 0; f < s->nexperts; f++)
    if (dopt_dist_expert_rank(f, s->nexperts, o->ep) != d % o->ep) memset(g + (size_t)f * per, 0, per * sizeof *g);
}

/* A layout that splits stacks over ep: zero 1 or 2 and the exact dp sum (their shards are exact ranges). */
dopt_status ce_check_stacks(const cmp_options *o, const source *s, const char *what) {
  int stacks = 0;
  for (int i = 0; i < s->np; i++) stacks += ce_ep_stack(o, s, i);
  if (!stacks) return DOPT_OK;
  DOPT_CHECK_ARG(o->zero >= 1 && o->dp_sum_words >= 1, "%s%d expert stacks split over ep=%d need zero 1 or 2 and the "
                 "exact dp sum (got zero %d, dp sum %s): their shards are exact ranges of each ep rank's experts", what,
                 stacks, o->ep, o->zero, cmp_dp_sum_name(o->dp_sum_words));
  return DOPT_OK;
}

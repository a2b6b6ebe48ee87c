/* Golden vectors: every reference optimizer against the upstream package
 * (torch AdamW, HF Adafactor, official CAME, ColossalAI LAMB), every
 * parameter and every state tensor after every step.
 *
 * Data: datasets/golden/ (generator gen_golden.py, pinned versions in its
 * README): inputs.safetensors holds init/<p> and grad/<t>/<p>; each case file
 * holds param/<t>/<p> and state/<t>/<p>/<key> and its optimizer/hparams/groups
 * in the metadata.
 *
 * Tolerance. The reference repeats upstream's fp32 operations in upstream's
 * order, but not bit for bit: torch's vectorised CPU kernels contract a+α·b
 * into FMAs, torch sums means and norms in fp32 (pairwise/vectorised) where we
 * sum exactly, and bias corrections/step sizes round differently in a few
 * places. Each such difference is O(1 ulp) = 6e-8 relative per operation on
 * the quantity it touches; a step chains ~10 of them and 20 steps accumulate
 * them (linearly in the worst case), giving ~10·20·6e-8 ≈ 1.2e-5 on the
 * *update*, which is itself ≤ 1e-2 of the parameter for these learning rates.
 * Hence the target for parameters: normwise relative error
 * max|a-b|/max|b| ≤ 1e-6 after every step. States carry the per-operation
 * rounding without the lr damping: second-moment and residual statistics
 * (sums/means of squares) are compared at 1e-5 normwise (~170 ulp), momenta at
 * 1e-5. A wrong formula (a missing bias correction, eps placement, decay order,
 * mean instead of sum) shows up at 1e-3 or worse, far outside these bounds.
 *
 * A case may declare its own tolerance (metadata tol_param/tol_state, from
 * its entry file, where the measured errors and the margin are given: the
 * 200-step runs); anything looser than TOL_LIMIT is refused, so a data file
 * cannot switch the comparison off. record_every=K: only every K-th step
 * was recorded and is compared. defaults_only=1: upstream ran with its own
 * defaults; the hparams string may hold only keys that distopt requires (its
 * create fails without them) or keys listed in defaults_differ whose value
 * differs from distopt's default, so a changed distopt default fails here.
 *
 * Coverage: datasets/golden/manifest.json (written by gen_golden.py from
 * entries/<optimizer>.py) says per optimizer which case files cover it, or
 * which test checks its golden data (checked_by + data), or why it is exempt.
 * Every registered optimizer must be in it, every case-covered optimizer
 * needs a defaults-only case and a run of >= 200 steps, and every case file
 * in the directory must belong to a manifest entry. */
#include "testutil.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <math.h>
#include <sys/stat.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "distopt/distopt.h"
#include "distopt/safetensors.h"
#include "optim_impl.h"
#include "registry.h"

#define TOL_PARAM 1e-6
#define TOL_STATE 1e-5
#define TOL_LIMIT 2e-3 /* the loosest tolerance a case may declare: bf16 arithmetic (Muon; one bf16 ulp is 3.9e-3) */
#define LONG_STEPS 200 /* a case-covered optimizer needs a run at least this long */
#define MAXP 32

typedef struct errstat {
  double max_abs, max_rel;
  char worst[320];
} errstat;

/* normwise relative error of a against golden b */
static double compare(const float *a, const float *b, size_t n, double *abs_out) {
  double maxd = 0, maxb = 0;
  for (size_t i = 0; i < n; i++) {
    double d = fabs((double)a[i] - (double)b[i]);
    if (!(d <= maxd)) maxd = d; /* NaN propagates as failure */
    if (fabs((double)b[i]) > maxb) maxb = fabs((double)b[i]);
  }
  *abs_out = maxd;
  if (maxd == 0) return 0;
  return maxb > 0 ? maxd / maxb : INFINITY;
}

static void note(errstat *e, double rel, double ab, const char *what) {
  if (ab > e->max_abs) e->max_abs = ab;
  if (rel > e->max_rel || isnan(rel)) {
    e->max_rel = rel;
    snprintf(e->worst, sizeof e->worst, "%s", what);
  }
}

static char *path_join(const char *dir, const char *file) {
  size_t n = strlen(dir) + strlen(file) + 2;
  char *p = malloc(n);
  snprintf(p, n, "%s/%s", dir, file);
  return p;
}

typedef struct case_info {
  int steps, every, defaults_only;
  double tol_param, tol_state;
} case_info;

/* A declared tolerance: a finite number in (0, TOL_LIMIT]. */
static double meta_tol(const dopt_st_file *cf, const char *file, const char *key, double def) {
  const char *v = dopt_st_meta(cf, key);
  if (!v) return def;
  char *end = NULL;
  double x = strtod(v, &end);
  if (end == v || *end != '\0' || !(x > 0) || !isfinite(x)) fail_msg("%s: %s=\"%s\" is not a positive number", file, key, v);
  if (x > TOL_LIMIT) fail_msg("%s: declares %s=%g, looser than the limit %g: refused", file, key, x, TOL_LIMIT);
  return x;
}

static int in_list(const char *list, const char *key, size_t klen) {
  for (const char *p = list; p && *p;) {
    const char *c = strchr(p, ',');
    size_t l = c ? (size_t)(c - p) : strlen(p);
    if (l == klen && strncmp(p, key, klen) == 0) return 1;
    p = c ? c + 1 : NULL;
  }
  return 0;
}

/* defaults_only=1: upstream ran with its defaults, so every key passed here
 * must be one distopt cannot do without (create fails when it is left out),
 * or one declared in defaults_differ (distopt's default deliberately differs)
 * whose value is not distopt's default. Anything else would hide a default. */
static void check_defaults_only(const char *file, const char *optname, const char *hparams, const char *differ,
                                const char *fixed, const dopt_optim *o) {
  char buf[1024], rest[1024];
  snprintf(buf, sizeof buf, "%s", hparams ? hparams : "");
  char *items[64];
  int n = 0;
  char *save = NULL;
  for (char *t = strtok_r(buf, ",", &save); t && n < 64; t = strtok_r(NULL, ",", &save)) items[n++] = t;
  for (int i = 0; i < n; i++) {
    size_t off = 0;
    rest[0] = '\0';
    for (int j = 0; j < n; j++)
      if (j != i) off += (size_t)snprintf(rest + off, sizeof rest - off, "%s%s", off ? "," : "", items[j]);
    const char *eq = strchr(items[i], '=');
    size_t klen = eq ? (size_t)(eq - items[i]) : strlen(items[i]);
    char key[128];
    snprintf(key, sizeof key, "%.*s", (int)klen, items[i]);
    dopt_optim *o2 = NULL;
    if (dopt_optim_create(optname, rest, &o2) != DOPT_OK) continue; /* required by distopt */
    if (in_list(fixed, items[i], klen)) { /* set on both sides (the entry's DEFAULTS_FIXED, its reason there) */
      dopt_optim_destroy(o2);
      continue;
    }
    double mine = NAN, theirs = NAN;
    dopt_status s1 = dopt_optim_get_hparam(o2, 0, key, &mine), s2 = dopt_optim_get_hparam(o, 0, key, &theirs);
    dopt_optim_destroy(o2);
    if (!in_list(differ, key, klen))
      fail_msg("%s: defaults-only case passes %s, which %s does not require, so its default goes unchecked "
               "(a deliberate difference from upstream belongs in the entry's DEFAULTS_DIFFER)",
               file, items[i], optname);
    if (s1 != DOPT_OK || s2 != DOPT_OK || mine == theirs || (isnan(mine) && isnan(theirs)))
      fail_msg("%s: defaults_differ names %s, but %s's default is that value", file, key, optname);
  }
}

/* Runs one case; returns the number of compared tensors. */
/* One case: replays its gradients at `threads` threads (pieces down to one
 * element, so every parameter of an optimizer that takes pieces is split) and
 * checks every recorded step against upstream; dig gets the SHA-256 of every
 * parameter and state after every step, for the thread-count comparison. */
/* metadata adopt_states (SOAP's eigenbases Q0, Q1, ...): a state distopt recomputes at discrete events (the
 * first step's eigendecomposition, the QR refreshes) that upstream recorded at every change (adopt/<t>/<p>/<key>).
 * The events must coincide (distopt's value changed at step t exactly when upstream's did), and at each one
 * upstream's value is checked (dopt__soap_basis_check: orthonormal; the first an eigenbasis of distopt's own
 * GG<k> in descending order; a refresh's columns within the QR's derived bound of ours) and taken into
 * distopt's state, so the later steps compare at the golden bounds whatever LAPACK chose. A different sort
 * moves v's rows, which the state comparison then names. prev[s]: distopt's state s after the last step. */
static double adopt_worst; /* the largest measured / bound of the checks, printed with the table */
static void adopt(dopt_st_file *cf, const char *file, dopt_optim *o, int i, const char *name, int t, float **prev) {
  const char *list = dopt_st_meta(cf, "adopt_states");
  int64_t step;
  if (!list || dopt_optim_get_step(o, i, &step) != DOPT_OK) return;
  for (int s = 0; s < dopt_optim_num_states(o, i); s++) {
    dopt_state_view v;
    assert_ok(dopt_optim_state(o, i, s, &v));
    if (!in_list(list, v.name, strlen(v.name))) continue;
    const size_t d = (size_t)v.shape[0];
    char key[256];
    snprintf(key, sizeof key, "adopt/%d/%s/%s", t, name, v.name);
    dopt_st_tensor up;
    const int theirs = dopt_st_find(cf, key, &up) == DOPT_OK;
    const int mine = !prev[s] || memcmp(prev[s], v.data, v.bytes) != 0;
    if (theirs != mine)
      fail_msg("%s: %s: %s a new value at step %d, upstream %s", file, key, mine ? "distopt computed" : "distopt kept",
               t, theirs ? "did" : "did not");
    if (!prev[s]) prev[s] = malloc(v.bytes);
    if (!theirs) continue;
    if (v.ndim != 2 || (size_t)v.shape[1] != d || up.numel != d * d)
      fail_msg("%s: %s: %zu elements upstream, a [%zu, %zu] basis here", file, key, up.numel, d, d);
    char gname[64];
    snprintf(gname, sizeof gname, "GG%s", v.name + 1); /* Q<k> is GG<k>'s */
    const float *A = NULL;
    for (int s2 = 0; s2 < dopt_optim_num_states(o, i); s2++) {
      dopt_state_view g;
      assert_ok(dopt_optim_state(o, i, s2, &g));
      if (strcmp(g.name, gname) == 0) A = g.data;
    }
    if (!A) fail_msg("%s: %s: no %s state here to check the basis against", file, key, gname);
    float *Q = malloc(d * d * sizeof *Q);
    memcpy(Q, up.data, d * d * sizeof *Q);
    char why[256];
    double w;
    if (dopt__soap_basis_check(d, A, step == 1 ? NULL : prev[s], Q, v.data, &w, why, sizeof why))
      fail_msg("%s: %s: upstream's basis: %s", file, key, why);
    adopt_worst = fmax(adopt_worst, w);
    memcpy(v.data, Q, d * d * sizeof *Q);
    free(Q);
  }
  for (int s = 0; s < dopt_optim_num_states(o, i); s++) { /* the values the next step starts from */
    dopt_state_view v;
    assert_ok(dopt_optim_state(o, i, s, &v));
    if (prev[s]) memcpy(prev[s], v.data, v.bytes);
  }
}

static int run_case(const char *dir, const char *file, errstat *ep, errstat *es, case_info *ci, int threads,
                    uint8_t dig[DOPT_DIGEST_BYTES]) {
  char *path = path_join(dir, file);
  dopt_st_file *cf = NULL, *inf = NULL;
  assert_ok(dopt_st_load(path, &cf));
  const char *inputs = dopt_st_meta(cf, "inputs");
  char *ipath = inputs ? path_join(dir, inputs) : NULL;
  if (ipath) assert_ok(dopt_st_load(ipath, &inf));
  else inf = cf;
  const char *optname = dopt_st_meta(cf, "optimizer");
  /* the case's own subset of the inputs' parameters, else all of them */
  const char *params = dopt_st_meta(cf, "case_params") ? dopt_st_meta(cf, "case_params")
                       : dopt_st_meta(inf, "params")   ? dopt_st_meta(inf, "params")
                                                         : dopt_st_meta(cf, "params");
  const char *steps_s = dopt_st_meta(cf, "steps") ? dopt_st_meta(cf, "steps") : dopt_st_meta(inf, "steps");
  assert_non_null(optname);
  assert_non_null(params);
  assert_non_null(steps_s);
  int steps = atoi(steps_s);
  assert_true(steps >= 20);
  const char *every_s = dopt_st_meta(cf, "record_every");
  int every = every_s ? atoi(every_s) : 1;
  if (every < 1 || steps % every != 0 || steps / every < 4)
    fail_msg("%s: record_every=%s must divide steps=%d and leave at least 4 recorded steps", file, every_s, steps);
  ci->steps = steps;
  ci->every = every;
  ci->tol_param = meta_tol(cf, file, "tol_param", TOL_PARAM);
  ci->tol_state = meta_tol(cf, file, "tol_state", TOL_STATE);
  const char *dflt = dopt_st_meta(cf, "defaults_only");
  ci->defaults_only = dflt && strcmp(dflt, "1") == 0;
  /* mode=eval: upstream stepped in train mode and was recorded in evaluation mode (schedulefree's train()/eval()) */
  const char *mode = dopt_st_meta(cf, "mode");
  if (mode && strcmp(mode, "eval") != 0) fail_msg("%s: mode=%s (eval, or no mode key)", file, mode);
  const int eval = mode != NULL;

  dopt_optim *o;
  assert_ok(dopt_optim_create(optname, dopt_st_meta(cf, "hparams"), &o));
  assert_ok(dopt_optim_set_threads(o, threads));
  if (threads > 1) dopt__optim_set_min_chunk(o, 1);
  dopt_digest *dg;
  assert_ok(dopt_digest_create(&dg));
  if (ci->defaults_only)
    check_defaults_only(file, optname, dopt_st_meta(cf, "hparams"), dopt_st_meta(cf, "defaults_differ"),
                        dopt_st_meta(cf, "defaults_fixed"), o);

  /* parameters and groups */
  char names[MAXP][64];
  int np = 0;
  {
    char *tmp = strdup(params), *save = NULL;
    for (char *t = strtok_r(tmp, ",", &save); t; t = strtok_r(NULL, ",", &save)) snprintf(names[np++], 64, "%s", t);
    free(tmp);
  }
  int gid[MAXP] = {0};
  const char *groups = dopt_st_meta(cf, "groups"), *ghp = dopt_st_meta(cf, "group_hparams");
  if (groups && ghp) {
    char *gs = strdup(groups), *hs = strdup(ghp), *s1 = NULL, *s2 = NULL;
    char *g = strtok_r(gs, "|", &s1), *h = strtok_r(hs, "|", &s2);
    for (; g && h; g = strtok_r(NULL, "|", &s1), h = strtok_r(NULL, "|", &s2)) {
      int id;
      assert_ok(dopt_optim_add_group(o, h, &id));
      char *s3 = NULL;
      for (char *pn = strtok_r(g, ",", &s3); pn; pn = strtok_r(NULL, ",", &s3))
        for (int i = 0; i < np; i++)
          if (strcmp(names[i], pn) == 0) gid[i] = id;
    }
    free(gs);
    free(hs);
  }
  float *data[MAXP], *grad[MAXP], *gold = NULL;
  const float *gp[MAXP];
  size_t numel[MAXP], maxn = 0;
  char key[256];
  for (int i = 0; i < np; i++) {
    dopt_st_tensor t;
    snprintf(key, sizeof key, "init/%s", names[i]);
    assert_ok(dopt_st_find(inf, key, &t));
    numel[i] = t.numel;
    maxn = t.numel > maxn ? t.numel : maxn;
    data[i] = malloc(t.numel * sizeof(float));
    grad[i] = malloc(t.numel * sizeof(float));
    memcpy(data[i], t.data, t.numel * sizeof(float));
    dopt_param_config pc = DOPT_PARAM_CONFIG_INIT;
    pc.name = names[i];
    pc.ndim = t.ndim;
    memcpy(pc.shape, t.shape, sizeof pc.shape);
    pc.data = data[i];
    int id;
    assert_ok(dopt_optim_add_param(o, gid[i], &pc, &id));
    assert_int_equal(id, i);
  }
  gold = malloc(maxn * sizeof(float));
  float *kept[MAXP][DOPT_MAX_STATES] = {{0}}; /* adopt_states: each state's value after the last step */
  int compared = 0;
  for (int t = 1; t <= steps; t++) {
    for (int i = 0; i < np; i++) {
      snprintf(key, sizeof key, "grad/%d/%s", t, names[i]);
      dopt_st_tensor g;
      gp[i] = NULL;
      if (dopt_st_find(inf, key, &g) == DOPT_OK) {
        memcpy(grad[i], g.data, numel[i] * sizeof(float));
        gp[i] = grad[i];
      }
    }
    if (eval) assert_ok(dopt_optim_set_mode(o, 0));
    assert_ok(dopt_optim_step(o, gp));
    if (eval) assert_ok(dopt_optim_set_mode(o, 1));
    for (int i = 0; i < np; i++) adopt(cf, file, o, i, names[i], t, kept[i]);
    for (int i = 0; i < np; i++) {
      assert_ok(dopt_digest_bytes(dg, data[i], numel[i] * sizeof(float)));
      for (int s = 0; s < dopt_optim_num_states(o, i); s++) {
        dopt_state_view v;
        assert_ok(dopt_optim_state(o, i, s, &v));
        assert_ok(dopt_digest_bytes(dg, v.data, v.bytes));
      }
    }
    if (t % every) continue; /* not recorded */
    for (int i = 0; i < np; i++) {
      double ab, rel;
      char what[320];
      snprintf(key, sizeof key, "param/%d/%s", t, names[i]);
      assert_ok(dopt_st_read_f32(cf, key, gold, numel[i]));
      rel = compare(data[i], gold, numel[i], &ab);
      snprintf(what, sizeof what, "%.60s %.200s", file, key);
      if (threads == 1) note(ep, rel, ab, what);
      if (!(rel <= ci->tol_param))
        fail_msg("%s: %s normwise rel error %.3g > %.3g (max abs %.3g)", file, key, rel, ci->tol_param, ab);
      compared++;
      /* every upstream state key must exist here, and vice versa */
      int ns = dopt_optim_num_states(o, i), upstream_keys = 0;
      snprintf(key, sizeof key, "state/%d/%s/", t, names[i]);
      size_t kl = strlen(key);
      for (int k = 0; k < dopt_st_count(cf); k++) {
        dopt_st_tensor st;
        dopt_st_get(cf, k, &st);
        if (strncmp(st.name, key, kl) != 0) continue;
        const char *sk = st.name + kl;
        if (strcmp(sk, "step") == 0) {
          int64_t mine;
          assert_ok(dopt_optim_get_step(o, i, &mine));
          float theirs;
          memcpy(&theirs, st.data, sizeof theirs);
          if ((double)mine != (double)theirs) fail_msg("%s: %s step %lld vs upstream %g", file, st.name, (long long)mine, (double)theirs);
          continue;
        }
        upstream_keys++;
        int found = 0;
        for (int s = 0; s < ns; s++) {
          dopt_state_view v;
          assert_ok(dopt_optim_state(o, i, s, &v));
          if (strcmp(v.name, sk) != 0) continue;
          found = 1;
          size_t n = v.bytes / sizeof(float);
          if (n != st.numel) fail_msg("%s: %s has %zu elements here, %zu upstream", file, st.name, n, st.numel);
          if (n > maxn) { /* a state larger than every parameter (APOLLO's low-rank moments at a rank above a side) */
            float *g2 = realloc(gold, n * sizeof(float));
            assert_non_null(g2);
            gold = g2, maxn = n;
          }
          memcpy(gold, st.data, n * sizeof(float));
          rel = compare(v.data, gold, n, &ab);
          snprintf(what, sizeof what, "%.60s %.200s", file, st.name);
          if (threads == 1) note(es, rel, ab, what);
          if (!(rel <= ci->tol_state))
            fail_msg("%s: %s normwise rel error %.3g > %.3g (max abs %.3g)", file, st.name, rel, ci->tol_state, ab);
          compared++;
        }
        if (!found) fail_msg("%s: upstream state '%s' has no counterpart", file, st.name);
      }
      int extra = 0; /* distopt's states upstream keeps elsewhere (metadata extra_states: its param group) */
      for (int s = 0; s < ns; s++) {
        dopt_state_view v;
        assert_ok(dopt_optim_state(o, i, s, &v));
        extra += in_list(dopt_st_meta(cf, "extra_states"), v.name, strlen(v.name));
      }
      if (upstream_keys != ns - extra && !(upstream_keys == 0 && gp[i] == NULL && ns == 0))
        fail_msg("%s: param %s step %d: %d states here, %d upstream", file, names[i], t, ns, upstream_keys);
    }
  }
  for (int i = 0; i < np; i++) {
    free(data[i]);
    free(grad[i]);
    for (int s = 0; s < DOPT_MAX_STATES; s++) free(kept[i][s]);
  }
  free(gold);
  if (threads > 1 && dopt__optim_impl(o)->distributable && dopt__optim_last_parts(o) != threads)
    fail_msg("%s at %d threads: the last step split a parameter into %d pieces", file, threads,
             dopt__optim_last_parts(o));
  assert_ok(dopt_digest_final(dg, dig, NULL));
  dopt_digest_destroy(dg);
  dopt_optim_destroy(o);
  if (inf != cf) dopt_st_free(inf);
  dopt_st_free(cf);
  free(ipath);
  free(path);
  return compared;
}

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

static char *read_text(const char *path) {
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  char *buf = malloc((size_t)n + 1);
  size_t got = fread(buf, 1, (size_t)n, f);
  fclose(f);
  buf[got] = '\0';
  return buf;
}

static const char *jstr(const cJSON *obj, const char *key) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
  if (v && !cJSON_IsString(v)) fail_msg("manifest.json: \"%s\" must be a string", key);
  return v ? v->valuestring : NULL;
}

static int count_safetensors(const char *dir) {
  DIR *d = opendir(dir);
  if (!d) return -1;
  int n = 0;
  struct dirent *e;
  while ((e = readdir(d))) {
    size_t l = strlen(e->d_name);
    n += l > 12 && strcmp(e->d_name + l - 12, ".safetensors") == 0;
  }
  closedir(d);
  return n;
}

/* Runs the case files of one case-covered optimizer. */
static void run_cases(const char *dir, const char *opt, const char *entry, const cJSON *cases, char **files, int nf,
                      int *claimed, char *line, size_t cap) {
  int n = cJSON_GetArraySize(cases), has_defaults = 0, has_long = 0;
  if (!cJSON_IsArray(cases) || n == 0) fail_msg("manifest.json: %s: \"cases\" must be a non-empty list", opt);
  for (int c = 0; c < n; c++) {
    const cJSON *it = cJSON_GetArrayItem(cases, c);
    if (!cJSON_IsString(it)) fail_msg("manifest.json: %s: case names must be strings", opt);
    int k = -1;
    for (int i = 0; i < nf; i++)
      if (strcmp(files[i], it->valuestring) == 0) k = i;
    if (k < 0) fail_msg("%s: case file %s (manifest.json) is missing in %s", opt, it->valuestring, dir);
    if (claimed[k]) fail_msg("%s: case file %s is listed twice in manifest.json", opt, files[k]);
    claimed[k] = 1;
    /* the file must say it is this optimizer's, from this entry */
    char *path = path_join(dir, files[k]);
    dopt_st_file *cf = NULL;
    assert_ok(dopt_st_load(path, &cf));
    const char *o = dopt_st_meta(cf, "optimizer"), *e = dopt_st_meta(cf, "entry");
    if (!o || strcmp(o, opt) != 0) fail_msg("%s: optimizer \"%s\", but manifest.json lists it under %s", files[k], o ? o : "", opt);
    if (!e || strcmp(e, entry) != 0) fail_msg("%s: entry \"%s\", but manifest.json says %s", files[k], e ? e : "", entry);
    dopt_st_free(cf);
    free(path);
    errstat ep = {0, 0, ""}, es = {0, 0, ""};
    case_info ci = {0, 1, 0, TOL_PARAM, TOL_STATE};
    uint8_t d1[DOPT_DIGEST_BYTES], dn[DOPT_DIGEST_BYTES];
    int cnt = run_case(dir, files[k], &ep, &es, &ci, 1, d1);
    /* the same bits at any thread count (docs/threads.md) */
    static const int counts[] = {2, 3, 8};
    for (int m = 0; m < 3; m++) {
      case_info cn = ci;
      run_case(dir, files[k], &ep, &es, &cn, counts[m], dn);
      if (memcmp(d1, dn, sizeof d1)) fail_msg("%s: the outputs at %d threads differ from 1 thread", files[k], counts[m]);
    }
    printf("%-32s %8d %12.3g %12.3g %12.3g %12.3g  %d/%d%s%s\n", files[k], cnt, ep.max_abs, ep.max_rel, es.max_abs,
           es.max_rel, ci.steps, ci.every, ci.defaults_only ? " defaults" : "",
           ci.tol_param != TOL_PARAM || ci.tol_state != TOL_STATE ? " tol*" : "");
    has_defaults |= ci.defaults_only;
    has_long |= ci.steps >= LONG_STEPS;
  }
  if (!has_defaults) fail_msg("%s: no defaults-only case (add one to %s)", opt, entry);
  if (!has_long) fail_msg("%s: no case of >= %d steps (add one to %s)", opt, LONG_STEPS, entry);
  snprintf(line, cap, "%d cases run", n);
}

static void test_golden(void **st) {
  (void)st;
  const char *env = getenv("DOPT_GOLDEN_DIR");
  char *dir = env ? strdup(env) : path_join(dt_source_dir(), "datasets/golden");
  DIR *d = opendir(dir);
  if (!d) fail_msg("golden directory %s missing", dir);
  char *files[128];
  int nf = 0, claimed[128] = {0};
  struct dirent *e;
  while ((e = readdir(d))) {
    size_t l = strlen(e->d_name);
    if (l > 12 && strcmp(e->d_name + l - 12, ".safetensors") == 0 && strncmp(e->d_name, "inputs", 6) != 0 &&
        strncmp(e->d_name, "bnb_", 4) != 0) { /* inputs*: shared inputs; bnb_*: 8-bit maps and kernel data */
      if (nf == 128) fail_msg("more than 128 case files in %s", dir);
      files[nf++] = strdup(e->d_name);
    }
  }
  closedir(d);
  qsort(files, (size_t)nf, sizeof files[0], cmp_str);

  char *mpath = path_join(dir, "manifest.json");
  char *text = read_text(mpath);
  if (!text) fail_msg("%s missing (written by datasets/golden/gen_golden.py)", mpath);
  cJSON *man = cJSON_Parse(text);
  const cJSON *opts = man ? cJSON_GetObjectItemCaseSensitive(man, "optimizers") : NULL;
  const cJSON *fmt = man ? cJSON_GetObjectItemCaseSensitive(man, "format") : NULL;
  if (!cJSON_IsObject(opts) || !cJSON_IsNumber(fmt) || fmt->valuedouble != 1)
    fail_msg("%s: not a format-1 golden manifest", mpath);

  /* every name in the manifest must be registered */
  const cJSON *m;
  cJSON_ArrayForEach(m, opts) {
    int found = 0;
    for (int i = 0; i < dopt_optim_registry_count(); i++) found |= strcmp(dopt_optim_registry_name(i), m->string) == 0;
    if (!found) fail_msg("manifest.json names %s, which is not a registered optimizer", m->string);
  }

  printf("%-32s %8s %12s %12s %12s %12s  %s\n", "case", "tensors", "param abs", "param rel", "state abs", "state rel",
         "steps/every");
  int nreg = dopt_optim_registry_count();
  char(*cover)[400] = calloc((size_t)nreg, sizeof *cover);
  for (int r = 0; r < nreg; r++) {
    const char *opt = dopt_optim_registry_name(r);
    m = cJSON_GetObjectItemCaseSensitive(opts, opt);
    if (!m) {
      if (env) { /* another directory may hold some optimizers only */
        snprintf(cover[r], sizeof cover[r], "not in %s", dir);
        continue;
      }
      fail_msg("optimizer %s is registered but has no golden coverage: no entry in %s (add "
               "datasets/golden/entries/%s.py and run python3 datasets/golden/gen_golden.py %s)",
               opt, mpath, opt, opt);
    }
    const char *entry = jstr(m, "entry"), *checked = jstr(m, "checked_by"), *exempt = jstr(m, "exempt");
    const cJSON *cases = cJSON_GetObjectItemCaseSensitive(m, "cases");
    if (!entry || !*entry) fail_msg("manifest.json: %s has no entry file", opt);
    if ((cases != NULL) + (checked != NULL) + (exempt != NULL) != 1)
      fail_msg("manifest.json: %s must have exactly one of cases, checked_by, exempt", opt);
    char what[300];
    if (cases) {
      run_cases(dir, opt, entry, cases, files, nf, claimed, what, sizeof what);
    } else if (checked) {
      /* golden data checked by another test: that test and its data must exist */
      const char *data = jstr(m, "data");
      char *tpath = path_join(dt_source_dir(), checked);
      struct stat sb;
      if (stat(tpath, &sb) != 0) fail_msg("%s: checked_by %s does not exist", opt, checked);
      free(tpath);
      if (!data) fail_msg("manifest.json: %s: checked_by needs \"data\"", opt);
      char *dpath = path_join(dt_source_dir(), data);
      int nd = count_safetensors(dpath);
      free(dpath);
      if (nd < 1) fail_msg("%s: golden data %s (checked by %s) has no .safetensors files", opt, data, checked);
      snprintf(what, sizeof what, "checked by %s (%s, %d files)", checked, data, nd);
    } else {
      if (strlen(exempt) < 40) fail_msg("%s: an exemption needs a reason, not \"%s\"", opt, exempt);
      snprintf(what, sizeof what, "exempt: %.200s%s", exempt, strlen(exempt) > 200 ? "..." : "");
    }
    snprintf(cover[r], sizeof cover[r], "%s [%s]", what, entry);
  }
  for (int i = 0; i < nf; i++)
    if (!claimed[i]) fail_msg("%s/%s belongs to no optimizer in manifest.json (stale? rerun gen_golden.py)", dir, files[i]);
  printf("\ncoverage of the %d registered optimizers:\n", nreg);
  for (int r = 0; r < nreg; r++) printf("  %-18s %s\n", dopt_optim_registry_name(r), cover[r]);
  printf("adopted bases (adopt_states): the largest check measured at %.3g of its derived bound\n", adopt_worst);
  free(cover);
  for (int i = 0; i < nf; i++) free(files[i]);
  cJSON_Delete(man);
  free(text);
  free(mpath);
  free(dir);
}

int main(void) {
  const struct CMUnitTest tests[] = {cmocka_unit_test(test_golden)};
  return cmocka_run_group_tests(tests, NULL, NULL);
}

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
 * mean instead of sum) shows up at 1e-3 or worse, far outside these bounds. */
#include "testutil.h"

#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "distopt/distopt.h"
#include "distopt/safetensors.h"

#define TOL_PARAM 1e-6
#define TOL_STATE 1e-5
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

/* Runs one case; returns the number of compared tensors. */
static int run_case(const char *dir, const char *file, errstat *ep, errstat *es) {
  char *path = path_join(dir, file);
  dopt_st_file *cf = NULL, *inf = NULL;
  assert_ok(dopt_st_load(path, &cf));
  const char *inputs = dopt_st_meta(cf, "inputs");
  char *ipath = inputs ? path_join(dir, inputs) : NULL;
  if (ipath) assert_ok(dopt_st_load(ipath, &inf));
  else inf = cf;
  const char *optname = dopt_st_meta(cf, "optimizer");
  const char *params = dopt_st_meta(inf, "params") ? dopt_st_meta(inf, "params") : dopt_st_meta(cf, "params");
  const char *steps_s = dopt_st_meta(cf, "steps") ? dopt_st_meta(cf, "steps") : dopt_st_meta(inf, "steps");
  assert_non_null(optname);
  assert_non_null(params);
  assert_non_null(steps_s);
  int steps = atoi(steps_s);
  assert_true(steps >= 20);

  dopt_optim *o;
  assert_ok(dopt_optim_create(optname, dopt_st_meta(cf, "hparams"), &o));

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
    assert_ok(dopt_optim_step(o, gp));
    for (int i = 0; i < np; i++) {
      double ab, rel;
      char what[320];
      snprintf(key, sizeof key, "param/%d/%s", t, names[i]);
      assert_ok(dopt_st_read_f32(cf, key, gold, numel[i]));
      rel = compare(data[i], gold, numel[i], &ab);
      snprintf(what, sizeof what, "%.60s %.200s", file, key);
      note(ep, rel, ab, what);
      if (!(rel <= TOL_PARAM))
        fail_msg("%s: %s normwise rel error %.3g > %.1g (max abs %.3g)", file, key, rel, TOL_PARAM, ab);
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
          memcpy(gold, st.data, n * sizeof(float));
          rel = compare(v.data, gold, n, &ab);
          snprintf(what, sizeof what, "%.60s %.200s", file, st.name);
          note(es, rel, ab, what);
          if (!(rel <= TOL_STATE))
            fail_msg("%s: %s normwise rel error %.3g > %.1g (max abs %.3g)", file, st.name, rel, TOL_STATE, ab);
          compared++;
        }
        if (!found) fail_msg("%s: upstream state '%s' has no counterpart", file, st.name);
      }
      if (upstream_keys != ns && !(upstream_keys == 0 && gp[i] == NULL && ns == 0))
        fail_msg("%s: param %s step %d: %d states here, %d upstream", file, names[i], t, ns, upstream_keys);
    }
  }
  for (int i = 0; i < np; i++) {
    free(data[i]);
    free(grad[i]);
  }
  free(gold);
  dopt_optim_destroy(o);
  if (inf != cf) dopt_st_free(inf);
  dopt_st_free(cf);
  free(ipath);
  free(path);
  return compared;
}

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

static void test_golden(void **st) {
  (void)st;
  const char *env = getenv("DOPT_GOLDEN_DIR");
  char *dir = env ? strdup(env) : path_join(dt_source_dir(), "datasets/golden");
  DIR *d = opendir(dir);
  if (!d) fail_msg("golden directory %s missing", dir);
  char *files[64];
  int nf = 0;
  struct dirent *e;
  while ((e = readdir(d)) && nf < 64) {
    size_t l = strlen(e->d_name);
    if (l > 12 && strcmp(e->d_name + l - 12, ".safetensors") == 0 && strcmp(e->d_name, "inputs.safetensors") != 0 &&
        strncmp(e->d_name, "bnb_", 4) != 0) /* bnb_*: 8-bit maps and kernel data, not optimizer cases */
      files[nf++] = strdup(e->d_name);
  }
  closedir(d);
  qsort(files, (size_t)nf, sizeof files[0], cmp_str);
  /* all four optimizers must be covered: a missing file is a failure, not a skip */
  const char *need[] = {"adamw_", "adafactor_", "came_", "lamb_"};
  for (int k = 0; k < 4; k++) {
    int have = 0;
    for (int i = 0; i < nf; i++) have |= strncmp(files[i], need[k], strlen(need[k])) == 0;
    if (!have) fail_msg("no golden case for %s* in %s", need[k], dir);
  }
  printf("%-32s %8s %12s %12s %12s %12s\n", "case", "tensors", "param abs", "param rel", "state abs", "state rel");
  for (int i = 0; i < nf; i++) {
    errstat ep = {0, 0, ""}, es = {0, 0, ""};
    int n = run_case(dir, files[i], &ep, &es);
    printf("%-32s %8d %12.3g %12.3g %12.3g %12.3g\n", files[i], n, ep.max_abs, ep.max_rel, es.max_abs, es.max_rel);
    free(files[i]);
  }
  free(dir);
}

int main(void) {
  const struct CMUnitTest tests[] = {cmocka_unit_test(test_golden)};
  return cmocka_run_group_tests(tests, NULL, NULL);
}

/* `distopt run` end to end: a good run equals the library bit for bit; bad
 * input gives one line on stderr naming the problem, exit code 2, and no
 * output file. argv[1] = path of the distopt binary. */
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include "distopt/distopt.h"
#include "distopt/safetensors.h"

static const char *bin;
static char dir[256], inputs[512], errfile[600];

static int setup(void **st) {
  (void)st;
  snprintf(inputs, sizeof inputs, "%s/datasets/golden/inputs.safetensors", dt_source_dir());
  int rc = dt_make_tmpdir(dir, sizeof dir, "dopt_cli");
  snprintf(errfile, sizeof errfile, "%s/stderr.txt", dir);
  return rc;
}

static int teardown(void **st) {
  (void)st;
  return dt_remove_tmpdir(dir);
}

/* Runs the binary with args (NULL-terminated), stderr to errfile; returns the exit code. */
static int run(const char *const *args) { return dt_run(bin, args, NULL, errfile); }

static void expect_usage_error(const char *const *args, const char *needle, const char *out) {
  unlink(out);
  int rc = run(args);
  FILE *f = fopen(errfile, "r");
  char buf[2048] = "";
  size_t n = f ? fread(buf, 1, sizeof buf - 1, f) : 0;
  buf[n] = '\0';
  if (f) fclose(f);
  int lines = 0;
  for (size_t i = 0; i < n; i++) lines += buf[i] == '\n';
  if (rc != 2 || lines != 1 || !strstr(buf, needle))
    fail_msg("args[0..]=%s %s: rc %d, %d lines, stderr '%s' (want '%s')", args[0], args[1], rc, lines, buf, needle);
  if (access(out, F_OK) == 0) fail_msg("output file written despite the error: %s", out);
}

static void test_good_run_equals_library(void **st) {
  (void)st;
  char out[600];
  snprintf(out, sizeof out, "%s/out.safetensors", dir);
  const char *args[] = {"run",     "--params", inputs,  "--optimizer", "adafactor", "--hparams",
                        "beta1=0.9,weight_decay=0.01", "--group", "v*:weight_decay=0", "--steps", "12",
                        "--out", out, NULL};
  assert_int_equal(run(args), 0);
  dopt_st_file *in, *res;
  assert_ok(dopt_st_load(inputs, &in));
  assert_ok(dopt_st_load(out, &res));
  /* the same computation through the library */
  dopt_optim *o;
  assert_ok(dopt_optim_create("adafactor", "beta1=0.9,weight_decay=0.01", &o));
  int g;
  assert_ok(dopt_optim_add_group(o, "weight_decay=0", &g));
  float *data[32], *grad[32];
  char names[32][64], key[300];
  int np = 0;
  for (int i = 0; i < dopt_st_count(in); i++) {
    dopt_st_tensor t;
    assert_ok(dopt_st_get(in, i, &t));
    if (strncmp(t.name, "init/", 5) != 0) continue;
    snprintf(names[np], 64, "%s", t.name + 5);
    data[np] = malloc(t.numel * 4);
    grad[np] = malloc(t.numel * 4);
    memcpy(data[np], t.data, t.numel * 4);
    dopt_param_config pc = DOPT_PARAM_CONFIG_INIT;
    pc.name = names[np];
    pc.ndim = t.ndim;
    memcpy(pc.shape, t.shape, sizeof pc.shape);
    pc.data = data[np];
    assert_ok(dopt_optim_add_param(o, names[np][0] == 'v' ? g : 0, &pc, NULL));
    np++;
  }
  assert_true(np >= 8);
  for (int t = 1; t <= 12; t++) {
    const float *gp[32];
    for (int i = 0; i < np; i++) {
      dopt_st_tensor gt;
      snprintf(key, sizeof key, "grad/%d/%s", t, names[i]);
      gp[i] = NULL;
      if (dopt_st_find(in, key, &gt) == DOPT_OK) {
        memcpy(grad[i], gt.data, gt.bytes);
        gp[i] = grad[i];
      }
    }
    assert_ok(dopt_optim_step(o, gp));
  }
  for (int i = 0; i < np; i++) {
    dopt_st_tensor t;
    snprintf(key, sizeof key, "param/%s", names[i]);
    assert_ok(dopt_st_find(res, key, &t));
    if (memcmp(t.data, data[i], t.bytes) != 0) fail_msg("CLI result for %s differs from the library", names[i]);
    for (int s = 0; s < dopt_optim_num_states(o, i); s++) {
      dopt_state_view v;
      assert_ok(dopt_optim_state(o, i, s, &v));
      snprintf(key, sizeof key, "state/%s/%s", names[i], v.name);
      assert_ok(dopt_st_find(res, key, &t));
      if (t.bytes != v.bytes || memcmp(t.data, v.data, v.bytes) != 0) fail_msg("CLI state %s differs", key);
    }
    snprintf(key, sizeof key, "state/%s/step", names[i]);
    assert_ok(dopt_st_find(res, key, &t));
    assert_int_equal(t.dtype, DOPT_I64);
    free(data[i]);
    free(grad[i]);
  }
  assert_string_equal(dopt_st_meta(res, "optimizer"), "adafactor");
  dopt_optim_destroy(o);
  dopt_st_free(in);
  dopt_st_free(res);
}

/* A golden case file names its inputs; run takes optimizer, hyperparameters
 * and groups from its metadata and reproduces its last step (same tolerance
 * as test_golden.c). */
static void test_run_golden_case(void **st) {
  (void)st;
  char cas[600], out[600];
  snprintf(cas, sizeof cas, "%s/datasets/golden/adafactor_groups.safetensors", dt_source_dir());
  snprintf(out, sizeof out, "%s/case_out.safetensors", dir);
  const char *args[] = {"run", "--params", cas, "--out", out, "--quiet", NULL};
  assert_int_equal(run(args), 0);
  dopt_st_file *gold, *res;
  assert_ok(dopt_st_load(cas, &gold));
  assert_ok(dopt_st_load(out, &res));
  assert_string_equal(dopt_st_meta(res, "optimizer"), "adafactor");
  int checked = 0;
  for (int i = 0; i < dopt_st_count(res); i++) {
    dopt_st_tensor t, g;
    assert_ok(dopt_st_get(res, i, &t));
    if (strncmp(t.name, "param/", 6) != 0) continue;
    char key[300];
    snprintf(key, sizeof key, "param/20/%s", t.name + 6);
    assert_ok(dopt_st_find(gold, key, &g));
    const float *a = t.data, *b = g.data;
    double maxd = 0, maxb = 0;
    for (size_t k = 0; k < t.numel; k++) {
      double d = fabs((double)a[k] - (double)b[k]);
      maxd = d > maxd ? d : maxd;
      maxb = fabs((double)b[k]) > maxb ? fabs((double)b[k]) : maxb;
    }
    if (maxd > 1e-6 * maxb) fail_msg("%s: normwise error %.3g", t.name, maxd / maxb);
    checked++;
  }
  assert_int_equal(checked, 8);
  dopt_st_free(gold);
  dopt_st_free(res);
}

static char *slurp(const char *path);

static void test_bad_input(void **st) {
  (void)st;
  char out[600], garbage[600], trunc[600], shaped[600];
  snprintf(out, sizeof out, "%s/bad_out.safetensors", dir);
  snprintf(garbage, sizeof garbage, "%s/garbage.safetensors", dir);
  snprintf(trunc, sizeof trunc, "%s/trunc.safetensors", dir);
  snprintf(shaped, sizeof shaped, "%s/shaped.safetensors", dir);
  FILE *f = fopen(garbage, "wb");
  fputs("this is not a safetensors file at all", f);
  fclose(f);
  /* truncated copy of the inputs */
  FILE *src = fopen(inputs, "rb");
  f = fopen(trunc, "wb");
  char buf[4096];
  size_t n = fread(buf, 1, sizeof buf, src);
  fwrite(buf, 1, n / 2, f);
  fclose(f);
  fclose(src);
  /* a params file whose 'vec' has the wrong shape for the gradients */
  dopt_st_writer *w;
  assert_ok(dopt_st_writer_create(&w));
  float v[12] = {0};
  const int64_t s12[1] = {12};
  assert_ok(dopt_st_writer_add(w, "vec", DOPT_F32, 1, s12, v));
  assert_ok(dopt_st_writer_save(w, shaped));
  dopt_st_writer_free(w);

#define ARGS(...) ((const char *const[]){"run", __VA_ARGS__, NULL})
  expect_usage_error(ARGS("--params", inputs, "--optimizer", "adamx", "--out", out), "unknown optimizer 'adamx'", out);
  expect_usage_error(ARGS("--params", inputs, "--optimizer", "came", "--hparams", "lr=1e-3,gamma=2", "--out", out),
                     "'gamma'", out);
  expect_usage_error(ARGS("--params", inputs, "--optimizer", "adamw", "--hparams", "lr=nan", "--out", out), "lr=nan",
                     out);
  expect_usage_error(ARGS("--params", inputs, "--optimizer", "came", "--out", out), "lr=none", out);
  expect_usage_error(ARGS("--params", "/nonexistent/p.safetensors", "--optimizer", "adamw", "--out", out),
                     "/nonexistent/p.safetensors", out);
  expect_usage_error(ARGS("--params", garbage, "--optimizer", "adamw", "--out", out), "garbage.safetensors", out);
  expect_usage_error(ARGS("--params", trunc, "--optimizer", "adamw", "--out", out), "trunc.safetensors", out);
  expect_usage_error(ARGS("--params", shaped, "--grads", inputs, "--optimizer", "adamw", "--out", out), "shape", out);
  expect_usage_error(ARGS("--params", inputs, "--optimizer", "adamw", "--steps", "500", "--out", out), "--steps 500",
                     out);
  expect_usage_error(ARGS("--params", inputs, "--optimizer", "adamw", "--frobnicate", "1", "--out", out),
                     "--frobnicate", out);
  expect_usage_error(ARGS("--params", inputs, "--optimizer", "adamw"), "--out", out);
  expect_usage_error(ARGS("--params", inputs, "--optimizer", "adamw", "--group", "nocolon", "--out", out), "nocolon",
                     out);
  /* echoed input stays on one line */
  expect_usage_error(ARGS("--params", inputs, "--optimizer", "ada\nmw", "--out", out), "ada\\x0amw", out);
  /* hostile input that used to pass silently or hang */
  char odd[600], far[600], meta[600], copy[600];
  snprintf(odd, sizeof odd, "%s/odd.safetensors", dir);
  snprintf(far, sizeof far, "%s/far.safetensors", dir);
  snprintf(meta, sizeof meta, "%s/meta.safetensors", dir);
  snprintf(copy, sizeof copy, "%s/copy.safetensors", dir);
  float x[2] = {1, 2};
  const int64_t s2[1] = {2};
  static const char *const odd_names[] = {"grad/01/w", "grad/+1/w", "grad/ 1/w", "grad/1x/w"};
  for (int k = 0; k < 4; k++) { /* names that were accepted and never applied */
    assert_ok(dopt_st_writer_create(&w));
    assert_ok(dopt_st_writer_add(w, "w", DOPT_F32, 1, s2, x));
    assert_ok(dopt_st_writer_add(w, "grad/1/w", DOPT_F32, 1, s2, x));
    assert_ok(dopt_st_writer_add(w, odd_names[k], DOPT_F32, 1, s2, x));
    assert_ok(dopt_st_writer_save(w, odd));
    dopt_st_writer_free(w);
    expect_usage_error(ARGS("--params", odd, "--optimizer", "adamw", "--out", out), odd_names[k], out);
  }
  assert_ok(dopt_st_writer_create(&w)); /* a step count that would run for hours */
  assert_ok(dopt_st_writer_add(w, "w", DOPT_F32, 1, s2, x));
  assert_ok(dopt_st_writer_add(w, "grad/1000000000/w", DOPT_F32, 1, s2, x));
  assert_ok(dopt_st_writer_save(w, far));
  dopt_st_writer_free(w);
  expect_usage_error(ARGS("--params", far, "--optimizer", "adamw", "--out", out), "beyond the limit", out);
  char longname[300]; /* a parameter name over run's limit: named (cut) with its length and the limit */
  memset(longname, 'n', sizeof longname - 1);
  longname[sizeof longname - 1] = '\0';
  assert_ok(dopt_st_writer_create(&w));
  assert_ok(dopt_st_writer_add(w, longname, DOPT_F32, 1, s2, x));
  assert_ok(dopt_st_writer_save(w, far));
  dopt_st_writer_free(w);
  expect_usage_error(ARGS("--params", far, "--optimizer", "adamw", "--out", out), "is 299 bytes, more than the limit of 255",
                     out);
  static const char *const groups[][3] = {{"w||v", "lr=1|lr=2|lr=3", "empty"}, /* an empty field shifted groups */
                                          {"w|v", "lr=1", "2 groups but 'group_hparams' has 1"}};
  for (int k = 0; k < 2; k++) {
    assert_ok(dopt_st_writer_create(&w));
    assert_ok(dopt_st_writer_add(w, "w", DOPT_F32, 1, s2, x));
    assert_ok(dopt_st_writer_add(w, "v", DOPT_F32, 1, s2, x));
    assert_ok(dopt_st_writer_add(w, "grad/1/w", DOPT_F32, 1, s2, x));
    assert_ok(dopt_st_writer_meta(w, "optimizer", "adamw"));
    assert_ok(dopt_st_writer_meta(w, "groups", groups[k][0]));
    assert_ok(dopt_st_writer_meta(w, "group_hparams", groups[k][1]));
    assert_ok(dopt_st_writer_save(w, meta));
    dopt_st_writer_free(w);
    expect_usage_error(ARGS("--params", meta, "--out", out), groups[k][2], out);
  }
  expect_usage_error(ARGS("--params", inputs, "--optimizer", "adamw", "--group", "nomatch*:lr=1", "--out", out),
                     "matches no parameter", out);
  expect_usage_error(ARGS("--params", inputs, "--optimizer", "adamw", "--group", "[:lr=1", "--out", out), "'['",
                     out);
  /* --out naming an input would replace it */
  FILE *a = fopen(inputs, "rb"), *b = fopen(copy, "wb");
  size_t got;
  while ((got = fread(buf, 1, sizeof buf, a)) > 0) fwrite(buf, 1, got, b);
  fclose(a);
  fclose(b);
  const char *same[] = {"run", "--params", copy, "--optimizer", "adamw", "--out", copy, NULL};
  assert_int_equal(run(same), 2);
  char *err = slurp(errfile), *before = slurp(inputs), *after = slurp(copy);
  if (!err || !strstr(err, "would be replaced")) fail_msg("--out = --params: '%s'", err ? err : "");
  assert_non_null(before);
  assert_non_null(after);
  assert_memory_equal(before, after, 64); /* the input is intact */
  free(err), free(before), free(after);
#undef ARGS
}

/* Runs the binary with stdout to outfile too; returns the exit code. */
static int run_out(const char *const *args, const char *outfile) { return dt_run(bin, args, outfile, errfile); }

static char *slurp(const char *path) {
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  rewind(f);
  char *b = malloc((size_t)n + 1);
  size_t got = fread(b, 1, (size_t)n, f);
  b[got] = '\0';
  fclose(f);
  return b;
}

/* `distopt compare` on the bundled trace: bitwise table, exit 0, JSON and SVG
 * written; a ring-order reduction at dp=3 is reported as diverged, exit 1. */
/* The digest line of a compare run's output (64 hex digits) into hex. */
static void digest_of(const char *txt, char hex[65]) {
  const char *dl = strstr(txt, "digest sha256:");
  if (!dl) fail_msg("no digest line: %s", txt);
  memcpy(hex, dl + 14, 64);
  hex[64] = '\0';
}

/* The stretch goal: one global batch of 24 micro-batches split as
 * dp x accumulation in {1x24, 2x12, 3x8, 4x6, 6x4, 8x3} gives the same bits
 * with --batch-invariant (every layout bitwise the reference and one digest);
 * without it the split changes the result (the control). */
static void test_batch_invariant(void **st) {
  (void)st;
  char out[600], first[65] = "", hex[65], acc[8], dps[8];
  snprintf(out, sizeof out, "%s/bi.txt", dir);
  static const int DP[] = {1, 2, 3, 4, 6, 8};
  for (int inv = 1; inv >= 0; inv--) {
    int differs = 0;
    for (int k = 0; k < 6; k++) {
      snprintf(dps, sizeof dps, "%d", DP[k]);
      snprintf(acc, sizeof acc, "%d", 24 / DP[k]);
      const char *args[] = {"compare", "--optimizer", "adafactor", "--plugin", "zero", "--tp", "1", "--zero", "2",
                            "--dp", dps, "--accumulation", acc, "--steps", "4", "--quiet", "--ring-order",
                            inv ? "--batch-invariant" : NULL, NULL};
      if (DP[k] == 1) args[4] = "ddp", args[8] = "0";
      assert_int_equal(run_out(args, out), 0);
      char *txt = slurp(out);
      digest_of(txt, hex);
      if (!strstr(txt, "(reference: equal)")) fail_msg("dp=%d: distributed digest differs: %s", DP[k], txt);
      free(txt);
      if (k == 0) memcpy(first, hex, sizeof hex);
      else if (inv && strcmp(hex, first) != 0) fail_msg("batch invariant: dp=%d digest %s, dp=1 %s", DP[k], hex, first);
      differs |= strcmp(hex, first) != 0;
    }
    if (!inv && !differs) fail_msg("control: without --batch-invariant every split gave the same digest");
  }
  const char *bad[] = {"compare", "--batch-invariant", "--dp-sum", "rank-order", NULL};
  assert_int_equal(run_out(bad, out), 2);
  char *err = slurp(errfile);
  if (!strstr(err, "batch_invariant")) fail_msg("batch-invariant with rank-order sum: %s", err);
  free(err);
}

/* --checkpoint-at: saved after step 5 in tp2 x dp2 x zero2, resumed in
 * tp3 x dp2 x zero3 (fsdp) and in 1 x 1 x 0: bitwise every step, and the final
 * digest is the uninterrupted run's; a checkpoint directory that cannot be
 * created fails with one line. */
/* Every option used or refused: a resume layout without --checkpoint-at, --matrix beside an option it would
 * ignore, a group pattern that matches no parameter (run refused it; compare ignored all three). */
static void test_compare_unused_options(void **st) {
  (void)st;
  char out[600];
  snprintf(out, sizeof out, "%s/unused.txt", dir);
  static const struct {
    const char *args[12];
    const char *needle;
  } cases[] = {
      {{"compare", "--steps", "2", "--resume-tp", "2", NULL}, "there is no resume (checkpoint_at)"},
      {{"compare", "--steps", "2", "--resume-pp", "2", NULL}, "there is no resume (checkpoint_at)"},
      {{"compare", "--steps", "2", "--resume-plugin", "fsdp", NULL}, "there is no resume (checkpoint_at)"},
      {{"compare", "--matrix", "--steps", "2", "--tp", "3", NULL}, "'--tp' would be ignored"},
      {{"compare", "--optimizer", "adamw", "--matrix", NULL}, "'--optimizer' would be ignored"},
      {{"compare", "--optimizer", "adamw", "--steps", "2", "--group", "nomatch*:lr=0.1", NULL},
       "group 'nomatch*': the pattern matches none of the"},
  };
  for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
    assert_int_equal(run_out(cases[k].args, out), 2);
    char *err = slurp(errfile);
    if (!strstr(err, cases[k].needle) || strchr(err, '\n') != strrchr(err, '\n'))
      fail_msg("case %zu: want one line naming '%s': %s", k, cases[k].needle, err);
    free(err);
  }
}

/* --model: the least the run holds, against the memory it may use, before anything is allocated: refused in
 * one line naming the measure (DOPT_MEM_AVAILABLE here; RLIMIT_AS through ulimit -v), run when it fits. */
static void test_compare_model_memory(void **st) {
  (void)st;
  char out[600];
  snprintf(out, sizeof out, "%s/mem.txt", dir);
  const char *args[] = {"compare", "--model", "2mx4", "--steps", "1", "--quiet", NULL};
  const char *tight[] = {"DOPT_MEM_AVAILABLE=1000000", NULL}, *roomy[] = {"DOPT_MEM_AVAILABLE=1e12", NULL};
  dt_run_opts o = {120, 0, tight, 0};
  assert_int_equal(dt_run_with(bin, args, out, errfile, &o), 2);
  char *err = slurp(errfile);
  if (!strstr(err, "--model 2mx4 (") || !strstr(err, "more than the 0.00 GiB available (DOPT_MEM_AVAILABLE)"))
    fail_msg("the refusal: %s", err);
  free(err);
  o.env = roomy;
  assert_int_equal(dt_run_with(bin, args, out, errfile, &o), 0);
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  /* a sanitizer reserves terabytes of address space at start: under RLIMIT_AS the process cannot start at all */
  printf("RLIMIT_AS case skipped: a sanitizer build cannot start under an address-space limit\n");
#else
  const char *big[] = {"compare", "--model", "llama-130m", "--steps", "1", NULL};
  dt_run_opts lim = {120, 0, NULL, 2000000000ul};
  assert_int_equal(dt_run_with(bin, big, out, errfile, &lim), 2);
  err = slurp(errfile);
  if (!strstr(err, "available (RLIMIT_AS (ulimit -v))")) fail_msg("the refusal under RLIMIT_AS: %s", err);
  free(err);
#endif
}

/* The reference's gradients a chunk of rows at a time (compare/rank.c ref_chunk): --model 21.7mx1 (a [5632, 960]
 * embedding: chunks of 272 rows, whole 256-element blocks of the exact sum with 960 columns; [2560, 960] and
 * [960, 2560] weights) at tp 2 x dp 2, ZeRO 2, bitwise to the distributed run, which sums whole blocks; seen
 * failing with every chunk generated from row 0. */
static void test_compare_reference_chunks(void **st) {
  (void)st;
  char out[600];
  snprintf(out, sizeof out, "%s/chunks.txt", dir);
  const char *args[] = {"compare", "--model", "21.7mx1", "--optimizer", "adamw", "--tp", "2", "--dp", "2", "--zero",
                        "2", "--steps", "2", NULL};
  assert_int_equal(run_out(args, out), 0);
  char *txt = slurp(out);
  if (!strstr(txt, "verdict: EQUIVALENT (bitwise") || !strstr(txt, "(reference: equal)")) fail_msg("compare: %s", txt);
  free(txt);
}

/* Every wrapper around every inner optimizer it takes, distributed (fsdp: tp 2 x dp 2, ZeRO 3): bitwise. The
 * inner is every registered optimizer the wrapper accepts (the library refuses the others: a wrapper, or a GaLore
 * optimizer inside galore), with the inner's example hyperparameters where its defaults are no optimizer (CAME's
 * lr). galore(inner=muon) caught the wrapper that ignored its inner's need for whole tensors. */
static void test_wrappers_distributed(void **st) {
  (void)st;
  char out[600], hp[512];
  snprintf(out, sizeof out, "%s/wrap.txt", dir);
  int ran = 0, refused = 0;
  static const char *const wrappers[] = {"galore", "lisa"};
  for (int w = 0; w < 2; w++)
    for (int i = 0; i < dopt_optim_registry_count(); i++) {
      /* the inner's example keys under inner. (LISA routes them; galore's composite takes inner.KEY of the inner) */
      dt_wrapped_hparams(dopt_optim_registry_name(i), hp, sizeof hp, NULL);
      dopt_optim *o = NULL;
      if (dopt_optim_create(wrappers[w], hp, &o) != DOPT_OK) {
        refused++;
        continue;
      }
      dopt_optim_destroy(o);
      const char *args[] = {"compare", "--optimizer", wrappers[w], "--hparams", hp, "--plugin", "fsdp", "--steps", "4",
                            "--quiet", NULL};
      const int rc = run_out(args, out);
      char *txt = slurp(out);
      if (rc != 0 || !strstr(txt, "verdict: EQUIVALENT (bitwise")) fail_msg("%s %s: exit %d\n%s", wrappers[w], hp, rc, txt);
      free(txt);
      ran++;
    }
  printf("wrappers distributed: %d combinations bitwise, %d refused by the library\n", ran, refused);
  assert_true(ran >= 16);
}

static void test_compare_checkpoint(void **st) {
  (void)st;
  char out[600], ck[600], hex[65], want[65];
  snprintf(out, sizeof out, "%s/ck.txt", dir);
  const char *plain[] = {"compare", "--optimizer", "came", "--hparams", "lr=2e-4", "--steps", "12", "--quiet", NULL};
  assert_int_equal(run_out(plain, out), 0);
  char *txt = slurp(out);
  digest_of(txt, want);
  free(txt);
  static const char *const B[][4] = {{"fsdp", "3", "2", "3"}, {"ddp", "1", "1", "0"}};
  for (int k = 0; k < 2; k++) {
    snprintf(ck, sizeof ck, "%s/ckpt%d", dir, k);
    const char *args[] = {"compare", "--optimizer", "came", "--hparams", "lr=2e-4", "--steps", "12", "--quiet",
                          "--checkpoint-at", "5", "--checkpoint-dir", ck, "--resume-plugin", B[k][0], "--resume-tp",
                          B[k][1], "--resume-dp", B[k][2], "--resume-zero", B[k][3], NULL};
    assert_int_equal(run_out(args, out), 0);
    txt = slurp(out);
    if (!strstr(txt, "EQUIVALENT (bitwise")) fail_msg("resume in %s: %s", B[k][0], txt);
    digest_of(txt, hex);
    free(txt);
    /* same dp: the same global batch, so the uninterrupted run's digest */
    if (k == 0 && strcmp(hex, want) != 0) fail_msg("resumed digest %s, uninterrupted %s", hex, want);
    char latest[700];
    snprintf(latest, sizeof latest, "%s/latest", ck);
    assert_int_equal(access(latest, F_OK), 0);
  }
  const char *bad[] = {"compare", "--steps", "4", "--checkpoint-at", "2", "--checkpoint-dir", "/proc/no/such", NULL};
  assert_int_equal(run_out(bad, out), 2);
  char *err = slurp(errfile);
  if (!strstr(err, "/proc/no")) fail_msg("unwritable checkpoint directory not named: %s", err);
  free(err);
  const char *late[] = {"compare", "--steps", "4", "--checkpoint-at", "4", NULL};
  assert_int_equal(run_out(late, out), 2);
  err = slurp(errfile);
  if (!strstr(err, "checkpoint_at=4")) fail_msg("checkpoint at the last step: %s", err);
  free(err);
}

static void test_compare(void **st) {
  (void)st;
  char trace[600], out[600], json[600], svg[600];
  snprintf(trace, sizeof trace, "%s/datasets/trace/digits_mlp.safetensors", dt_source_dir());
  snprintf(out, sizeof out, "%s/compare.txt", dir);
  snprintf(json, sizeof json, "%s/compare.json", dir);
  snprintf(svg, sizeof svg, "%s/compare.svg", dir);
  const char *args[] = {"compare", "--trace", trace, "--steps", "30", "--json", json, "--plot", svg, NULL};
  assert_int_equal(run_out(args, out), 0);
  char *txt = slurp(out);
  assert_non_null(txt);
  if (!strstr(txt, "EQUIVALENT") || !strstr(txt, "fc1.weight") || !strstr(txt, "exp_avg_sq_row"))
    fail_msg("compare table: %s", txt);
  /* the last line: the digest, 64 lowercase hex digits, equal to the reference's */
  const char *dl = strstr(txt, "\ndigest sha256:");
  if (!dl || strspn(dl + 15, "0123456789abcdef") != 64 || strcmp(dl + 79, " (reference: equal)\n") != 0)
    fail_msg("compare: no final digest line: %s", txt);
  char hex[65];
  memcpy(hex, dl + 15, 64);
  hex[64] = '\0';
  free(txt);
  assert_int_equal(access(json, F_OK), 0);
  assert_int_equal(access(svg, F_OK), 0);
  /* the SVG parses as XML and the JSON as JSON: with python3's parsers where
   * python3 exists (the writers themselves are checked without Python in
   * test_compare_report.c) */
  if (system("command -v python3 >/dev/null 2>&1") == 0) {
    char cmd[1400];
    snprintf(cmd, sizeof cmd, "python3 -c \"import sys, xml.etree.ElementTree as E; E.parse(sys.argv[1])\" %s", svg);
    assert_int_equal(system(cmd), 0);
    snprintf(cmd, sizeof cmd,
             "python3 -c \"import sys, json; d = json.load(open(sys.argv[1])); "
             "assert d['schema_version'] == 6 and d['events']['first_difference'] is None and d['digest']['distributed'] == d['digest']['reference'] == sys.argv[2]\" "
             "%s %s",
             json, hex);
    assert_int_equal(system(cmd), 0);
  } else {
    printf("note: no python3: the SVG/JSON of the CLI run are checked by test_compare_report only\n");
  }
  /* a ring all-reduce's order: bitwise with the exact dp sum (the default and
   * exact2), diverged with the fp32 sum in the transport's order */
  const char *ring[] = {"compare", "--optimizer", "adamw", "--plugin", "ddp", "--tp", "1", "--dp", "3", "--zero", "0",
                        "--steps", "5", "--ring-order", "--dp-sum", "exact", NULL};
  const char *modes[] = {"exact", "exact2", "rank-order"};
  for (int m = 0; m < 3; m++) {
    ring[15] = modes[m];
    assert_int_equal(run_out(ring, out), m == 2 ? 1 : 0);
    txt = slurp(out);
    if (m == 2 && !strstr(txt, "DIVERGED")) fail_msg("ring order, rank-order sum: not reported as diverged: %s", txt);
    if (m < 2 && !strstr(txt, "EQUIVALENT (bitwise")) fail_msg("ring order, %s sum: not bitwise: %s", modes[m], txt);
    free(txt);
  }
  const char *badsum[] = {"compare", "--dp-sum", "fast", NULL};
  assert_int_equal(run_out(badsum, out), 2);
  txt = slurp(errfile);
  if (!strstr(txt, "--dp-sum 'fast'")) fail_msg("bad --dp-sum not named: %s", txt);
  free(txt);
  /* the measured compatibility matrix: every optimizer x plugin, all bitwise */
  const char *matrix[] = {"compare", "--matrix", "--steps", "3", NULL};
  assert_int_equal(run_out(matrix, out), 0);
  txt = slurp(out);
  for (int k = 0; k < dopt_optim_registry_count(); k++)
    if (!strstr(txt, dopt_optim_registry_name(k))) fail_msg("matrix lacks %s: %s", dopt_optim_registry_name(k), txt);
  if (!strstr(txt, "\xe2\x9c\x94") || strstr(txt, "\xe2\x9c\x98")) fail_msg("matrix: %s", txt);
  if (!strstr(txt, "hybrid z1 pp3x2x2")) fail_msg("matrix lacks the pipeline column: %s", txt);
  if (!strstr(txt, "gemini z3 1x3")) fail_msg("matrix lacks the gemini column: %s", txt);
  if (!strstr(txt, "moe z1 2x4 ep4")) fail_msg("matrix lacks the moe_hybrid column: %s", txt);
  free(txt);
}

static void test_compare_bad_input(void **st) {
  (void)st;
  char json[600], trace[600], yaml[600];
  snprintf(json, sizeof json, "%s/bad.json", dir);
  snprintf(trace, sizeof trace, "%s/datasets/trace/digits_mlp.safetensors", dt_source_dir());
  snprintf(yaml, sizeof yaml, "%s/bad.yaml", dir);
  FILE *f = fopen(yaml, "w");
  fputs("optimizer: {type: came, lr: 2e-4}\nplugin: {type: hybrid, tp: 2, dp: 2, zeroo: 2}\n", f);
  fclose(f);
#define ARGS(...) ((const char *const[]){"compare", __VA_ARGS__, "--json", json, NULL})
  expect_usage_error(ARGS("--optimizer", "adamx"), "'adamx'", json);
  expect_usage_error(ARGS("--plugin", "moe"), "'moe'", json);
  expect_usage_error(ARGS("--optimizer", "came", "--hparams", "lr=1e-3,gamma=1"), "'gamma'", json);
  expect_usage_error(ARGS("--tp", "2", "--dp", "2", "--ranks", "3"), "ranks=3", json);
  expect_usage_error(ARGS("--trace", "/nonexistent/trace.safetensors"), "/nonexistent/trace.safetensors", json);
  expect_usage_error(ARGS("--trace", trace, "--dp", "3", "--tp", "1"), "dp=3", json);
  /* a trace's shards are the micro-batches: a different --accumulation is refused, not ignored */
  expect_usage_error(ARGS("--trace", trace, "--accumulation", "3"), "accumulation=3 with a trace", json);
  expect_usage_error(ARGS("--config", yaml), "zeroo", json);
  expect_usage_error(ARGS("--steps", "0"), "--steps", json);
#undef ARGS
}

/* LISA through the CLI: layer indices come from "layers.N." names; the result equals the library with those
 * layers, and only the sampled layer plus the unnumbered parameter change. */
/* The numerical input policy of `distopt run` (docs/nan-policy.md): a step with
 * a non-finite gradient is skipped whole and counted (the run equals one
 * without that step's gradients); finite gradients that overflow a parameter
 * (lr = 1e300) are an error and nothing is written. */
/* compare under LISA on the default synthetic model (three layers.N. layers, n_layers 2): in the first interval
 * one layer is frozen and never stepped, so the reference holds no states for it; the distributed states are
 * measured against the declared zeros, they are in the table, and both digests cover the same tensors: the
 * digest line says equal (it said "differs" under an EQUIVALENT verdict when those states were skipped). */
static void test_compare_lisa_frozen(void **st) {
  (void)st;
  char out[600];
  snprintf(out, sizeof out, "%s/lisa.txt", dir);
  const char *args[] = {"compare", "--optimizer", "lisa", "--steps", "10", "--quiet", NULL};
  assert_int_equal(run_out(args, out), 0);
  char *txt = slurp(out);
  assert_non_null(txt);
  if (!strstr(txt, "EQUIVALENT (bitwise, 27 tensors") || !strstr(txt, "(reference: equal)"))
    fail_msg("lisa: %s", txt);
  static const char *const layers[] = {"layers.0.attn.qkv.weight/exp_avg_sq", "layers.1.mlp.fc1.bias/exp_avg",
                                       "layers.2.mlp.fc2.weight/exp_avg", NULL};
  for (int k = 0; layers[k]; k++)
    if (!strstr(txt, layers[k])) fail_msg("lisa: no row for %s: %s", layers[k], txt);
  char sampled[65], all[65];
  digest_of(txt, sampled);
  free(txt);
  /* LISA really samples the layers by default: training all three (n_layers=3) is another run */
  const char *every[] = {"compare", "--optimizer", "lisa", "--hparams", "n_layers=3", "--steps", "10", "--quiet", NULL};
  assert_int_equal(run_out(every, out), 0);
  txt = slurp(out);
  digest_of(txt, all);
  free(txt);
  if (strcmp(sampled, all) == 0) fail_msg("lisa: the default run trains every layer (no layer is sampled out)");
}

static void test_nonfinite_policy(void **st) {
  (void)st;
  char a[600], b[600], oa[600], ob[600];
  snprintf(a, sizeof a, "%s/nan_a.safetensors", dir);
  snprintf(b, sizeof b, "%s/nan_b.safetensors", dir);
  snprintf(oa, sizeof oa, "%s/nan_oa.safetensors", dir);
  snprintf(ob, sizeof ob, "%s/nan_ob.safetensors", dir);
  const int64_t s3[1] = {3};
  float w[3] = {0.5f, -0.25f, 1.0f}, g1[3] = {0.1f, 0.2f, -0.3f}, g2[3] = {0.1f, NAN, 0.2f}, g3[3] = {-0.2f, 0.1f, 0.4f};
  for (int k = 0; k < 2; k++) {
    dopt_st_writer *wr;
    assert_ok(dopt_st_writer_create(&wr));
    assert_ok(dopt_st_writer_add(wr, "w", DOPT_F32, 1, s3, w));
    assert_ok(dopt_st_writer_add(wr, "grad/1/w", DOPT_F32, 1, s3, g1));
    if (k == 0) assert_ok(dopt_st_writer_add(wr, "grad/2/w", DOPT_F32, 1, s3, g2));
    assert_ok(dopt_st_writer_add(wr, "grad/3/w", DOPT_F32, 1, s3, g3));
    assert_ok(dopt_st_writer_save(wr, k == 0 ? a : b));
    dopt_st_writer_free(wr);
  }
  const char *ra[] = {"run", "--params", a, "--optimizer", "adamw", "--out", oa, "--quiet", NULL};
  const char *rb[] = {"run", "--params", b, "--optimizer", "adamw", "--out", ob, "--quiet", NULL};
  assert_int_equal(run(ra), 0);
  assert_int_equal(run(rb), 0);
  dopt_st_file *fa, *fb;
  assert_ok(dopt_st_load(oa, &fa));
  assert_ok(dopt_st_load(ob, &fb));
  dopt_st_tensor ta, tb;
  assert_ok(dopt_st_find(fa, "param/w", &ta));
  assert_ok(dopt_st_find(fb, "param/w", &tb));
  assert_memory_equal(ta.data, tb.data, 12);
  assert_string_equal(dopt_st_meta(fa, "skipped_steps"), "1");
  assert_string_equal(dopt_st_meta(fb, "skipped_steps"), "0");
  dopt_st_free(fa);
  dopt_st_free(fb);
  const char *ap[] = {"run", "--params", a, "--optimizer", "adamw", "--out", oa, "--nonfinite", "apply", "--quiet", NULL};
  assert_int_equal(run(ap), 0); /* upstream's behaviour on request: the NaN reaches the parameter */
  assert_ok(dopt_st_load(oa, &fa));
  assert_ok(dopt_st_find(fa, "param/w", &ta));
  assert_true(isnan(((const float *)ta.data)[1]));
  dopt_st_free(fa);
#define ARGS(...) ((const char *const[]){"run", __VA_ARGS__, NULL})
  expect_usage_error(ARGS("--params", b, "--optimizer", "adamw", "--hparams", "lr=1e300", "--out", ob),
                     "overflow the update", ob);
  expect_usage_error(ARGS("--params", b, "--optimizer", "adamw", "--nonfinite", "maybe", "--out", ob), "'maybe'", ob);
  expect_usage_error(ARGS("--params", b, "--optimizer", "adamw", "--hparams", "lr=1e999", "--out", ob),
                     "out of the double range", ob);
  const char *tiny[] = {"run", "--params", b, "--optimizer", "adamw", "--hparams", "lr=1e-320", "--out", ob, "--quiet",
                        NULL}; /* a subnormal lr is a number (it was "not a number") */
  assert_int_equal(run(tiny), 0);
  char unwritable[700];
  snprintf(unwritable, sizeof unwritable, "%s/no/such/dir/out.safetensors", dir);
  expect_usage_error(ARGS("--params", b, "--optimizer", "adamw", "--out", unwritable), unwritable, unwritable);
#undef ARGS
}

/* 80 000 parameters, each with a gradient: every loader, lookup and writer
 * step must be O(n log n) or better (they were quadratic: 80 000 tensors never
 * finished; the CTest TIMEOUT turns a regression into a failure). */
static void test_many_tensors(void **st) {
  (void)st;
  enum { N = 80000 };
  char many[600], out[600];
  snprintf(many, sizeof many, "%s/many.safetensors", dir);
  snprintf(out, sizeof out, "%s/many_out.safetensors", dir);
  dopt_st_writer *w;
  assert_ok(dopt_st_writer_create(&w));
  const int64_t one[1] = {1};
  for (int i = 0; i < N; i++) {
    char name[64];
    float v = 0.5f, g = 0.25f;
    snprintf(name, sizeof name, "layers.%d.x%d", i % 7, i);
    assert_ok(dopt_st_writer_add(w, name, DOPT_F32, 1, one, &v));
    snprintf(name, sizeof name, "grad/1/layers.%d.x%d", i % 7, i);
    assert_ok(dopt_st_writer_add(w, name, DOPT_F32, 1, one, &g));
  }
  assert_ok(dopt_st_writer_save(w, many));
  dopt_st_writer_free(w);
  const char *args[] = {"run", "--params", many, "--optimizer", "adamw", "--out", out, "--quiet", NULL};
  assert_int_equal(run(args), 0);
  dopt_st_file *f;
  assert_ok(dopt_st_load(out, &f));
  dopt_st_tensor t;
  assert_ok(dopt_st_find(f, "param/layers.2.x79998", &t)); /* 79998 % 7 == 2 */
  assert_int_equal(t.numel, 1);
  dopt_st_free(f);
}

/* One row of `distopt mem`'s per-rank table: the tensors stepping piecewise and in owner mode, the max / mean
 * column, the states bytes of the most loaded rank and of all ranks. */
static void mem_row(const char *txt, const char *opt, int *npiece, int *nowner, double *ratio, double *max,
                    double *all) {
  char key[64];
  snprintf(key, sizeof key, "| %s | ", opt);
  const char *r = strstr(txt, key);
  if (!r) fail_msg("mem: no row for %s", opt);
  double v[7];
  char name[64];
  if (sscanf(r, "| %63s | %d / %d | %lf | %lf | %lf | %lf | %lf | %lf | %lf |", name, npiece, nowner, &v[0], &v[1],
             &v[2], &v[3], &v[4], &v[5], &v[6]) != 10)
    fail_msg("mem: cannot read the row for %s", opt);
  *ratio = v[4];
  *max = v[5];
  *all = v[6];
}

/* distopt mem --dp: GaLore's projected states (owner mode) are held once
 * across the ranks, about 1/dp each (up to one tensor's states: whole
 * tensors are owned); piecewise states, 8-bit ones included, are 1/dp up to
 * the ZeRO padding and, for 8-bit absmax, a block per shard edge (held by
 * both ranks whose elements share it). */
static void test_mem_per_rank(void **st) {
  (void)st;
  char out[600];
  snprintf(out, sizeof out, "%s/mem.txt", dir);
  const char *one[] = {"mem", "--model", "llama-1b", "--dp", "1", "--zero", "2", NULL};
  const char *four[] = {"mem", "--model", "llama-1b", "--dp", "4", "--zero", "2", NULL};
  assert_int_equal(run_out(one, out), 0);
  char *t1 = slurp(out);
  assert_int_equal(run_out(four, out), 0);
  char *t4 = slurp(out);
  /* the largest single tensor's states: embedding or lm_head [32000, 2048] under AdamW8bit (2 code bytes
   * per element + block absmax) or plain AdamW inside GaLore (8 bytes per element) */
  const double biggest = 32000.0 * 2048.0 * 8.0;
  static const char *const opts[] = {"adamw8bit", "galore_adamw", "galore_adamw8bit", "q_galore", "adamw"};
  for (int k = 0; k < 5; k++) {
    double m1, a1, m4, a4, r1, r4;
    int p1, o1, p4, o4;
    mem_row(t1, opts[k], &p1, &o1, &r1, &m1, &a1);
    mem_row(t4, opts[k], &p4, &o4, &r4, &m4, &a4);
    if (p1 != p4 || o1 != o4 || p1 + o1 != 219) fail_msg("%s: tensors %d / %d and %d / %d", opts[k], p1, o1, p4, o4);
    /* max / mean, printed with 3 decimals: the most loaded rank over the mean of the 4 */
    if (fabs(r4 - m4 / (a4 / 4)) > 0.0006) fail_msg("%s: max / mean %.3f, bytes give %.4f", opts[k], r4, m4 / (a4 / 4));
    if (strncmp(opts[k], "adamw", 5) == 0) { /* piecewise: chunk = ceil(numel / 4): within padding of 1/dp */
      if (o1 != 0) fail_msg("%s: %d tensors in owner mode", opts[k], o1);
      if (!(m4 * 4 >= m1 && m4 * 4 <= m1 * 1.0001)) fail_msg("%s: dp4 %.0f vs dp1 %.0f", opts[k], m4, m1);
      continue;
    }
    /* owner mode per tensor: GaLore's unprojected tensors (norms, embedding, lm_head) step piecewise, its
     * projected linears in owner mode */
    if (o1 == 0 || p1 == 0) fail_msg("%s: tensors %d piecewise / %d owner: no per-tensor decision", opts[k], p1, o1);
    /* once across the ranks, but for the absmax of a block two ranks' elements share (8 bytes, 3 edges) */
    if (a4 < a1 || a4 > a1 + 219.0 * 3 * 8)
      fail_msg("%s: the ranks hold %.0f state bytes together, one rank %.0f", opts[k], a4, a1);
    if (m1 != a1) fail_msg("%s: dp1 max %.0f vs all %.0f", opts[k], m1, a1);
    if (!(m4 <= a1 / 4 + biggest)) fail_msg("%s: max rank %.0f > 1/4 of %.0f + one tensor", opts[k], m4, a1);
  }
  free(t1);
  /* --pp 5 (24 layers: 5 + 5 + 5 + 5 + 4 as ColossalAI splits them): the ranks of all stages hold what the
   * ranks of one stage held (the "all ranks" column, piecewise), the busiest stage is the first or the last
   * (the embedding, or the head and the final norm, beside its layers), and a rank of it holds well under a
   * third of what a rank without stages holds (its stage: 5 of 24 layers and one of the two vocab matrices,
   * about a quarter of the model, plus the owners' imbalance) */
  /* --ep 8 on Mixtral-8x7B (moe_dp 1, ZeRO 1): each rank holds its expert's 32 x 3 matrices whole and 1/8 of the
   * dense tensors: AdamW's 8 bytes per element of that, 8 x (1 605 636 096 / 8 + 5 637 144 576) = 46 702 792 704
   * on every rank (exactly the model's count: the same arithmetic), the 8 bytes per parameter once over the
   * ranks; and a rank's fp32 parameters 26.98 GiB against 174 GiB with the experts dense over dp */
  const char *moe[] = {"mem", "--model", "mixtral-8x7b", "--dp", "8", "--ep", "8", "--zero", "1", NULL};
  const char *dense8[] = {"mem", "--model", "mixtral-8x7b", "--dp", "8", "--zero", "1", NULL};
  assert_int_equal(run_out(moe, out), 0);
  char *tm = slurp(out);
  assert_int_equal(run_out(dense8, out), 0);
  char *td = slurp(out);
  {
    double mm, am, rm, md, ad, rd, pm, pd;
    int p1, o1, p2, o2;
    mem_row(tm, "adamw", &p1, &o1, &rm, &mm, &am);
    mem_row(td, "adamw", &p2, &o2, &rd, &md, &ad);
    if (mm != 46702792704.0 || am != 8 * 46702792704.0 || ad != am || p1 != 995)
      fail_msg("mem --ep 8: adamw max %.0f all %.0f (dense: all %.0f), %d tensors\n%s", mm, am, ad, p1, tm);
    const char *r1 = strstr(tm, "| adamw | "), *r2 = strstr(td, "| adamw | ");
    if (!r1 || !r2 || sscanf(r1, "| adamw | %*d / %*d | %lf", &pm) != 1 || sscanf(r2, "| adamw | %*d / %*d | %lf", &pd) != 1 ||
        fabs(pm - 26.98) > 0.006 || pd < 170)
      fail_msg("mem --ep 8: params per rank %.2f GiB, dense %.2f GiB", pm, pd);
  }
  free(tm);
  free(td);
  const char *five[] = {"mem", "--model", "llama-1b", "--dp", "4", "--zero", "2", "--pp", "5", NULL};
  assert_int_equal(run_out(five, out), 0);
  char *t5 = slurp(out);
  for (int k = 0; k < 5; k++) {
    char key[64], name[64];
    snprintf(key, sizeof key, "| %s | ", opts[k]);
    const char *r = strstr(t5, key);
    int stage = -1, np5 = 0, no5 = 0;
    double v[7], m4, a4, r4;
    int p4, o4;
    if (!r || sscanf(r, "| %63s | %d | %d / %d | %lf | %lf | %lf | %lf | %lf | %lf | %lf |", name, &stage, &np5, &no5,
                     &v[0], &v[1], &v[2], &v[3], &v[4], &v[5], &v[6]) != 11)
      fail_msg("mem --pp: no row for %s:\n%s", opts[k], t5);
    mem_row(t4, opts[k], &p4, &o4, &r4, &m4, &a4);
    if (stage != 0 && stage != 4) fail_msg("%s: busiest stage %d of 5", opts[k], stage);
    if (strncmp(opts[k], "adamw", 5) == 0 && v[6] != a4)
      fail_msg("%s: all stages' ranks hold %.0f state bytes, one stage's ranks %.0f", opts[k], v[6], a4);
    if (!(v[5] < m4 / 3)) fail_msg("%s: a rank of 5 stages holds %.0f, of one %.0f", opts[k], v[5], m4);
  }
  free(t5);
  free(t4);
  const char *bad[] = {"mem", "--dp", "0", NULL};
  assert_int_equal(run_out(bad, out), 2);
  const char *many[] = {"mem", "--model", "llama-1b", "--pp", "25", NULL};
  assert_int_equal(run_out(many, out), 2);
  /* --chunk-size (Gemini): the ranks together hold exactly what per-tensor ZeRO-3's ranks hold (elementwise
   * states over the shards; 8-bit blocks counted on every rank holding elements of them, as distributed/
   * keeps them), one rank holding at least the mean; with --zero 2: refused */
  const char *z3[] = {"mem", "--model", "llama-1b", "--dp", "8", "--zero", "3", NULL};
  const char *gem[] = {"mem", "--model", "llama-1b", "--dp", "8", "--chunk-size", "33554432", NULL};
  assert_int_equal(run_out(z3, out), 0);
  char *tz = slurp(out);
  assert_int_equal(run_out(gem, out), 0);
  char *tg = slurp(out);
  static const char *const gopts[] = {"adamw", "adamw8bit", "came"};
  for (int k = 0; k < 3; k++) {
    char key[64], name[64];
    snprintf(key, sizeof key, "| %s | ", gopts[k]);
    const char *r = strstr(tg, key);
    double v[6], mz, az, rz;
    int pz, oz;
    if (!r || sscanf(r, "| %63s | %lf | %lf | %lf | %lf | %lf | %lf |", name, &v[0], &v[1], &v[2], &v[3], &v[4],
                     &v[5]) != 7)
      fail_msg("mem --chunk-size: no row for %s:\n%s", gopts[k], tg);
    mem_row(tz, gopts[k], &pz, &oz, &rz, &mz, &az);
    if (v[5] != az) fail_msg("%s: gemini's ranks hold %.0f state bytes, zero 3's %.0f", gopts[k], v[5], az);
    if (!(v[4] >= 1.0)) fail_msg("%s: max / mean %.3f", gopts[k], v[4]);
  }
  free(tz);
  free(tg);
  const char *gz2[] = {"mem", "--model", "llama-1b", "--zero", "2", "--chunk-size", "1000", NULL};
  assert_int_equal(run_out(gz2, out), 2);
}

static void test_lisa_layers_from_names(void **st) {
  (void)st;
  const char *names[5] = {"model.embed", "model.layers.0.w", "model.layers.1.w", "model.layers.2.w",
                          "model.layers.10.w"};
  const int layers[5] = {-1, 0, 1, 2, 10};
  char pfile[600], out[600], key[128];
  snprintf(pfile, sizeof pfile, "%s/lisa_in.safetensors", dir);
  snprintf(out, sizeof out, "%s/lisa_out.safetensors", dir);
  dopt_st_writer *w;
  assert_ok(dopt_st_writer_create(&w));
  float init[5][12], grads[4][5][12];
  int64_t shape[2] = {3, 4};
  uint64_t seed = 5;
  for (int i = 0; i < 5; i++) {
    for (int k = 0; k < 12; k++) init[i][k] = (float)dt_rand_normal(&seed);
    snprintf(key, sizeof key, "init/%s", names[i]);
    assert_ok(dopt_st_writer_add(w, key, DOPT_F32, 2, shape, init[i]));
    for (int t = 0; t < 4; t++) {
      for (int k = 0; k < 12; k++) grads[t][i][k] = (float)dt_rand_normal(&seed);
      snprintf(key, sizeof key, "grad/%d/%s", t + 1, names[i]);
      assert_ok(dopt_st_writer_add(w, key, DOPT_F32, 2, shape, grads[t][i]));
    }
  }
  assert_ok(dopt_st_writer_save(w, pfile));
  dopt_st_writer_free(w);
  const char *hp = "inner=adamw,n_layers=1,interval=2,seed=4,lr=0.01";
  const char *args[] = {"run", "--params", pfile, "--optimizer", "lisa", "--hparams", hp, "--out", out, "--quiet", NULL};
  assert_int_equal(run(args), 0);
  dopt_optim *o;
  assert_ok(dopt_optim_create("lisa", hp, &o));
  for (int i = 0; i < 5; i++) {
    dopt_param_config pc = DOPT_PARAM_CONFIG_INIT;
    pc.name = names[i];
    pc.ndim = 2;
    pc.shape[0] = 3;
    pc.shape[1] = 4;
    pc.data = init[i];
    pc.layer = layers[i];
    assert_ok(dopt_optim_add_param(o, 0, &pc, NULL));
  }
  for (int t = 0; t < 4; t++) {
    const float *g[5] = {grads[t][0], grads[t][1], grads[t][2], grads[t][3], grads[t][4]};
    assert_ok(dopt_optim_step(o, g));
  }
  dopt_st_file *res;
  assert_ok(dopt_st_load(out, &res));
  int stepped = 0;
  for (int i = 0; i < 5; i++) {
    dopt_st_tensor t;
    snprintf(key, sizeof key, "param/%s", names[i]);
    if (dopt_st_find(res, key, &t) != DOPT_OK) assert_ok(dopt_st_find(res, names[i], &t));
    assert_memory_equal(t.data, init[i], sizeof init[i]);
    int64_t s;
    assert_ok(dopt_optim_get_step(o, i, &s));
    if (i == 0) assert_true(s == 4);
    else stepped += s > 0;
  }
  assert_true(stepped >= 1 && stepped <= 2); /* one layer per interval, two intervals */
  dopt_st_free(res);
  dopt_optim_destroy(o);
}

/* --save/--save-every/--resume: a run resumed from any generation writes the very file an uninterrupted run writes
 * (LISA around GaLore: the layer schedule and the projector refresh continue where they stopped). */
static int same_bytes(const char *a, const char *b) {
  FILE *fa = fopen(a, "rb"), *fb = fopen(b, "rb");
  int same = fa && fb;
  while (same) {
    int x = fgetc(fa), y = fgetc(fb);
    same = x == y;
    if (x == EOF || y == EOF) break;
  }
  if (fa) fclose(fa);
  if (fb) fclose(fb);
  return same;
}

/* --threads: run writes the same bytes at 1 and 3 threads on a parameter the
 * reference splits (300 x 300 = 90 000 elements: two 32768+ pieces at 3 threads);
 * bad counts are usage errors; bench prints a minimum-traffic row and %floor
 * for every registered optimizer (no "?") and both floors. */
static void test_threads_options(void **st) {
  (void)st;
  char in[600], o1[600], o3[600], txt[600];
  snprintf(in, sizeof in, "%s/big.safetensors", dir);
  snprintf(o1, sizeof o1, "%s/big1.safetensors", dir);
  snprintf(o3, sizeof o3, "%s/big3.safetensors", dir);
  snprintf(txt, sizeof txt, "%s/bench.txt", dir);
  enum { H = 300, W = 300 };
  float *v = malloc(H * W * sizeof *v);
  assert_non_null(v);
  dopt_st_writer *w;
  assert_ok(dopt_st_writer_create(&w));
  const int64_t shape[2] = {H, W};
  uint64_t s = 5;
  for (int k = 0; k < H * W; k++) v[k] = (float)dt_rand_normal(&s);
  assert_ok(dopt_st_writer_add(w, "w", DOPT_F32, 2, shape, v));
  for (int t = 1; t <= 3; t++) {
    char name[32];
    snprintf(name, sizeof name, "grad/%d/w", t);
    for (int k = 0; k < H * W; k++) v[k] = (float)(dt_rand_normal(&s) * 1e-2);
    assert_ok(dopt_st_writer_add(w, name, DOPT_F32, 2, shape, v));
  }
  assert_ok(dopt_st_writer_save(w, in));
  dopt_st_writer_free(w);
  free(v);
  const char *one[] = {"run", "--params", in, "--optimizer", "adafactor", "--threads", "1", "--out", o1, "--quiet", NULL};
  const char *three[] = {"run", "--params", in, "--optimizer", "adafactor", "--threads", "3", "--out", o3, "--quiet", NULL};
  assert_int_equal(run(one), 0);
  assert_int_equal(run(three), 0);
  if (!same_bytes(o1, o3)) fail_msg("run --threads 3 wrote other bytes than --threads 1");
  const char *zero[] = {"run", "--params", in, "--optimizer", "adamw", "--threads", "0", "--out", o1, NULL};
  expect_usage_error(zero, "--threads '0'", o1);
  const char *bench[] = {"bench", "--size", "64x64", "--iters", "1", "--warmup", "1", "--threads", "2", NULL};
  assert_int_equal(run_out(bench, txt), 0);
  char *b = slurp(txt);
  if (strstr(b, " ?")) fail_msg("bench printed '?':\n%s", b);
  for (int i = 0; i < dopt_optim_registry_count(); i++) {
    char key[64];
    snprintf(key, sizeof key, "\n%s ", dopt_optim_registry_name(i));
    const char *row = strstr(b, key);
    const char *eol = row ? strchr(row + 1, '\n') : NULL;
    const char *pct = row ? strchr(row + 1, '%') : NULL;
    if (!row || !pct || (eol && pct > eol)) fail_msg("bench: no %%floor for %s:\n%s", dopt_optim_registry_name(i), b);
  }
  if (!strstr(b, "on 2 threads") || !strstr(b, "on 1 thread ")) fail_msg("bench: both floors expected:\n%s", b);
  free(b);
  /* --galore: a row per inner galore can wrap (not the GaLore forms, not LISA), each with both ratios */
  const char *gal[] = {"bench", "--size", "64x64", "--iters", "1", "--warmup", "1", "--galore", "8", NULL};
  assert_int_equal(run_out(gal, txt), 0);
  b = slurp(txt);
  const char *want[] = {"\nadamw ", "\nadafactor ", "\ncame ", "\nlamb ", "\nadamw8bit ", NULL};
  for (int i = 0; want[i]; i++) {
    const char *row = strstr(b, want[i]);
    const char *x1 = row ? strchr(row + 1, 'x') : NULL, *eol = row ? strchr(row + 1, '\n') : NULL;
    if (!row || !x1 || !strchr(x1 + 1, 'x') || strchr(x1 + 1, 'x') > eol) fail_msg("bench --galore: row%s\n%s", want[i], b);
  }
  if (strstr(b, "\nlisa ") || strstr(b, "\ngalore_adamw ")) fail_msg("bench --galore: a row for a wrapper:\n%s", b);
  free(b);
  const char *galbad[] = {"bench", "--galore", "8", "--optimizer", "adamw", NULL};
  assert_int_equal(run_out(galbad, txt), 2);
  const char *bad[] = {"bench", "--threads", "257", NULL};
  assert_int_equal(run_out(bad, txt), 2);
}

static void test_checkpoint_resume(void **st) {
  (void)st;
  char full[600], res[600], ck[600], gen[700];
  snprintf(full, sizeof full, "%s/ck_full.safetensors", dir);
  snprintf(res, sizeof res, "%s/ck_res.safetensors", dir);
  snprintf(ck, sizeof ck, "%s/ck", dir);
  const char *hp = "inner=galore_adamw,n_layers=1,interval=3,rank=2,update_proj_gap=4,lr=1e-2";
  const char *a1[] = {"run", "--params", inputs, "--optimizer", "lisa", "--hparams", hp, "--out", full, "--quiet", NULL};
  assert_int_equal(run(a1), 0);
  const char *a2[] = {"run", "--params", inputs, "--optimizer", "lisa", "--hparams", hp, "--steps", "12",
                      "--save", ck, "--save-every", "5", "--quiet", NULL};
  assert_int_equal(run(a2), 0);
  const char *gens[] = {"step-000000005", "step-000000010", "step-000000012", NULL};
  for (int k = 0; gens[k]; k++) {
    snprintf(gen, sizeof gen, "%s/%s/index.json", ck, gens[k]);
    if (access(gen, F_OK) != 0) fail_msg("no generation %s", gen);
  }
  const char *a3[] = {"run", "--params", inputs, "--optimizer", "lisa", "--hparams", hp, "--resume", ck,
                      "--out", res, "--quiet", NULL};
  assert_int_equal(run(a3), 0);
  if (!same_bytes(full, res)) fail_msg("resumed from %s/latest: output differs from the uninterrupted run", ck);
  snprintf(gen, sizeof gen, "%s/step-000000005", ck);
  unlink(res);
  const char *a4[] = {"run", "--params", inputs, "--optimizer", "lisa", "--hparams", hp, "--resume", gen,
                      "--out", res, "--quiet", NULL};
  assert_int_equal(run(a4), 0);
  if (!same_bytes(full, res)) fail_msg("resumed from %s: output differs from the uninterrupted run", gen);
  /* refusals: other hyperparameters, a step beyond --steps, --save-every alone */
#define ARGS(...) ((const char *const[]){"run", __VA_ARGS__, NULL})
  expect_usage_error(ARGS("--params", inputs, "--optimizer", "lisa", "--hparams",
                          "inner=galore_adamw,n_layers=1,interval=3,rank=2,update_proj_gap=5,lr=1e-2", "--resume", ck,
                          "--out", res),
                     "hyperparameter update_proj_gap is 4 in the checkpoint, 5 in the optimizer", res);
  expect_usage_error(ARGS("--params", inputs, "--optimizer", "lisa", "--hparams", hp, "--resume", ck, "--steps", "11",
                          "--out", res),
                     "the checkpoint is at step 12, beyond the last step 11", res);
  expect_usage_error(ARGS("--params", inputs, "--optimizer", "adamw", "--save-every", "2", "--out", res),
                     "--save-every needs --save", res);
  expect_usage_error(ARGS("--params", inputs, "--optimizer", "adamw", "--resume", dir, "--out", res), "not a checkpoint",
                     res);
  /* a hand-edited global_step (the loop's clock) that disagrees with the steps taken and skipped: refused, it
   * would resume another clock (index.json stays well-formed: 7 >= 5 + 0) */
  snprintf(gen, sizeof gen, "%s/step-000000005/index.json", ck);
  FILE *f = fopen(gen, "rb");
  assert_non_null(f);
  static char text[1 << 20];
  size_t n = fread(text, 1, sizeof text - 1, f);
  fclose(f);
  text[n] = '\0';
  char *at = strstr(text, "\"global_step\":\t5,");
  if (!at) fail_msg("test bug: no global_step 5 in %s", gen);
  at[15] = '7';
  f = fopen(gen, "wb");
  fwrite(text, 1, n, f);
  fclose(f);
  snprintf(gen, sizeof gen, "%s/step-000000005", ck);
  expect_usage_error(ARGS("--params", inputs, "--optimizer", "lisa", "--hparams", hp, "--resume", gen, "--out", res),
                     "index.json says global_step 7 but optimizer_steps 5 + skipped_steps 0 = 5", res);
#undef ARGS
}

/* Overflowing rows (finite gradients ~3e20 whose squares overflow fp32): the
 * factored optimizers' parameters turn NaN. Under the NaN policy two NaNs are
 * equal whatever their bits, so compare says EQUIVALENT and counts them on a
 * line of their own (docs/nan-policy.md); the reference and every layout see
 * the NaNs in the same places. */
static void test_compare_overflow_nan(void **st) {
  (void)st;
  char trace[600], out[600];
  snprintf(trace, sizeof trace, "%s/overflow.safetensors", dir);
  snprintf(out, sizeof out, "%s/overflow.txt", dir);
  /* w [37, 23] column-parallel, v [29], o [19, 37] row-parallel; 4 shards x 5 steps */
  static const char *const names[3] = {"w", "v", "o"};
  static const int64_t shapes[3][2] = {{37, 23}, {29, 1}, {19, 37}};
  static const int nd[3] = {2, 1, 2};
  static float buf[37 * 37];
  uint64_t z = 99;
  dopt_st_writer *wr;
  assert_ok(dopt_st_writer_create(&wr));
  char key[64];
  for (int t = 0; t <= 5; t++)
    for (int r = 0; r < (t ? 4 : 1); r++)
      for (int p = 0; p < 3; p++) {
        const int rows = (int)shapes[p][0], cols = nd[p] == 2 ? (int)shapes[p][1] : 1;
        for (int k = 0; k < rows * cols; k++) buf[k] = (float)(dt_rand_normal(&z) * (t ? 1.0 : 0.5));
        if (t >= 2 && nd[p] == 2) /* one row of each shard overflows when squared */
          for (int c = 0; c < cols; c++) buf[((t * 7 + r * 5) % rows) * cols + c] *= 3e20f;
        if (t) snprintf(key, sizeof key, "grad/%d/%d/%s", t, r, names[p]);
        else snprintf(key, sizeof key, "init/%s", names[p]);
        assert_ok(dopt_st_writer_add(wr, key, DOPT_F32, nd[p], shapes[p], buf));
      }
  assert_ok(dopt_st_writer_meta(wr, "params", "w,v,o"));
  assert_ok(dopt_st_writer_meta(wr, "steps", "5"));
  assert_ok(dopt_st_writer_meta(wr, "shards", "4"));
  assert_ok(dopt_st_writer_meta(wr, "tp_roles", "w:column,v:column,o:row"));
  assert_ok(dopt_st_writer_save(wr, trace));
  dopt_st_writer_free(wr);
  const char *layouts[][8] = {{"--plugin", "hybrid", "--tp", "2", "--dp", "2", "--zero", "2"},
                              {"--plugin", "fsdp", "--tp", "4", "--dp", "1", "--zero", "3"}};
  for (int i = 0; i < 2; i++) {
    const char *const *l = layouts[i];
    const char *args[] = {"compare", "--optimizer", "came", "--hparams", "lr=2e-4", l[0], l[1], l[2], l[3], l[4],
                          l[5], l[6], l[7], "--trace", trace, "--steps", "5", NULL};
    int rc = run_out(args, out);
    char *txt = slurp(out);
    if (rc != 0 || !strstr(txt, "verdict: EQUIVALENT") || !strstr(txt, "NaN on both sides (equal under the NaN policy): "))
      fail_msg("came %s on overflowing rows: exit %d\n%s", l[1], rc, txt);
    free(txt);
  }
}

/* A trace's metadata is checked against its tensors before anything is sized by it: a shard count
 * the file does not hold (the fuzzer's 2e9 shards sized a 128 GB buffer), counts that are not whole
 * numbers, a missing gradient, a gradient of the wrong size: one line each, exit 2, no output. */
static void test_compare_trace_metadata(void **st) {
  (void)st;
  char trace[600], json[600];
  snprintf(trace, sizeof trace, "%s/meta.safetensors", dir);
  snprintf(json, sizeof json, "%s/meta.json", dir);
  static const int64_t shape[1] = {16};
  static const int64_t shape15[1] = {15};
  static float buf[16];
  /* 2 steps x 2 shards of w [16]; variant v changes one thing */
  static const struct {
    const char *shards, *steps, *want;
    int drop_last, short_last;
  } v[] = {
      {"2", "2", NULL, 0, 0},
      {"2000000000", "2", "2000000000 shards x 2 steps x 1 parameters need 4000000000 gradient tensors, the file holds 5",
       0, 0},
      {"2x", "2", "metadata shards='2x' (a whole number in 1..2147483647)", 0, 0},
      {"2", "-1", "metadata steps='-1' (a whole number in 1..2147483647)", 0, 0},
      {"2", "99999999999", "metadata steps='99999999999'", 0, 0},
      {"2", "2", "'grad/2/1/w'", 1, 0},
      {"2", "2", "tensor 'grad/2/1/w' has 15 elements, its parameter 16", 0, 1},
  };
  for (size_t c = 0; c < sizeof v / sizeof v[0]; c++) {
    dopt_st_writer *wr;
    assert_ok(dopt_st_writer_create(&wr));
    for (int k = 0; k < 16; k++) buf[k] = 0.01f * (float)(k + 1);
    assert_ok(dopt_st_writer_add(wr, "init/w", DOPT_F32, 1, shape, buf));
    for (int t = 1; t <= 2; t++)
      for (int r = 0; r < 2; r++) {
        const int last = t == 2 && r == 1;
        if (last && v[c].drop_last) continue;
        char key[64];
        snprintf(key, sizeof key, "grad/%d/%d/w", t, r);
        assert_ok(dopt_st_writer_add(wr, key, DOPT_F32, 1, last && v[c].short_last ? shape15 : shape, buf));
      }
    if (v[c].drop_last) { /* the same tensor count as the good trace: only the key is missing */
      assert_ok(dopt_st_writer_add(wr, "grad/9/9/w", DOPT_F32, 1, shape, buf));
    }
    assert_ok(dopt_st_writer_meta(wr, "params", "w"));
    assert_ok(dopt_st_writer_meta(wr, "steps", v[c].steps));
    assert_ok(dopt_st_writer_meta(wr, "shards", v[c].shards));
    assert_ok(dopt_st_writer_save(wr, trace));
    dopt_st_writer_free(wr);
    const char *args[] = {"compare", "--optimizer", "adamw", "--plugin", "ddp", "--dp", "2", "--trace", trace,
                          "--steps", "2", "--quiet", "--json", json, NULL};
    if (!v[c].want) {
      int rc = run(args);
      if (rc != 0) fail_msg("the good trace: exit %d", rc);
    } else {
      expect_usage_error(args, v[c].want, json);
    }
  }
}

/* ---- compare: plugins imply their layout; --sweep (group "layouts") ---------------------------------------- */

/* Runs compare with args; expects exit 0 and the header's layout "PLUGIN tpT×dpD×zeroZ" (and, with a
 * checkpoint, "resumed after step K in ..."). */
static void expect_layout(const char *const *args, const char *want, const char *want_resume) {
  char out[600];
  snprintf(out, sizeof out, "%s/layout.txt", dir);
  int rc = run_out(args, out);
  char *txt = slurp(out), *err = slurp(errfile);
  if (rc != 0 || !txt || !strstr(txt, want) || (want_resume && !strstr(txt, want_resume)))
    fail_msg("%s %s %s %s: rc %d, want '%s' / '%s' in: %s (stderr: %s)", args[1], args[2], args[3], args[4], rc, want,
             want_resume ? want_resume : "", txt ? txt : "", err ? err : "");
  free(txt);
  free(err);
}

/* Every plugin alone runs in the layout it implies, whatever the order of the options; an explicit value the
 * plugin allows is kept; a value it does not allow is one line naming both options, the values and what the
 * plugin implies. The same through --resume-* and the YAML keys. */
static void test_compare_plugin_implies(void **st) {
  (void)st;
  char json[600], yaml[600];
  snprintf(json, sizeof json, "%s/implies.json", dir);
  snprintf(yaml, sizeof yaml, "%s/implies.yaml", dir);
#define C(...) ((const char *const[]){"compare", "--optimizer", "adamw", "--steps", "2", "--quiet", __VA_ARGS__, NULL})
  /* alone */
  expect_layout(C("--plugin", "ddp"), "| ddp tp1\xC3\x97" "dp2\xC3\x97zero0 |", NULL);
  expect_layout(C("--plugin", "zero"), "| zero tp1\xC3\x97" "dp2\xC3\x97zero1 |", NULL);
  expect_layout(C("--plugin", "hybrid"), "| hybrid tp2\xC3\x97" "dp2\xC3\x97zero2 |", NULL);
  expect_layout(C("--plugin", "fsdp"), "| fsdp tp2\xC3\x97" "dp2\xC3\x97zero3 |", NULL);
  expect_layout(C("--zero", "3"), "| fsdp tp2\xC3\x97" "dp2\xC3\x97zero3 |", NULL); /* no plugin given: fsdp */
  /* explicit compatible values are kept, in either order */
  expect_layout(C("--plugin", "zero", "--zero", "2"), "| zero tp1\xC3\x97" "dp2\xC3\x97zero2 |", NULL);
  expect_layout(C("--zero", "2", "--plugin", "zero"), "| zero tp1\xC3\x97" "dp2\xC3\x97zero2 |", NULL);
  expect_layout(C("--tp", "1", "--plugin", "fsdp", "--dp", "3"), "| fsdp tp1\xC3\x97" "dp3\xC3\x97zero3 |", NULL);
  expect_layout(C("--plugin", "hybrid", "--zero", "0", "--tp", "3"), "| hybrid tp3\xC3\x97" "dp2\xC3\x97zero0 |", NULL);
  expect_layout(C("--tp", "1", "--zero", "0", "--plugin", "ddp", "--dp", "1"), "| ddp tp1\xC3\x97" "dp1\xC3\x97zero0 |",
                NULL);
  /* contradictions, in either order */
  expect_usage_error(C("--plugin", "ddp", "--zero", "2", "--json", json),
                     "--plugin ddp contradicts --zero 2: plugin ddp implies zero 0", json);
  expect_usage_error(C("--zero", "2", "--plugin", "ddp", "--json", json),
                     "--plugin ddp contradicts --zero 2: plugin ddp implies zero 0", json);
  expect_usage_error(C("--plugin", "ddp", "--tp", "2", "--json", json),
                     "--plugin ddp contradicts --tp 2: plugin ddp implies tp 1", json);
  expect_usage_error(C("--plugin", "fsdp", "--zero", "1", "--json", json),
                     "--plugin fsdp contradicts --zero 1: plugin fsdp implies zero 3", json);
  expect_usage_error(C("--tp", "2", "--plugin", "zero", "--json", json),
                     "--plugin zero contradicts --tp 2: plugin zero implies tp 1", json);
  expect_usage_error(C("--plugin", "zero", "--zero", "0", "--json", json),
                     "--plugin zero contradicts --zero 0: plugin zero implies zero 1 (allowed: zero 1 or 2", json);
  expect_usage_error(C("--plugin", "hybrid", "--zero", "3", "--json", json),
                     "--plugin hybrid contradicts --zero 3: plugin hybrid implies zero 2", json);
  /* the resume layout: what the resume plugin implies, else the first layout's */
  expect_layout(C("--steps", "4", "--checkpoint-at", "2", "--resume-plugin", "ddp"), "| hybrid tp2\xC3\x97",
                "resumed after step 2 in ddp tp1\xC3\x97" "dp2\xC3\x97zero0 |");
  expect_layout(C("--steps", "4", "--plugin", "ddp", "--checkpoint-at", "2", "--resume-plugin", "fsdp"), "| ddp tp1",
                "resumed after step 2 in fsdp tp1\xC3\x97" "dp2\xC3\x97zero3 |");
  expect_layout(C("--steps", "4", "--resume-zero", "3", "--checkpoint-at", "2"), "| hybrid tp2",
                "resumed after step 2 in fsdp tp2\xC3\x97" "dp2\xC3\x97zero3 |");
  expect_layout(C("--steps", "4", "--resume-plugin", "zero", "--checkpoint-at", "2", "--resume-dp", "1"), "| hybrid",
                "resumed after step 2 in zero tp1\xC3\x97" "dp1\xC3\x97zero2 |"); /* the first's zero 2: allowed */
  /* a plugin without stages resumes with pp 1 (as one without experts with ep 1), not 'pp=3 needs plugin hybrid' */
  expect_layout(C("--steps", "4", "--plugin", "hybrid", "--pp", "3", "--tp", "1", "--zero", "1", "--checkpoint-at", "2",
                  "--resume-plugin", "gemini"),
                "| hybrid pp3", "resumed after step 2 in gemini tp1\xC3\x97" "dp2\xC3\x97zero3");
  expect_usage_error(C("--steps", "4", "--checkpoint-at", "2", "--resume-zero", "1", "--resume-plugin", "fsdp", "--json",
                       json),
                     "--resume-plugin fsdp contradicts --resume-zero 1: plugin fsdp implies zero 3", json);
  expect_usage_error(C("--steps", "4", "--checkpoint-at", "2", "--resume-plugin", "ddp", "--resume-tp", "2", "--json",
                       json),
                     "--resume-plugin ddp contradicts --resume-tp 2: plugin ddp implies tp 1", json);
  /* YAML: the same implications, spelled as keys; the command line's values win over the file's */
  FILE *f = fopen(yaml, "w");
  fputs("plugin: {type: zero}\n", f);
  fclose(f);
  expect_layout(C("--config", yaml), "| zero tp1\xC3\x97" "dp2\xC3\x97zero1 |", NULL);
  expect_layout(C("--config", yaml, "--zero", "2"), "| zero tp1\xC3\x97" "dp2\xC3\x97zero2 |", NULL);
  expect_layout(C("--config", yaml, "--plugin", "fsdp"), "| fsdp tp2\xC3\x97" "dp2\xC3\x97zero3 |", NULL);
  f = fopen(yaml, "w");
  fputs("plugin: {type: ddp, zero: 2}\n", f);
  fclose(f);
  expect_usage_error(C("--config", yaml, "--json", json), "plugin.type ddp contradicts plugin.zero 2", json);
  expect_usage_error(C("--config", yaml, "--plugin", "fsdp", "--json", json), "--plugin fsdp contradicts plugin.zero 2",
                     json);
  f = fopen(yaml, "w");
  fputs("checkpoint: {at: 1, resume: {type: ddp}}\n", f);
  fclose(f);
  expect_layout(C("--config", yaml), "| hybrid tp2", "resumed after step 1 in ddp tp1\xC3\x97" "dp2\xC3\x97zero0 |");
#undef C
}

/* Occurrences of needle in s. */
static int count_of(const char *s, const char *needle) {
  int n = 0;
  for (const char *p = s; (p = strstr(p, needle)) != NULL; p += strlen(needle)) n++;
  return n;
}

/* --sweep: every tp x dp x zero against the reference; a grid of verdicts, "N of M layouts bitwise", exit 0 only
 * when all are; JSON with schema_version; owner-mode optimizers and defaults (CAME's lr) too; a ring-order fp32
 * dp sum diverges at dp 3 (exit 1, the cells name the step); a trace skips the dp its shards cannot split; bad
 * bounds and options the sweep replaces are one-line errors. */
static void test_compare_sweep(void **st) {
  (void)st;
  char out[600], json[600], yaml[600], trace[600];
  snprintf(out, sizeof out, "%s/sweep.txt", dir);
  snprintf(json, sizeof json, "%s/sweep.json", dir);
  snprintf(yaml, sizeof yaml, "%s/sweep.yaml", dir);
  snprintf(trace, sizeof trace, "%s/datasets/trace/digits_mlp.safetensors", dt_source_dir());
  const char *ok[] = {"compare", "--sweep", "--optimizer", "adamw", "--max-dp", "2", "--max-tp", "2", "--steps", "3",
                      "--quiet", "--json", json, NULL};
  assert_int_equal(run_out(ok, out), 0);
  char *txt = slurp(out);
  if (!strstr(txt, "  zero 0") || !strstr(txt, "  zero 3\n") || !strstr(txt, "\n1\xC3\x97" "1 ") ||
      !strstr(txt, "\n2\xC3\x97" "2 ") || strstr(txt, "\n3\xC3\x97") || count_of(txt, "\xE2\x9C\x94") != 16 ||
      !strstr(txt, "\n16 of 16 layouts bitwise\n"))
    fail_msg("sweep 2 x 2: %s", txt);
  free(txt);
  txt = slurp(json);
  assert_non_null(txt);
  if (system("command -v python3 >/dev/null 2>&1") == 0) {
    char cmd[1400];
    snprintf(cmd, sizeof cmd,
             "python3 -c \"import sys, json; d = json.load(open(sys.argv[1])); L = d['layouts']; "
             "assert d['schema_version'] == 1 and d['kind'] == 'sweep' and len(L) == 16; "
             "assert sorted((l['tp'], l['dp'], l['zero']) for l in L) == [(t, p, z) for t in (1, 2) for p in (1, 2) "
             "for z in range(4)]; assert all(l['result'] == 'bitwise' and l['digest'] == l['reference_digest'] "
             "for l in L); assert d['summary']['bitwise'] == 16 and d['summary']['all_equivalent']\" %s",
             json);
    assert_int_equal(system(cmd), 0);
  } else if (!strstr(txt, "\"schema_version\":\t1") || count_of(txt, "\"result\":\t\"bitwise\"") != 16) {
    fail_msg("sweep JSON: %s", txt);
  }
  free(txt);
  /* --max-pp 3: pipelined rows pp x tp x dp (hybrid at zero 0-2; zero 3 is fsdp, which has no stages: skipped,
   * said so), every run bitwise; --pp itself is not a sweep option */
  const char *pp[] = {"compare", "--sweep", "--optimizer", "muon", "--max-pp", "3", "--max-tp", "1", "--max-dp", "2",
                      "--steps", "2", "--quiet", NULL};
  assert_int_equal(run_out(pp, out), 0);
  txt = slurp(out);
  if (!strstr(txt, "\n3\xC3\x97" "1\xC3\x97" "2 ") || !strstr(txt, "\n20 of 20 layouts bitwise (4 skipped)\n") ||
      !strstr(txt, "pp 3 \xC3\x97 tp 1 \xC3\x97 dp 2 \xC3\x97 zero 3 (fsdp): skipped"))
    fail_msg("sweep --max-pp 3: %s", txt);
  free(txt);
  const char *ppx[] = {"compare", "--sweep", "--pp", "2", "--steps", "2", NULL};
  assert_int_equal(run_out(ppx, out), 2);
  /* owner mode (GaLore: whole tensors on one rank) with its registry example, and CAME without --hparams */
  const char *owner[] = {"compare", "--sweep", "--optimizer", "galore_adamw", "--hparams", "rank=4,update_proj_gap=2",
                         "--max-tp", "2", "--max-dp", "2", "--steps", "3", "--quiet", NULL};
  assert_int_equal(run_out(owner, out), 0);
  txt = slurp(out);
  if (!strstr(txt, "\n16 of 16 layouts bitwise\n")) fail_msg("sweep galore_adamw: %s", txt);
  free(txt);
  const char *came[] = {"compare", "--sweep", "--optimizer", "came", "--max-tp", "1", "--max-dp", "2", "--steps", "2",
                        "--quiet", NULL};
  assert_int_equal(run_out(came, out), 0);
  txt = slurp(out);
  if (!strstr(txt, "sweep: came lr=") || !strstr(txt, "\n8 of 8 layouts bitwise\n")) fail_msg("sweep came: %s", txt);
  free(txt);
  /* a real divergence: the fp32 dp sum in a ring's order at dp 3 */
  const char *ring[] = {"compare", "--sweep", "--optimizer", "adamw", "--max-tp", "1", "--max-dp", "3", "--steps", "4",
                        "--ring-order", "--dp-sum", "rank-order", "--quiet", NULL};
  assert_int_equal(run_out(ring, out), 1);
  txt = slurp(out);
  const char *row3 = strstr(txt, "\n1\xC3\x97" "3 ");
  if (!row3 || count_of(row3, "\xE2\x9C\x97 step ") != 4 || count_of(txt, "\xE2\x9C\x94") != 8 ||
      !strstr(txt, "tp 1 \xC3\x97 dp 3 \xC3\x97 zero 0 (ddp): diverged at step") ||
      !strstr(txt, "\n8 of 12 layouts bitwise\n"))
    fail_msg("sweep ring order: %s", txt);
  free(txt);
  /* a trace: dp 3 does not divide its 4 shards per step: skipped and said so */
  const char *tr[] = {"compare", "--sweep", "--trace", trace, "--optimizer", "adamw", "--max-tp", "1", "--max-dp", "3",
                      "--steps", "2", "--quiet", NULL};
  assert_int_equal(run_out(tr, out), 0);
  txt = slurp(out);
  if (count_of(txt, "- skipped") != 4 || !strstr(txt, "dp 3 does not divide the 4 shards") ||
      !strstr(txt, "\n8 of 8 layouts bitwise (4 skipped)\n"))
    fail_msg("sweep trace: %s", txt);
  free(txt);
  /* YAML: compare.sweep, max_tp, max_dp */
  FILE *f = fopen(yaml, "w");
  fputs("optimizer: {type: adafactor}\nsteps: 2\ncompare: {sweep: true, max_tp: 1, max_dp: 2}\n", f);
  fclose(f);
  const char *cfg[] = {"compare", "--config", yaml, "--quiet", NULL};
  assert_int_equal(run_out(cfg, out), 0);
  txt = slurp(out);
  if (!strstr(txt, "sweep: adafactor") || !strstr(txt, "\n8 of 8 layouts bitwise\n")) fail_msg("sweep YAML: %s", txt);
  free(txt);
#define S(...) ((const char *const[]){"compare", __VA_ARGS__, "--json", json, NULL})
  expect_usage_error(S("--sweep", "--max-tp", "9"), "--max-tp '9': expected an integer in [1, 8]", json);
  expect_usage_error(S("--sweep", "--max-dp", "0"), "--max-dp '0': expected an integer in [1, 8]", json);
  expect_usage_error(S("--max-tp", "2"), "--max-tp/--max-dp/--max-pp only apply with --sweep", json);
  expect_usage_error(S("--sweep", "--tp", "2"), "--tp is not used with it", json);
  expect_usage_error(S("--plugin", "ddp", "--sweep"), "--plugin is not used with it", json);
  expect_usage_error(S("--sweep", "--matrix"), "--matrix and --sweep", json);
  expect_usage_error(S("--sweep", "--steps", "4", "--checkpoint-at", "2"), "--checkpoint-at", json);
  expect_usage_error(S("--sweep", "--optimizer", "adamx"), "'adamx'", json);
#undef S
}


/* ---- pipeline stages (--pp; docs/distributed.md "Pipeline stages") ---- */

/* Runs compare with args, expects exit 0 and a bitwise verdict whose digest equals the reference's; the
 * digest into hex. */
static void expect_bitwise(const char *const *args, const char *what, char hex[65]) {
  char out[600];
  snprintf(out, sizeof out, "%s/pp.txt", dir);
  const int rc = run_out(args, out);
  char *txt = slurp(out);
  if (rc != 0 || !txt || !strstr(txt, "verdict: EQUIVALENT (bitwise") || !strstr(txt, "(reference: equal)")) {
    char *err = slurp(errfile);
    fail_msg("%s: exit %d\n%s\n%s", what, rc, txt ? txt : "", err ? err : "");
  }
  digest_of(txt, hex);
  free(txt);
}

/* Every registered optimizer at pp 2 x tp 2 x dp 2 (zero 2), pp 3 x dp 2 (zero 1, 5 layers: 2 + 2 + 1 as
 * ColossalAI splits them) and pp 4 x tp 2 x dp 2 (zero 0, 16 ranks; 5 layers: 1 + 1 + 2 + 1), with clipping
 * that binds (the norm spans the stages), bf16 and accumulation in the last: bitwise the reference, and the
 * digest of each pipelined run equals the same tp x dp x zero run without stages. */
static void test_pp_every_optimizer(void **st) {
  (void)st;
  static const char *const opts[] = {"adamw", "adafactor", "came", "lamb", "adamw8bit", "galore_adamw",
                                     "galore_adamw8bit", "q_galore", "lisa", "galore", "muon"};
  static const char *const L[][8] = {{"--pp", "2", "--tp", "2", "--dp", "2", "--zero", "2"},
                                     {"--pp", "3", "--tp", "1", "--dp", "2", "--zero", "1"},
                                     {"--pp", "4", "--tp", "2", "--dp", "2", "--zero", "0"}};
  for (size_t k = 0; k < sizeof opts / sizeof opts[0]; k++)
    for (int l = 0; l < 3; l++) {
      if (!dt_subset_keep(0x7070 + k, l, 3)) continue; /* the sanitizer passes: a rotating subset */
      const char *extra = l == 2 ? "--bf16" : "--quiet";
      char what[160], hp[65], h1[65];
      snprintf(what, sizeof what, "%s pp %s tp %s dp %s zero %s", opts[k], L[l][1], L[l][3], L[l][5], L[l][7]);
      const char *pp[] = {"compare", "--optimizer", opts[k], "--model", "1mx5", "--steps", "3", "--accumulation",
                          l == 2 ? "2" : "1", "--max-grad-norm", "0.01", extra, "--quiet", L[l][0], L[l][1], L[l][2],
                          L[l][3], L[l][4], L[l][5], L[l][6], L[l][7], NULL};
      expect_bitwise(pp, what, hp);
      const char *flat[] = {"compare", "--optimizer", opts[k], "--model", "1mx5", "--steps", "3", "--accumulation",
                            l == 2 ? "2" : "1", "--max-grad-norm", "0.01", extra, "--quiet", L[l][2], L[l][3],
                            L[l][4], L[l][5], L[l][6], L[l][7], NULL};
      expect_bitwise(flat, what, h1);
      if (strcmp(hp, h1) != 0) fail_msg("%s: digest %s with stages, %s without", what, hp, h1);
    }
}

/* Stages under every plugin the library steps them with (compare allowed pp only with hybrid): fsdp (ZeRO 3, as
 * torchtitan's PP + FSDP), gemini (prime chunks), moe_hybrid (experts over ep, ColossalAI's pp_size), zero and
 * ddp; piecewise and owner-mode optimizers: each bitwise, with the digest of the same layout without stages; and a
 * resume from moe_hybrid with stages into fsdp with others, bitwise. */
static void test_pp_every_plugin(void **st) {
  (void)st;
  static const char *const L[][12] = {
      {"adamw", "--plugin", "fsdp", "--pp", "3", "--tp", "2", "--dp", "2", NULL},
      {"muon", "--plugin", "fsdp", "--pp", "2", "--tp", "1", "--dp", "2", NULL},
      {"galore_adamw", "--plugin", "gemini", "--pp", "3", "--tp", "1", "--dp", "2", "--chunk-size", "37", NULL},
      {"adafactor", "--plugin", "moe_hybrid", "--pp", "2", "--tp", "1", "--dp", "4", "--ep", "2", NULL},
      {"lamb", "--plugin", "zero", "--pp", "2", "--tp", "1", "--dp", "2", "--zero", "1", NULL},
      {"came", "--plugin", "ddp", "--pp", "3", "--tp", "1", "--dp", "2", NULL},
  };
  for (size_t l = 0; l < sizeof L / sizeof L[0]; l++) {
    if (!dt_subset_keep(0x7072, (int)l, (int)(sizeof L / sizeof L[0]))) continue;
    const char *args[32] = {"compare", "--optimizer", L[l][0], "--model", strcmp(L[l][2], "moe_hybrid") ? "1mx5" : "1mx5e4",
                            "--steps", "3", "--quiet"};
    int n = 8, m = 8;
    for (int i = 1; L[l][i]; i++) args[n++] = L[l][i];
    const char *flat[32];
    memcpy(flat, args, sizeof flat);
    for (int i = 1; L[l][i]; i++) /* the same layout without its stages */
      if (strcmp(L[l][i], "--pp") == 0) i++;
      else flat[m++] = L[l][i];
    flat[m] = NULL;
    args[n] = NULL;
    char what[200], hp[65], h1[65];
    snprintf(what, sizeof what, "%s %s pp %s", L[l][0], L[l][2], L[l][4]);
    expect_bitwise(args, what, hp);
    expect_bitwise(flat, what, h1);
    if (strcmp(hp, h1) != 0) fail_msg("%s: digest %s with stages, %s without", what, hp, h1);
  }
  char ck[600], a[65];
  snprintf(ck, sizeof ck, "%s/ppck_moe_fsdp", dir);
  const char *res[] = {"compare", "--optimizer", "adamw", "--model", "1mx5e4", "--steps", "4", "--quiet", "--plugin",
                       "moe_hybrid", "--pp", "2", "--tp", "1", "--dp", "2", "--ep", "2", "--zero", "1",
                       "--checkpoint-at", "2", "--checkpoint-dir", ck, "--resume-plugin", "fsdp", "--resume-pp", "3",
                       "--resume-ep", "1", NULL};
  expect_bitwise(res, "moe_hybrid pp 2 resumed in fsdp pp 3", a); /* ep 2 -> 1 regroups the experts' data */
}

/* Checkpoints resume across stage counts (pp 2 -> 1, 1 -> 4, 3 -> 2; the same dp: the uninterrupted run's
 * digest), piecewise and owner-mode optimizers. */
static void test_pp_resume(void **st) {
  (void)st;
  static const char *const opts[] = {"adafactor", "galore_adamw8bit", "lisa"};
  static const char *const R[][2] = {{"2", "1"}, {"1", "4"}, {"3", "2"}};
  for (int k = 0; k < 3; k++) {
    char want[65], hex[65], what[160], ck[600];
    const char *plain[] = {"compare", "--optimizer", opts[k], "--model", "1mx5", "--steps", "6", "--quiet", NULL};
    expect_bitwise(plain, opts[k], want);
    for (int r = 0; r < 3; r++) {
      if (!dt_subset_keep(0x7071 + (uint64_t)k, r, 3)) continue;
      snprintf(ck, sizeof ck, "%s/ppck%d_%d", dir, k, r);
      snprintf(what, sizeof what, "%s resumed pp %s -> %s", opts[k], R[r][0], R[r][1]);
      const char *args[] = {"compare", "--optimizer", opts[k], "--model", "1mx5", "--steps", "6", "--quiet",
                            "--pp", R[r][0], "--checkpoint-at", "3", "--checkpoint-dir", ck, "--resume-pp", R[r][1],
                            NULL};
      expect_bitwise(args, what, hex);
      if (strcmp(hex, want) != 0) fail_msg("%s: digest %s, uninterrupted %s", what, hex, want);
    }
  }
}

/* A non-finite gradient on one stage skips the step on every stage: layers.1.w (stage 1 of 2) is NaN at step
 * 2; both sides skip it and stay bitwise (a skip decided per stage would step stage 0 and diverge). */
static void test_pp_nonfinite_skip(void **st) {
  (void)st;
  char trace[600], out[600];
  snprintf(trace, sizeof trace, "%s/pp_nan.safetensors", dir);
  snprintf(out, sizeof out, "%s/pp_nan.txt", dir);
  static const char *const names[4] = {"emb", "layers.0.w", "layers.1.w", "head"};
  static const int64_t shape[2] = {6, 5};
  float buf[30];
  uint64_t z = 7;
  dopt_st_writer *wr;
  assert_ok(dopt_st_writer_create(&wr));
  char key[64];
  for (int t = 0; t <= 4; t++)
    for (int r = 0; r < (t ? 2 : 1); r++)
      for (int p = 0; p < 4; p++) {
        for (int k = 0; k < 30; k++) buf[k] = (float)dt_rand_normal(&z);
        if (t == 2 && p == 2 && r == 1) buf[7] = NAN;
        if (t) snprintf(key, sizeof key, "grad/%d/%d/%s", t, r, names[p]);
        else snprintf(key, sizeof key, "init/%s", names[p]);
        assert_ok(dopt_st_writer_add(wr, key, DOPT_F32, 2, shape, buf));
      }
  assert_ok(dopt_st_writer_meta(wr, "params", "emb,layers.0.w,layers.1.w,head"));
  assert_ok(dopt_st_writer_meta(wr, "steps", "4"));
  assert_ok(dopt_st_writer_meta(wr, "shards", "2"));
  assert_ok(dopt_st_writer_save(wr, trace));
  dopt_st_writer_free(wr);
  const char *args[] = {"compare", "--optimizer", "adamw", "--trace", trace, "--steps", "4", "--pp", "2", "--tp", "1",
                        "--dp", "2", "--zero", "1", NULL};
  const int rc = run_out(args, out);
  char *txt = slurp(out);
  if (rc != 0 || !txt || !strstr(txt, "verdict: EQUIVALENT (bitwise") || !strstr(txt, "skipped"))
    fail_msg("NaN on stage 1 at step 2: exit %d\n%s", rc, txt ? txt : "");
  free(txt);
}

/* A command line compare refuses: exit 2, one line on stderr naming the problem. */
typedef struct refusal {
  const char *args[16];
  const char *needle;
} refusal;

static void expect_refusals(const refusal *bad, size_t n, const char *tag) {
  char out[600];
  snprintf(out, sizeof out, "%s/%s_bad.txt", dir, tag);
  for (size_t k = 0; k < n; k++) {
    const int rc = run_out(bad[k].args, out);
    char *err = slurp(errfile);
    int lines = 0;
    for (const char *c = err ? err : ""; *c; c++) lines += *c == '\n';
    if (rc != 2 || lines != 1 || !strstr(err, bad[k].needle))
      fail_msg("%s case %zu: exit %d, %d lines: %s (want '%s')", tag, k, rc, lines, err ? err : "", bad[k].needle);
    free(err);
  }
}

/* Refusals, one line each: more stages than layers, a partition that does not add
 * up or names another number of stages. */
static void test_pp_bad_input(void **st) {
  (void)st;
  static const refusal bad[] = {
      {{"compare", "--model", "1mx5", "--pp", "6", "--tp", "1", "--dp", "1", "--steps", "1", NULL},
       "the model has 5 decoder layers"},
      {{"compare", "--model", "1mx5", "--pp", "2", "--layers-per-stage", "2,2", "--steps", "1", NULL},
       "4 layers in all, the model has 5"},
      {{"compare", "--model", "1mx5", "--pp", "2", "--layers-per-stage", "1,1,3", "--steps", "1", NULL},
       "3 stages given, pp=2"},
      {{"compare", "--pp", "2", "--layers-per-stage", "2,x", "--steps", "1", NULL}, "'2,x'"},
      /* said before any rank starts (no "rank 0:" prefix), for the resume layout too */
      {{"compare", "--model", "1mx5", "--pp", "2", "--checkpoint-at", "1", "--resume-pp", "6", "--steps", "3", NULL},
       "DOPT_ERR_INVALID_ARG: resume: pp=6: the model has 5 decoder layers"},
  };
  expect_refusals(bad, sizeof bad / sizeof bad[0], "pp");
}


/* ---- Gemini (--plugin gemini --chunk-size; docs/distributed.md "Gemini: chunked ZeRO") ---- */

/* Every registered optimizer under Gemini with chunks that divide nothing (--model 1mx5: 64 x 64 attention
 * blocks of 4096 elements, 64 x 192 MLP blocks, norms of 64): chunks of 5000 (each attention block alone with
 * a few norms, the MLP blocks larger than a chunk: their own) and 20011 (several tensors per chunk) over dp
 * 3 and 2 with tp 2, clipping; bitwise, with the digest of the same layout under fsdp (per-tensor ZeRO-3). */
static void test_gemini_every_optimizer(void **st) {
  (void)st;
  static const char *const opts[] = {"adamw", "adafactor", "came", "lamb", "adamw8bit", "galore_adamw",
                                     "galore_adamw8bit", "q_galore", "lisa", "galore", "muon"};
  static const char *const L[][5] = {{"1", "3", "5000", "--quiet", "1"}, {"2", "2", "20011", "--bf16", "2"}};
  for (size_t k = 0; k < sizeof opts / sizeof opts[0]; k++)
    for (int l = 0; l < 2; l++) {
      if (!dt_subset_keep(0x6e6e + k, l, 2)) continue; /* the sanitizer passes: a rotating subset */
      char what[160], hg[65], hf[65];
      snprintf(what, sizeof what, "%s gemini chunk %s tp %s dp %s", opts[k], L[l][2], L[l][0], L[l][1]);
      const char *gem[] = {"compare", "--optimizer", opts[k], "--model", "1mx5", "--steps", "3", "--max-grad-norm",
                           "0.01", "--accumulation", L[l][4], L[l][3], "--quiet", "--plugin", "gemini", "--tp", L[l][0],
                           "--dp", L[l][1], "--chunk-size", L[l][2], NULL};
      expect_bitwise(gem, what, hg);
      const char *fsdp[] = {"compare", "--optimizer", opts[k], "--model", "1mx5", "--steps", "3", "--max-grad-norm",
                            "0.01", "--accumulation", L[l][4], L[l][3], "--quiet", "--plugin", "fsdp", "--tp", L[l][0],
                            "--dp", L[l][1], NULL};
      expect_bitwise(fsdp, what, hf);
      if (strcmp(hg, hf) != 0) fail_msg("%s: digest %s, per-tensor ZeRO-3 %s", what, hg, hf);
    }
}

/* Checkpoints resume across chunk sizes and into and out of Gemini (the same dp: the uninterrupted run's
 * digest). */
static void test_gemini_resume(void **st) {
  (void)st;
  static const char *const opts[] = {"adafactor", "adamw8bit", "galore_adamw"};
  static const char *const R[][6] = {{"gemini", "5000", "gemini", "--resume-chunk-size", "20011", "3"},
                                     {"gemini", "5000", "hybrid", "--resume-zero", "2", "2"},
                                     {"fsdp", "", "gemini", "--resume-chunk-size", "777", "3"}};
  for (int k = 0; k < 3; k++) {
    char want[65], hex[65], what[200], ck[600];
    const char *plain[] = {"compare", "--optimizer", opts[k], "--model", "1mx5", "--steps", "6", "--quiet", NULL};
    expect_bitwise(plain, opts[k], want);
    for (int r = 0; r < 3; r++) {
      if (!dt_subset_keep(0x6e6f + (uint64_t)k, r, 3)) continue;
      snprintf(ck, sizeof ck, "%s/gemck%d_%d", dir, k, r);
      snprintf(what, sizeof what, "%s: %s %s -> %s %s %s", opts[k], R[r][0], R[r][1], R[r][2], R[r][3], R[r][4]);
      const char *args[] = {"compare", "--optimizer", opts[k], "--model", "1mx5", "--steps", "6", "--quiet",
                            "--plugin", R[r][0], "--checkpoint-at", "3", "--checkpoint-dir", ck, "--resume-plugin",
                            R[r][2], R[r][3], R[r][4], R[r][1][0] ? "--chunk-size" : NULL, R[r][1], NULL};
      expect_bitwise(args, what, hex);
      if (strcmp(hex, want) != 0) fail_msg("%s: digest %s, uninterrupted %s", what, hex, want);
    }
  }
}

/* Refusals, one line each: a chunk size without gemini, gemini at another ZeRO stage, an empty chunk, the
 * rank-order dp sum. */
static void test_gemini_bad_input(void **st) {
  (void)st;
  static const refusal bad[] = {
      {{"compare", "--plugin", "hybrid", "--chunk-size", "100", "--steps", "1", NULL}, "needs plugin gemini"},
      {{"compare", "--plugin", "gemini", "--zero", "2", "--steps", "1", NULL}, "--plugin gemini contradicts --zero 2"},
      {{"compare", "--plugin", "gemini", "--chunk-size", "0", "--steps", "1", NULL}, "--chunk-size '0'"},
      {{"compare", "--plugin", "gemini", "--dp-sum", "rank-order", "--steps", "1", NULL}, "rank-order cannot"},
  };
  expect_refusals(bad, sizeof bad / sizeof bad[0], "gemini");
}

/* ---- MoE-Hybrid (--plugin moe_hybrid --ep N; docs/distributed.md "MoE-Hybrid") ---- */

/* Every registered optimizer on the Mixtral-shaped model (6 experts of w1, w2, w3 per layer, GQA k and v) at
 * ep 2 (moe_dp 2, tp 1, zero 1) and ep 4 (6 experts on 4 ranks: two hold two, two hold one; moe_dp 1, tp 2,
 * zero 2, bf16, two micro-batches), clipping that binds (its norm adds the experts of every ep rank once):
 * bitwise the reference, whose expert gradients are the means over their ep rank's dp ranks only; and at ep 1
 * the digest of the hybrid plugin (no expert parallelism: the same layout). */
static void test_moe_every_optimizer(void **st) {
  (void)st;
  static const char *const opts[] = {"adamw", "adafactor", "came", "lamb", "adamw8bit", "galore_adamw",
                                     "galore_adamw8bit", "q_galore", "lisa", "galore", "muon"};
  static const char *const L[][6] = {{"1", "4", "2", "1", "--quiet", "1"}, {"2", "4", "4", "2", "--bf16", "2"}};
  for (size_t k = 0; k < sizeof opts / sizeof opts[0]; k++) {
    for (int l = 0; l < 2; l++) {
      if (!dt_subset_keep(0x6d6f + k, l, 2)) continue; /* the sanitizer passes: a rotating subset */
      char what[160], hex[65];
      snprintf(what, sizeof what, "%s moe_hybrid tp %s dp %s ep %s zero %s", opts[k], L[l][0], L[l][1], L[l][2], L[l][3]);
      const char *moe[] = {"compare", "--optimizer", opts[k], "--model", "mixtral-mini", "--steps", "3",
                           "--max-grad-norm", "0.01", "--accumulation", L[l][5], L[l][4], "--quiet", "--plugin",
                           "moe_hybrid", "--tp", L[l][0], "--dp", L[l][1], "--ep", L[l][2], "--zero", L[l][3], NULL};
      expect_bitwise(moe, what, hex);
    }
    if (!dt_subset_keep(0x6d70 + k, 0, 1)) continue;
    char h1[65], hh[65];
    const char *ep1[] = {"compare", "--optimizer", opts[k], "--model", "mixtral-mini", "--steps", "2", "--quiet",
                         "--plugin", "moe_hybrid", "--tp", "1", "--dp", "2", "--zero", "1", NULL};
    expect_bitwise(ep1, opts[k], h1);
    const char *hyb[] = {"compare", "--optimizer", opts[k], "--model", "mixtral-mini", "--steps", "2", "--quiet",
                         "--plugin", "hybrid", "--tp", "1", "--dp", "2", "--zero", "1", NULL};
    expect_bitwise(hyb, opts[k], hh);
    if (strcmp(h1, hh) != 0) fail_msg("%s: moe_hybrid ep 1 digest %s, hybrid %s", opts[k], h1, hh);
  }
}

/* Expert stacks (--model 300kx2e4: per layer stacks [4, f, h] and [4, h, f], named mlp.experts.*): every
 * registered optimizer at ep 2 (tp 1 x dp 4, zero 1) and ep 4 (tp 2 x dp 4, zero 2, bf16, accumulation 2), clipping
 * that binds: bitwise the reference, whose stack gradients count each rank's own experts only; a resume ep 2 -> 4;
 * zero 0 and the rank-order sum refused in one line (a stack's shards are exact ranges of its ep rank's experts). */
static void test_moe_stacks(void **st) {
  (void)st;
  static const char *const opts[] = {"adamw", "adafactor", "came", "lamb", "adamw8bit", "galore_adamw",
                                     "galore_adamw8bit", "q_galore", "lisa", "galore", "muon"};
  static const char *const L[][6] = {{"1", "4", "2", "1", "--quiet", "1"}, {"2", "4", "4", "2", "--bf16", "2"}};
  for (size_t k = 0; k < sizeof opts / sizeof opts[0]; k++)
    for (int l = 0; l < 2; l++) {
      if (!dt_subset_keep(0x7374 + k, l, 2)) continue;
      char what[160], hex[65];
      snprintf(what, sizeof what, "%s stacks tp %s dp %s ep %s zero %s", opts[k], L[l][0], L[l][1], L[l][2], L[l][3]);
      const char *args[] = {"compare", "--optimizer", opts[k], "--model", "300kx2e4", "--steps", "3",
                            "--max-grad-norm", "0.01", "--accumulation", L[l][5], L[l][4], "--quiet", "--plugin",
                            "moe_hybrid", "--tp", L[l][0], "--dp", L[l][1], "--ep", L[l][2], "--zero", L[l][3], NULL};
      expect_bitwise(args, what, hex);
    }
  char ck[600], hex[65];
  snprintf(ck, sizeof ck, "%s/stackck", dir);
  const char *resume[] = {"compare", "--optimizer", "adamw8bit", "--model", "300kx2e4", "--steps", "4", "--quiet",
                          "--plugin", "moe_hybrid", "--tp", "1", "--dp", "4", "--ep", "2", "--zero", "1",
                          "--checkpoint-at", "2", "--checkpoint-dir", ck, "--resume-ep", "4", NULL};
  expect_bitwise(resume, "stacks ep 2 -> 4", hex);
  /* --expert-stacks GLOB (YAML plugin.expert_stacks) marks the stacks instead of their names: the same stacks by
   * a glob give the same digest; only the down projections marked: bitwise too, another digest */
  char h1[65], h2[65], h3[65];
  const char *byname[] = {"compare", "--optimizer", "lamb", "--model", "300kx2e4", "--steps", "2", "--quiet",
                          "--plugin", "moe_hybrid", "--tp", "1", "--dp", "4", "--ep", "2", "--zero", "1", NULL};
  expect_bitwise(byname, "stacks by name", h1);
  const char *byglob[] = {"compare", "--optimizer", "lamb", "--model", "300kx2e4", "--steps", "2", "--quiet",
                          "--plugin", "moe_hybrid", "--tp", "1", "--dp", "4", "--ep", "2", "--zero", "1",
                          "--expert-stacks", "model.layers.*.mlp.experts.*", NULL};
  expect_bitwise(byglob, "stacks by glob", h2);
  const char *down[] = {"compare", "--optimizer", "lamb", "--model", "300kx2e4", "--steps", "2", "--quiet",
                        "--plugin", "moe_hybrid", "--tp", "1", "--dp", "4", "--ep", "2", "--zero", "1",
                        "--expert-stacks", "*.down_proj", NULL};
  expect_bitwise(down, "only the down projections as stacks", h3);
  if (strcmp(h1, h2) != 0 || strcmp(h1, h3) == 0)
    fail_msg("stacks by name %s, by the same glob %s, only down_proj %s", h1, h2, h3);
  static const refusal bad[] = {
      {{"compare", "--model", "300kx2e4", "--plugin", "moe_hybrid", "--dp", "2", "--ep", "2", "--zero", "0",
        "--steps", "1", NULL}, "expert stacks split over ep=2 need zero 1 or 2"},
      {{"compare", "--model", "300kx2e4", "--plugin", "moe_hybrid", "--dp", "2", "--ep", "2", "--zero", "1",
        "--dp-sum", "rank-order", "--steps", "1", NULL}, "and the exact dp sum"},
  };
  expect_refusals(bad, sizeof bad / sizeof bad[0], "stacks");
}

/* Checkpoints resume across ep (2 -> 4, 4 -> 2 at another dp), into and out of moe_hybrid (the experts then
 * dense over dp, or split from it), bitwise with the reference that replays the first layout; and a resume in
 * the same layout has the uninterrupted run's digest. */
static void test_moe_resume(void **st) {
  (void)st;
  static const char *const opts[] = {"adafactor", "adamw8bit", "galore_adamw"};
  static const char *const R[][10] = {
      {"moe_hybrid", "4", "2", "moe_hybrid", "--resume-ep", "4", "--resume-dp", "4", "", ""},
      {"moe_hybrid", "4", "4", "moe_hybrid", "--resume-ep", "2", "--resume-dp", "2", "", ""},
      {"moe_hybrid", "4", "2", "hybrid", "--resume-dp", "2", "", "", "", ""},
      {"hybrid", "2", "1", "moe_hybrid", "--resume-dp", "4", "--resume-ep", "4", "", ""},
  };
  for (int k = 0; k < 3; k++) {
    char hex[65], want[65], what[200], ck[600];
    for (int r = 0; r < 4; r++) {
      if (!dt_subset_keep(0x6d71 + (uint64_t)k, r, 4)) continue;
      snprintf(ck, sizeof ck, "%s/moeck%d_%d", dir, k, r);
      snprintf(what, sizeof what, "%s: %s dp %s ep %s -> %s %s %s %s %s", opts[k], R[r][0], R[r][1], R[r][2], R[r][3],
               R[r][4], R[r][5], R[r][6], R[r][7]);
      const char *args[] = {"compare", "--optimizer", opts[k], "--model", "mixtral-mini", "--steps", "5", "--quiet",
                            "--tp", "1", "--zero", "1", "--plugin", R[r][0], "--dp", R[r][1],
                            "--ep", R[r][2], "--checkpoint-at", "2",
                            "--checkpoint-dir", ck, "--resume-plugin", R[r][3], R[r][4], R[r][5],
                            R[r][6][0] ? R[r][6] : NULL, R[r][7], NULL};
      expect_bitwise(args, what, hex);
    }
    if (!dt_subset_keep(0x6d72 + (uint64_t)k, 0, 1)) continue;
    const char *plain[] = {"compare", "--optimizer", opts[k], "--model", "mixtral-mini", "--steps", "5", "--quiet",
                           "--tp", "2", "--dp", "4", "--ep", "2", "--zero", "2", "--plugin", "moe_hybrid", NULL};
    expect_bitwise(plain, opts[k], want);
    snprintf(ck, sizeof ck, "%s/moeck%d_same", dir, k);
    const char *same[] = {"compare", "--optimizer", opts[k], "--model", "mixtral-mini", "--steps", "5", "--quiet",
                          "--tp", "2", "--dp", "4", "--ep", "2", "--zero", "2", "--plugin", "moe_hybrid",
                          "--checkpoint-at", "3", "--checkpoint-dir", ck, NULL};
    expect_bitwise(same, opts[k], hex);
    if (strcmp(hex, want) != 0) fail_msg("%s: resumed in the same layout: digest %s, uninterrupted %s", opts[k], hex, want);
  }
  /* the YAML keys plugin.ep and checkpoint.resume.ep, and the header that says both layouts */
  char yaml[600], out[600];
  snprintf(yaml, sizeof yaml, "%s/moe.yaml", dir);
  snprintf(out, sizeof out, "%s/moe_yaml.txt", dir);
  FILE *f = fopen(yaml, "w");
  assert_non_null(f);
  fputs("optimizer: {type: adamw8bit}\nplugin: {type: moe_hybrid, tp: 1, dp: 4, ep: 2, zero: 1}\n"
        "gradients: {model: mixtral-mini}\ncheckpoint: {at: 2, resume: {type: moe_hybrid, ep: 4}}\nsteps: 4\n", f);
  fclose(f);
  const char *cfg[] = {"compare", "--config", yaml, "--quiet", NULL};
  char hex[65];
  expect_bitwise(cfg, "plugin.ep 2 -> checkpoint.resume.ep 4", hex);
  assert_int_equal(run_out(cfg, out), 0);
  char *txt = slurp(out);
  if (!txt || !strstr(txt, "moe_hybrid tp1\xC3\x97" "dp4\xC3\x97zero1 ep 2 (moe_dp 2)") ||
      !strstr(txt, "resumed after step 2 in moe_hybrid tp1\xC3\x97" "dp4\xC3\x97zero1 ep 4"))
    fail_msg("YAML ep: header %s", txt ? txt : "");
  free(txt);
}

/* Refusals, one line each: ep without moe_hybrid, an ep that does not divide dp (first or resume layout),
 * moe_hybrid at ZeRO 3, an unknown plugin names moe_hybrid among the expected. */
static void test_moe_bad_input(void **st) {
  (void)st;
  static const refusal bad[] = {
      {{"compare", "--plugin", "hybrid", "--ep", "2", "--steps", "1", NULL}, "ep=2 needs plugin moe_hybrid"},
      {{"compare", "--plugin", "moe_hybrid", "--dp", "6", "--ep", "4", "--steps", "1", NULL},
       "ep=4 must divide dp=6"},
      {{"compare", "--plugin", "moe_hybrid", "--dp", "4", "--ep", "2", "--checkpoint-at", "1", "--resume-ep", "3",
        "--steps", "2", NULL}, "resume: ep=3 must divide dp=4"},
      {{"compare", "--plugin", "moe_hybrid", "--zero", "3", "--steps", "1", NULL},
       "--plugin moe_hybrid contradicts --zero 3"},
      {{"compare", "--plugin", "moe", "--steps", "1", NULL}, "moe_hybrid"},
  };
  expect_refusals(bad, sizeof bad / sizeof bad[0], "moe");
}

int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: %s PATH-TO-distopt [layouts|pipeline|gemini|moe]\n", argv[0]);
    return 2;
  }
  bin = argv[1];
  if (argc > 2 && strcmp(argv[2], "layouts") == 0) { /* registered as unit_test_cli_layouts */
    const struct CMUnitTest layouts[] = {
        cmocka_unit_test(test_compare_plugin_implies),
        cmocka_unit_test(test_compare_sweep),
    };
    return cmocka_run_group_tests(layouts, setup, teardown);
  }
  if (argc > 2 && strcmp(argv[2], "gemini") == 0) { /* registered as unit_test_cli_gemini */
    const struct CMUnitTest gemini[] = {
        cmocka_unit_test(test_gemini_every_optimizer),
        cmocka_unit_test(test_gemini_resume),
        cmocka_unit_test(test_gemini_bad_input),
    };
    return cmocka_run_group_tests(gemini, setup, teardown);
  }
  if (argc > 2 && strcmp(argv[2], "moe") == 0) { /* registered as unit_test_cli_moe */
    const struct CMUnitTest moe[] = {
        cmocka_unit_test(test_moe_every_optimizer),
        cmocka_unit_test(test_moe_resume),
        cmocka_unit_test(test_moe_stacks),
        cmocka_unit_test(test_moe_bad_input),
    };
    return cmocka_run_group_tests(moe, setup, teardown);
  }
  if (argc > 2 && strcmp(argv[2], "pipeline") == 0) { /* registered as unit_test_cli_pipeline */
    const struct CMUnitTest pipeline[] = {
        cmocka_unit_test(test_pp_every_optimizer), cmocka_unit_test(test_pp_every_plugin),
        cmocka_unit_test(test_pp_resume),
        cmocka_unit_test(test_pp_nonfinite_skip),
        cmocka_unit_test(test_pp_bad_input),
    };
    return cmocka_run_group_tests(pipeline, setup, teardown);
  }
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_good_run_equals_library),
      cmocka_unit_test(test_run_golden_case),
      cmocka_unit_test(test_bad_input),
      cmocka_unit_test(test_compare),
      cmocka_unit_test(test_batch_invariant),
      cmocka_unit_test(test_compare_unused_options), cmocka_unit_test(test_compare_model_memory), cmocka_unit_test(test_compare_reference_chunks),
      cmocka_unit_test(test_wrappers_distributed), cmocka_unit_test(test_compare_checkpoint),
      cmocka_unit_test(test_compare_bad_input),
      cmocka_unit_test(test_lisa_layers_from_names),
      cmocka_unit_test(test_mem_per_rank),
      cmocka_unit_test(test_many_tensors),
      cmocka_unit_test(test_nonfinite_policy),
      cmocka_unit_test(test_compare_lisa_frozen),
      cmocka_unit_test(test_compare_overflow_nan),
      cmocka_unit_test(test_compare_trace_metadata),
      cmocka_unit_test(test_checkpoint_resume),
      cmocka_unit_test(test_threads_options),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}

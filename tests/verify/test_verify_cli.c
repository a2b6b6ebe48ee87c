/* `distopt verify` end to end without Python: recordings written here (safetensors through the library,
 * index.json as text) from the reference itself, so a faithful recording verifies with error 0; a perturbed
 * state or step count diverges (exit 1, naming step, tensor and rank); a malformed recording is exit 2 with
 * one line on stderr naming the file, key and value, and no --json written. argv[1] = the distopt binary.
 * Runs in the sanitizer builds too (it needs no shared library). */
#include "testutil.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "distopt/distopt.h"
#include "distopt/safetensors.h"
#include "fstree.h"
#include "verify.h" /* compare/: the recording's reader */

static const char *bin;
static char dir[256], outfile[600], errfile[600], jsonfile[600];

#define STEPS 6
#define HP "lr=0.01,beta1=0.9,beta2=0.99,eps=1e-08,weight_decay=0.1,amsgrad=false"

/* Two parameters: w [4, 3] split by rows over 2 ranks (flat [0, 6) and [6, 12)), b [5] whole on rank 0. */
static const char *const INDEX =
    "{\"schema_version\": 1, \"kind\": \"distopt-record\", \"generator\": \"test_verify_cli\",\n"
    " \"optimizer\": {\"name\": \"adamw\", \"upstream\": \"test\"},\n"
    " \"groups\": [{\"hparams\": \"" HP "\"}],\n"
    " \"params\": [{\"name\": \"w\", \"shape\": [4, 3], \"dtype\": \"F32\", \"group\": 0},\n"
    "            {\"name\": \"b\", \"shape\": [5], \"dtype\": \"F32\", \"group\": 0}],\n"
    " \"torch\": {\"version\": \"none\", \"cpu_capability\": \"none\", \"num_threads\": 1},\n"
    " \"world_size\": 2, \"record\": {\"every\": 1, \"params\": true, \"states\": true, \"flush_every\": 4},\n"
    " \"ranks\": [\n"
    "  {\"rank\": 0, \"pieces\": [{\"param\": \"w\", \"lo\": 0, \"len\": 6}, {\"param\": \"b\"}],\n"
    "   \"files\": [{\"path\": \"rank0/a.safetensors\", \"first_step\": 1, \"last_step\": 4},\n"
    "             {\"path\": \"rank0/b.safetensors\", \"first_step\": 5, \"last_step\": 6}]},\n"
    "  {\"rank\": 1, \"pieces\": [{\"param\": \"w\", \"lo\": 6, \"len\": 6}],\n"
    "   \"files\": [{\"path\": \"rank1/a.safetensors\", \"first_step\": 1, \"last_step\": 4},\n"
    "             {\"path\": \"rank1/b.safetensors\", \"first_step\": 5, \"last_step\": 6}]}],\n"
    " \"steps\": 6, \"complete\": true, \"hparam_changes\": [{\"step\": 4, \"group\": 0, \"key\": \"lr\", \"value\": 0.005}]}\n";

static void grad_at(int step, int p, size_t n, float *g) {
  uint64_t st = UINT64_C(0x9e3779b97f4a7c15) * (uint64_t)(unsigned)(step * 7 + p + 1);
  for (size_t i = 0; i < n; i++) g[i] = (float)dt_rand_normal(&st);
}

/* Writes the recording of the reference's own run: faithful, so verify finds error 0. perturb: 0 none;
 * 1 rank 1's w/exp_avg at step 3 scaled by 1.001 (in the recording only); 2 rank 0's b/step at step 5 off by
 * one; 3 no param/3/b; 4 the run's own w/exp_avg element 8 scaled by 1.001 after step 3 (the run goes on from
 * it: a one-step glitch of the recorded run). */
static void make_trace(const char *root, int perturb) {
  char path[900];
  snprintf(path, sizeof path, "%s/rank0", root);
  mkdir(root, 0755);
  mkdir(path, 0755);
  snprintf(path, sizeof path, "%s/rank1", root);
  mkdir(path, 0755);
  float w[12], b[5], gw[12], gb[5];
  uint64_t st = 42;
  for (int i = 0; i < 12; i++) w[i] = (float)dt_rand_normal(&st);
  for (int i = 0; i < 5; i++) b[i] = (float)dt_rand_normal(&st);
  dopt_optim *o;
  assert_ok(dopt_optim_create("adamw", HP, &o));
  dopt_param_config pc = DOPT_PARAM_CONFIG_INIT;
  int id;
  pc.name = "w", pc.ndim = 2, pc.shape[0] = 4, pc.shape[1] = 3, pc.data = w;
  assert_ok(dopt_optim_add_param(o, 0, &pc, &id));
  pc.name = "b", pc.ndim = 1, pc.shape[0] = 5, pc.data = b;
  assert_ok(dopt_optim_add_param(o, 0, &pc, &id));
  dopt_st_writer *wr[2] = {NULL, NULL};
  char name[128];
  int64_t half[1] = {6}, bs[1] = {5};
  for (int t = 0; t <= STEPS; t++) {
    if (t == 0 || t == 5) {
      for (int r = 0; r < 2; r++) assert_ok(dopt_st_writer_create(&wr[r]));
    }
    if (t == 0) {
      assert_ok(dopt_st_writer_add(wr[0], "init/w", DOPT_F32, 1, half, w));
      assert_ok(dopt_st_writer_add(wr[1], "init/w", DOPT_F32, 1, half, w + 6));
      assert_ok(dopt_st_writer_add(wr[0], "init/b", DOPT_F32, 1, bs, b));
      continue;
    }
    if (t == 4) assert_ok(dopt_optim_set_hparam(o, 0, "lr", 0.005));
    grad_at(t, 0, 12, gw);
    grad_at(t, 1, 5, gb);
    const float *g[2] = {gw, gb};
    assert_ok(dopt_optim_step(o, g));
    if (perturb == 4 && t == 3) {
      dopt_state_view v;
      assert_ok(dopt_optim_state(o, 0, 0, &v)); /* exp_avg */
      ((float *)v.data)[8] *= 1.001f;
    }
    for (int r = 0; r < 2; r++) {
      snprintf(name, sizeof name, "grad/%d/w", t);
      assert_ok(dopt_st_writer_add(wr[r], name, DOPT_F32, 1, half, gw + 6 * r));
      snprintf(name, sizeof name, "param/%d/w", t);
      assert_ok(dopt_st_writer_add(wr[r], name, DOPT_F32, 1, half, w + 6 * r));
      for (int k = 0; k < dopt_optim_num_states(o, 0); k++) {
        dopt_state_view v;
        assert_ok(dopt_optim_state(o, 0, k, &v));
        float buf[6];
        memcpy(buf, (const float *)v.data + 6 * r, sizeof buf);
        if (perturb == 1 && r == 1 && t == 3 && strcmp(v.name, "exp_avg") == 0) buf[2] *= 1.001f;
        snprintf(name, sizeof name, "state/%d/w/%s", t, v.name);
        assert_ok(dopt_st_writer_add(wr[r], name, DOPT_F32, 1, half, buf));
      }
      int64_t step;
      assert_ok(dopt_optim_get_step(o, 0, &step));
      snprintf(name, sizeof name, "state/%d/w/step", t);
      assert_ok(dopt_st_writer_add(wr[r], name, DOPT_I64, 0, NULL, &step));
    }
    snprintf(name, sizeof name, "grad/%d/b", t);
    assert_ok(dopt_st_writer_add(wr[0], name, DOPT_F32, 1, bs, gb));
    snprintf(name, sizeof name, "param/%d/b", t);
    if (!(perturb == 3 && t == 3)) assert_ok(dopt_st_writer_add(wr[0], name, DOPT_F32, 1, bs, b));
    int64_t step;
    assert_ok(dopt_optim_get_step(o, 1, &step));
    float fstep = (float)step + (perturb == 2 && t == 5 ? 1.0f : 0.0f); /* upstream's F32 step */
    snprintf(name, sizeof name, "state/%d/b/step", t);
    assert_ok(dopt_st_writer_add(wr[0], name, DOPT_F32, 0, NULL, &fstep));
    dopt_state_view v;
    assert_ok(dopt_optim_state(o, 1, 1, &v)); /* exp_avg_sq */
    snprintf(name, sizeof name, "state/%d/b/%s", t, v.name);
    assert_ok(dopt_st_writer_add(wr[0], name, DOPT_F32, 1, bs, v.data));
    if (t == 4 || t == STEPS) {
      for (int r = 0; r < 2; r++) {
        snprintf(path, sizeof path, "%s/rank%d/%s.safetensors", root, r, t == 4 ? "a" : "b");
        char rank[8];
        snprintf(rank, sizeof rank, "%d", r);
        assert_ok(dopt_st_writer_meta(wr[r], "rank", rank));
        assert_ok(dopt_st_writer_save(wr[r], path));
        dopt_st_writer_free(wr[r]);
        wr[r] = NULL;
      }
    }
  }
  dopt_optim_destroy(o);
  snprintf(path, sizeof path, "%s/index.json", root);
  FILE *f = fopen(path, "w");
  assert_non_null(f);
  fputs(INDEX, f);
  fclose(f);
}

static void write_index(const char *root, const char *text) {
  char path[900];
  snprintf(path, sizeof path, "%s/index.json", root);
  FILE *f = fopen(path, "w");
  assert_non_null(f);
  fputs(text, f);
  fclose(f);
}

/* src with the first `from` replaced by `to` (which must occur); malloc'd. */
static char *replaced(const char *src, const char *from, const char *to) {
  const char *at = strstr(src, from);
  if (!at) fail_msg("test bug: '%s' is not in the index", from);
  size_t n = strlen(src) - strlen(from) + strlen(to) + 1;
  char *s = malloc(n);
  assert_non_null(s);
  memcpy(s, src, (size_t)(at - src));
  strcpy(s + (at - src), to);
  strcat(s, at + strlen(from));
  return s;
}

static char *edited(const char *from, const char *to) { return replaced(INDEX, from, to); }

/* Runs the binary with args (NULL-terminated); stdout to outfile, stderr to errfile; the exit code. */
static int run(const char *const *args) { return dt_run(bin, args, outfile, errfile); }

static void slurp(const char *path, char *buf, size_t cap) {
  FILE *f = fopen(path, "r");
  size_t n = f ? fread(buf, 1, cap - 1, f) : 0;
  buf[n] = '\0';
  if (f) fclose(f);
}

static int setup(void **st) {
  (void)st;
  int rc = dt_make_tmpdir(dir, sizeof dir, "dopt_verify");
  snprintf(outfile, sizeof outfile, "%s/stdout.txt", dir);
  snprintf(errfile, sizeof errfile, "%s/stderr.txt", dir);
  snprintf(jsonfile, sizeof jsonfile, "%s/out.json", dir);
  return rc;
}

static int teardown(void **st) {
  (void)st;
  return dt_remove_tmpdir(dir);
}

static void test_faithful_recording_verifies(void **st) {
  (void)st;
  char root[400], out[16384];
  snprintf(root, sizeof root, "%s/good", dir);
  make_trace(root, 0);
  const char *args[] = {"verify", root, "--json", jsonfile, NULL};
  int rc = run(args);
  slurp(outfile, out, sizeof out);
  printf("%s", out);
  assert_int_equal(rc, 0);
  assert_non_null(strstr(out, "verdict: WITHIN TOLERANCE"));
  assert_non_null(strstr(out, "1 hyperparameter change replayed"));
  /* the reference against itself: every error exactly 0 */
  assert_non_null(strstr(out, "parameters 0 of 1e-06, states 0 of 1e-05"));
  assert_null(strstr(out, "\xE2\x9C\x97"));
  char js[65536];
  slurp(jsonfile, js, sizeof js);
  assert_non_null(strstr(js, "\"schema_version\":\t8"));
  assert_non_null(strstr(js, "\"continues\":\tnull"));
  assert_non_null(strstr(js, "\"kind\":\t\"within_tolerance\""));
  /* the index file itself as TRACE */
  char ipath[500];
  snprintf(ipath, sizeof ipath, "%s/index.json", root);
  const char *args2[] = {"verify", ipath, "--quiet", NULL};
  assert_int_equal(run(args2), 0);
  slurp(outfile, out, sizeof out);
  assert_string_equal(out, "verdict: WITHIN TOLERANCE\n");
}

/* Schema 3's tensor-parallel blocks: the same recording with w's pieces given as blocks of dimension 0 (rows
 * [0, 2) and [2, 4): the same elements as the flat ranges) verifies with error 0; bad blocks are refused in
 * one line. */
static void expect_bad(const char *root, const char *needle, const char *const *extra);

/* Writes index (and frees it) over the faithful recording at root: verify exits 0 with error 0, its table
 * shows `row` and its JSON holds `json`. */
static void verifies_exactly(const char *root, char *index, const char *row, const char *json) {
  char out[16384], js[65536];
  write_index(root, index);
  free(index);
  const char *args[] = {"verify", root, "--json", jsonfile, NULL};
  int rc = run(args);
  slurp(outfile, out, sizeof out);
  printf("%s", out);
  assert_int_equal(rc, 0);
  assert_non_null(strstr(out, "parameters 0 of 1e-06, states 0 of 1e-05"));
  assert_non_null(strstr(out, row));
  slurp(jsonfile, js, sizeof js);
  assert_non_null(strstr(js, json));
}

static char *as_blocks(const char *rank1_block) {
  char *a = replaced(INDEX, "\"schema_version\": 1", "\"schema_version\": 3");
  char *b = replaced(a, "{\"param\": \"w\", \"lo\": 0, \"len\": 6}",
                     "{\"param\": \"w\", \"block\": {\"dim\": 0, \"lo\": 0, \"len\": 2}}");
  char *c = replaced(b, "{\"param\": \"w\", \"lo\": 6, \"len\": 6}", rank1_block);
  free(a);
  free(b);
  return c;
}

/* Schema 5's gradient agreement says how many digests it compared, and plainly that it compared none where no
 * two ranks hold a digest of the same pieces (here: record.grad_agree on, no digest recorded): never "equal". */
static void test_agreement_compared_none(void **st) {
  (void)st;
  char root[400], out[16384], js[65536];
  snprintf(root, sizeof root, "%s/agree_none", dir);
  make_trace(root, 0);
  char *a = replaced(INDEX, "\"schema_version\": 1", "\"schema_version\": 5");
  char *b = replaced(a, "\"flush_every\": 4}", "\"flush_every\": 4, \"grads\": \"F32\", \"projectors\": false, "
                        "\"grad_agree\": true}");
  free(a);
  write_index(root, b);
  free(b);
  const char *args[] = {"verify", root, "--json", jsonfile, NULL};
  const int rc = run(args);
  slurp(outfile, out, sizeof out);
  printf("%s", out);
  assert_int_equal(rc, 0);
  assert_non_null(strstr(out, "gradients: no digest compared at 6 steps (no two ranks hold the same piece"));
  assert_null(strstr(out, "all equal"));
  slurp(jsonfile, js, sizeof js);
  assert_non_null(strstr(js, "\"gradients_compared\":\t0"));
}

/* What the terminal report echoes from index.json is escaped by the one rule (dopt__escape): a bidi override in
 * the torch version and a C1 control (CSI) in the upstream name appear as \u202e and \u009b, never as the raw
 * characters that reorder or drive a terminal; the JSON keeps the text as it is. */
static void test_report_escapes(void **st) {
  (void)st;
  char root[400], out[16384], js[65536];
  snprintf(root, sizeof root, "%s/escapes", dir);
  make_trace(root, 0);
  char *a = replaced(INDEX, "\"version\": \"none\"", "\"version\": \"2.15\\u202e1\"");
  char *b = replaced(a, "\"upstream\": \"test\"", "\"upstream\": \"te\\u009bst\"");
  free(a);
  write_index(root, b);
  free(b);
  const char *args[] = {"verify", root, "--json", jsonfile, NULL};
  assert_int_equal(run(args), 0);
  slurp(outfile, out, sizeof out);
  if (!strstr(out, "torch 2.15\\u202e1 (") || !strstr(out, "recorded from te\\u009bst") ||
      strstr(out, "\xE2\x80\xAE") || strstr(out, "\xC2\x9B"))
    fail_msg("the report echoes the recording's text unescaped: %s", out);
  slurp(jsonfile, js, sizeof js);
  assert_non_null(strstr(js, "\xE2\x80\xAE")); /* the JSON: the text itself, in JSON's own escaping (UTF-8) */
}

static void test_block_layout(void **st) {
  (void)st;
  char root[400];
  snprintf(root, sizeof root, "%s/blocks", dir);
  make_trace(root, 0);
  char *ix = as_blocks("{\"param\": \"w\", \"block\": {\"dim\": 0, \"lo\": 2, \"len\": 2}}");
  verifies_exactly(root, ix, "d0[2,4)", "\"block\":");
  /* a block of rows [1, 4) overlaps rank 0's [0, 2); a block of another dimension; a dimension w lacks; a
   * block in schema 1 */
  static const struct {
    const char *rank1, *needle;
  } bad[] = {
      {"{\"param\": \"w\", \"block\": {\"dim\": 0, \"lo\": 1, \"len\": 3}}",
       "rank 1's elements dim 0 [1, 4) [0, 9) overlap rank 0's dim 0 [0, 2) [0, 6) partially"},
      {"{\"param\": \"w\", \"block\": {\"dim\": 1, \"lo\": 0, \"len\": 3}}", "one dimension per parameter"},
      {"{\"param\": \"w\", \"block\": {\"dim\": 2, \"lo\": 0, \"len\": 3}}", "block.dim: 2 is outside [0, 1]"},
      {"{\"param\": \"w\", \"block\": {\"dim\": 0, \"lo\": 2, \"len\": 1}}", "are held by no rank"},
  };
  for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
    char *b = as_blocks(bad[k].rank1);
    write_index(root, b);
    free(b);
    expect_bad(root, bad[k].needle, NULL);
  }
  char *v1 = replaced(INDEX, "{\"param\": \"w\", \"lo\": 0, \"len\": 6}",
                      "{\"param\": \"w\", \"block\": {\"dim\": 0, \"lo\": 0, \"len\": 2}}");
  write_index(root, v1);
  free(v1);
  expect_bad(root, "unknown key 'block'", NULL);
}

/* Schema 4's pipeline stages and expert ids: the recording as a 2-stage pipeline (w's row halves on stage 0,
 * b on stage 1 held by rank 0: a rank may hold pieces of several stages, as an interleaved schedule does) with
 * b as expert 2 of 4 verifies with error 0 and reports each tensor's stage and expert; out-of-range ids, a
 * missing stage, ids the recording has no room for, a split parameter on two stages and a parameter of two
 * experts are one line each (exit 2). */
static char *as_stages(const char *top, const char *w0, const char *w1, const char *b) {
  char *a = replaced(INDEX, "\"schema_version\": 1", "\"schema_version\": 4");
  char *t = replaced(a, "\"steps\": 6,", top);
  char *x = replaced(t, "{\"param\": \"w\", \"lo\": 0, \"len\": 6}", w0);
  char *y = replaced(x, "{\"param\": \"w\", \"lo\": 6, \"len\": 6}", w1);
  char *z = replaced(y, "{\"param\": \"b\"}", b);
  free(a);
  free(t);
  free(x);
  free(y);
  return z;
}

static void test_stage_expert_layout(void **st) {
  (void)st;
  char root[400];
  snprintf(root, sizeof root, "%s/stages", dir);
  make_trace(root, 0);
  const char *top = "\"steps\": 6, \"stages\": 2, \"experts\": 4,";
  const char *w0 = "{\"param\": \"w\", \"lo\": 0, \"len\": 6, \"stage\": 0}";
  const char *w1 = "{\"param\": \"w\", \"lo\": 6, \"len\": 6, \"stage\": 0}";
  const char *b = "{\"param\": \"b\", \"stage\": 1, \"expert\": 2}";
  verifies_exactly(root, as_stages(top, w0, w1, b), "whole s1 e2", "\"stage\":\t1,\n\t\t\t\"expert\":\t2");
  static const struct {
    const char *top, *w1, *b, *needle;
  } bad[] = {
      {NULL, NULL, "{\"param\": \"b\", \"stage\": 2}", "ranks[0].pieces[1].stage: 2 is outside [0, 1]"},
      {NULL, NULL, "{\"param\": \"b\"}", "ranks[0].pieces[1].stage: missing (stages is 2: every piece names its stage)"},
      {NULL, NULL, "{\"param\": \"b\", \"stage\": 1, \"expert\": 4}", "ranks[0].pieces[1].expert: 4 is outside [0, 3]"},
      {"\"steps\": 6,", "{\"param\": \"w\", \"lo\": 6, \"len\": 6}", "{\"param\": \"b\", \"expert\": 0}",
       "ranks[0].pieces[0].stage: given but the recording has no stages"},
      {"\"steps\": 6, \"stages\": 2,", NULL, "{\"param\": \"b\", \"stage\": 1, \"expert\": 0}",
       "ranks[0].pieces[1].expert: given but the recording has no experts"},
      {NULL, "{\"param\": \"w\", \"lo\": 6, \"len\": 6, \"stage\": 1}", NULL,
       "ranks: parameter w: rank 1's piece is on stage 1, rank 0's on stage 0 (a parameter lives on one stage"},
      {NULL, "{\"param\": \"w\", \"lo\": 6, \"len\": 6, \"stage\": 0, \"expert\": 1}", NULL,
       "ranks: parameter w: rank 1's piece is of expert 1, rank 0's of expert -1 (a parameter belongs to one expert"},
      {"\"steps\": 6, \"stages\": 0,", NULL, NULL, "index.json: stages: 0 is outside [1, 4096]"},
  };
  for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
    char *x = as_stages(bad[k].top ? bad[k].top : top, w0, bad[k].w1 ? bad[k].w1 : w1, bad[k].b ? bad[k].b : b);
    write_index(root, x);
    free(x);
    expect_bad(root, bad[k].needle, NULL);
  }
  /* a recorder's hyperparameter disagreement (schema 4): exit 1 at its step, naming the rank and the key; before
   * the values (which are the reference's own here); bad ones exit 2 */
  char *hp = as_stages("\"steps\": 6, \"stages\": 2, \"experts\": 4, \"hparam_disagreement\": {\"step\": 3, "
                       "\"rank\": 1, \"group\": 0, \"key\": \"lr\", \"value\": 0.02, \"rank0_value\": 0.01},",
                       w0, w1, b);
  write_index(root, hp);
  free(hp);
  {
    const char *a2[] = {"verify", root, "--json", jsonfile, NULL};
    assert_int_equal(run(a2), 1);
    char out2[16384], js2[65536];
    slurp(outfile, out2, sizeof out2);
    assert_non_null(strstr(out2, "verdict: DIVERGED at step 3 (hyperparameters: rank 1's lr of group 0 is 0.02, rank 0's "
                                 "0.01, which the replay uses)"));
    slurp(jsonfile, js2, sizeof js2);
    assert_non_null(strstr(js2, "\"kind\":\t\"hparams\""));
  }
  static const struct {
    const char *field, *needle;
  } badhp[] = {
      {"\"hparam_disagreement\": {\"step\": 3, \"rank\": 0, \"group\": 0, \"key\": \"lr\", \"value\": 1, \"rank0_value\": 2},",
       "hparam_disagreement.rank: 0 is outside [1, 1]"},
      {"\"hparam_disagreement\": {\"step\": 9, \"rank\": 1, \"group\": 0, \"key\": \"lr\", \"value\": 1, \"rank0_value\": 2},",
       "hparam_disagreement.step: 9 is outside [1, 6]"},
      {"\"hparam_disagreement\": {\"step\": 3, \"rank\": 1, \"group\": 0, \"key\": \"lr\", \"value\": \"x\", \"rank0_value\": 2},",
       "hparam_disagreement.value: 'x', expected a finite number, true, false or null"},
  };
  for (size_t k = 0; k < sizeof badhp / sizeof badhp[0]; k++) {
    char t[512];
    snprintf(t, sizeof t, "\"steps\": 6, \"stages\": 2, \"experts\": 4, %s", badhp[k].field);
    char *x = as_stages(t, w0, w1, b);
    write_index(root, x);
    free(x);
    expect_bad(root, badhp[k].needle, NULL);
  }
  /* schema 3 has no stage */
  char *a = replaced(INDEX, "\"schema_version\": 1", "\"schema_version\": 3");
  char *v3 = replaced(a, "{\"param\": \"b\"}", "{\"param\": \"b\", \"stage\": 0}");
  write_index(root, v3);
  free(a);
  free(v3);
  expect_bad(root, "unknown key 'stage'", NULL);
}

/* vr_piece_run: the runs of a piece, concatenated, are its elements one by one (vr_piece_elem) and each run is
 * contiguous in the parameter, for blocks of every dimension of a [3, 4, 5] parameter at any flat offset. */
static void test_piece_runs(void **st) {
  (void)st;
  static const int64_t shape[3] = {3, 4, 5};
  for (int dim = -1; dim < 3; dim++)
    for (int64_t blo = 0; blo < (dim < 0 ? 1 : shape[dim]); blo++) {
      vr_piece pc;
      memset(&pc, 0, sizeof pc);
      const dopt_layout_piece init = DOPT_LAYOUT_PIECE_INIT;
      pc.lp = init;
      pc.ndim = 3, pc.shape = shape;
      pc.lp.block_dim = dim, pc.lp.block_lo = blo, pc.lp.block_len = dim < 0 ? 0 : shape[dim] - blo;
      const int64_t extent = dopt_layout_piece_extent(3, shape, &pc.lp);
      for (int64_t lo = 0; lo < extent; lo += 7) {
        pc.lp.lo = lo, pc.lp.len = extent - lo - (extent - lo > 3 ? 2 : 0);
        int64_t at, n, j = 0;
        for (; (n = vr_piece_run(&pc, j, &at)) > 0; j += n)
          for (int64_t i = 0; i < n; i++) assert_int_equal(vr_piece_elem(&pc, j + i), at + i);
        assert_int_equal(j, pc.lp.len);
      }
    }
}

static void test_perturbed_state_diverges(void **st) {
  (void)st;
  char root[400], out[16384], svg[600];
  snprintf(root, sizeof root, "%s/perturbed", dir);
  snprintf(svg, sizeof svg, "%s/out.svg", dir);
  make_trace(root, 1);
  unlink(jsonfile);
  const char *args[] = {"verify", root, "--json", jsonfile, "--plot", svg, NULL};
  int rc = run(args);
  slurp(outfile, out, sizeof out);
  printf("%s", out);
  assert_int_equal(rc, 1);
  assert_non_null(strstr(out, "verdict: DIVERGED at step 3 (tensor w/exp_avg, rank 1: normwise relative error"));
  char js[65536];
  slurp(jsonfile, js, sizeof js);
  assert_non_null(strstr(js, "\"tensor\":\t\"w/exp_avg\""));
  assert_non_null(strstr(js, "\"rank\":\t1,\n\t\t\"rel\""));
  slurp(svg, js, sizeof js);
  assert_non_null(strstr(js, "DIVERGED at step 3 (tensor w/exp_avg, rank 1)</text>"));
  /* a looser --rtol accepts the perturbation (1e-3 of one element) */
  const char *loose[] = {"verify", root, "--rtol", "0.01", NULL};
  assert_int_equal(run(loose), 0);
}

static void expect_bad(const char *root, const char *needle, const char *const *extra);
static void write_index(const char *root, const char *text);
static char *edited(const char *from, const char *to);

/* --stepwise on a run with a one-step glitch at step 3 (its exp_avg changed, and the run went on from it):
 * both modes name step 3; accumulated the error persists afterwards, stepwise every other step is exactly 0
 * (each starts from the recorded state, and the reference is the recorder). */
static void test_stepwise_names_the_glitch(void **st) {
  (void)st;
  char root[400], out[16384], js[65536];
  snprintf(root, sizeof root, "%s/glitch", dir);
  make_trace(root, 4);
  for (int stepwise = 0; stepwise < 2; stepwise++) {
    unlink(jsonfile);
    const char *args[] = {"verify", root, "--json", jsonfile, stepwise ? "--stepwise" : NULL, NULL};
    int rc = run(args);
    slurp(outfile, out, sizeof out);
    printf("%s", out);
    assert_int_equal(rc, 1);
    assert_non_null(strstr(out, "verdict: DIVERGED at step 3 (tensor w/exp_avg, rank 1:"));
    slurp(jsonfile, js, sizeof js);
    /* rank 1's w/exp_avg row: its per-step errors, steps 1..6 */
    const char *row = strstr(js, "\"name\":\t\"w/exp_avg\",\n\t\t\t\"param\":\t\"w\",\n\t\t\t\"state\":\t\"exp_avg\",\n\t\t\t\"rank\":\t1");
    assert_non_null(row);
    const char *rel = strstr(row, "\"rel_per_step\":");
    assert_non_null(rel);
    double v[6];
    const char *p = strchr(rel, '[');
    for (int k = 0; k < 6; k++) {
      p += strspn(p, "[, \t\n");
      v[k] = strtod(p, (char **)&p);
    }
    for (int k = 0; k < 6; k++) {
      int t = k + 1;
      if (t < 3) assert_true(v[k] == 0.0);
      else if (t == 3) assert_true(v[k] > 1e-5);
      else if (stepwise) assert_true(v[k] == 0.0); /* from the recorded (glitched) state: exact */
      else assert_true(v[k] > 1e-6);              /* the reference never had the glitch */
    }
  }
  assert_non_null(strstr(out, "mode: stepwise"));
  /* --stepwise needs the states: a recording without them is refused */
  char *ix = edited("\"states\": true", "\"states\": false");
  write_index(root, ix);
  free(ix);
  expect_bad(root, "--stepwise starts each step from the recorded parameters and states, but record.states is false",
             (const char *const[]){"--stepwise", NULL});
}

/* A recorded step whose file lacks a parameter (record.params true): bad input, not a silent pass. */
static void test_missing_param_refused(void **st) {
  (void)st;
  char root[400], err[4096];
  snprintf(root, sizeof root, "%s/missing", dir);
  make_trace(root, 3);
  const char *args[] = {"verify", root, NULL};
  assert_int_equal(run(args), 2);
  slurp(errfile, err, sizeof err);
  assert_non_null(strstr(err, "file for step 3 has no 'param/3/b'"));
}

static void test_step_count_diverges(void **st) {
  (void)st;
  char root[400], out[16384];
  snprintf(root, sizeof root, "%s/stepcount", dir);
  make_trace(root, 2);
  const char *args[] = {"verify", root, NULL};
  int rc = run(args);
  slurp(outfile, out, sizeof out);
  assert_int_equal(rc, 1);
  assert_non_null(strstr(out, "DIVERGED at step 5 (tensor b/step, rank 0: the step count differs"));
}

/* exit 2, exactly one line on stderr containing needle, no --json written */
static void expect_bad(const char *root, const char *needle, const char *const *extra) {
  const char *args[16] = {"verify", root, "--json", jsonfile};
  int n = 4;
  for (int i = 0; extra && extra[i] && n < 15; i++) args[n++] = extra[i];
  args[n] = NULL;
  unlink(jsonfile);
  int rc = run(args);
  char err[4096];
  slurp(errfile, err, sizeof err);
  int lines = 0;
  for (const char *p = err; *p; p++) lines += *p == '\n';
  if (rc != 2 || lines != 1 || !strstr(err, needle))
    fail_msg("%s: rc %d, %d lines, stderr '%s' (want '%s')", root, rc, lines, err, needle);
  if (access(jsonfile, F_OK) == 0) fail_msg("--json written despite the error (%s)", needle);
}

static void bad_index(const char *root, const char *from, const char *to, const char *needle) {
  char *s = edited(from, to);
  write_index(root, s);
  free(s);
  expect_bad(root, needle, NULL);
}

static void test_bad_input(void **st) {
  (void)st;
  char root[400], missing[500];
  snprintf(root, sizeof root, "%s/bad", dir);
  make_trace(root, 0);
  snprintf(missing, sizeof missing, "%s/nope", dir);
  expect_bad(missing, "nope: No such file or directory", NULL);
  expect_bad(root, "--rtol '-1': expected a positive number", (const char *const[]){"--rtol", "-1", NULL});
  expect_bad(root, "unknown option '--bogus'", (const char *const[]){"--bogus", "1", NULL});
  write_index(root, "{\"schema_version\": 1,");
  expect_bad(root, "index.json: not valid JSON", NULL);
  bad_index(root, "\"schema_version\": 1", "\"schema_version\": 7",
            "index.json: schema_version: 7 is not supported (this distopt reads 1 to 6)");
  /* schema 6's keys: refused in older schemas, checked in 6 */
  bad_index(root, "\"flush_every\": 4}", "\"flush_every\": 4, \"clip\": {\"max_norm\": 1, \"norm_type\": 2}}",
            "index.json: record: unknown key 'clip'");
  static const struct { const char *to, *needle; } v6[] = {
      {"\"flush_every\": 4, \"clip\": {\"max_norm\": 1, \"norm_type\": 1}}",
       "record.clip.norm_type: 1, expected 2 (the 2-norm; no other is recorded)"},
      {"\"flush_every\": 4, \"clip\": {\"max_norm\": -1, \"norm_type\": 2}}",
       "record.clip.max_norm: -1, expected a finite number > 0"},
      {"\"flush_every\": 4, \"clip\": {\"max_norm\": 1, \"norm\": 2}}", "record.clip: unknown key 'norm'"},
      {"\"flush_every\": 4}, \"twin\": {\"terms\": 0, \"construction_steps\": 0}",
       "twin.terms: 0 is outside [1, 1073741824]"},
      {"\"flush_every\": 4}, \"construction_steps\": 1", "construction_steps: 1 is outside [0, 0]"},
  };
  for (size_t i = 0; i < sizeof v6 / sizeof v6[0]; i++) {
    char *a = replaced(INDEX, "\"schema_version\": 1", "\"schema_version\": 6");
    char *b = replaced(a, "\"flush_every\": 4}", v6[i].to);
    write_index(root, b);
    free(a), free(b);
    expect_bad(root, v6[i].needle, NULL);
  }
  bad_index(root, "\"distopt-record\"", "\"other\"", "index.json: kind: 'other', expected \"distopt-record\"");
  bad_index(root, "\"generator\"", "\"generatr\"", "index.json: (top level): unknown key 'generatr'");
  bad_index(root, "\"world_size\": 2", "\"world_size\": 5000", "world_size: 5000 is outside [1, 4096]");
  bad_index(root, "\"shape\": [4, 3]", "\"shape\": [4, -3]", "params[0].shape[1]: -3 is outside");
  bad_index(root, "\"shape\": [5]", "\"shape\": [5, 1, 1, 1, 1, 1, 1, 1, 1]", "params[1].shape: more than 8 entries");
  bad_index(root, "\"dtype\": \"F32\", \"group\": 0},\n            {\"name\": \"b\"",
            "\"dtype\": \"BF16\", \"group\": 0},\n            {\"name\": \"b\"", "only F32 parameters can be verified");
  bad_index(root, "{\"name\": \"b\"", "{\"name\": \"w\"", "params[1].name: 'w' appears twice");
  bad_index(root, "{\"name\": \"b\"", "{\"name\": \"b\\u0001x\"", "params[1].name: 'b\\x01x' holds a control character");
  bad_index(root, "\"rank1/b.safetensors\"", "\"rank1/b.safetensors\\u0000/../../x\"",
            "index.json: a NUL character at byte");
  {
    char longname[400] = "{\"name\": \"";
    memset(longname + 10, 'n', 300);
    strcpy(longname + 310, "\"");
    bad_index(root, "{\"name\": \"b\"", longname, "bytes, longer than the limit of 255");
  }
  bad_index(root, "\"rank0/b.safetensors\"", "\"../b.safetensors\"", "expected a relative path inside the recording");
  bad_index(root, "\"first_step\": 5", "\"first_step\": 6", "ranks[0].files[1].first_step: 6, expected 5");
  bad_index(root, "\"lo\": 6, \"len\": 6", "\"lo\": 7, \"len\": 5", "parameter w: elements [6, 7) are held by no rank");
  bad_index(root, "\"lo\": 6, \"len\": 6", "\"lo\": 4, \"len\": 8", "overlap rank 0's [0, 6) partially");
  bad_index(root, "\"lo\": 6, \"len\": 6", "\"lo\": 6, \"len\": 7", "ranks[1].pieces[0].len: 7 is outside [1, 6]");
  bad_index(root, "{\"param\": \"b\"}", "{\"param\": \"c\"}", "ranks[0].pieces[1].param: 'c' is not in params");
  bad_index(root, "\"steps\": 6", "\"steps\": 7", "ranks[0].files: cover steps 1..6 but steps is 7");
  bad_index(root, "\"name\": \"adamw\"", "\"name\": \"nosuch\"", "nosuch");
  bad_index(root, "\"name\": \"adamw\"", "\"name\": \"adamw8bit\"", "'adamw8bit' has no declared tolerance (give --rtol)");
  bad_index(root, "\"hparams\": \"" HP "\"", "\"hparams\": \"lr=-1\"", "adamw: lr=-1 must be >= 0");
  bad_index(root, "\"key\": \"lr\"", "\"key\": \"nokey\"", "hparam_changes[0] (step 4)");
  bad_index(root, "\"step\": 4, \"group\": 0", "\"step\": 4, \"group\": 3", "hparam_changes[0].group: 3 is outside [0, 0]");
  /* a change to null: refused (replayed, it was lr=nan) */
  bad_index(root, "\"value\": 0.005", "\"value\": null", "hparam_changes[0].value: null: a change must set a finite");
  /* a tensor file that does not match the index */
  bad_index(root, "\"rank0/a.safetensors\"", "\"rank1/a.safetensors\"", "metadata rank '1' but the index lists it for rank 0");
  bad_index(root, "\"rank1/b.safetensors\"", "\"rank1/none.safetensors\"", "rank1/none.safetensors");
  { /* b moves to rank 1's layout: rank 0's file still records it */
    char *a = edited(", {\"param\": \"b\"}]", "]");
    char *b = replaced(a, "\"lo\": 6, \"len\": 6}]", "\"lo\": 6, \"len\": 6}, {\"param\": \"b\"}]");
    write_index(root, b);
    free(a);
    free(b);
    expect_bad(root, "tensor 'init/b': rank 0's layout has no parameter 'b'", NULL);
  }
  { /* w whole on rank 0 (rank 1 records b instead): its file holds 6 of the 12 elements */
    char *a = edited("{\"param\": \"w\", \"lo\": 0, \"len\": 6}", "{\"param\": \"w\"}");
    char *b = replaced(a, "{\"param\": \"w\", \"lo\": 6, \"len\": 6}", "{\"param\": \"b\"}");
    write_index(root, b);
    free(a);
    free(b);
    expect_bad(root, "tensor 'init/w' has 6 elements but rank 0's piece of 'w' has 12", NULL);
  }
  write_index(root, INDEX);
  expect_bad(root, "--plot '/nonexistent-dir/x.svg': the folder", (const char *const[]){"--plot", "/nonexistent-dir/x.svg", NULL});
  /* --continues: a recording from step 0 continues nothing; a missing PREV */
  expect_bad(root, "is no window (start_step 0)", (const char *const[]){"--continues", root, NULL});
  expect_bad(root, "--continues: empty path", (const char *const[]){"--continues", "", NULL});
  expect_bad(root, "nope", (const char *const[]){"--continues", missing, NULL});
  /* and the untouched recording still verifies */
  const char *args[] = {"verify", root, NULL};
  assert_int_equal(run(args), 0);
}

/* The parser's message is one line whatever the index's keys hold (a newline in a key of a piece's states
 * was echoed raw: found by fuzz_verify, kept as tests/fuzz/corpus/verify/newline_in_key.json). */
static void test_index_error_one_line(void **st) {
  (void)st;
  char path[600], text[8192], err[1024];
  snprintf(path, sizeof path, "%s/tests/fuzz/corpus/verify/newline_in_key.json", dt_source_dir());
  FILE *f = fopen(path, "rb");
  assert_non_null(f);
  size_t n = fread(text, 1, sizeof text, f);
  fclose(f);
  vr_index ix;
  /* the fuzzed file also holds raw NUL bytes: refused for them first (a string would be cut there) */
  assert_int_equal(vr_index_parse(text, n, "index.json", &ix, err, sizeof err), -1);
  vr_index_free(&ix);
  assert_non_null(strstr(err, "index.json: a NUL character at byte"));
  for (size_t i = 0; i < n; i++) /* without them: the newline in a key, escaped */
    if (!text[i]) text[i] = ' ';
  assert_int_equal(vr_index_parse(text, n, "index.json", &ix, err, sizeof err), -1);
  vr_index_free(&ix);
  printf("%s\n", err);
  assert_null(strchr(err, '\n'));
  assert_non_null(strstr(err, "states.exp_rat\\x0aor"));
}

/* ---- the recording's reader (verify/verify_reader.c) and `distopt compare --trace` on a recording ---- */

/* The parameters before step 1 as make_trace draws them. */
static void initial_values(float w[12], float b[5]) {
  uint64_t st = 42;
  for (int i = 0; i < 12; i++) w[i] = (float)dt_rand_normal(&st);
  for (int i = 0; i < 5; i++) b[i] = (float)dt_rand_normal(&st);
}

/* The reader assembles each step's gradient from both ranks' pieces, loading a rank's next block only
 * when the step moves past it (one open file per rank): reading steps 1..6 loads each of the 4 files once;
 * going back to step 2 reloads the first blocks. */
static void test_reader_blocks(void **st) {
  (void)st;
  char root[400];
  snprintf(root, sizeof root, "%s/reader", dir);
  make_trace(root, 0);
  vr_reader rd;
  dopt_status s = vr_reader_open(&rd, root);
  if (s != DOPT_OK) fail_msg("vr_reader_open: %s", rd.err);
  assert_int_equal(rd.ix.nparams, 2);
  assert_int_equal(rd.nsrc[0], 2); /* w: rows split over ranks 0 and 1 */
  assert_int_equal(rd.nsrc[1], 1); /* b: rank 0 */
  assert_int_equal(rd.loads, 0);
  float w[12], b[5], got[12], want[12];
  initial_values(w, b);
  assert_int_equal(vr_reader_init(&rd, 0, got), DOPT_OK);
  assert_memory_equal(got, w, sizeof w);
  assert_int_equal(vr_reader_init(&rd, 1, got), DOPT_OK);
  assert_memory_equal(got, b, sizeof b);
  assert_int_equal(rd.loads, 2);
  for (long t = 1; t <= STEPS; t++)
    for (int p = 0; p < 2; p++) {
      int present = 0;
      size_t n = p ? 5 : 12;
      memset(got, 0xff, sizeof got);
      if (vr_reader_grad(&rd, p, t, got, &present) != DOPT_OK) fail_msg("step %ld: %s", t, rd.err);
      assert_int_equal(present, 1);
      grad_at((int)t, p, n, want);
      if (memcmp(got, want, n * sizeof(float)) != 0) fail_msg("step %ld, parameter %d: wrong gradient", t, p);
      for (int r = 0; r < 2; r++) assert_int_equal(rd.cur[r], t <= 4 ? 0 : 1);
    }
  assert_int_equal(rd.loads, 4); /* each file once */
  int present = 0;
  assert_int_equal(vr_reader_grad(&rd, 0, 2, got, &present), DOPT_OK);
  grad_at(2, 0, 12, want);
  assert_memory_equal(got, want, sizeof want);
  assert_int_equal(rd.loads, 6);
  assert_int_equal(vr_reader_seek(&rd, 0, 7), DOPT_ERR_FORMAT);
  assert_non_null(strstr(rd.err, "rank 0: no file holds step 7"));
  vr_reader_close(&rd);
  /* a missing block: the load fails naming the file, and the reader stays usable */
  char *ix = edited("\"rank1/b.safetensors\"", "\"rank1/none.safetensors\"");
  write_index(root, ix);
  free(ix);
  assert_int_equal(vr_reader_open(&rd, root), DOPT_OK);
  assert_int_equal(vr_reader_grad(&rd, 0, 4, got, &present), DOPT_OK);
  assert_int_not_equal(vr_reader_grad(&rd, 0, 5, got, &present), DOPT_OK);
  assert_non_null(strstr(rd.err, "rank1/none.safetensors"));
  vr_reader_close(&rd);
}

/* The same gradients as make_trace's recording, as one single-file trace (shards 1). */
static void make_single_trace(const char *path) {
  float w[12], b[5], gw[12], gb[5];
  initial_values(w, b);
  dopt_st_writer *wr;
  assert_ok(dopt_st_writer_create(&wr));
  int64_t ws[2] = {4, 3}, bs[1] = {5};
  assert_ok(dopt_st_writer_add(wr, "init/w", DOPT_F32, 2, ws, w));
  assert_ok(dopt_st_writer_add(wr, "init/b", DOPT_F32, 1, bs, b));
  char name[64];
  for (int t = 1; t <= STEPS; t++) {
    grad_at(t, 0, 12, gw);
    grad_at(t, 1, 5, gb);
    snprintf(name, sizeof name, "grad/%d/0/w", t);
    assert_ok(dopt_st_writer_add(wr, name, DOPT_F32, 2, ws, gw));
    snprintf(name, sizeof name, "grad/%d/0/b", t);
    assert_ok(dopt_st_writer_add(wr, name, DOPT_F32, 1, bs, gb));
  }
  assert_ok(dopt_st_writer_meta(wr, "params", "w,b"));
  assert_ok(dopt_st_writer_meta(wr, "steps", "6"));
  assert_ok(dopt_st_writer_meta(wr, "shards", "1"));
  assert_ok(dopt_st_writer_save(wr, path));
  dopt_st_writer_free(wr);
}

/* `distopt compare --trace` on trace (rest of the options appended); the exit code; its digest line into dg. */
static int compare_trace(const char *trace, const char *dp, char *dg, size_t cap) {
  const char *args[] = {"compare", "--trace", trace, "--optimizer", "adamw", "--hparams", HP, "--steps", "6",
                        "--tp", "2", "--dp", dp, "--zero", "3", "--quiet", NULL};
  int rc = run(args);
  char out[16384];
  slurp(outfile, out, sizeof out);
  const char *d = strstr(out, "digest sha256:");
  size_t n = d ? 7 + strcspn(d + 7, " \n") : 0; /* "digest sha256:HEX" */
  snprintf(dg, cap, "%.*s", (int)n, d ? d : "");
  if (rc == 0 && !strstr(out, "verdict: EQUIVALENT (bitwise")) fail_msg("%s: not bitwise:\n%s", trace, out);
  return rc;
}

/* exit 2 and exactly one line on stderr holding needle */
static void expect_one_line(int rc, const char *needle) {
  char err[4096];
  slurp(errfile, err, sizeof err);
  int lines = 0;
  for (const char *p = err; *p; p++) lines += *p == '\n';
  if (rc != 2 || lines != 1 || !strstr(err, needle))
    fail_msg("rc %d, %d lines, stderr '%s' (want '%s')", rc, lines, err, needle);
  printf("exit 2: %s", err);
}

static void test_compare_on_recording(void **st) {
  (void)st;
  char root[400], ipath[500], single[500], dg_dir[128], dg_index[128], dg_single[128];
  snprintf(root, sizeof root, "%s/ctrace", dir);
  snprintf(ipath, sizeof ipath, "%s/index.json", root);
  snprintf(single, sizeof single, "%s/ctrace.safetensors", dir);
  make_trace(root, 0);
  make_single_trace(single);
  /* the directory, its index.json and the single-file trace of the same gradients: bitwise equivalent
   * (tp 2 x zero 3 against the reference), one final digest */
  assert_int_equal(compare_trace(root, "1", dg_dir, sizeof dg_dir), 0);
  assert_int_equal(compare_trace(ipath, "1", dg_index, sizeof dg_index), 0);
  assert_int_equal(compare_trace(single, "1", dg_single, sizeof dg_single), 0);
  printf("recording: %s\nsingle file: %s\n", dg_dir, dg_single);
  assert_true(strlen(dg_dir) == strlen("digest sha256:") + 64);
  assert_string_equal(dg_dir, dg_index);
  assert_string_equal(dg_dir, dg_single);
  /* --sweep on a recording: every layout with dp 1 runs bitwise, dp 2 is skipped and said so */
  {
    const char *args[] = {"compare", "--trace", root, "--sweep", "--max-tp", "2", "--max-dp", "2", "--optimizer",
                          "adamw", "--hparams", HP, "--steps", "6", "--quiet", NULL};
    assert_int_equal(run(args), 0);
    char out[16384];
    slurp(outfile, out, sizeof out);
    if (!strstr(out, "8 of 8 layouts bitwise") || !strstr(out, "skipped"))
      fail_msg("--sweep on a recording:\n%s", out);
  }
  /* bad: dp 2 (a recorded gradient is the whole step's), more steps than recorded, a missing block */
  int rc = compare_trace(root, "2", dg_index, sizeof dg_index);
  expect_one_line(rc, "dp=2 with a recording");
  expect_one_line(rc, "so dp must be 1");
  {
    const char *args[] = {"compare", "--trace", root, "--optimizer", "adamw", "--steps", "7", "--tp", "2", "--dp",
                          "1", "--zero", "3", "--quiet", NULL};
    expect_one_line(run(args), "steps=7 but");
  }
  char *ix = edited("\"rank1/b.safetensors\"", "\"rank1/none.safetensors\"");
  write_index(root, ix);
  free(ix);
  expect_one_line(compare_trace(root, "1", dg_index, sizeof dg_index), "rank1/none.safetensors");
  /* 33 parameters (compare once held at most 32): no limit in the way, the missing tensor file is named */
  {
    size_t cap = 16384, n = 0;
    char *big = malloc(cap);
    assert_non_null(big);
    n += (size_t)snprintf(big + n, cap - n,
                          "{\"schema_version\": 1, \"kind\": \"distopt-record\", \"generator\": \"t\", "
                          "\"optimizer\": {\"name\": \"adamw\", \"upstream\": \"t\"}, \"groups\": [{\"hparams\": \"\"}], "
                          "\"params\": [");
    for (int p = 0; p < 33; p++)
      n += (size_t)snprintf(big + n, cap - n, "%s{\"name\": \"p%d\", \"shape\": [2], \"dtype\": \"F32\", \"group\": 0}",
                            p ? ", " : "", p);
    n += (size_t)snprintf(big + n, cap - n,
                          "], \"torch\": {\"version\": \"none\", \"cpu_capability\": \"none\", \"num_threads\": 1}, "
                          "\"record\": {\"every\": 1, \"params\": true, \"states\": true, \"flush_every\": 6}, "
                          "\"world_size\": 1, \"ranks\": [{\"rank\": 0, \"pieces\": [");
    for (int p = 0; p < 33; p++) n += (size_t)snprintf(big + n, cap - n, "%s{\"param\": \"p%d\"}", p ? ", " : "", p);
    snprintf(big + n, cap - n, "], \"files\": [{\"path\": \"r0.safetensors\", \"first_step\": 1, \"last_step\": 6}]}], "
                               "\"steps\": 6, \"complete\": true}");
    write_index(root, big);
    free(big);
    expect_one_line(compare_trace(root, "1", dg_index, sizeof dg_index), "r0.safetensors");
  }
}

/* No output of verify or compare is, or lies inside, the recording it reads: exit 2, one line, and every file
 * of the recording byte-identical afterwards (docs/files.md). */
static void test_outputs_outside_recording(void **st) {
  (void)st;
  char root[400], ipath[500], a_st[500], other[500];
  snprintf(root, sizeof root, "%s/kept", dir);
  snprintf(ipath, sizeof ipath, "%s/index.json", root);
  snprintf(a_st, sizeof a_st, "%s/rank0/a.safetensors", root);
  snprintf(other, sizeof other, "%s/rank1/new.json", root);
  make_trace(root, 0);
  dt_tree *before = dt_tree_snap(root);
  const char *v1[] = {"verify", root, "--json", ipath, NULL};
  expect_one_line(run(v1), "--json '");
  const char *v2[] = {"verify", root, "--plot", a_st, NULL};
  expect_one_line(run(v2), "is inside the input TRACE");
  const char *v3[] = {"verify", ipath, "--json", other, NULL};
  expect_one_line(run(v3), "is inside the input TRACE");
  const char *c1[] = {"compare", "--trace", root, "--dp", "1", "--json", ipath, NULL};
  expect_one_line(run(c1), "is inside the input --trace");
  const char *c2[] = {"compare", "--trace", ipath, "--dp", "1", "--plot", a_st, NULL};
  expect_one_line(run(c2), "is inside the input --trace");
  dt_tree *after = dt_tree_snap(root);
  char diff[800];
  if (dt_tree_diff(before, after, NULL, diff, sizeof diff)) fail_msg("the recording changed: %s", diff);
  dt_tree_free(before);
  dt_tree_free(after);
}

int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: %s /path/to/distopt\n", argv[0]);
    return 2;
  }
  bin = argv[1];
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_faithful_recording_verifies), cmocka_unit_test(test_agreement_compared_none),
      cmocka_unit_test(test_report_escapes),
      cmocka_unit_test(test_block_layout),
      cmocka_unit_test(test_stage_expert_layout), cmocka_unit_test(test_piece_runs),
      cmocka_unit_test(test_perturbed_state_diverges),
      cmocka_unit_test(test_missing_param_refused),
      cmocka_unit_test(test_index_error_one_line),
      cmocka_unit_test(test_step_count_diverges),
      cmocka_unit_test(test_stepwise_names_the_glitch),
      cmocka_unit_test(test_bad_input),
      cmocka_unit_test(test_reader_blocks),
      cmocka_unit_test(test_compare_on_recording),
      cmocka_unit_test(test_outputs_outside_recording),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}

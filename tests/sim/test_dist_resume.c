/* Reshardable checkpoints (docs/checkpoints.md): train K steps in layout A,
 * save (every rank its own pieces), load in layout B — another tp, dp, ZeRO
 * stage and plugin, uneven splits, 1 × 1 × 0 — continue to N; the result is
 * bit for bit the uninterrupted reference (every parameter, bf16 copy, state
 * and step counter), for every optimizer the distributed core runs. The dp
 * sum is batch-invariant and the gradients are one global batch of 12
 * micro-batches split as dp × (12/dp), so changing dp changes nothing either.
 * Also: a checkpoint of another optimizer or other hyperparameters is refused
 * on every rank, and a save that fails on one rank leaves the previous
 * generation loadable. */
#include "testutil.h"

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "disttest.h"
#include "distopt/checkpoint.h"

/* LISA layers via "layers.N."; uneven sizes for tp 2, 3 and dp 3, 4 */
static const dt_param PARAMS[] = {
    {"layers.0.sq", 2, {12, 12}, DOPT_TP_COLUMN, 0}, {"layers.1.tall", 2, {13, 5}, DOPT_TP_ROW, 0},
    {"layers.2.wide", 2, {5, 17}, DOPT_TP_COLUMN, 0}, {"emb", 2, {11, 6}, DOPT_TP_COLUMN, 0},
    {"layers.1.t3", 3, {2, 3, 5}, DOPT_TP_COLUMN, 0}, {"layers.0.vec", 1, {7}, DOPT_TP_COLUMN, 1},
    {"bias", 1, {9}, DOPT_TP_REPLICATED, 1},          {"s0", 0, {0}, DOPT_TP_REPLICATED, 1},
};
#define NPARAMS ((int)(sizeof PARAMS / sizeof PARAMS[0]))

static const struct {
  const char *opt, *hp;
  int bf16;
} OPTS[] = {
    {"adamw", "lr=1e-2,weight_decay=0.01", 1},
    {"adafactor", "beta1=0.9,weight_decay=0.01", 0},
    {"came", "lr=1e-3,weight_decay=0.01", 1},
    {"lamb", "lr=1e-2,bias_correction=true,weight_decay=0.01", 0},
    {"adamw8bit", "lr=1e-2,min_8bit_size=16,block_size=256", 0},
    {"galore_adamw", "lr=1e-2,rank=3,update_proj_gap=4", 0},
    {"galore_adamw8bit", "lr=1e-2,rank=3,update_proj_gap=5,min_8bit_size=8,block_size=256,proj_type=left", 0},
    {"q_galore", "lr=1e-2,rank=3,update_proj_gap=3,proj_group_size=-1,int8_weights=true,weight_group_size=1", 0},
    {"galore", "inner=adafactor,rank=3,update_proj_gap=4,beta1=0.9,weight_decay=0.01", 0},
    {"galore", "inner=lamb,rank=2,update_proj_gap=5,proj_type=left,lr=1e-2,weight_decay=0.01", 1},
    {"lisa", "inner=adamw,n_layers=1,interval=3,lr=1e-2", 0},
    {"lisa", "inner=galore,inner.inner=came,rank=2,update_proj_gap=3,n_layers=1,interval=4,lr=1e-3", 0},
    {"lisa", "inner=galore_adamw,rank=3,update_proj_gap=4,n_layers=2,interval=5,reset_states=true", 0},
    /* blocks of 64 that ZeRO and TP edges cut (absmax of shared blocks), percentile clipping's history */
    {"adamw8bit", "lr=1e-2,min_8bit_size=16,block_size=64,percentile_clipping=5,weight_decay=0.01", 1},
    /* Muon's matrices on owners (3-D per batch index), aux Adam piecewise */
    {"muon", "lr=2e-2,weight_decay=0.01", 1},
    /* issue 70's: lerp'd whole row/col states; z, v and the double weight_sum/lr_max; block sums per row */
    {"torch_adafactor", "weight_decay=0.05,beta2_decay=-0.5", 0},
    {"adamw_schedulefree", "lr=1e-2,weight_decay=0.01,warmup_steps=3,r=0.5", 1},
    {"adam_mini", "lr=1e-2,block=neuron,weight_decay=0.01", 0},
    {"normuon", "lr=2e-2,weight_decay=0.01", 1},
    /* APOLLO: low-rank moments, projector and the limiter's norm on the matrices' owners */
    {"apollo", "lr=1e-2,rank=2,update_proj_gap=3,weight_decay=0.01", 0},
    /* SOAP: preconditioners, eigenbases and v in the eigenbasis on the owners, refreshes after the cut */
    {"soap", "lr=1e-2,precondition_frequency=3,weight_decay=0.01", 1},
};
#define NOPTS ((int)(sizeof OPTS / sizeof OPTS[0]))

/* A → B pairs; every tp, dp and zero changes somewhere, 1×1×0 on both sides */
static const dt_layout PAIRS[][2] = {
    {{2, 2, 2, 0}, {1, 3, 3, 0}}, {{1, 4, 1, 0}, {3, 1, 0, 0}}, {{3, 2, 0, 256}, {2, 3, 2, 1}},
    {{1, 1, 0, 0}, {2, 2, 3, 0}}, {{2, 3, 3, 1}, {1, 1, 0, 0}}, {{1, 6, 2, 0}, {4, 1, 1, 0}},
};
#define NPAIRS ((int)(sizeof PAIRS / sizeof PAIRS[0]))

enum { STEPS = 12, K = 5, GLOBAL = 12 };

static dt_case make_case(int o, int dp) {
  dt_case c = {OPTS[o].opt, OPTS[o].hp, NULL, PARAMS, NPARAMS, STEPS, GLOBAL / dp, 0.0, OPTS[o].bf16,
               99 + (uint64_t)o, 0.05, 0, STEPS, 0, 0, 0, 0, 1};
  return c;
}

static void tmpdir(char *dir, size_t cap) {
  const char *t = getenv("TMPDIR");
  snprintf(dir, cap, "%s/dopt-resume-XXXXXX", t && t[0] ? t : "/tmp");
  assert_non_null(mkdtemp(dir));
}

static void rmtree(const char *dir) {
  char cmd[700];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
  assert_int_equal(system(cmd), 0);
}

static void run_phase(const dt_case *c, const dt_layout *l, int first, int last, const char *load, const char *save,
                      dt_result *ref, dt_result *got) {
  dt_expect(got, ref);
  char err[1024] = "";
  if (dt_run_dist_steps(c, l, first, last, load, save, got, err, sizeof err) != DOPT_OK)
    fail_msg("%s tp%d dp%d zero%d steps %d..%d: %s", c->optimizer, l->tp, l->dp, l->zero, first, last, err);
}

static void test_resume_grid(void **st) {
  (void)st;
  int runs = 0;
  for (int o = 0; o < NOPTS; o++) {
    dt_case c1 = make_case(o, 1);
    dt_result ref; /* uninterrupted; one global batch, so any dp gives it */
    assert_ok(dt_run_reference(&c1, 1, &ref));
    for (int p = 0; p < NPAIRS; p++) {
      const dt_layout *a = &PAIRS[p][0], *b = &PAIRS[p][1];
      dt_case ca = make_case(o, a->dp), cb = make_case(o, b->dp);
      char dir[512];
      tmpdir(dir, sizeof dir);
      dt_result ga, gb;
      run_phase(&ca, a, 1, K, NULL, dir, &ref, &ga);
      run_phase(&cb, b, K + 1, STEPS, dir, NULL, &ref, &gb);
      char msg[512] = "";
      if (dt_compare(&cb, &ref, &gb, msg, sizeof msg))
        fail_msg("%s [%s]: tp%d dp%d zero%d -> tp%d dp%d zero%d at step %d: not the uninterrupted run: %s",
                 c1.optimizer, c1.hparams, a->tp, a->dp, a->zero, b->tp, b->dp, b->zero, K, msg);
      dt_result_free(&ga);
      dt_result_free(&gb);
      rmtree(dir);
      runs++;
    }
    dt_result_free(&ref);
  }
  printf("resume grid: %d runs (%d optimizer settings x %d layout pairs), bitwise the uninterrupted run\n", runs,
         NOPTS, NPAIRS);
}

/* Two resumes real runs hit, for an elementwise (adamw), a factored (adafactor), an owner-mode (galore_adamw)
 * and a LISA optimizer: a run that skipped a step (a NaN gradient at step 3) before the save at step K, whose
 * step clock and per-parameter counters must survive the checkpoint (LISA samples its layers by that clock);
 * and a resume into ZeRO-1 with dp > 1, where a rank's ZeRO range is a piece of the block (not the whole
 * block, as at dp 1) and the per-element state pieces are not ZeRO-2's. Each bitwise the uninterrupted run. */
static void test_resume_real_runs(void **st) {
  (void)st;
  static const int WHICH[] = {0, 1, 5, 8}; /* adamw bf16, adafactor, galore_adamw, lisa(adamw) */
  static const struct {
    const char *what;
    int nan_step;
    dt_layout a, b;
  } CASES[] = {
      {"a step skipped before the save", 3, {2, 2, 2, 0}, {1, 3, 3, 0}},
      {"a step skipped before the save, same layout", 2, {1, 2, 1, 0}, {1, 2, 1, 0}},
      {"into ZeRO-1 with dp 3", 0, {2, 2, 2, 0}, {1, 3, 1, 0}},
      {"into ZeRO-1 with dp 2 from one rank", 0, {1, 1, 0, 0}, {2, 2, 1, 0}},
  };
  int runs = 0;
  for (size_t w = 0; w < sizeof WHICH / sizeof WHICH[0]; w++)
    for (size_t k = 0; k < sizeof CASES / sizeof CASES[0]; k++) {
      const int o = WHICH[w];
      dt_case c1 = make_case(o, 1), ca = make_case(o, CASES[k].a.dp), cb = make_case(o, CASES[k].b.dp);
      c1.nan_step = ca.nan_step = cb.nan_step = CASES[k].nan_step;
      dt_result ref, ga, gb;
      assert_ok(dt_run_reference(&c1, 1, &ref));
      if (CASES[k].nan_step && ref.skipped != 1) fail_msg("%s: the reference skipped %lld steps, not 1", c1.optimizer,
                                                          (long long)ref.skipped);
      char dir[512];
      tmpdir(dir, sizeof dir);
      run_phase(&ca, &CASES[k].a, 1, K, NULL, dir, &ref, &ga);
      run_phase(&cb, &CASES[k].b, K + 1, STEPS, dir, NULL, &ref, &gb);
      char msg[512] = "";
      if (dt_compare(&cb, &ref, &gb, msg, sizeof msg))
        fail_msg("%s [%s], %s: tp%d dp%d zero%d -> tp%d dp%d zero%d: not the uninterrupted run: %s", c1.optimizer,
                 c1.hparams, CASES[k].what, CASES[k].a.tp, CASES[k].a.dp, CASES[k].a.zero, CASES[k].b.tp,
                 CASES[k].b.dp, CASES[k].b.zero, msg);
      dt_result_free(&ref);
      dt_result_free(&ga);
      dt_result_free(&gb);
      rmtree(dir);
      runs++;
    }
  printf("real-run resumes: %d runs, bitwise the uninterrupted run\n", runs);
}

/* Through the single-device reference: a checkpoint written by tp2 x dp2 x
 * zero2 loads into the reference optimizer (dopt_optim_load) as exactly the
 * reference's own state after K steps (parameters, bf16 copies, states,
 * steps); saved again by the reference (dopt_optim_save), it resumes in
 * tp1 x dp3 x zero3 bitwise the uninterrupted run. */
static void test_resume_through_reference(void **st) {
  (void)st;
  static const int WHICH[] = {0, 1, 2, 5, 7, 9}; /* adamw bf16, adafactor, came bf16, galore, q_galore, lisa reset */
  const dt_layout a = {2, 2, 2, 0}, b = {1, 3, 3, 0};
  for (size_t w = 0; w < sizeof WHICH / sizeof WHICH[0]; w++) {
    const int o = WHICH[w];
    dt_case full = make_case(o, 1), ck = make_case(o, a.dp), cb = make_case(o, b.dp), atk = make_case(o, 1);
    ck.steps = K;
    atk.steps = K;
    dt_result ref, refk, ga, gb;
    assert_ok(dt_run_reference(&full, 1, &ref));
    assert_ok(dt_run_reference(&atk, 1, &refk));
    char d1[512], d2[512];
    tmpdir(d1, sizeof d1);
    tmpdir(d2, sizeof d2);
    run_phase(&ck, &a, 1, K, NULL, d1, &refk, &ga);
    /* into the reference */
    float *data[DT_MAXP], *master[DT_MAXP];
    uint16_t *work[DT_MAXP];
    dopt_optim *plain = NULL;
    assert_ok(dt_build_plain(&full, data, master, work, &plain));
    assert_ok(dopt_optim_load(plain, d1));
    for (int i = 0; i < NPARAMS; i++) {
      size_t n = 1;
      for (int k = 0; k < PARAMS[i].ndim; k++) n *= (size_t)PARAMS[i].shape[k];
      if (memcmp(data[i], refk.param[0][i], n * sizeof(float)) != 0)
        fail_msg("%s: %s after dopt_optim_load differs from the reference at step %d", full.optimizer, PARAMS[i].name, K);
      if (full.bf16 && memcmp(work[i], refk.work[0][i], n * sizeof(uint16_t)) != 0)
        fail_msg("%s: %s/bf16 after dopt_optim_load differs", full.optimizer, PARAMS[i].name);
      int64_t step = -1;
      assert_ok(dopt_optim_get_step(plain, i, &step));
      if (step != refk.step[0][i]) fail_msg("%s: %s step %lld vs %lld", full.optimizer, PARAMS[i].name, (long long)step,
                                            (long long)refk.step[0][i]);
      for (int q = 0; q < dopt_optim_num_states(plain, i); q++) {
        dopt_state_view v;
        assert_ok(dopt_optim_state(plain, i, q, &v));
        for (int k = 0; k < refk.nstates[i]; k++)
          if (strcmp(refk.state_name[i][k], v.name) == 0 && refk.state[0][i][k] &&
              memcmp(v.data, refk.state[0][i][k], v.bytes) != 0)
            fail_msg("%s: state %s/%s after dopt_optim_load differs", full.optimizer, PARAMS[i].name, v.name);
      }
    }
    /* out of the reference, into another layout */
    assert_ok(dopt_optim_save(plain, d2, NULL));
    run_phase(&cb, &b, K + 1, STEPS, d2, NULL, &ref, &gb);
    char msg[512] = "";
    if (dt_compare(&cb, &ref, &gb, msg, sizeof msg))
      fail_msg("%s: reference checkpoint -> tp1 dp3 zero3: not the uninterrupted run: %s", full.optimizer, msg);
    dopt_optim_destroy(plain);
    for (int i = 0; i < NPARAMS; i++) {
      free(data[i]);
      free(work[i]);
    }
    dt_result_free(&ref);
    dt_result_free(&refk);
    dt_result_free(&ga);
    dt_result_free(&gb);
    rmtree(d1);
    rmtree(d2);
  }
}

/* A checkpoint of another optimizer, or of other hyperparameters, is refused
 * on every rank (nothing stepped afterwards); the message names the key. */
/* Case 0 at tp 2 x dp 2 x ZeRO 2, steps 1..K saved into a fresh dir; the uninterrupted reference into ref. */
static const dt_layout SAVED_LAYOUT = {2, 2, 2, 0};
static dt_case saved_case(char *dir, size_t cap, dt_result *ref) {
  tmpdir(dir, cap);
  dt_case c = make_case(0, 2);
  dt_result got;
  assert_ok(dt_run_reference(&c, 2, ref));
  run_phase(&c, &SAVED_LAYOUT, 1, K, NULL, dir, ref, &got);
  dt_result_free(&got);
  return c;
}

static void test_resume_refused(void **st) {
  (void)st;
  char dir[512];
  dt_result ref, got;
  dt_case c = saved_case(dir, sizeof dir, &ref);
  const dt_layout l = SAVED_LAYOUT;
  static const char *const other[][3] = {
      {"adamw", "lr=2e-2,weight_decay=0.01", "lr"}, /* another hyperparameter value */
      {"lamb", "lr=1e-2,weight_decay=0.01", "lamb"}, /* another optimizer */
  };
  for (int k = 0; k < 2; k++) {
    dt_case o = c;
    o.optimizer = other[k][0];
    o.hparams = other[k][1];
    dt_expect(&got, &ref);
    char err[1024] = "";
    dopt_status s = dt_run_dist_steps(&o, &l, K + 1, STEPS, dir, NULL, &got, err, sizeof err);
    if (s == DOPT_OK) fail_msg("%s [%s]: a checkpoint of adamw [%s] was accepted", o.optimizer, o.hparams, c.hparams);
    if (!strstr(err, other[k][2])) fail_msg("refusal does not name '%s': %s", other[k][2], err);
    dt_result_free(&got);
  }
  dt_result_free(&ref);
  rmtree(dir);
}

/* In `file`, the first "F32" after each occurrence of `after` becomes "I32" (the same length: a safetensors
 * header keeps its size); the number of changes. */
static int retype_in(const char *file, const char *after) {
  size_t len;
  char *b = dt_slurp(file, &len);
  if (!b) return 0;
  const long n = (long)len;
  int changed = 0;
  const size_t al = strlen(after);
  for (long i = 0; i + (long)al < n; i++) {
    if (memcmp(b + i, after, al) != 0) continue;
    for (long j = i + (long)al; j + 5 <= n; j++)
      if (memcmp(b + j, "\"F32\"", 5) == 0) {
        b[j + 1] = 'I';
        changed++;
        break;
      }
  }
  FILE *f = fopen(file, "wb");
  assert_non_null(f);
  assert_int_equal(fwrite(b, 1, (size_t)n, f), (size_t)n);
  fclose(f);
  free(b);
  return changed;
}

/* A state stored with another dtype of the same size (I32 where the F32 exp_avg belongs; the index and the rank
 * files agree, the bytes and digests unchanged) is refused by the distributed load on every rank, naming the
 * tensor and both dtypes: read as floats it would load silently. */
static void test_resume_dtype_refused(void **st) {
  (void)st;
  char dir[512], path[700];
  dt_result ref, got;
  dt_case c = saved_case(dir, sizeof dir, &ref);
  const dt_layout l = SAVED_LAYOUT;
  int changed = 0;
  snprintf(path, sizeof path, "%s/step-%09d/index.json", dir, K);
  changed += retype_in(path, "\"emb/exp_avg\"");
  snprintf(path, sizeof path, "%s/step-%09d", dir, K);
  DIR *g = opendir(path);
  assert_non_null(g);
  for (struct dirent *e; (e = readdir(g)) != NULL;) {
    const size_t n = strlen(e->d_name);
    if (n < 12 || strcmp(e->d_name + n - 12, ".safetensors") != 0) continue;
    char file[1000];
    snprintf(file, sizeof file, "%s/%s", path, e->d_name);
    changed += retype_in(file, "\"emb/exp_avg@");
  }
  closedir(g);
  if (changed < 2) fail_msg("test bug: emb/exp_avg retyped in %d places", changed);
  dt_expect(&got, &ref);
  char err[1024] = "";
  dopt_status s = dt_run_dist_steps(&c, &l, K + 1, STEPS, dir, NULL, &got, err, sizeof err);
  if (s == DOPT_OK) fail_msg("an I32 emb/exp_avg was loaded as the F32 state");
  if (!strstr(err, "tensor 'emb/exp_avg': expected F32, the checkpoint has I32")) fail_msg("refusal: %s", err);
  dt_result_free(&got);
  dt_result_free(&ref);
  rmtree(dir);
}

/* 8-bit absmax of ROW-split tensors whose rows are wider than a block: a rank's blocks are strided (rows 0,
 * 1, ... of its columns touch blocks with gaps between them), so a load must pick its blocks out of the
 * saved range, not take the first ones. Bitwise the uninterrupted run across tp and dp changes. */
static void test_resume_8bit_strided_blocks(void **st) {
  (void)st;
  static const dt_param P[] = {{"wide_row", 2, {4, 300}, DOPT_TP_ROW, 0}, {"t3", 3, {2, 3, 130}, DOPT_TP_ROW, 0},
                               {"col", 2, {9, 70}, DOPT_TP_COLUMN, 0}};
  static const dt_layout PAIR[][2] = {{{3, 2, 2, 0}, {2, 3, 3, 0}}, {{1, 1, 0, 0}, {3, 1, 0, 0}},
                                      {{2, 2, 1, 0}, {1, 1, 0, 0}}};
  dt_case c1 = {"adamw8bit", "lr=1e-2,min_8bit_size=16,block_size=64", NULL, P, 3, STEPS, GLOBAL, 0.0, 0, 77, 0.05, 0,
                STEPS, 0, 0, 0, 0, 1};
  dt_result ref;
  assert_ok(dt_run_reference(&c1, 1, &ref));
  for (size_t k = 0; k < sizeof PAIR / sizeof PAIR[0]; k++) {
    const dt_layout *a = &PAIR[k][0], *b = &PAIR[k][1];
    dt_case ca = c1, cb = c1;
    ca.micro = GLOBAL / a->dp, cb.micro = GLOBAL / b->dp;
    char dir[512];
    tmpdir(dir, sizeof dir);
    dt_result ga, gb;
    run_phase(&ca, a, 1, K, NULL, dir, &ref, &ga);
    run_phase(&cb, b, K + 1, STEPS, dir, NULL, &ref, &gb);
    char msg[512] = "";
    if (dt_compare(&cb, &ref, &gb, msg, sizeof msg))
      fail_msg("adamw8bit strided blocks: tp%d dp%d zero%d -> tp%d dp%d zero%d: not the uninterrupted run: %s", a->tp,
               a->dp, a->zero, b->tp, b->dp, b->zero, msg);
    dt_result_free(&ga);
    dt_result_free(&gb);
    rmtree(dir);
  }
  dt_result_free(&ref);
}

/* Checkpoints written by an older layout resume bitwise: adamw8bit's when it stepped its 8-bit tensors in
 * owner mode (each tensor's codes and absmax whole on one rank; now sharded by blocks), galore_adamw's when
 * its owners were chosen by numel (now by cost and state bytes). The tensors are named and laid out logically
 * the same, only who held them changed. The fixtures (tests/data/ckpt-owner-layouts/<case>/, K steps at
 * tp2 x dp2 x zero2) were written by commit a51c4a2 with DOPT_WRITE_OWNER_FIXTURE=<dir>, which makes this
 * test write them instead of reading them.
 * Each resume is compared with the reference resumed from the same checkpoint (dopt_optim_load), and that with
 * the uninterrupted run: adamw8bit's must be it, bit for bit, everywhere. GaLore's projectors come from
 * OpenBLAS, whose kernels (picked by CPU) differ in the last bits between machines: the fixture holds the
 * writing machine's (AVX-512 SkylakeX/Cooperlake kernels), so galore's resumes are the uninterrupted run where
 * this machine's OpenBLAS picks those kernels (OPENBLAS_CORETYPE=SkylakeX forces them on an AVX-512 CPU), and
 * the resumed reference everywhere; the output says which held. */
static void test_resume_owner_mode_checkpoint(void **st) {
  (void)st;
  static const char *const HP[][3] = {
      {"plain", "adamw8bit", "lr=1e-2,min_8bit_size=16,block_size=64"},
      {"pct", "adamw8bit", "lr=1e-2,min_8bit_size=16,block_size=64,percentile_clipping=5,weight_decay=0.01"},
      /* owners by numel then, by cost and state bytes now (docs/distributed.md "Owners by cost") */
      {"galore", "galore_adamw", "lr=1e-2,rank=3,update_proj_gap=4"},
  };
  static const int BLAS[] = {0, 0, 1}; /* the fixture's steps went through OpenBLAS */
  static const dt_layout WROTE = {2, 2, 2, 0};
  static const dt_layout INTO[] = {{2, 2, 2, 0}, {1, 3, 3, 0}, {3, 2, 1, 0}, {1, 1, 0, 0}, {2, 4, 3, 64}};
  const char *write = getenv("DOPT_WRITE_OWNER_FIXTURE");
  int runs = 0;
  for (size_t h = 0; h < sizeof HP / sizeof HP[0]; h++) {
    dt_case c1 = {HP[h][1], HP[h][2], NULL, PARAMS, NPARAMS, STEPS, GLOBAL, 0.0, 0, 4242 + (uint64_t)h, 0.05, 0,
                  STEPS, 0, 0, 0, 0, 1};
    dt_result ref;
    assert_ok(dt_run_reference(&c1, 1, &ref));
    char dir[1024];
    if (write) {
      snprintf(dir, sizeof dir, "%s/%s", write, HP[h][0]);
      dt_case ca = c1;
      ca.micro = GLOBAL / WROTE.dp;
      dt_result ga;
      run_phase(&ca, &WROTE, 1, K, NULL, dir, &ref, &ga);
      dt_result_free(&ga);
      dt_result_free(&ref);
      continue;
    }
    snprintf(dir, sizeof dir, "%s/tests/data/ckpt-owner-layouts/%s", dt_source_dir(), HP[h][0]);
    dt_result rk; /* the reference resumed from the fixture */
    assert_ok(dt_run_reference_from(&c1, 1, dir, K + 1, &rk));
    char msg[512] = "";
    const int same = dt_compare(&c1, &ref, &rk, msg, sizeof msg) == 0;
    if (!same && !BLAS[h])
      fail_msg("%s [%s]: the reference resumed from the owner-mode checkpoint: not the uninterrupted run: %s",
               c1.optimizer, c1.hparams, msg);
    if (BLAS[h])
      printf("%s: this machine's OpenBLAS kernels (%s) %s the fixture's steps: resumes compared with %s\n", HP[h][0],
             getenv("OPENBLAS_CORETYPE") ? getenv("OPENBLAS_CORETYPE") : "picked by CPU",
             same ? "reproduce" : "do not reproduce",
             same ? "the uninterrupted run (and the resumed reference: the same bits)" : "the resumed reference");
    for (size_t b = 0; b < sizeof INTO / sizeof INTO[0]; b++) {
      dt_case cb = c1;
      cb.micro = GLOBAL / INTO[b].dp;
      dt_result gb;
      run_phase(&cb, &INTO[b], K + 1, STEPS, dir, NULL, &rk, &gb);
      if (dt_compare(&cb, &rk, &gb, msg, sizeof msg))
        fail_msg("%s [%s]: owner-mode checkpoint -> tp%d dp%d zero%d: not the reference resumed from it%s: %s",
                 c1.optimizer, c1.hparams, INTO[b].tp, INTO[b].dp, INTO[b].zero,
                 same ? " (nor the uninterrupted run)" : "", msg);
      dt_result_free(&gb);
      runs++;
    }
    dt_result_free(&rk);
    dt_result_free(&ref);
  }
  if (!write) printf("owner-mode checkpoints: %d resumes, bitwise the resumed reference\n", runs);
}

int main(void) {
  const struct CMUnitTest tests[] = {cmocka_unit_test(test_resume_grid), cmocka_unit_test(test_resume_real_runs),
                                     cmocka_unit_test(test_resume_through_reference),
                                     cmocka_unit_test(test_resume_refused),
                                     cmocka_unit_test(test_resume_dtype_refused),
                                     cmocka_unit_test(test_resume_owner_mode_checkpoint),
                                     cmocka_unit_test(test_resume_8bit_strided_blocks)};
  return cmocka_run_group_tests(tests, NULL, NULL);
}

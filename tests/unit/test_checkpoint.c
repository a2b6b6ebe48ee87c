/* Checkpoints (core/ckpt_*.c, docs/checkpoints.md): bitwise resume for
 * every optimizer; every corruption class refused with a one-line message and
 * nothing loaded; a crash between rank files leaves the previous generation;
 * any piece read back from a checkpoint written in other pieces. */
#include "testutil.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "distopt/checkpoint.h"
#include "distopt/digest.h"
#include "distopt/safetensors.h"
#include "grid.h"

static char dir[256];

static int setup(void **st) {
  (void)st;
  return dt_make_tmpdir(dir, sizeof dir, "dopt_ckpt");
}

static int teardown(void **st) {
  (void)st;
  return dt_remove_tmpdir(dir);
}

static const char *sub(const char *name) {
  static char bufs[4][512];
  static int k;
  char *b = bufs[k++ & 3];
  snprintf(b, 512, "%s/%s", dir, name);
  return b;
}

static void rm_rf(const char *path) {
  char cmd[1200];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", path);
  assert_int_equal(system(cmd), 0);
}

/* ---- a model: parameters of several ranks, some bf16, gradients by step ---------- */

enum { NP = 7 };
typedef struct model {
  float *data[NP];
  uint16_t *work[NP];
  float *master[NP];
  float *grad[NP];
  size_t numel[NP];
} model;

static const char *const pname[NP] = {"layers.0.w", "layers.1.w", "layers.0.b", "norm", "t3", "scalar", "unused"};
static const int pndim[NP] = {2, 2, 1, 1, 3, 0, 2};
static const int64_t pshape[NP][3] = {{8, 12}, {12, 8}, {12}, {8}, {2, 3, 4}, {0}, {4, 4}};

static void model_init(model *m, int bf16, uint64_t seed) {
  for (int i = 0; i < NP; i++) {
    size_t n = 1;
    for (int d = 0; d < pndim[i]; d++) n *= (size_t)pshape[i][d];
    m->numel[i] = n;
    m->data[i] = malloc(n * sizeof(float));
    m->grad[i] = malloc(n * sizeof(float));
    m->master[i] = NULL;
    m->work[i] = NULL;
    uint64_t s = seed * 131 + (uint64_t)i;
    for (size_t k = 0; k < n; k++) m->data[i][k] = (float)(0.5 * dt_rand_normal(&s));
    if (bf16 && (i == 1 || i == 3)) { /* two mixed-precision parameters */
      m->master[i] = m->data[i];
      m->work[i] = malloc(n * sizeof(uint16_t));
      for (size_t k = 0; k < n; k++) m->work[i][k] = dopt_f32_to_bf16(m->master[i][k]);
    }
  }
}

static void model_free(model *m) {
  for (int i = 0; i < NP; i++) {
    free(m->data[i]);
    free(m->grad[i]);
    free(m->work[i]);
  }
}

static dopt_optim *build(const char *name, const char *hp, const char *group, model *m) {
  dopt_optim *o;
  assert_ok(dopt_optim_create(name, hp, &o));
  int g1 = 0;
  if (group) assert_ok(dopt_optim_add_group(o, group, &g1));
  for (int i = 0; i < NP; i++) {
    dopt_param_config pc = DOPT_PARAM_CONFIG_INIT;
    pc.name = pname[i];
    pc.ndim = pndim[i];
    for (int d = 0; d < pndim[i]; d++) pc.shape[d] = pshape[i][d];
    pc.layer = dopt_layer_from_name(pname[i]);
    if (m->work[i]) {
      pc.dtype = DOPT_BF16;
      pc.data = m->work[i];
      pc.master = m->master[i];
    } else {
      pc.data = m->data[i];
    }
    assert_ok(dopt_optim_add_param(o, (i == 2 || i == 3) ? g1 : 0, &pc, NULL));
  }
  return o;
}

/* Step t's gradients (t = 1, 2, ...): heavy-ish tails, some parameters without one. */
static void step(dopt_optim *o, model *m, int t) {
  const float *g[NP];
  for (int i = 0; i < NP; i++) {
    uint64_t s = (uint64_t)t * 1000003u + (uint64_t)i;
    for (size_t k = 0; k < m->numel[i]; k++) m->grad[i][k] = (float)(dt_rand_normal(&s) * (k % 5 == 0 ? 3.0 : 0.3));
    g[i] = m->grad[i];
  }
  g[6] = NULL;                       /* "unused" never has a gradient: no state */
  if (t % 3 == 2) g[2] = NULL;       /* the bias skips some steps: another step count */
  assert_ok(dopt_optim_step(o, g));
}

/* Bitwise: parameters, working copies, every state, step counts and the clock. */
static void assert_same(dopt_optim *a, const model *ma, dopt_optim *b, const model *mb, const char *what) {
  assert_int_equal(dopt_optim_get_gstep(a), dopt_optim_get_gstep(b));
  for (int i = 0; i < NP; i++) {
    if (memcmp(ma->data[i], mb->data[i], ma->numel[i] * sizeof(float)) != 0)
      fail_msg("%s: parameter %s differs", what, pname[i]);
    if (ma->work[i] && memcmp(ma->work[i], mb->work[i], ma->numel[i] * sizeof(uint16_t)) != 0)
      fail_msg("%s: bf16 copy of %s differs", what, pname[i]);
    int64_t sa, sb;
    assert_ok(dopt_optim_get_step(a, i, &sa));
    assert_ok(dopt_optim_get_step(b, i, &sb));
    if (sa != sb) fail_msg("%s: %s step %lld vs %lld", what, pname[i], (long long)sa, (long long)sb);
    int na = dopt_optim_num_states(a, i), nb = dopt_optim_num_states(b, i);
    if (na != nb) fail_msg("%s: %s has %d vs %d states", what, pname[i], na, nb);
    for (int k = 0; k < na; k++) {
      dopt_state_view va, vb;
      assert_ok(dopt_optim_state(a, i, k, &va));
      assert_ok(dopt_optim_state(b, i, k, &vb));
      assert_string_equal(va.name, vb.name);
      assert_int_equal(va.bytes, vb.bytes);
      if (memcmp(va.data, vb.data, va.bytes) != 0) fail_msg("%s: state %s/%s differs", what, pname[i], va.name);
    }
  }
}

/* SHA-256 of an optimizer's whole state (to show a failed load changed nothing). */
static void optim_digest(dopt_optim *o, const model *m, char hex[DOPT_DIGEST_HEX]) {
  dopt_digest *d;
  assert_ok(dopt_digest_create(&d));
  int64_t g = dopt_optim_get_gstep(o);
  assert_ok(dopt_digest_bytes(d, &g, sizeof g));
  for (int i = 0; i < NP; i++) {
    assert_ok(dopt_digest_bytes(d, m->data[i], m->numel[i] * sizeof(float)));
    if (m->work[i]) assert_ok(dopt_digest_bytes(d, m->work[i], m->numel[i] * sizeof(uint16_t)));
    int64_t s;
    assert_ok(dopt_optim_get_step(o, i, &s));
    int n = dopt_optim_num_states(o, i);
    assert_ok(dopt_digest_bytes(d, &s, sizeof s));
    assert_ok(dopt_digest_bytes(d, &n, sizeof n));
    for (int k = 0; k < n; k++) {
      dopt_state_view v;
      assert_ok(dopt_optim_state(o, i, k, &v));
      assert_ok(dopt_digest_bytes(d, v.data, v.bytes));
    }
  }
  assert_ok(dopt_digest_final(d, NULL, hex));
  dopt_digest_destroy(d);
}

/* ---- bitwise resume ------------------------------------------------------------------- */

typedef struct resume_case {
  const char *name, *hp, *group;
  int bf16;
} resume_case;

static const resume_case cases[] = {
    {"adamw", "lr=1e-2,weight_decay=0.1", "weight_decay=0", 1},
    {"adamw", "lr=1e-2,amsgrad=true", NULL, 0},
    {"adafactor", NULL, "weight_decay=0", 1},
    {"adafactor", "beta1=0.9,weight_decay=0.01,lr=1e-2,relative_step=false", NULL, 0},
    {"came", "lr=1e-3,weight_decay=0.01", "beta3=0.99", 1},
    {"lamb", "lr=1e-2,weight_decay=0.01,bias_correction=true", "adam=true", 0},
    {"adamw8bit", "lr=1e-2,min_8bit_size=64,block_size=64,percentile_clipping=5", NULL, 1},
    {"galore_adamw", "lr=1e-2,rank=3,update_proj_gap=3", "rank=0", 1},
    {"galore_adamw", "lr=1e-2,rank=2,update_proj_gap=2,proj_type=full,svd=randomized,seed=5", NULL, 0},
    {"galore_adamw8bit", "lr=1e-2,rank=3,update_proj_gap=3,min_8bit_size=16,block_size=64", NULL, 0},
    {"q_galore", "lr=1e-2,rank=3,update_proj_gap=2,queue_size=2,cos_threshold=-1,proj_group_size=-1,min_8bit_size=16,"
                 "block_size=64,int8_weights=true,weight_group_size=8", NULL, 0},
    {"q_galore", "lr=1e-2,rank=2,update_proj_gap=2,queue_size=3,proj_quant=false,cos_threshold=0.2", NULL, 1},
    {"galore", "inner=adafactor,rank=3,update_proj_gap=3,beta1=0.9,weight_decay=0.01", "rank=0", 1},
    {"galore", "inner=lamb,rank=2,update_proj_gap=2,proj_type=left,lr=1e-2,weight_decay=0.01", NULL, 0},
    {"galore", "inner=adamw8bit,rank=3,update_proj_gap=4,min_8bit_size=8,block_size=64,svd=randomized,seed=2", NULL,
     0},
    {"galore", "inner=came,rank=2,update_proj_gap=2,lr=1e-3,proj_quant=true,proj_group_size=-1,lazy_refresh=true,"
               "queue_size=2,cos_threshold=-1,int8_weights=true,weight_group_size=4", "rank=0", 0},
    {"lisa", "inner=adamw,n_layers=1,interval=3,seed=3,lr=1e-2", "weight_decay=0", 1},
    {"lisa", "inner=galore,inner.inner=came,n_layers=1,interval=2,rank=2,update_proj_gap=3,lr=1e-3", NULL, 0},
    {"lisa", "inner=adamw,n_layers=1,interval=3,seed=4,reset_states=true,lr=1e-2", NULL, 0},
    {"lisa", "inner=galore_adamw,n_layers=1,interval=2,reset_states=true,rank=2,update_proj_gap=2,lr=1e-2", NULL, 1},
    {"lisa", "inner=q_galore,n_layers=1,interval=3,rank=2,update_proj_gap=2,queue_size=2,proj_group_size=-1", NULL, 0},
    /* Muon on the matrices (bf16), aux Adam on the rest (auto); a whole aux group; fp32 iteration */
    {"muon", "lr=2e-2,weight_decay=0.01", "use_muon=false,weight_decay=0", 1},
    {"muon", "lr=2e-2,ns_dtype=fp32,nesterov=false,adjust_lr_fn=original", NULL, 0},
    {"lisa", "inner=muon,n_layers=1,interval=2,lr=2e-2", NULL, 0},
    /* torch.optim.Adafactor: lerp'd factored moments (whole row/col states) and the 1-D variance */
    {"torch_adafactor", "weight_decay=0.05,beta2_decay=-0.5", "eps1=1e-3,d=2", 1},
    {"galore", "inner=torch_adafactor,rank=2,update_proj_gap=2,lr=1e-2", NULL, 0},
    /* Schedule-Free AdamW: z, v and the double weight_sum/lr_max; saved in evaluation mode (resume_one) */
    {"adamw_schedulefree", "lr=1e-2,weight_decay=0.05,warmup_steps=2,r=0.5", "beta1=0.5", 1},
    {"lisa", "inner=adamw_schedulefree,n_layers=1,interval=2,lr=1e-2", NULL, 0},
    /* Adam-mini: a second moment per row (whole [rows, 1] states), plain Adam in group 1; one per tensor */
    {"adam_mini", "lr=1e-2,block=neuron,weight_decay=0.05", "block=elementwise,weight_decay=0", 1},
    {"adam_mini", "lr=1e-2,block=tensor", NULL, 0},
    /* NorMuon: momentum and the rows' [d0, 1] second moment on the matrices, AdamW on the rest; fp32 iteration */
    {"normuon", "lr=2e-2,weight_decay=0.01", "use_muon=false,weight_decay=0", 1},
    {"normuon", "lr=2e-2,ns_dtype=fp32,update_scale=match_rms,nesterov=false", NULL, 0},
    /* APOLLO: low-rank moments, the projector between refreshes and the limiter's norm; APOLLO-Mini in group 1 */
    {"apollo", "lr=1e-2,rank=2,update_proj_gap=3,weight_decay=0.05", "rank=1,scale_type=tensor,scale=128", 1},
    {"apollo", "lr=1e-2,rank=3,update_proj_gap=4,proj_type=left,scale_type=tensor,scale_front=true", NULL, 0},
    {"lisa", "inner=apollo,n_layers=1,interval=2,rank=2,update_proj_gap=3,lr=1e-2", NULL, 0},
    /* SOAP: the preconditioners GG<k> and eigenbases Q<k> (whole), v in the eigenbasis, QR refreshes on both
     * sides of the cut; preconditioned vectors and a dimension past max_precondition_dim */
    {"soap", "lr=1e-2,precondition_frequency=2,weight_decay=0.05", "beta2=0.9", 1},
    {"soap", "lr=1e-2,precondition_frequency=3,precondition_1d=true,max_precondition_dim=5,normalize_gradient=true",
     NULL, 0},
    {"lisa", "inner=soap,n_layers=1,interval=2,lr=1e-2,precondition_frequency=2", NULL, 0},
};

static void resume_one(const resume_case *c, int K, int N) {
  char what[400], ck[300];
  snprintf(what, sizeof what, "%s(%s | %s, bf16=%d) K=%d N=%d", c->name, c->hp ? c->hp : "", c->group ? c->group : "",
           c->bf16, K, N);
  snprintf(ck, sizeof ck, "%s/resume", dir);
  rm_rf(ck);
  model a, b;
  model_init(&a, c->bf16, 1);
  model_init(&b, c->bf16, 1);
  dopt_optim *oa = build(c->name, c->hp, c->group, &a);
  dopt_optim *ob = build(c->name, c->hp, c->group, &b);
  /* an optimizer with train/eval points (adamw_schedulefree) is saved in evaluation mode, as schedulefree advises:
   * the checkpoint says so, the loaded optimizer is in that mode, and train mode takes both back to y */
  for (int t = 1; t <= K; t++) step(oa, &a, t);
  const int modes = dopt_optim_set_mode(oa, 1) == DOPT_OK;
  if (modes) assert_ok(dopt_optim_set_mode(oa, 0));
  for (int t = K + 1; t <= K + N; t++) step(oa, &a, t);
  for (int t = 1; t <= K; t++) step(ob, &b, t);
  if (modes) assert_ok(dopt_optim_set_mode(ob, 1));
  assert_ok(dopt_optim_save(ob, ck, NULL));
  dopt_optim_destroy(ob);
  model_free(&b);
  /* a fresh optimizer over other initial values: everything must come from the checkpoint */
  model_init(&b, c->bf16, 99);
  ob = build(c->name, c->hp, c->group, &b);
  assert_ok(dopt_optim_load(ob, ck));
  assert_int_equal(dopt_optim_get_mode(ob), modes);
  if (modes) assert_ok(dopt_optim_set_mode(ob, 0));
  for (int t = K + 1; t <= K + N; t++) step(ob, &b, t);
  assert_same(oa, &a, ob, &b, what);
  dopt_optim_destroy(oa);
  dopt_optim_destroy(ob);
  model_free(&a);
  model_free(&b);
}

static void test_resume_bitwise(void **st) {
  (void)st;
  int names = 0;
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    resume_one(&cases[i], 4, 5);
    resume_one(&cases[i], 1, 3); /* saved right after the first step */
  }
  /* every registered optimizer is in the grid */
  for (int r = 0; r < dopt_optim_registry_count(); r++) {
    int found = 0;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) found |= strcmp(cases[i].name, dopt_optim_registry_name(r)) == 0;
    if (!found) fail_msg("optimizer %s has no resume case", dopt_optim_registry_name(r));
    names++;
  }
  assert_int_equal(names, 17); /* a registry that lost one fails here */
}

/* Save before any step (no states), and save twice at the same step (the generation is replaced). */
static void test_save_edges(void **st) {
  (void)st;
  char ck[300];
  snprintf(ck, sizeof ck, "%s/edges", dir);
  model a, b;
  model_init(&a, 1, 5);
  model_init(&b, 1, 6);
  dopt_optim *oa = build("adafactor", NULL, NULL, &a), *ob = build("adafactor", NULL, NULL, &b);
  assert_ok(dopt_optim_save(oa, ck, NULL));
  assert_ok(dopt_optim_save(oa, sub("edges0"), NULL));
  assert_ok(dopt_optim_load(ob, ck));
  assert_same(oa, &a, ob, &b, "before any step");
  step(oa, &a, 1);
  dopt_ckpt_info info = DOPT_CKPT_INFO_INIT;
  info.global_step = 0; /* a global step below the steps taken: the counters disagree, nothing written */
  assert_status(dopt_optim_save(oa, ck, &info), DOPT_ERR_INVALID_ARG, "global_step=0 is less than optimizer_steps=1");
  info.global_step = 1;
  assert_ok(dopt_optim_save(oa, ck, &info));
  step(oa, &a, 1);
  info.global_step = 1; /* the same generation name again (a label the caller chose) */
  info.skipped_steps = 0;
  assert_status(dopt_optim_save(oa, ck, &info), DOPT_ERR_INVALID_ARG, "optimizer_steps=2");
  info.global_step = -1;
  assert_ok(dopt_optim_save(oa, ck, &info)); /* step-000000002 */
  assert_ok(dopt_optim_load(ob, ck));
  assert_same(oa, &a, ob, &b, "a later generation");
  assert_ok(dopt_optim_save(oa, ck, &info)); /* step-000000002 again: replaced */
  assert_ok(dopt_optim_load(ob, ck));
  assert_same(oa, &a, ob, &b, "replaced generation");
  /* the latest file names the generation; no temporary directory is left */
  FILE *f = fopen(sub("edges/latest"), "r");
  char line[64] = "";
  assert_non_null(f);
  assert_non_null(fgets(line, sizeof line, f));
  fclose(f);
  assert_string_equal(line, "step-000000002\n");
  struct stat sb;
  assert_int_not_equal(stat(sub("edges/.tmp-step-000000002"), &sb), 0);
  /* global step and skipped steps are recorded */
  info.global_step = 7;
  info.skipped_steps = 2;
  assert_ok(dopt_optim_save(oa, ck, &info));
  dopt_ckpt_reader *r;
  const dopt_ckpt_meta *m;
  assert_ok(dopt_ckpt_open(ck, &r));
  assert_ok(dopt_ckpt_read_meta(r, &m));
  assert_int_equal(m->global_step, 7);
  assert_int_equal(m->skipped_steps, 2);
  assert_int_equal(m->optimizer_steps, 2);
  assert_string_equal(m->optimizer, "adafactor");
  assert_null(m->wrapper);
  assert_string_equal(m->world.plugin, "reference");
  assert_int_equal(m->nparams, NP);
  assert_int_equal(m->params[1].dtype, DOPT_BF16);
  assert_true(m->params[1].has_bf16);
  assert_false(m->params[6].has_state);
  assert_true(strstr(dopt_ckpt_path(r), "step-000000007") != NULL);
  assert_ok(dopt_ckpt_verify(r));
  dopt_ckpt_close(r);
  /* a whole piece is stored with its tensor's shape */
  dopt_st_file *sf;
  assert_ok(dopt_st_load(sub("edges/step-000000007/rank-00000-of-00001.safetensors"), &sf));
  dopt_st_tensor t;
  assert_ok(dopt_st_find(sf, "t3/exp_avg_sq_row@0", &t));
  assert_int_equal(t.ndim, 2);
  assert_ok(dopt_st_find(sf, "t3@0", &t));
  assert_int_equal(t.ndim, 3);
  assert_int_equal(t.shape[2], 4);
  assert_ok(dopt_st_find(sf, "layers.1.w/bf16@0", &t));
  assert_int_equal(t.dtype, DOPT_BF16);
  dopt_st_free(sf);
  /* a generation directory opens directly too */
  assert_ok(dopt_ckpt_open(sub("edges/step-000000000"), &r));
  dopt_ckpt_close(r);
  /* loading a checkpoint without states into a stepped optimizer frees its states (step 0, clock 0) */
  model c;
  model_init(&c, 1, 5);
  dopt_optim *oc = build("adafactor", NULL, NULL, &c);
  step(ob, &b, 1);
  step(ob, &b, 2);
  assert_int_not_equal(dopt_optim_num_states(ob, 0), 0);
  assert_ok(dopt_optim_load(ob, sub("edges0")));
  assert_same(oc, &c, ob, &b, "states freed by a load");
  dopt_optim_destroy(oc);
  model_free(&c);
  dopt_optim_destroy(oa);
  dopt_optim_destroy(ob);
  model_free(&a);
  model_free(&b);
}

/* Hyperparameters by name in index.json: enumerations as names, none as null, the wrapper apart. */
static void test_index_names(void **st) {
  (void)st;
  char ck[300];
  snprintf(ck, sizeof ck, "%s/names", dir);
  model a;
  model_init(&a, 0, 2);
  dopt_optim *o = build("lisa", "inner=galore_adamw,rank=2,proj_type=reverse_std,lr=1e-2", NULL, &a);
  step(o, &a, 1);
  assert_ok(dopt_optim_save(o, ck, NULL));
  cJSON *j;
  FILE *f = fopen(sub("names/step-000000001/index.json"), "rb");
  assert_non_null(f);
  static char text[1 << 20];
  size_t n = fread(text, 1, sizeof text - 1, f);
  fclose(f);
  text[n] = '\0';
  assert_non_null(j = cJSON_Parse(text));
  assert_string_equal(cJSON_GetObjectItem(j, "format")->valuestring, "distopt-checkpoint");
  assert_int_equal(cJSON_GetObjectItem(j, "version")->valueint, 1);
  assert_string_equal(cJSON_GetObjectItem(j, "optimizer")->valuestring, "galore_adamw");
  cJSON *w = cJSON_GetObjectItem(j, "wrapper");
  assert_string_equal(cJSON_GetObjectItem(w, "name")->valuestring, "lisa");
  assert_string_equal(cJSON_GetObjectItem(cJSON_GetObjectItem(w, "hparams"), "inner")->valuestring, "galore_adamw");
  cJSON *g0 = cJSON_GetObjectItem(cJSON_GetArrayItem(cJSON_GetObjectItem(j, "groups"), 0), "hparams");
  assert_string_equal(cJSON_GetObjectItem(g0, "proj_type")->valuestring, "reverse_std");
  assert_true(cJSON_IsTrue(cJSON_GetObjectItem(g0, "correct_bias")));
  assert_true(cJSON_GetObjectItem(g0, "lr")->valuedouble == 1e-2);
  cJSON_Delete(j);
  dopt_optim_destroy(o);
  model_free(&a);
  /* Adafactor's unset lr is null */
  model_init(&a, 0, 2);
  o = build("adafactor", NULL, NULL, &a);
  assert_ok(dopt_optim_save(o, sub("names2"), NULL));
  f = fopen(sub("names2/step-000000000/index.json"), "rb");
  n = fread(text, 1, sizeof text - 1, f);
  fclose(f);
  text[n] = '\0';
  assert_non_null(strstr(text, "\"lr\":\tnull"));
  dopt_optim_destroy(o);
  model_free(&a);
}

/* ---- corruption -------------------------------------------------------------------------- */

static const char *RANKF = "rank-00000-of-00001.safetensors";

/* fmt: rm -rf P && cp -r DIR/good/... P */
static void copy_good(const char *p) {
  char cmd[4096];
  snprintf(cmd, sizeof cmd, "rm -rf '%s' && cp -r '%s/good/step-000000004' '%s'", p, dir, p);
  assert_int_equal(system(cmd), 0);
}

static void flip_byte(const char *path, long off) {
  FILE *f = fopen(path, "r+b");
  assert_non_null(f);
  if (off < 0) {
    fseek(f, 0, SEEK_END);
    off += ftell(f);
  }
  fseek(f, off, SEEK_SET);
  int c = fgetc(f);
  fseek(f, off, SEEK_SET);
  fputc(c ^ 0x10, f);
  fclose(f);
}

/* Edits index.json with fn. */
static void edit_index(const char *gen, void (*fn)(cJSON *)) {
  char path[1200];
  snprintf(path, sizeof path, "%s/index.json", gen);
  FILE *f = fopen(path, "rb");
  static char text[1 << 20];
  size_t n = fread(text, 1, sizeof text - 1, f);
  fclose(f);
  text[n] = '\0';
  cJSON *j = cJSON_Parse(text);
  assert_non_null(j);
  fn(j);
  char *out = cJSON_Print(j);
  f = fopen(path, "wb");
  fputs(out, f);
  fclose(f);
  free(out);
  cJSON_Delete(j);
}

/* Replaces the first `from` in gen's index.json text with `to` (raw text: what cJSON cannot print). */
static void edit_index_text(const char *gen, const char *from, const char *to) {
  char path[1200];
  snprintf(path, sizeof path, "%s/index.json", gen);
  FILE *f = fopen(path, "rb");
  assert_non_null(f);
  static char text[1 << 20], out[(1 << 20) + 256];
  size_t n = fread(text, 1, sizeof text - 1, f);
  fclose(f);
  text[n] = '\0';
  char *at = strstr(text, from);
  assert_non_null(at);
  snprintf(out, sizeof out, "%.*s%s%s", (int)(at - text), text, to, at + strlen(from));
  f = fopen(path, "wb");
  fputs(out, f);
  fclose(f);
}

static cJSON *first_piece(cJSON *j, const char *tensor) {
  cJSON *t;
  cJSON_ArrayForEach(t, cJSON_GetObjectItem(j, "tensors")) if (strcmp(cJSON_GetObjectItem(t, "name")->valuestring,
                                                                     tensor) == 0) return cJSON_GetArrayItem(
      cJSON_GetObjectItem(t, "pieces"), 0);
  fail_msg("no tensor %s", tensor);
  return NULL;
}
static void set_num(cJSON *o, const char *key, double v) { cJSON_SetNumberValue(cJSON_GetObjectItem(o, key), v); }
static void ed_version(cJSON *j) { set_num(j, "version", 2); }
static void ed_gap(cJSON *j) { /* the piece starts one element late */
  cJSON *p = first_piece(j, "layers.0.w/exp_avg");
  set_num(p, "lo", 1);
  set_num(p, "len", 95);
  set_num(p, "bytes", 380);
}
static void ed_overlap(cJSON *j) { /* a second copy of the only piece */
  cJSON *t;
  cJSON_ArrayForEach(t, cJSON_GetObjectItem(j, "tensors")) if (strcmp(cJSON_GetObjectItem(t, "name")->valuestring,
                                                                     "norm") == 0) {
    cJSON *ps = cJSON_GetObjectItem(t, "pieces");
    cJSON_AddItemToArray(ps, cJSON_Duplicate(cJSON_GetArrayItem(ps, 0), 1));
  }
}
static void ed_short(cJSON *j) { /* the piece claims fewer elements: a gap, and a byte count that does not match */
  cJSON *p = first_piece(j, "t3");
  set_num(p, "len", 20);
  set_num(p, "bytes", 80);
}
static void ed_format(cJSON *j) { cJSON_ReplaceItemInObject(j, "format", cJSON_CreateString("something-else")); }
/* hand-edited counters that disagree (the good generation: 4 steps taken, none skipped, global step 4) */
static void ed_global_low(cJSON *j) { set_num(j, "global_step", 3); }
static void ed_skipped_high(cJSON *j) { set_num(j, "skipped_steps", 1); }
static void ed_param_step_high(cJSON *j) { set_num(cJSON_GetArrayItem(cJSON_GetObjectItem(j, "params"), 2), "step", 5); }

typedef struct corrupt_case {
  const char *name;
  dopt_status want;
  const char *needle1, *needle2;
} corrupt_case;

static void expect_refused(dopt_optim *o, const model *m, const char *path, dopt_status want, const char *n1,
                           const char *n2) {
  char before[DOPT_DIGEST_HEX], after[DOPT_DIGEST_HEX];
  optim_digest(o, m, before);
  dopt_status s = dopt_optim_load(o, path);
  const char *msg = dopt_last_error();
  if (s != want) fail_msg("%s: load gave %s (%s), want %s", path, dopt_status_name(s), msg, dopt_status_name(want));
  if (n1 && !strstr(msg, n1)) fail_msg("%s: message '%s' does not name '%s'", path, msg, n1);
  if (n2 && !strstr(msg, n2)) fail_msg("%s: message '%s' does not name '%s'", path, msg, n2);
  if (strchr(msg, '\n')) fail_msg("message is not one line: %s", msg);
  optim_digest(o, m, after);
  if (strcmp(before, after) != 0) fail_msg("%s: a refused load changed the optimizer", path);
  print_message("refused as expected: %s\n", msg);
}

/* A galore checkpoint names its inner: another inner (other keys and states) is refused in one line. */
static void test_galore_inner(void **st) {
  (void)st;
  char ck[300];
  snprintf(ck, sizeof ck, "%s/galore_inner", dir);
  rm_rf(ck);
  model a, c;
  model_init(&a, 0, 1);
  dopt_optim *oa = build("galore", "inner=adamw,rank=2,update_proj_gap=2,lr=1e-2", NULL, &a);
  for (int t = 1; t <= 3; t++) step(oa, &a, t);
  assert_ok(dopt_optim_save(oa, ck, NULL));
  model_init(&c, 0, 9);
  dopt_optim *oc = build("galore", "inner=adafactor,rank=2,update_proj_gap=2", NULL, &c);
  char got[400];
  snprintf(got, sizeof got, "%s/step-000000003", ck);
  expect_refused(oc, &c, got, DOPT_ERR_INVALID_ARG, "inner", "adamw");
  dopt_optim_destroy(oc);
  oc = build("galore", "inner=adamw,rank=2,update_proj_gap=2,lr=1e-2", NULL, &c);
  assert_ok(dopt_optim_load(oc, got));
  dopt_optim_destroy(oc);
  dopt_optim_destroy(oa);
  model_free(&a);
  model_free(&c);
}

static void test_corruption(void **st) {
  (void)st;
  model a, b;
  model_init(&a, 1, 7);
  model_init(&b, 1, 8);
  dopt_optim *oa = build("adamw", "lr=1e-2", "weight_decay=0", &a);
  for (int t = 1; t <= 4; t++) step(oa, &a, t);
  char good[300];
  snprintf(good, sizeof good, "%s/good", dir);
  assert_ok(dopt_optim_save(oa, good, NULL));
  /* the optimizer that must stay untouched: stepped, so it has states to protect */
  dopt_optim *ob = build("adamw", "lr=1e-2", "weight_decay=0", &b);
  for (int t = 1; t <= 2; t++) step(ob, &b, t);
  char path[600], f[700];

  /* missing file */
  snprintf(path, sizeof path, "%s/c_missing", dir);
  copy_good(path);
  snprintf(f, sizeof f, "%s/%s", path, RANKF);
  unlink(f);
  expect_refused(ob, &b, path, DOPT_ERR_NOT_FOUND, RANKF, "cannot open");
  /* truncated file */
  snprintf(path, sizeof path, "%s/c_trunc", dir);
  copy_good(path);
  snprintf(f, sizeof f, "%s/%s", path, RANKF);
  struct stat sb;
  stat(f, &sb);
  assert_int_equal(truncate(f, sb.st_size - 100), 0);
  expect_refused(ob, &b, path, DOPT_ERR_FORMAT, RANKF, "index.json says");
  /* one flipped byte of data: the SHA-256 of its piece */
  snprintf(path, sizeof path, "%s/c_data", dir);
  copy_good(path);
  snprintf(f, sizeof f, "%s/%s", path, RANKF);
  flip_byte(f, -5); /* in the last piece */
  expect_refused(ob, &b, path, DOPT_ERR_FORMAT, "SHA-256", "unused");
  /* one flipped byte in the safetensors header: its JSON, and its padding */
  long offs[] = {8, 20, 100, -1 /* the header's last byte: padding or its closing brace */};
  for (size_t k = 0; k < sizeof offs / sizeof offs[0]; k++) {
    snprintf(path, sizeof path, "%s/c_header%zu", dir, k);
    copy_good(path);
    snprintf(f, sizeof f, "%s/%s", path, RANKF);
    if (offs[k] < 0) {
      FILE *fp = fopen(f, "rb");
      unsigned char lb[8];
      assert_int_equal(fread(lb, 1, 8, fp), 8);
      fclose(fp);
      long hl = 0;
      for (int i = 7; i >= 0; i--) hl = (hl << 8) | lb[i];
      offs[k] = 8 + hl - 1;
    }
    flip_byte(f, offs[k]);
    expect_refused(ob, &b, path, DOPT_ERR_FORMAT, RANKF, NULL);
  }
  /* the 8-byte header length */
  snprintf(path, sizeof path, "%s/c_hlen", dir);
  copy_good(path);
  snprintf(f, sizeof f, "%s/%s", path, RANKF);
  flip_byte(f, 2);
  expect_refused(ob, &b, path, DOPT_ERR_FORMAT, RANKF, NULL);
  /* index missing: a half-written generation */
  snprintf(path, sizeof path, "%s/c_noindex", dir);
  copy_good(path);
  snprintf(f, sizeof f, "%s/index.json", path);
  unlink(f);
  expect_refused(ob, &b, path, DOPT_ERR_NOT_FOUND, "index.json", "half-written");
  /* index truncated */
  snprintf(path, sizeof path, "%s/c_indextrunc", dir);
  copy_good(path);
  snprintf(f, sizeof f, "%s/index.json", path);
  stat(f, &sb);
  assert_int_equal(truncate(f, sb.st_size / 2), 0);
  expect_refused(ob, &b, path, DOPT_ERR_FORMAT, "index.json", "not valid JSON");
  /* pieces with a gap, an overlap, a short piece */
  snprintf(path, sizeof path, "%s/c_gap", dir);
  copy_good(path);
  edit_index(path, ed_gap);
  expect_refused(ob, &b, path, DOPT_ERR_FORMAT, "layers.0.w/exp_avg", "no piece");
  snprintf(path, sizeof path, "%s/c_overlap", dir);
  copy_good(path);
  edit_index(path, ed_overlap);
  expect_refused(ob, &b, path, DOPT_ERR_FORMAT, "'norm'", "listed twice");
  snprintf(path, sizeof path, "%s/c_short", dir);
  copy_good(path);
  edit_index(path, ed_short);
  expect_refused(ob, &b, path, DOPT_ERR_FORMAT, "'t3'", "no piece");
  /* unknown version, unknown format */
  snprintf(path, sizeof path, "%s/c_version", dir);
  copy_good(path);
  edit_index(path, ed_version);
  expect_refused(ob, &b, path, DOPT_ERR_UNSUPPORTED, "version 2", "index.json");
  snprintf(path, sizeof path, "%s/c_format", dir);
  copy_good(path);
  edit_index(path, ed_format);
  expect_refused(ob, &b, path, DOPT_ERR_FORMAT, "something-else", "index.json");
  /* a NUL escaped into a string: the parser would cut the format name there and accept it */
  snprintf(path, sizeof path, "%s/c_nul", dir);
  copy_good(path);
  edit_index_text(path, "\"distopt-checkpoint\"", "\"distopt-checkpoint\\u0000/../x\"");
  expect_refused(ob, &b, path, DOPT_ERR_FORMAT, "a NUL character at byte", "index.json");
  /* counters that disagree with each other */
  static const struct {
    const char *name;
    void (*fn)(cJSON *);
    const char *n1, *n2;
  } counters[] = {
      {"c_global", ed_global_low, "global_step 3 is less than optimizer_steps 4 + skipped_steps 0", "disagree"},
      {"c_skipped", ed_skipped_high, "global_step 4 is less than optimizer_steps 4 + skipped_steps 1", "disagree"},
      {"c_pstep", ed_param_step_high, "step 5 is more than optimizer_steps 4", "parameter '"},
  };
  for (size_t k = 0; k < sizeof counters / sizeof counters[0]; k++) {
    snprintf(path, sizeof path, "%s/%s", dir, counters[k].name);
    copy_good(path);
    edit_index(path, counters[k].fn);
    expect_refused(ob, &b, path, DOPT_ERR_FORMAT, counters[k].n1, counters[k].n2);
  }
  /* a missing directory */
  expect_refused(ob, &b, sub("nowhere"), DOPT_ERR_NOT_FOUND, "nowhere", NULL);

  /* another optimizer, other hyperparameters, other shapes, other names, other groups */
  model c;
  model_init(&c, 1, 9);
  dopt_optim *oc = build("came", "lr=1e-2", "weight_decay=0", &c);
  expect_refused(oc, &c, good, DOPT_ERR_INVALID_ARG, "'adamw'", "'came'");
  dopt_optim_destroy(oc);
  oc = build("adamw", "lr=2e-2", "weight_decay=0", &c);
  expect_refused(oc, &c, good, DOPT_ERR_INVALID_ARG, "group 0: hyperparameter lr is 0.01", "0.02");
  dopt_optim_destroy(oc);
  oc = build("adamw", "lr=1e-2", "weight_decay=0,amsgrad=true", &c);
  expect_refused(oc, &c, good, DOPT_ERR_INVALID_ARG, "group 1: hyperparameter amsgrad is false", "true in the optimizer");
  dopt_optim_destroy(oc);
  oc = build("adamw", "lr=1e-2", NULL, &c);
  expect_refused(oc, &c, good, DOPT_ERR_INVALID_ARG, "2 parameter groups in the checkpoint, 1", NULL);
  dopt_optim_destroy(oc);
  model_free(&c);
  model_init(&c, 0, 9); /* no bf16: other dtypes */
  oc = build("adamw", "lr=1e-2", "weight_decay=0", &c);
  expect_refused(oc, &c, good, DOPT_ERR_SHAPE, "layers.1.w", "BF16 [12,8] in the checkpoint, F32 [12,8] here");
  dopt_optim_destroy(oc);
  model_free(&c);
  /* other shapes: one more parameter, and a transposed one */
  dopt_optim *od;
  float w1[96], w2[96], bias[12], nrm[8], t3[24], sc[1], un[16], extra[3];
  assert_ok(dopt_optim_create("adamw", "lr=1e-2", &od));
  int g1;
  assert_ok(dopt_optim_add_group(od, "weight_decay=0", &g1));
  float *datas[NP] = {w1, w2, bias, nrm, t3, sc, un};
  for (int i = 0; i < NP; i++) {
    dopt_param_config pc = DOPT_PARAM_CONFIG_INIT;
    pc.name = pname[i];
    pc.ndim = pndim[i];
    for (int d = 0; d < pndim[i]; d++) pc.shape[d] = pshape[i][d];
    if (i == 0) pc.shape[0] = 12, pc.shape[1] = 8;
    pc.data = datas[i];
    assert_ok(dopt_optim_add_param(od, (i == 2 || i == 3) ? g1 : 0, &pc, NULL));
  }
  assert_status(dopt_optim_load(od, good), DOPT_ERR_SHAPE, "'layers.0.w' is F32 [8,12] in the checkpoint, F32 [12,8]");
  dopt_param_config pc = DOPT_PARAM_CONFIG_INIT;
  pc.name = "extra";
  pc.ndim = 1;
  pc.shape[0] = 3;
  pc.data = extra;
  assert_ok(dopt_optim_add_param(od, 0, &pc, NULL));
  assert_status(dopt_optim_load(od, good), DOPT_ERR_SHAPE, "7 parameters in the checkpoint, 8 here");
  dopt_optim_destroy(od);

  /* after all that, the good one still loads and equals the source */
  assert_ok(dopt_optim_load(ob, good));
  assert_same(oa, &a, ob, &b, "good after refusals");
  dopt_optim_destroy(oa);
  dopt_optim_destroy(ob);
  model_free(&a);
  model_free(&b);
}

/* ---- crash in the middle of a distributed save ---------------------------------------------- */

static void test_crash_between_ranks(void **st) {
  (void)st;
  char ck[300], tmp[512];
  snprintf(ck, sizeof ck, "%s/crash", dir);
  model a, b;
  model_init(&a, 0, 11);
  model_init(&b, 0, 12);
  dopt_optim *oa = build("adamw", "lr=1e-2", NULL, &a);
  for (int t = 1; t <= 3; t++) step(oa, &a, t);
  assert_ok(dopt_optim_save(oa, ck, NULL)); /* generation 3 */
  char want[DOPT_DIGEST_HEX];
  optim_digest(oa, &a, want);
  step(oa, &a, 4);
  step(oa, &a, 5);
  /* generation 5 as a 2-rank job: rank 0 finishes, rank 1 dies while writing */
  assert_ok(dopt_ckpt_begin(ck, 5, tmp, sizeof tmp));
  char tmp2[512];
  assert_ok(dopt_ckpt_tmp_dir(ck, 5, tmp2, sizeof tmp2));
  assert_string_equal(tmp, tmp2); /* every rank computes the same name */
  dopt_ckpt_writer *w0, *w1;
  assert_ok(dopt_ckpt_writer_open(tmp, 0, 2, &w0));
  assert_ok(dopt_ckpt_writer_open(tmp, 1, 2, &w1));
  dopt_piece pc;
  dopt_piece_full(pndim[0], pshape[0], &pc);
  assert_ok(dopt_ckpt_put(w0, pname[0], DOPT_F32, pndim[0], pshape[0], &pc, a.data[0]));
  assert_ok(dopt_ckpt_writer_close(w0));
  dopt_piece_full(pndim[1], pshape[1], &pc);
  assert_ok(dopt_ckpt_put(w1, pname[1], DOPT_F32, pndim[1], pshape[1], &pc, a.data[1]));
  /* rank 1 never closes; nobody commits. The previous generation is what loads: */
  FILE *f = fopen(sub("crash/latest"), "r");
  char line[64] = "";
  assert_non_null(fgets(line, sizeof line, f));
  fclose(f);
  assert_string_equal(line, "step-000000003\n");
  dopt_optim *ob = build("adamw", "lr=1e-2", NULL, &b);
  assert_ok(dopt_optim_load(ob, ck));
  char got[DOPT_DIGEST_HEX];
  optim_digest(ob, &b, got);
  assert_string_equal(got, want);
  /* a commit now refuses the incomplete generation and changes nothing */
  dopt_ckpt_meta *m;
  assert_ok(dopt_ckpt_meta_from_optim(oa, NULL, &m));
  assert_int_equal(m->global_step, 5);
  assert_status(dopt_ckpt_commit(ck, tmp, m), DOPT_ERR_NOT_FOUND, "rank 1 did not close its writer");
  f = fopen(sub("crash/latest"), "r");
  assert_non_null(fgets(line, sizeof line, f));
  fclose(f);
  assert_string_equal(line, "step-000000003\n");
  dopt_ckpt_meta_free(m);
  dopt_ckpt_abort_writer(w1); /* (the process died; free its memory) */
  /* the next save of that step removes the stale temporary directory and succeeds */
  assert_ok(dopt_optim_save(oa, ck, NULL));
  assert_ok(dopt_optim_load(ob, ck));
  assert_same(oa, &a, ob, &b, "after the crashed save");
  dopt_optim_destroy(oa);
  dopt_optim_destroy(ob);
  model_free(&a);
  model_free(&b);
}

/* A hyperparameter added to an optimizer after a checkpoint was written (muon's flavor, ns_a..ns_eps): the
 * checkpoint lacks the key; it loads while the optimizer holds the key's default, and is refused, naming the
 * key and the value, when it does not. */
static void test_added_key_default(void **st) {
  (void)st;
  model a, b;
  model_init(&a, 0, 1), model_init(&b, 0, 1);
  dopt_optim *oa = build("muon", "lr=1e-2", NULL, &a), *ob = build("muon", "lr=1e-2,flavor=torch", NULL, &b);
  dopt_ckpt_meta *saved, *here, *other;
  assert_ok(dopt_ckpt_meta_from_optim(oa, NULL, &saved));
  assert_ok(dopt_ckpt_meta_from_optim(oa, NULL, &here));
  assert_ok(dopt_ckpt_meta_from_optim(ob, NULL, &other));
  for (int g = 0; g < saved->ngroups; g++) { /* the saved side as written before the key existed */
    dopt_ckpt_group *gr = &saved->groups[g];
    int n = 0;
    for (int k = 0; k < gr->nhparams; k++)
      if (strcmp(gr->hparams[k].key, "flavor") != 0) gr->hparams[n++] = gr->hparams[k];
    assert_int_equal(n, gr->nhparams - 1);
    gr->nhparams = n;
  }
  assert_ok(dopt_ckpt_meta_check(saved, here, "ck"));
  assert_status(dopt_ckpt_meta_check(saved, other, "ck"), DOPT_ERR_INVALID_ARG,
                "ck: group 0: hyperparameter flavor is missing in the checkpoint (optimizer torch)");
  dopt_ckpt_meta_free(saved), dopt_ckpt_meta_free(here), dopt_ckpt_meta_free(other);
  dopt_optim_destroy(oa), dopt_optim_destroy(ob);
  model_free(&a), model_free(&b);
}

/* ---- pieces --------------------------------------------------------------------------------- */

/* The elements of piece pc of a logical tensor x (elements of size es). */
static void slice(const void *x, const dopt_piece *pc, size_t es, void *out) {
  for (size_t j = 0; j < pc->len; j++)
    memcpy((char *)out + j * es, (const char *)x + dopt_grid_logical(pc, pc->lo + j) * es, es);
}

static void make_piece(int ndim, const int64_t *shape, size_t h0, size_t hl, size_t w0, size_t wl, size_t lo,
                       size_t len, dopt_piece *pc) {
  dopt_piece_full(ndim, shape, pc);
  pc->h0 = h0, pc->hl = hl, pc->w0 = w0, pc->wl = wl, pc->lo = lo, pc->len = len;
}

/* Writes a tensor as TP blocks (cols split at cut, or rows when by_rows) each split into `ranges` flat ranges, the
 * pieces spread over nranks writers. */
static void put_split(dopt_ckpt_writer **w, int nranks, const char *name, dopt_dtype dt, int ndim, const int64_t *shape,
                      const void *x, int by_rows, size_t cut, int ranges, int *turn) {
  dopt_piece f;
  dopt_piece_full(ndim, shape, &f);
  size_t es = dopt_dtype_size(dt);
  for (int blk = 0; blk < 2; blk++) {
    dopt_piece pc = f;
    if (by_rows) pc.h0 = blk ? cut : 0, pc.hl = blk ? f.h - cut : cut;
    else pc.w0 = blk ? cut : 0, pc.wl = blk ? f.w - cut : cut;
    size_t n = f.b * pc.hl * pc.wl, lo = 0;
    for (int r = 0; r < ranges; r++) {
      size_t hi = r == ranges - 1 ? n : n * (size_t)(r + 1) * (size_t)(r + 2) / (size_t)(ranges * (ranges + 1));
      if (hi < lo) hi = lo;
      pc.lo = lo;
      pc.len = hi - lo;
      void *buf = malloc(pc.len * es + 1);
      slice(x, &pc, es, buf);
      assert_ok(dopt_ckpt_put(w[(*turn)++ % nranks], name, dt, ndim, shape, &pc, buf));
      free(buf);
      lo = hi;
    }
  }
}

/* The file and byte offset of the first non-empty piece of `tensor` whose block starts at row h0 (index.json, then
 * the file's safetensors header). */
static void piece_offset(const char *ck, const char *tensor, size_t h0, char *file, size_t cap, long *at) {
  char path[700];
  snprintf(path, sizeof path, "%s/step-000000001/index.json", ck);
  FILE *fp = fopen(path, "rb");
  static char text[1 << 20];
  size_t n = fread(text, 1, sizeof text - 1, fp);
  fclose(fp);
  text[n] = '\0';
  cJSON *j = cJSON_Parse(text), *t, *p, *hit = NULL;
  assert_non_null(j);
  cJSON_ArrayForEach(t, cJSON_GetObjectItem(j, "tensors")) if (strcmp(cJSON_GetObjectItem(t, "name")->valuestring,
                                                                     tensor) == 0)
      cJSON_ArrayForEach(p, cJSON_GetObjectItem(t, "pieces")) if (!hit && cJSON_GetObjectItem(p, "h0")->valueint ==
                                                                              (int)h0 &&
                                                                  cJSON_GetObjectItem(p, "len")->valueint > 0) hit = p;
  assert_non_null(hit);
  snprintf(file, cap, "%s/step-000000001/%s", ck, cJSON_GetObjectItem(hit, "file")->valuestring);
  char key[300];
  snprintf(key, sizeof key, "%s", cJSON_GetObjectItem(hit, "key")->valuestring);
  cJSON_Delete(j);
  fp = fopen(file, "rb");
  unsigned char lb[8];
  assert_int_equal(fread(lb, 1, 8, fp), 8);
  uint64_t hl = 0;
  for (int i = 7; i >= 0; i--) hl = (hl << 8) | lb[i];
  char *hdr = malloc(hl + 1);
  assert_int_equal(fread(hdr, 1, hl, fp), hl);
  fclose(fp);
  hdr[hl] = '\0';
  j = cJSON_Parse(hdr);
  free(hdr);
  cJSON *e = cJSON_GetObjectItem(j, key);
  assert_non_null(e);
  *at = (long)(8 + hl) + (long)cJSON_GetArrayItem(cJSON_GetObjectItem(e, "data_offsets"), 0)->valuedouble;
  cJSON_Delete(j);
}

static void test_pieces(void **st) {
  (void)st;
  char ck[300], tmp[512];
  snprintf(ck, sizeof ck, "%s/pieces", dir);
  const int64_t s3[3] = {2, 5, 7}, s1[1] = {29}, s2[2] = {6, 9};
  float x3[70];
  double x1[29];
  uint8_t x2[54];
  uint64_t seed = 3;
  for (int i = 0; i < 70; i++) x3[i] = (float)dt_rand_normal(&seed);
  for (int i = 0; i < 29; i++) x1[i] = dt_rand_normal(&seed);
  for (int i = 0; i < 54; i++) x2[i] = (uint8_t)(dt_rand_u64(&seed) & 0xff);
  assert_ok(dopt_ckpt_begin(ck, 1, tmp, sizeof tmp));
  dopt_ckpt_writer *w[3];
  for (int r = 0; r < 3; r++) assert_ok(dopt_ckpt_writer_open(tmp, r, 3, &w[r]));
  int turn = 0;
  put_split(w, 3, "w", DOPT_F32, 3, s3, x3, 0, 3, 3, &turn);        /* column blocks [0,3) [3,7), 3 ranges each */
  put_split(w, 3, "v", DOPT_F64, 1, s1, x1, 0, 0, 4, &turn);        /* 1-D: one empty block, then 4 ranges */
  put_split(w, 3, "u/codes", DOPT_U8, 2, s2, x2, 1, 4, 2, &turn);   /* row blocks [0,4) [4,6) */
  for (int r = 0; r < 3; r++) assert_ok(dopt_ckpt_writer_close(w[r]));
  /* the metadata of one parameter "w" of an adamw at step 1 */
  dopt_ckpt_hparam hp[1] = {{"lr", DOPT_CKPT_HP_NUMBER, 1e-3, NULL, 0}};
  dopt_ckpt_group grp = {1, hp};
  dopt_ckpt_param prm = {"w", DOPT_F32, 3, {2, 5, 7}, 0, -1, 1, 0, 1};
  dopt_ckpt_meta m = DOPT_CKPT_META_INIT;
  m.optimizer = "adamw";
  m.ngroups = 1;
  m.groups = &grp;
  m.nparams = 1;
  m.params = &prm;
  m.global_step = 1;
  m.optimizer_steps = 1;
  m.world = (dopt_ckpt_world){"hybrid", 2, 3, 2};
  assert_ok(dopt_ckpt_commit(ck, tmp, &m));

  dopt_ckpt_reader *r;
  assert_ok(dopt_ckpt_open(ck, &r));
  const dopt_ckpt_meta *rm;
  assert_ok(dopt_ckpt_read_meta(r, &rm));
  assert_string_equal(rm->world.plugin, "hybrid");
  assert_int_equal(rm->world.dp, 3);
  assert_int_equal(dopt_ckpt_num_tensors(r), 3);
  dopt_ckpt_tensor_info ti;
  assert_ok(dopt_ckpt_find(r, "w", &ti));
  assert_int_equal(ti.npieces, 6);
  assert_status(dopt_ckpt_find(r, "nope", &ti), DOPT_ERR_NOT_FOUND, "nope");
  /* random pieces of each tensor equal slices of the logical tensor */
  struct { const char *name; int ndim; const int64_t *shape; const void *x; size_t es; } ts[3] = {
      {"w", 3, s3, x3, 4}, {"v", 1, s1, x1, 8}, {"u/codes", 2, s2, x2, 1}};
  unsigned char got[600], want[600];
  int checked = 0;
  for (int k = 0; k < 3; k++) {
    dopt_piece f;
    dopt_piece_full(ts[k].ndim, ts[k].shape, &f);
    for (int trial = 0; trial < 400; trial++) {
      size_t h0 = dt_rand_u64(&seed) % f.h, hl = 1 + dt_rand_u64(&seed) % (f.h - h0);
      size_t w0 = dt_rand_u64(&seed) % f.w, wl = 1 + dt_rand_u64(&seed) % (f.w - w0);
      if (trial % 4 == 0) h0 = 0, hl = f.h, w0 = 0, wl = f.w;
      size_t blk = f.b * hl * wl, lo = dt_rand_u64(&seed) % blk, len = dt_rand_u64(&seed) % (blk - lo + 1);
      if (trial % 8 == 0) lo = 0, len = blk;
      dopt_piece pc;
      make_piece(ts[k].ndim, ts[k].shape, h0, hl, w0, wl, lo, len, &pc);
      memset(got, 0xee, sizeof got);
      assert_ok(dopt_ckpt_get(r, ts[k].name, &pc, got));
      slice(ts[k].x, &pc, ts[k].es, want);
      if (memcmp(got, want, len * ts[k].es) != 0)
        fail_msg("%s: piece rows [%zu,+%zu) cols [%zu,+%zu) range [%zu,+%zu) differs", ts[k].name, h0, hl, w0, wl, lo,
                 len);
      checked++;
    }
  }
  assert_int_equal(checked, 1200);
  /* a piece outside the tensor is refused */
  dopt_piece bad;
  make_piece(3, s3, 3, 3, 0, 7, 0, 1, &bad);
  assert_status(dopt_ckpt_get(r, "w", &bad, got), DOPT_ERR_INVALID_ARG, "outside");
  dopt_ckpt_close(r);

  /* whole pieces are stored with their logical shape, the others flat; safetensors reads the files */
  char f[700];
  snprintf(f, sizeof f, "%s/step-000000001/rank-00000-of-00003.safetensors", ck);
  dopt_st_file *sf;
  assert_ok(dopt_st_load(f, &sf));
  dopt_st_tensor t;
  assert_ok(dopt_st_find(sf, "w@0", &t));
  assert_int_equal(t.ndim, 1);
  dopt_st_free(sf);

  /* only overlapping pieces are read: break the piece of rows [4, 6) of u/codes */
  dopt_piece top;
  make_piece(2, s2, 0, 4, 0, 9, 0, 36, &top);
  assert_ok(dopt_ckpt_open(ck, &r));
  /* break the piece of rows [4, 6): its file and key from index.json, its offset from the file's header */
  long at;
  piece_offset(ck, "u/codes", 4, f, sizeof f, &at);
  flip_byte(f, at);
  int broken = 1;
  assert_true(broken);
  assert_ok(dopt_ckpt_get(r, "u/codes", &top, got)); /* rows [0, 4) do not need it */
  slice(x2, &top, 1, want);
  assert_memory_equal(got, want, 36);
  dopt_piece all;
  dopt_piece_full(2, s2, &all);
  assert_status(dopt_ckpt_get(r, "u/codes", &all, got), DOPT_ERR_FORMAT, "SHA-256");
  assert_status(dopt_ckpt_verify(r), DOPT_ERR_FORMAT, "u/codes");
  dopt_ckpt_close(r);
}

/* Pieces that do not cover a tensor exactly once are refused when the generation is committed. */
static void test_commit_cover(void **st) {
  (void)st;
  char ck[300], tmp[512];
  snprintf(ck, sizeof ck, "%s/cover", dir);
  const int64_t s2[2] = {4, 6};
  float x[24] = {0};
  dopt_ckpt_hparam hp[1] = {{"lr", DOPT_CKPT_HP_NUMBER, 1e-3, NULL, 0}};
  dopt_ckpt_group grp = {1, hp};
  dopt_ckpt_param prm = {"x", DOPT_F32, 2, {4, 6}, 0, -1, 0, 0, 0};
  dopt_ckpt_meta m = DOPT_CKPT_META_INIT;
  m.optimizer = "adamw";
  m.ngroups = 1;
  m.groups = &grp;
  m.nparams = 1;
  m.params = &prm;
  struct { size_t h0, hl, w0, wl, lo, len; } sets[4][2] = {
      {{0, 4, 0, 6, 0, 12}, {0, 4, 0, 6, 10, 14}},  /* overlap in one block */
      {{0, 4, 0, 6, 0, 12}, {0, 4, 0, 6, 13, 11}},  /* gap */
      {{0, 4, 0, 3, 0, 12}, {0, 4, 2, 4, 0, 16}},   /* blocks that overlap */
      {{0, 2, 0, 6, 0, 12}, {3, 1, 0, 6, 0, 6}},    /* a row in no block */
  };
  const char *needle[4] = {"overlap", "no piece", "overlap", "cover 18 of the 4 x 6"};
  for (int k = 0; k < 4; k++) {
    assert_ok(dopt_ckpt_begin(ck, (int64_t)k, tmp, sizeof tmp));
    dopt_ckpt_writer *w;
    assert_ok(dopt_ckpt_writer_open(tmp, 0, 1, &w));
    for (int p = 0; p < 2; p++) {
      dopt_piece pc;
      make_piece(2, s2, sets[k][p].h0, sets[k][p].hl, sets[k][p].w0, sets[k][p].wl, sets[k][p].lo, sets[k][p].len, &pc);
      assert_ok(dopt_ckpt_put(w, "x", DOPT_F32, 2, s2, &pc, x));
    }
    assert_ok(dopt_ckpt_writer_close(w));
    m.global_step = k;
    assert_status(dopt_ckpt_commit(ck, tmp, &m), DOPT_ERR_FORMAT, needle[k]);
  }
  /* a piece that does not fit its tensor is refused by put */
  assert_ok(dopt_ckpt_begin(ck, 9, tmp, sizeof tmp));
  dopt_ckpt_writer *w;
  assert_ok(dopt_ckpt_writer_open(tmp, 0, 1, &w));
  dopt_piece pc;
  make_piece(2, s2, 0, 4, 0, 6, 20, 5, &pc);
  assert_status(dopt_ckpt_put(w, "x", DOPT_F32, 2, s2, &pc, x), DOPT_ERR_INVALID_ARG, "outside its block of 24");
  dopt_piece_full(2, s2, &pc);
  pc.w = 7;
  assert_status(dopt_ckpt_put(w, "x", DOPT_F32, 2, s2, &pc, x), DOPT_ERR_INVALID_ARG, "does not fit its shape [4,6]");
  dopt_piece_full(2, s2, &pc);
  assert_ok(dopt_ckpt_put(w, "x", DOPT_F32, 2, s2, &pc, x));
  assert_status(dopt_ckpt_put(w, "x", DOPT_F64, 2, s2, &pc, x), DOPT_ERR_INVALID_ARG, "was F32 [4,6], now F64");
  dopt_ckpt_abort_writer(w);
  /* no generation was published */
  struct stat sb;
  assert_int_not_equal(stat(sub("cover/latest"), &sb), 0);
}

/* Save and load time and size of one 4096 x 4096 parameter per optimizer (printed; DOPT_CKPT_BENCH=1). */
static void test_bench_4096(void **st) {
  (void)st;
  if (!getenv("DOPT_CKPT_BENCH")) {
    print_message("(set DOPT_CKPT_BENCH=1 for the 4096 x 4096 save/load table)\n");
    return;
  }
  const char *opts[][2] = {{"adamw", NULL},
                           {"adafactor", "beta1=0.9"},
                           {"came", "lr=1e-4"},
                           {"lamb", NULL},
                           {"adamw8bit", NULL},
                           {"galore_adamw", "rank=128"},
                           {"galore_adamw8bit", "rank=128"},
                           {"q_galore", "rank=128"},
                           {"lisa", "n_layers=1"}};
  const size_t n = 4096u * 4096u;
  float *w = malloc(n * sizeof *w), *g = malloc(n * sizeof *g);
  uint64_t seed = 1;
  for (size_t k = 0; k < n; k++) w[k] = (float)(0.02 * dt_rand_normal(&seed)), g[k] = (float)(1e-3 * dt_rand_normal(&seed));
  print_message("%-18s %12s %12s %9s %9s\n", "optimizer", "state bytes", "ckpt bytes", "save s", "load s");
  for (size_t i = 0; i < sizeof opts / sizeof opts[0]; i++) {
    dopt_optim *o;
    assert_ok(dopt_optim_create(opts[i][0], opts[i][1], &o));
    dopt_param_config pc = DOPT_PARAM_CONFIG_INIT;
    pc.name = "model.layers.0.mlp.weight";
    pc.ndim = 2;
    pc.shape[0] = pc.shape[1] = 4096;
    pc.data = w;
    pc.layer = 0;
    assert_ok(dopt_optim_add_param(o, 0, &pc, NULL));
    const float *gs[1] = {g};
    assert_ok(dopt_optim_step(o, gs));
    size_t state;
    assert_ok(dopt_optim_state_bytes(o, -1, &state, NULL));
    char ck[300], cmd[700];
    snprintf(ck, sizeof ck, "%s/bench_%s", dir, opts[i][0]);
    struct timespec t0, t1, t2;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    assert_ok(dopt_optim_save(o, ck, NULL));
    clock_gettime(CLOCK_MONOTONIC, &t1);
    assert_ok(dopt_optim_load(o, ck));
    clock_gettime(CLOCK_MONOTONIC, &t2);
    snprintf(cmd, sizeof cmd, "%s/step-000000001/rank-00000-of-00001.safetensors", ck);
    struct stat sb;
    assert_int_equal(stat(cmd, &sb), 0);
    print_message("%-18s %12zu %12lld %9.3f %9.3f\n", opts[i][0], state, (long long)sb.st_size,
                  (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec),
                  (double)(t2.tv_sec - t1.tv_sec) + 1e-9 * (double)(t2.tv_nsec - t1.tv_nsec));
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", ck);
    assert_int_equal(system(cmd), 0);
    dopt_optim_destroy(o);
  }
  free(w);
  free(g);
}

/* Rank files with more than 16 MiB of data keep the 1 MiB header reserve (data written as it comes); a header
 * longer than the reserve moves the data once. Both read back. */
static void test_large_files(void **st) {
  (void)st;
  char ck[300], tmp[512];
  snprintf(ck, sizeof ck, "%s/large", dir);
  const int64_t big[2] = {2048, 2100}; /* 17.2 MB of F32 */
  const size_t n = 2048u * 2100u;
  float *x = malloc(n * sizeof *x), *y = malloc(n * sizeof *y);
  for (size_t k = 0; k < n; k++) x[k] = (float)k * 0.5f - 7.0f;
  dopt_ckpt_hparam hp[1] = {{"lr", DOPT_CKPT_HP_NUMBER, 1e-3, NULL, 0}};
  dopt_ckpt_group grp = {1, hp};
  dopt_ckpt_param prm = {"big", DOPT_F32, 2, {2048, 2100}, 0, -1, 0, 0, 0};
  dopt_ckpt_meta m = DOPT_CKPT_META_INIT;
  m.optimizer = "adamw";
  m.ngroups = 1;
  m.groups = &grp;
  m.nparams = 1;
  m.params = &prm;
  for (int variant = 0; variant < 2; variant++) {
    m.global_step = variant;
    assert_ok(dopt_ckpt_begin(ck, variant, tmp, sizeof tmp));
    dopt_ckpt_writer *w;
    assert_ok(dopt_ckpt_writer_open(tmp, 0, 1, &w));
    dopt_piece pc;
    if (variant == 0) { /* one whole piece */
      dopt_piece_full(2, big, &pc);
      assert_ok(dopt_ckpt_put(w, "big", DOPT_F32, 2, big, &pc, x));
    } else { /* 2048 row pieces of "big" and 9000 tiny tensors with long names: a header above 1 MiB */
      for (size_t r = 0; r < 2048; r++) {
        dopt_piece_full(2, big, &pc);
        pc.lo = r * 2100;
        pc.len = 2100;
        assert_ok(dopt_ckpt_put(w, "big", DOPT_F32, 2, big, &pc, x + r * 2100));
      }
      char name[200];
      for (int k = 0; k < 9000; k++) {
        snprintf(name, sizeof name, "big/a_rather_long_state_name_to_make_the_safetensors_header_long_%05d", k);
        const int64_t one[1] = {1};
        dopt_piece_full(1, one, &pc);
        float v = (float)k;
        assert_ok(dopt_ckpt_put(w, name, DOPT_F32, 1, one, &pc, &v));
      }
    }
    assert_ok(dopt_ckpt_writer_close(w));
    assert_ok(dopt_ckpt_commit(ck, tmp, &m));
    char f[700];
    snprintf(f, sizeof f, "%s/step-%09d/rank-00000-of-00001.safetensors", ck, variant);
    FILE *fp = fopen(f, "rb");
    unsigned char lb[8];
    assert_int_equal(fread(lb, 1, 8, fp), 8);
    fclose(fp);
    uint64_t hl = 0;
    for (int i = 7; i >= 0; i--) hl = (hl << 8) | lb[i];
    if (variant == 0) assert_int_equal(hl, 1u << 20); /* the reserve */
    else assert_true(hl > (1u << 20));
    dopt_ckpt_reader *r;
    assert_ok(dopt_ckpt_open(ck, &r));
    dopt_piece all;
    dopt_piece_full(2, big, &all);
    assert_ok(dopt_ckpt_get(r, "big", &all, y));
    assert_memory_equal(x, y, n * sizeof *x);
    dopt_piece mid; /* rows 1000..1009, columns 50..149, a range of it */
    make_piece(2, big, 1000, 10, 50, 100, 17, 900, &mid);
    assert_ok(dopt_ckpt_get(r, "big", &mid, y));
    for (size_t j = 0; j < mid.len; j++) assert_true(y[j] == x[dopt_grid_logical(&mid, mid.lo + j)]);
    if (variant == 1) {
      float v;
      dopt_piece one;
      const int64_t s1[1] = {1};
      dopt_piece_full(1, s1, &one);
      assert_ok(dopt_ckpt_get(r, "big/a_rather_long_state_name_to_make_the_safetensors_header_long_08999", &one, &v));
      assert_true(v == 8999.0f);
    }
    assert_ok(dopt_ckpt_verify(r));
    dopt_ckpt_close(r);
  }
  free(x);
  free(y);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_resume_bitwise),
      cmocka_unit_test(test_save_edges),
      cmocka_unit_test(test_index_names),
      cmocka_unit_test(test_galore_inner),
      cmocka_unit_test(test_corruption),
      cmocka_unit_test(test_crash_between_ranks),
      cmocka_unit_test(test_pieces),
      cmocka_unit_test(test_added_key_default),
      cmocka_unit_test(test_commit_cover),
      cmocka_unit_test(test_large_files),
      cmocka_unit_test(test_bench_4096),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}

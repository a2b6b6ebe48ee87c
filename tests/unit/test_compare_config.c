/* cli/config.c: a full configuration maps onto cmp_options; every error
 * class (malformed YAML, unknown or duplicate key, wrong type, bad count,
 * too-long string) is DOPT_ERR_FORMAT with the file, line and key in the
 * message and leaves the options untouched; relative trace paths resolve
 * against the YAML file's directory. */
#include "testutil.h"

#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>

#include "compare.h"
#include "optim_impl.h"
#include "registry.h"

static char dir[256];

static int setup(void **st) {
  (void)st;
  return dt_make_tmpdir(dir, sizeof dir, "dopt_cmpcfg");
}

static int teardown(void **st) {
  (void)st;
  return dt_remove_tmpdir(dir);
}

/* Independent of cmp_options_default (compare/options.c). */
static void base_options(cmp_options *o) {
  memset(o, 0, sizeof *o);
  snprintf(o->optimizer, sizeof o->optimizer, "adafactor");
  snprintf(o->plugin, sizeof o->plugin, "hybrid");
  o->tp = 2;
  o->dp = 2;
  o->zero = 2;
  o->steps = 100;
  o->micro = 1;
  snprintf(o->source, sizeof o->source, "synthetic");
  o->seed = 1;
}

static const char *write_yaml(const char *name, const char *text) {
  static char path[512];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  FILE *f = fopen(path, "wb");
  assert_non_null(f);
  fputs(text, f);
  fclose(f);
  return path;
}

static void test_full(void **st) {
  (void)st;
  const char *p = write_yaml("full.yaml",
                             "# a full configuration\n"
                             "optimizer:\n"
                             "  type: adafactor\n"
                             "  lr: 2e-4\n"
                             "  weight_decay: 0.01\n"
                             "  relative_step: False\n"
                             "  beta1: null\n"
                             "groups:\n"
                             "  - params: \"*bias\"\n"
                             "    weight_decay: 0\n"
                             "  - {params: 'ln*.weight', lr: 1e-3, scale_parameter: true}\n"
                             "plugin: {type: fsdp, tp: 4, dp: 2, zero: 3, ranks: 8, backend: mpi, device: cpu}\n"
                             "steps: 250\n"
                             "accumulation: 4\n"
                             "max_grad_norm: 1.0\n"
                             "bf16: true\n"
                             "gradients:\n"
                             "  source: trace\n"
                             "  path: traces/g.safetensors\n"
                             "output: {json: out/r.json, plot: /abs/r.svg}\n");
  cmp_options o;
  base_options(&o);
  o.quiet = 1;
  assert_ok(cmp_load_yaml(p, &o));
  assert_string_equal(o.optimizer, "adafactor");
  assert_string_equal(o.hparams, "lr=2e-4,weight_decay=0.01,relative_step=false,beta1=none");
  assert_int_equal(o.ngroups, 2);
  assert_string_equal(o.groups[0].glob, "*bias");
  assert_string_equal(o.groups[0].hp, "weight_decay=0");
  assert_string_equal(o.groups[1].glob, "ln*.weight");
  assert_string_equal(o.groups[1].hp, "lr=1e-3,scale_parameter=true");
  assert_string_equal(o.plugin, "fsdp");
  assert_int_equal(o.tp, 4);
  assert_int_equal(o.dp, 2);
  assert_int_equal(o.zero, 3);
  assert_int_equal(o.ranks, 8);
  assert_string_equal(o.backend, "mpi");
  assert_string_equal(o.device, "cpu");
  assert_int_equal(o.steps, 250);
  assert_int_equal(o.micro, 4);
  assert_true(o.max_grad_norm == 1.0);
  assert_int_equal(o.bf16, 1);
  assert_string_equal(o.source, "trace");
  char want[600];
  snprintf(want, sizeof want, "%s/traces/g.safetensors", dir);
  assert_string_equal(o.trace_path, want);
  assert_string_equal(o.json_path, "out/r.json");
  assert_string_equal(o.svg_path, "/abs/r.svg");
  assert_int_equal(o.quiet, 1); /* untouched */
  assert_int_equal((int)o.seed, 1);
  cmp_options_free(&o);
}

static void test_partial_on_top(void **st) {
  (void)st;
  /* only what the file names changes; path implies source trace */
  const char *p = write_yaml("partial.yaml", "steps: 7\ngradients: {path: /data/t.safetensors}\n");
  cmp_options o, before;
  base_options(&o);
  assert_ok(cmp_options_add_group(&o, "*", 1, ""));
  before = o;
  assert_ok(cmp_load_yaml(p, &o));
  assert_int_equal(o.steps, 7);
  assert_string_equal(o.source, "trace");
  assert_string_equal(o.trace_path, "/data/t.safetensors"); /* absolute: unchanged */
  assert_string_equal(o.optimizer, before.optimizer);
  assert_int_equal(o.ngroups, 1);
  assert_int_equal(o.tp, 2);
  /* synthetic with the full 64-bit seed range; empty groups clear them */
  p = write_yaml("seed.yaml", "gradients: {source: synthetic, seed: 18446744073709551615}\ngroups: []\n"
                              "optimizer: {type: adamw}\nmax_grad_norm: 0\n");
  assert_ok(cmp_load_yaml(p, &o));
  assert_true(o.seed == UINT64_MAX);
  assert_string_equal(o.model, "");
  assert_ok(cmp_load_yaml(write_yaml("model.yaml", "gradients: {source: synthetic, model: 2mx32}\n"), &o));
  assert_string_equal(o.model, "2mx32");
  assert_int_equal(o.ngroups, 0);
  assert_string_equal(o.optimizer, "adamw");
  assert_string_equal(o.hparams, "");
  cmp_options_free(&o);
}

static void test_relative_trace_path(void **st) {
  (void)st;
  char sub[512], path[600];
  snprintf(sub, sizeof sub, "%s/cfgs", dir);
  assert_int_equal(mkdir(sub, 0755), 0);
  snprintf(path, sizeof path, "%s/run.yaml", sub);
  FILE *f = fopen(path, "wb");
  assert_non_null(f);
  fputs("gradients:\n  source: trace\n  path: ../traces/a.safetensors\n", f);
  fclose(f);
  cmp_options o;
  base_options(&o);
  assert_ok(cmp_load_yaml(path, &o));
  char want[700];
  snprintf(want, sizeof want, "%s/../traces/a.safetensors", sub);
  assert_string_equal(o.trace_path, want);
  /* a resolved path longer than the buffer is an error, not a truncation */
  char text[600];
  snprintf(text, sizeof text, "gradients: {source: trace, path: %0500d}\n", 0);
  f = fopen(path, "wb");
  fputs(text, f);
  fclose(f);
  assert_status(cmp_load_yaml(path, &o), DOPT_ERR_FORMAT, "gradients.path");
}

static void test_errors(void **st) {
  (void)st;
  static char long_type[200], long_hp[2000], many_groups[40000], many_line[16];
  snprintf(long_type, sizeof long_type, "optimizer:\n  type: %040d\n", 0);
  size_t n = (size_t)snprintf(long_hp, sizeof long_hp, "steps: 1\noptimizer:\n  type: came\n");
  for (int i = 0; i < 40; i++) n += (size_t)snprintf(long_hp + n, sizeof long_hp - n, "  key_number_%02d: 1\n", i);
  n = (size_t)snprintf(many_groups, sizeof many_groups, "groups:\n");
  for (int i = 0; i < CMP_MAX_GROUPS + 1; i++)
    n += (size_t)snprintf(many_groups + n, sizeof many_groups - n, "  - {params: \"g%d*\"}\n", i);
  snprintf(many_line, sizeof many_line, ":%d:", CMP_MAX_GROUPS + 2); /* the first group past the limit */
  static const struct {
    const char *yaml;
    dopt_status want;
    const char *line; /* ":N:" */
    const char *key;
  } bad[] = {
      {"steps: 3\nstepz: 4\n", DOPT_ERR_FORMAT, ":2:", "stepz"},
      {"plugin:\n  type: hybrid\n  tpp: 2\n", DOPT_ERR_FORMAT, ":3:", "plugin.tpp"},
      {"gradients: {source: synthetic, sed: 1}\n", DOPT_ERR_FORMAT, ":1:", "gradients.sed"},
      {"output:\n  json: a.json\n  svg: b.svg\n", DOPT_ERR_FORMAT, ":3:", "output.svg"},
      {"steps: abc\n", DOPT_ERR_FORMAT, ":1:", "steps"},
      {"\nplugin: {tp: 1.5}\n", DOPT_ERR_FORMAT, ":2:", "plugin.tp"},
      {"bf16: maybe\n", DOPT_ERR_FORMAT, ":1:", "bf16"},
      {"steps:\n  a: 1\n", DOPT_ERR_FORMAT, ":2:", "steps"},
      {"steps: [1, 2]\n", DOPT_ERR_FORMAT, ":1:", "steps"},
      {"plugin: hybrid\n", DOPT_ERR_FORMAT, ":1:", "plugin"},
      {"steps: 0\n", DOPT_ERR_FORMAT, ":1:", "steps"},
      {"steps: 5\naccumulation: -1\n", DOPT_ERR_FORMAT, ":2:", "accumulation"},
      {"plugin: {dp: 0}\n", DOPT_ERR_FORMAT, ":1:", "plugin.dp"},
      {"plugin: {zero: 4}\n", DOPT_ERR_FORMAT, ":1:", "plugin.zero"},
      {"plugin: {type: deepspeed}\n", DOPT_ERR_FORMAT, ":1:", "plugin.type"},
      {"plugin: {backend: gloo}\n", DOPT_ERR_FORMAT, ":1:", "plugin.backend"},
      {"plugin: {device: tpu}\n", DOPT_ERR_FORMAT, ":1:", "plugin.device"},
      {"max_grad_norm: -1\n", DOPT_ERR_FORMAT, ":1:", "max_grad_norm"},
      {"max_grad_norm: .inf\n", DOPT_ERR_FORMAT, ":1:", "max_grad_norm"},
      {"steps: 99999999999999999999\n", DOPT_ERR_FORMAT, ":1:", "steps"},
      {"gradients: {seed: -3}\n", DOPT_ERR_FORMAT, ":1:", "gradients.seed"},
      {"gradients: {source: file}\n", DOPT_ERR_FORMAT, ":1:", "gradients.source"},
      {"gradients: {source: synthetic, path: x}\n", DOPT_ERR_FORMAT, ":1:", "gradients.path"},
      {"output:\n  json:\n", DOPT_ERR_FORMAT, ":2:", "output.json"},
      {long_type, DOPT_ERR_FORMAT, ":2:", "optimizer.type"},
      {long_hp, DOPT_ERR_FORMAT, ":", "optimizer."},
      {"steps: 3\nplugin: {tp: 2}\nsteps: 4\n", DOPT_ERR_FORMAT, ":3:", "steps"},
      {"optimizer: {type: came, lr: 1, lr: 2}\n", DOPT_ERR_FORMAT, ":1:", "optimizer.lr"},
      {"optimizer:\n  type: came\n  lr: [1, 2]\n", DOPT_ERR_FORMAT, ":3:", "optimizer.lr"},
      {"optimizer:\n  type: came\n  lr: fast\n", DOPT_ERR_FORMAT, ":3:", "optimizer.lr"},
      /* integers are plain scalars of digits: a quoted, spaced or !!str-tagged one is a string */
      {"steps: \"2\"\n", DOPT_ERR_FORMAT, ":1:", "steps: must be an integer, got the quoted string '2'"},
      {"steps: \" 3\"\n", DOPT_ERR_FORMAT, ":1:", "steps"},
      {"steps: !!str 3\n", DOPT_ERR_FORMAT, ":1:", "steps: must be an integer, got the tagged '3'"},
      {"steps: 3.0\n", DOPT_ERR_FORMAT, ":1:", "steps"},
      {"steps: +3\n", DOPT_ERR_FORMAT, ":1:", "steps"},
      {"plugin: {tp: '2'}\n", DOPT_ERR_FORMAT, ":1:", "plugin.tp"},
      {"gradients: {seed: \"5\"}\n", DOPT_ERR_FORMAT, ":1:", "gradients.seed"},
      /* a name where the optimizer wants one of its choices: checked by the registry, at its line */
      {"optimizer:\n  type: galore_adamw\n  rank: 4\n  proj_type: sideways\n", DOPT_ERR_FORMAT, ":4:",
       "optimizer.proj_type: galore_adamw: proj_type='sideways' is not one of"},
      {"optimizer:\n  type: lisa\n  inner: lisa\n", DOPT_ERR_FORMAT, ":3:", "optimizer.inner"},
      {"optimizer: {type: came, lr: 1e-3}\ngroups:\n  - {params: '*', relative_step: true}\n", DOPT_ERR_FORMAT,
       ":3:", "groups[0]"},
      {"optimizer: {type: came, lr: 1e-3, beta1: a,b}\n", DOPT_ERR_FORMAT, ":1:", "optimizer"},
      {"optimizer:\n  lr: 1\n", DOPT_ERR_FORMAT, ":2:", "optimizer.type"},
      {"optimizer: {type: came, \"a=b\": 1}\n", DOPT_ERR_FORMAT, ":1:", "optimizer.a=b"},
      {"groups:\n  - {params: \"*\"}\n  - {lr: 1}\n", DOPT_ERR_FORMAT, ":3:", "groups[1].params"},
      {"groups:\n  - params: [a, b]\n", DOPT_ERR_FORMAT, ":2:", "groups[0].params"},
      {"groups: {params: a}\n", DOPT_ERR_FORMAT, ":1:", "groups"},
      {many_groups, DOPT_ERR_FORMAT, many_line, "groups"},
      {"gradients:\n  source: synthetic\n  model: llama-2b\n", DOPT_ERR_FORMAT, ":3:", "gradients.model"},
      {"gradients: {source: trace, model: 100m}\n", DOPT_ERR_FORMAT, ":1:", "gradients.model"},
      {"? [a, b]\n: 1\n", DOPT_ERR_FORMAT, ":1:", "keys must be scalars"},
      {"- steps: 1\n", DOPT_ERR_FORMAT, ":1:", "top level"},
      {"plugin: {type: hybrid\nsteps: 3\n", DOPT_ERR_FORMAT, ":2:", "YAML"},
      {"steps: 1\n\tplugin: x\n", DOPT_ERR_FORMAT, ":2:", "YAML"},
      {"steps: *nope\n", DOPT_ERR_FORMAT, ":1:", "YAML"},
      {"steps: 1\n---\nsteps: 2\n", DOPT_ERR_FORMAT, ":3:", "more than one"},
      {"", DOPT_ERR_FORMAT, "", "empty"},
      {"compare: {max_tp: 9}\n", DOPT_ERR_FORMAT, ":1:", "compare.max_tp"},
      {"compare:\n  max_dp: 0\n", DOPT_ERR_FORMAT, ":2:", "compare.max_dp"},
      {"compare: {sweep: yes}\n", DOPT_ERR_FORMAT, ":1:", "compare.sweep"},
      {"compare: {threads: 257}\n", DOPT_ERR_FORMAT, ":1:", "compare.threads"},
      {"compare: {threads: -1}\n", DOPT_ERR_FORMAT, ":1:", "compare.threads"},
      {"compare: {sweeps: true}\n", DOPT_ERR_FORMAT, ":1:", "compare.sweeps"},
      {"compare: true\n", DOPT_ERR_FORMAT, ":1:", "compare"},
      {"checkpoint: {resume: {type: colossal}}\n", DOPT_ERR_FORMAT, ":1:", "checkpoint.resume.type"},
      {"# only a comment\n", DOPT_ERR_FORMAT, "", "empty"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    char name[32];
    snprintf(name, sizeof name, "bad%zu.yaml", i);
    const char *p = write_yaml(name, bad[i].yaml);
    cmp_options o, before;
    base_options(&o);
    before = o;
    dopt_clear_error();
    dopt_status s = cmp_load_yaml(p, &o);
    const char *msg = dopt_last_error();
    if (s != bad[i].want || !strstr(msg, name) || !strstr(msg, bad[i].line) || !strstr(msg, bad[i].key))
      fail_msg("case %zu: %s '%s' (want %s with '%s' and '%s')", i, dopt_status_name(s), msg,
               dopt_status_name(bad[i].want), bad[i].line, bad[i].key);
    if (memcmp(&o, &before, sizeof o) != 0) fail_msg("case %zu: options modified on error", i);
  }
}

/* compare: {sweep, max_tp, max_dp, threads}, and the layout values the file gives are marked as given (from YAML). */
/* Every value --hparams takes is also a YAML value: for every registered optimizer, its registry example (the
 * settings it runs with) written as YAML, and then each choice of each of its enumerations (galore's proj_type and
 * svd, LISA's inner): the file loads and carries the same k=v string. */
static void test_every_hparam_value(void **st) {
  (void)st;
  int checked = 0;
  for (int r = 0; r < dopt_optim_registry_count(); r++) {
    dopt_optim_info in;
    assert_ok(dopt_optim_registry_info(r, &in));
    const dopt_optim_impl *im = dopt_find_impl(in.name);
    assert_non_null(im);
    char yaml[2048], want[1024];
    int n = snprintf(yaml, sizeof yaml, "optimizer:\n  type: %s\n", in.name);
    snprintf(want, sizeof want, "%s", in.example);
    for (char *kv = want, *next; kv && *kv; kv = next) { /* the example, one YAML line per k=v */
      next = strchr(kv, ',');
      int len = next ? (int)(next - kv) : (int)strlen(kv);
      const char *eq = memchr(kv, '=', (size_t)len);
      assert_non_null(eq);
      n += snprintf(yaml + n, sizeof yaml - (size_t)n, "  %.*s: %.*s\n", (int)(eq - kv), kv, len - (int)(eq - kv) - 1,
                    eq + 1);
      if (next) next++;
    }
    for (int k = -1; k < im->nhp; k++) {
      if (k >= 0 && im->hp[k].kind != DOPT_HP_ENUM) continue;
      for (int ch = 0; k < 0 ? ch < 1 : im->hp[k].choices[ch] != NULL; ch++) {
        char text[2300], expect[1200];
        if (k < 0) {
          snprintf(text, sizeof text, "%s", yaml);
          snprintf(expect, sizeof expect, "%s", in.example);
        } else {
          if (strstr(in.example, im->hp[k].key)) continue; /* the example sets it: its own value is checked above */
          if (k >= 0 && strcmp(im->hp[k].choices[ch], in.name) == 0) continue;
          snprintf(text, sizeof text, "%s  %s: %s\n", yaml, im->hp[k].key, im->hp[k].choices[ch]);
          snprintf(expect, sizeof expect, "%s%s%s=%s", in.example, in.example[0] ? "," : "", im->hp[k].key,
                   im->hp[k].choices[ch]);
        }
        cmp_options o;
        base_options(&o);
        dopt_status s = cmp_load_yaml(write_yaml("values.yaml", text), &o);
        /* a choice the example's other settings exclude (LISA's inner=a wrapper) is refused by the registry, at
         * its line, as on the command line */
        dopt_optim *probe = NULL;
        dopt_status cli = dopt_optim_create(in.name, expect, &probe);
        dopt_optim_destroy(probe);
        if (cli != DOPT_OK) {
          if (s != DOPT_ERR_FORMAT) fail_msg("%s: YAML took what --hparams '%s' refuses", in.name, expect);
          continue;
        }
        if (s != DOPT_OK) fail_msg("%s: --hparams '%s' runs, the YAML refuses it: %s", in.name, expect, dopt_last_error());
        assert_string_equal(o.hparams, expect);
        checked++;
      }
    }
  }
  assert_true(checked >= 9 + 6); /* every optimizer, and the choices of galore's and LISA's enumerations */
}

static void test_compare_section_and_given(void **st) {
  (void)st;
  const char *p = write_yaml("sweep.yaml", "compare: {sweep: true, max_tp: 3, max_dp: 8, threads: 3}\n"
                                           "plugin: {type: ddp, dp: 3}\ncheckpoint: {resume: {zero: 2}}\n");
  cmp_options o;
  base_options(&o);
  assert_ok(cmp_load_yaml(p, &o));
  assert_int_equal(o.sweep, 1);
  assert_int_equal(o.max_tp, 3);
  assert_int_equal(o.max_dp, 8);
  assert_int_equal(o.threads, 3);
  const unsigned want = CMP_GIVEN_PLUGIN | CMP_GIVEN_DP | CMP_GIVEN_RESUME_ZERO;
  assert_int_equal(o.given, want);
  assert_int_equal(o.given_yaml, want);
  assert_int_equal(o.tp, 2); /* not in the file: cmp_apply_plugin decides */
  assert_ok(cmp_apply_plugin(&o));
  assert_int_equal(o.tp, 1);
  assert_int_equal(o.dp, 3);
  assert_int_equal(o.zero, 0);
  assert_string_equal(o.resume_plugin, "zero"); /* ddp does not allow zero 2: the plugin that does */
  assert_int_equal(o.resume_zero, 2);
}

/* cmp_apply_plugin: what each plugin implies, what it keeps, what contradicts it (one message naming both
 * values), o unchanged on error; every explicit layout accepted exactly where ColossalAI's plugin allows it. */
static void test_apply_plugin(void **st) {
  (void)st;
  static const struct {
    const char *plugin; /* NULL: not given (the default hybrid) */
    int tp, zero;       /* -1: not given */
    int want_tp, want_zero;
    const char *want_plugin, *err; /* err: a needle of the expected error, NULL for success */
  } C[] = {
      {"ddp", -1, -1, 1, 0, "ddp", NULL},
      {"zero", -1, -1, 1, 1, "zero", NULL},
      {"hybrid", -1, -1, 2, 2, "hybrid", NULL},
      {"fsdp", -1, -1, 2, 3, "fsdp", NULL},
      {NULL, -1, -1, 2, 2, "hybrid", NULL},
      {NULL, -1, 3, 2, 3, "fsdp", NULL},
      {NULL, 1, 0, 1, 0, "hybrid", NULL},
      {"zero", -1, 2, 1, 2, "zero", NULL},
      {"zero", 1, -1, 1, 1, "zero", NULL},
      {"fsdp", 1, -1, 1, 3, "fsdp", NULL},
      {"fsdp", 4, 3, 4, 3, "fsdp", NULL},
      {"hybrid", 3, 0, 3, 0, "hybrid", NULL},
      {"ddp", 1, 0, 1, 0, "ddp", NULL},
      {"ddp", -1, 2, 0, 0, NULL, "--plugin ddp contradicts --zero 2: plugin ddp implies zero 0"},
      {"ddp", 2, -1, 0, 0, NULL, "--plugin ddp contradicts --tp 2: plugin ddp implies tp 1"},
      {"zero", 2, -1, 0, 0, NULL, "--plugin zero contradicts --tp 2: plugin zero implies tp 1"},
      {"zero", -1, 3, 0, 0, NULL, "--plugin zero contradicts --zero 3: plugin zero implies zero 1"},
      {"fsdp", -1, 1, 0, 0, NULL, "--plugin fsdp contradicts --zero 1: plugin fsdp implies zero 3"},
      {"hybrid", -1, 3, 0, 0, NULL, "--plugin hybrid contradicts --zero 3: plugin hybrid implies zero 2 (allowed: zero 0, 1 or 2;"},
      {"colossal", -1, -1, 0, 0, NULL, "--plugin 'colossal': unknown plugin"},
  };
  for (size_t i = 0; i < sizeof C / sizeof C[0]; i++) {
    cmp_options o, before;
    base_options(&o);
    o.resume_zero = -1;
    if (C[i].plugin) snprintf(o.plugin, sizeof o.plugin, "%s", C[i].plugin), o.given |= CMP_GIVEN_PLUGIN;
    if (C[i].tp >= 0) o.tp = C[i].tp, o.given |= CMP_GIVEN_TP;
    if (C[i].zero >= 0) o.zero = C[i].zero, o.given |= CMP_GIVEN_ZERO;
    before = o;
    dopt_clear_error();
    dopt_status s = cmp_apply_plugin(&o);
    if (C[i].err) {
      if (s == DOPT_OK || !strstr(dopt_last_error(), C[i].err))
        fail_msg("case %zu: %s '%s' (want '%s')", i, dopt_status_name(s), dopt_last_error(), C[i].err);
      if (memcmp(&o, &before, sizeof o) != 0) fail_msg("case %zu: options modified on error", i);
      continue;
    }
    if (s != DOPT_OK) fail_msg("case %zu: %s", i, dopt_last_error());
    if (o.tp != C[i].want_tp || o.zero != C[i].want_zero || strcmp(o.plugin, C[i].want_plugin) != 0)
      fail_msg("case %zu: %s tp %d zero %d (want %s tp %d zero %d)", i, o.plugin, o.tp, o.zero, C[i].want_plugin,
               C[i].want_tp, C[i].want_zero);
    assert_ok(dopt_dist_check_layout(o.plugin, o.tp, o.dp, o.zero));
  }
  /* spelled as the YAML keys when the file gave them */
  cmp_options o;
  base_options(&o);
  snprintf(o.plugin, sizeof o.plugin, "ddp");
  o.zero = 1;
  o.given = o.given_yaml = CMP_GIVEN_PLUGIN | CMP_GIVEN_ZERO;
  assert_status(cmp_apply_plugin(&o), DOPT_ERR_INVALID_ARG, "plugin.type ddp contradicts plugin.zero 1");
  /* every explicit layout: accepted exactly where the plugin allows it, written out here (ddp: tp 1, zero 0;
   * zero: tp 1, zero 1-2; hybrid and moe_hybrid: zero 0-2; fsdp and gemini: zero 3), by the CLI and the library */
  static const char *const P[] = {"ddp", "zero", "hybrid", "fsdp", "gemini", "moe_hybrid"};
  for (int p = 0; p < 6; p++)
    for (int tp = 1; tp <= 3; tp++)
      for (int z = 0; z <= 3; z++) {
        base_options(&o);
        o.resume_zero = -1;
        snprintf(o.plugin, sizeof o.plugin, "%s", P[p]);
        o.tp = tp, o.zero = z, o.given = CMP_GIVEN_PLUGIN | CMP_GIVEN_TP | CMP_GIVEN_ZERO;
        const int want = p == 0 ? tp == 1 && z == 0 : p == 1 ? tp == 1 && z >= 1 && z <= 2 : p == 2 || p == 5 ? z <= 2 : z == 3;
        int mine = cmp_apply_plugin(&o) == DOPT_OK, dist = dopt_dist_check_layout(P[p], tp, 2, z) == DOPT_OK;
        if (mine != want || dist != want)
          fail_msg("%s tp %d zero %d: cmp_apply_plugin %d, dopt_dist_check_layout %d, want %d", P[p], tp, z, mine, dist, want);
        /* and the sweep's plugin for the layout is one the layer accepts */
        assert_ok(dopt_dist_check_layout(cmp_layout_plugin(tp, z), tp, 2, z));
      }
  /* the resume layout: the first's values where the resume plugin allows them, else what it implies */
  base_options(&o);
  o.resume_zero = -1;
  snprintf(o.resume_plugin, sizeof o.resume_plugin, "fsdp");
  o.given = CMP_GIVEN_RESUME_PLUGIN;
  assert_ok(cmp_apply_plugin(&o));
  assert_int_equal(o.resume_tp, 0); /* 0: the first layout's tp (2): fsdp allows it */
  assert_int_equal(o.resume_zero, 3);
  base_options(&o);
  o.resume_zero = -1;
  snprintf(o.resume_plugin, sizeof o.resume_plugin, "ddp");
  o.given = CMP_GIVEN_RESUME_PLUGIN;
  assert_ok(cmp_apply_plugin(&o));
  assert_int_equal(o.resume_tp, 1);
  assert_int_equal(o.resume_zero, 0);
  base_options(&o);
  snprintf(o.resume_plugin, sizeof o.resume_plugin, "ddp");
  o.resume_zero = 1;
  o.given = CMP_GIVEN_RESUME_PLUGIN | CMP_GIVEN_RESUME_ZERO;
  assert_status(cmp_apply_plugin(&o), DOPT_ERR_INVALID_ARG, "--resume-plugin ddp contradicts --resume-zero 1");
}

static void test_missing_file(void **st) {
  (void)st;
  char path[512];
  snprintf(path, sizeof path, "%s/nope.yaml", dir);
  cmp_options o;
  base_options(&o);
  assert_status(cmp_load_yaml(path, &o), DOPT_ERR_IO, "nope.yaml");
}

/* Hostile configurations are refused in one pass over the event stream
 * (nested 200 000 deep or 50 000 keys took minutes), and leave o unchanged. */
static void test_hostile_sizes(void **st) {
  (void)st;
  cmp_options o, before;
  base_options(&o);
  before = o;
  size_t n = 200000;
  char *deep = malloc(2 * n + 16);
  assert_non_null(deep);
  memset(deep, '[', n);
  memset(deep + n, ']', n);
  deep[2 * n] = '\n';
  deep[2 * n + 1] = '\0';
  assert_status(cmp_load_yaml(write_yaml("deep.yaml", deep), &o), DOPT_ERR_FORMAT, "nested deeper than 32");
  free(deep);
  size_t cap = 50000 * 16 + 64, len = 0;
  char *wide = malloc(cap);
  assert_non_null(wide);
  for (int k = 0; k < 50000; k++) len += (size_t)snprintf(wide + len, cap - len, "k%d: 1\n", k);
  assert_status(cmp_load_yaml(write_yaml("wide.yaml", wide), &o), DOPT_ERR_FORMAT, "more than 10000 YAML nodes");
  free(wide);
  char *big = malloc((1 << 20) + 64);
  assert_non_null(big);
  memset(big, '#', (1 << 20) + 10); /* one long comment: valid YAML, too large */
  big[(1 << 20) + 10] = '\0';
  assert_status(cmp_load_yaml(write_yaml("big.yaml", big), &o), DOPT_ERR_FORMAT, "at most 1048576");
  free(big);
  assert_memory_equal(&o, &before, sizeof o);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_hostile_sizes),
      cmocka_unit_test(test_full),
      cmocka_unit_test(test_partial_on_top),
      cmocka_unit_test(test_relative_trace_path),
      cmocka_unit_test(test_errors),
      cmocka_unit_test(test_missing_file),
      cmocka_unit_test(test_compare_section_and_given),
      cmocka_unit_test(test_every_hparam_value),
      cmocka_unit_test(test_apply_plugin),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}

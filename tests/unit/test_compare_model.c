/* LLaMA-shaped models for `compare --model` and `mem` (compare/model.c), and
 * compare at model scale: a 291-tensor model and more groups than the old
 * fixed tables held, bitwise against the reference on every rank. */
#include "testutil.h"

#include <fnmatch.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "compare.h"
#include "model.h"

/* The presets as in the GaLore repository's LLaMA configs (llama_7b.json: hidden 4096, intermediate 11008,
 * 32 layers, vocab 32000; llama_1b.json 2048 / 5461 / 24; llama_130m.json 768 / 2048 / 12). */
static void test_presets(void **st) {
  (void)st;
  cmp_model m;
  assert_ok(cmp_model_parse("llama-7b", &m));
  assert_int_equal(m.hidden, 4096);
  assert_int_equal(m.inter, 11008);
  assert_int_equal(m.layers, 32);
  assert_int_equal(m.vocab, 32000);
  assert_int_equal(cmp_model_ntensors(&m), 291);
  /* 6 738 415 616: LlamaForCausalLM's parameter count for this config */
  assert_true(cmp_model_params(&m) == 6738415616.0);
  assert_ok(cmp_model_parse("llama-1b", &m));
  assert_int_equal(m.hidden, 2048);
  assert_int_equal(m.inter, 5461);
  assert_int_equal(m.layers, 24);
  assert_ok(cmp_model_parse("llama-130m", &m));
  assert_int_equal(m.hidden, 768);
  assert_int_equal(m.inter, 2048);
  assert_int_equal(m.layers, 12);
  assert_int_equal(cmp_model_npresets(), 7);
}

static void expect_bad(const char *const *bad, size_t n);

/* Mixtral-shaped models (Hugging Face's MixtralForCausalLM layout): separate experts w1, w2, w3 under
 * block_sparse_moe, a router, grouped-query k and v; the 8x7B preset has Mixtral-8x7B's 46 702 792 704
 * parameters (hidden 4096, intermediate 14336, 32 layers, 8 kv heads of 128, vocab 32000); every expert
 * tensor carries its expert id, which is also what compare reads from its name. */
static void test_mixtral(void **st) {
  (void)st;
  cmp_model m;
  assert_ok(cmp_model_parse("mixtral-8x7b", &m));
  assert_true(m.experts == 8 && m.separate && m.kv == 1024);
  assert_true(cmp_model_params(&m) == 46702792704.0);
  assert_int_equal(cmp_model_ntensors(&m), (7 + 3 * 8) * 32 + 3);
  assert_ok(cmp_model_parse("mixtral-mini", &m));
  const int n = cmp_model_ntensors(&m);
  assert_int_equal(n, (7 + 3 * 6) * 2 + 3);
  double sum = 0;
  int per_expert[6] = {0}, dense = 0;
  for (int i = 0; i < n; i++) {
    cmp_model_tensor t;
    cmp_model_tensor_at(&m, i, &t);
    sum += (double)t.shape[0] * (double)(t.ndim == 2 ? t.shape[1] : 1);
    assert_int_equal(cmp_expert_of(t.name), t.expert);
    if (t.expert >= 0) per_expert[t.expert]++;
    else dense++;
  }
  assert_true(sum == cmp_model_params(&m));
  for (int e = 0; e < 6; e++) assert_int_equal(per_expert[e], 3 * 2);
  assert_int_equal(dense, 7 * 2 + 3);
  cmp_model_tensor t;
  cmp_model_tensor_at(&m, 1 + 25 + 2, &t);
  assert_string_equal(t.name, "model.layers.1.self_attn.v_proj.weight");
  assert_true(t.shape[0] == m.kv && t.shape[1] == m.hidden && t.role == DOPT_TP_COLUMN);
  cmp_model_tensor_at(&m, 1 + 25 + 4, &t);
  assert_string_equal(t.name, "model.layers.1.block_sparse_moe.gate.weight");
  assert_true(t.shape[0] == 6 && t.expert == -1 && t.role == DOPT_TP_REPLICATED);
  cmp_model_tensor_at(&m, 1 + 25 + 5 + 3 * 5 + 1, &t);
  assert_string_equal(t.name, "model.layers.1.block_sparse_moe.experts.5.w2.weight");
  assert_true(t.shape[0] == m.hidden && t.shape[1] == m.inter && t.role == DOPT_TP_ROW && t.expert == 5 && t.projected);
  cmp_model_tensor_at(&m, 1 + 25 + 5 + 18, &t);
  assert_string_equal(t.name, "model.layers.1.input_layernorm.weight");
  /* a count with separate experts: the same parameters as the stacked one, 3·E tensors per layer */
  cmp_model s, k;
  assert_ok(cmp_model_parse("4mx2e8s", &s));
  assert_ok(cmp_model_parse("4mx2e8", &k));
  assert_true(s.separate && !k.separate && cmp_model_params(&s) == cmp_model_params(&k));
  assert_int_equal(cmp_model_ntensors(&s), (7 + 24) * 2 + 3);
  /* names: a whole component "experts" and a number, nothing else */
  assert_int_equal(cmp_expert_of("experts.12.w1.weight"), 12);
  assert_int_equal(cmp_expert_of("model.layers.0.mlp.experts.gate_proj"), -1);
  assert_int_equal(cmp_expert_of("model.shared_experts.3.w1"), -1);
  assert_int_equal(cmp_expert_of("x.experts.3"), -1);
  assert_int_equal(cmp_expert_of("x.experts.123456.w"), -1);
  static const char *const bad[] = {"1mx2s", "1mx2e8ss", "1mx2e8t"};
  expect_bad(bad, sizeof bad / sizeof bad[0]);
}

/* The tensors: names, shapes and roles of LlamaForCausalLM; their numels sum to the count. */
static void test_tensors(void **st) {
  (void)st;
  cmp_model m;
  assert_ok(cmp_model_parse("llama-60m", &m));
  const int n = cmp_model_ntensors(&m);
  assert_int_equal(n, 9 * 8 + 3);
  double sum = 0;
  int col = 0, row = 0, rep = 0, proj = 0;
  for (int i = 0; i < n; i++) {
    cmp_model_tensor t;
    cmp_model_tensor_at(&m, i, &t);
    sum += (double)t.shape[0] * (double)(t.ndim == 2 ? t.shape[1] : 1);
    col += t.role == DOPT_TP_COLUMN, row += t.role == DOPT_TP_ROW, rep += t.role == DOPT_TP_REPLICATED;
    proj += t.projected;
  }
  assert_true(sum == cmp_model_params(&m));
  assert_int_equal(col, 2 + 5 * 8); /* embedding, head, q k v gate up */
  assert_int_equal(row, 2 * 8);     /* o, down */
  assert_int_equal(rep, 2 * 8 + 1); /* the norms */
  assert_int_equal(proj, 7 * 8);
  cmp_model_tensor t;
  cmp_model_tensor_at(&m, 0, &t);
  assert_string_equal(t.name, "model.embed_tokens.weight");
  assert_true(t.shape[0] == 32000 && t.shape[1] == 512 && t.role == DOPT_TP_COLUMN);
  cmp_model_tensor_at(&m, 1 + 9 * 3 + 6, &t);
  assert_string_equal(t.name, "model.layers.3.mlp.down_proj.weight");
  assert_true(t.shape[0] == 512 && t.shape[1] == 1376 && t.role == DOPT_TP_ROW);
  cmp_model_tensor_at(&m, 1 + 9 * 7 + 8, &t);
  assert_string_equal(t.name, "model.layers.7.post_attention_layernorm.weight");
  assert_true(t.ndim == 1 && t.shape[0] == 512);
  cmp_model_tensor_at(&m, n - 2, &t);
  assert_string_equal(t.name, "model.norm.weight");
  cmp_model_tensor_at(&m, n - 1, &t);
  assert_string_equal(t.name, "lm_head.weight");
}

/* Each spec refused in one line naming --model. */
static void expect_bad(const char *const *bad, size_t n) {
  for (size_t k = 0; k < n; k++) {
    cmp_model m;
    dopt_clear_error();
    if (cmp_model_parse(bad[k], &m) != DOPT_ERR_INVALID_ARG) fail_msg("'%s' accepted", bad[k]);
    if (!strstr(dopt_last_error(), "--model")) fail_msg("'%s': %s", bad[k], dopt_last_error());
  }
}

/* Sizes: the closest model in LLaMA proportions; layers when given. */
static void test_sizes(void **st) {
  (void)st;
  static const struct {
    const char *spec;
    double count;
    int layers; /* 0: from the hidden size */
  } ok[] = {{"100m", 1e8, 0}, {"1.5b", 1.5e9, 0}, {"20M", 2e7, 0}, {"2mx32", 2e6, 32}, {"250k", 2.5e5, 0},
            {"7b", 7e9, 0}, {"10k", 1e4, 0}};
  for (size_t k = 0; k < sizeof ok / sizeof ok[0]; k++) {
    cmp_model m;
    assert_ok(cmp_model_parse(ok[k].spec, &m));
    assert_string_equal(m.name, ok[k].spec);
    const double p = cmp_model_params(&m);
    assert_true(m.hidden % 64 == 0 && m.hidden >= 64);
    assert_true(m.vocab % 64 == 0 || m.vocab == 32000);
    assert_true(m.inter % 32 == 0 && m.inter >= 8 * m.hidden / 3);
    if (ok[k].layers) assert_int_equal(m.layers, ok[k].layers);
    else assert_int_equal(m.layers, m.hidden / 64 < 2 ? 2 : m.hidden / 64 > 32 ? 32 : m.hidden / 64);
    /* the closest of hidden sizes 64 apart: within a third of the count unless it is the smallest model
     * (hidden 64: 10k, 250k, and 2m in 32 layers, whose layers alone are 1.7 m) */
    if (m.hidden > 64 && fabs(p - ok[k].count) > ok[k].count / 3)
      fail_msg("%s: %.0f parameters (hidden %d, %d layers, vocab %d)", ok[k].spec, p, m.hidden, m.layers, m.vocab);
  }
  cmp_model a, b;
  assert_ok(cmp_model_parse("100m", &a));
  assert_true(a.hidden == 640 && a.layers == 10 && a.inter == 1728 && a.vocab == 32000);
  assert_ok(cmp_model_parse("7b", &b));
  assert_true(b.layers == 32 && b.vocab == 32000 && b.hidden % 64 == 0);
  static const char *const bad[] = {"", "5", "0m", "-1m", "1e12", "100q", "1mx0", "1mx257", "1mx", "llama-2b",
                                    "nanm", "infm", "100m ", "1m x2"};
  expect_bad(bad, sizeof bad / sizeof bad[0]);
}

/* 291 tensors (a 32-layer LLaMA of 2.7 M parameters) and 40 groups (more than the 32 tensors and 8 groups
 * compare once held): bitwise on every rank, every tensor measured. */
static void test_compare_291(void **st) {
  (void)st;
  cmp_options o;
  cmp_options_default(&o);
  snprintf(o.optimizer, sizeof o.optimizer, "adamw");
  snprintf(o.model, sizeof o.model, "2mx32");
  o.steps = 2;
  o.quiet = 1;
  /* per layer a group of its own weight decay, and 8 more whose patterns match parameters that joined an earlier
   * group (a pattern that matches nothing is refused, as by run) */
  for (int g = 0; g < 40; g++) {
    char glob[64], hp[64];
    if (g < 32) snprintf(glob, sizeof glob, "model.layers.%d.*", g);
    else snprintf(glob, sizeof glob, "model.layers.%d.mlp.*", g - 32);
    snprintf(hp, sizeof hp, "weight_decay=%g", 0.001 * (g + 1));
    assert_ok(cmp_options_add_group(&o, glob, strlen(glob), hp));
  }
  assert_int_equal(o.ngroups, 40);
  assert_string_equal(o.groups[39].glob, "model.layers.7.mlp.*");
  assert_ok(cmp_apply_plugin(&o));
  cmp_result r;
  assert_ok(cmp_run(&o, &r, NULL, NULL));
  assert_int_equal(r.ntensors, 291 * 3); /* each parameter, exp_avg, exp_avg_sq */
  assert_int_equal(r.steps, 2);
  for (int k = 0; k < r.ntensors; k++)
    if (r.t[k].max_ulp != 0 || r.t[k].first_diff != 0) fail_msg("%s: %llu ULP", r.t[k].name, (unsigned long long)r.t[k].max_ulp);
  assert_true(r.equivalent);
  assert_int_equal(r.drift_step, 0);
  assert_int_equal(r.counter_step, 0);
  assert_string_equal(r.digest, r.ref_digest);
  assert_string_equal(r.t[3 * 290].name, "lm_head.weight");
  cmp_result_free(&r);
  /* the groups reach the optimizer: with layer 5's weight decay changed the digest changes */
  char before[DOPT_DIGEST_HEX];
  assert_ok(cmp_run(&o, &r, NULL, NULL));
  snprintf(before, sizeof before, "%s", r.digest);
  cmp_result_free(&r);
  snprintf(o.groups[5].hp, sizeof o.groups[5].hp, "weight_decay=0.5");
  assert_ok(cmp_run(&o, &r, NULL, NULL));
  assert_true(r.equivalent);
  assert_string_not_equal(r.digest, before);
  cmp_result_free(&r);
  /* the group limit is named */
  cmp_options f;
  cmp_options_default(&f);
  for (int g = 0; g < CMP_MAX_GROUPS; g++) assert_ok(cmp_options_add_group(&f, "x*", 2, ""));
  assert_status(cmp_options_add_group(&f, "x*", 2, ""), DOPT_ERR_INVALID_ARG, "more than 1024 groups");
  char longglob[CMP_GLOB_MAX + 1];
  memset(longglob, 'a', sizeof longglob - 1);
  longglob[sizeof longglob - 1] = '\0';
  cmp_options_free(&f);
  assert_status(cmp_options_add_group(&f, longglob, strlen(longglob), ""), DOPT_ERR_INVALID_ARG, "at most 255");
  assert_int_equal(f.ngroups, 0);
  cmp_options_free(&o);
}

/* The same model at tp 3 (uneven TP blocks of every role), dp 2, ZeRO 3, bf16, clipping and two
 * micro-batches: the per-rank block generator and the reference's whole tensors agree. */
static void test_compare_blocks(void **st) {
  (void)st;
  cmp_options o;
  cmp_options_default(&o);
  snprintf(o.optimizer, sizeof o.optimizer, "adafactor");
  snprintf(o.model, sizeof o.model, "300kx3");
  o.tp = 3, o.dp = 2, o.zero = 3;
  snprintf(o.plugin, sizeof o.plugin, "fsdp");
  o.micro = 2;
  o.bf16 = 1;
  o.max_grad_norm = 0.5;
  o.steps = 3;
  o.quiet = 1;
  cmp_result r;
  assert_ok(cmp_run(&o, &r, NULL, NULL));
  if (!r.equivalent) {
    for (int k = 0; k < r.ntensors; k++)
      if (r.t[k].max_ulp) fail_msg("%s: %llu ULP from step %d", r.t[k].name, (unsigned long long)r.t[k].max_ulp, r.t[k].first_diff);
    fail_msg("not equivalent (drift step %d, counter step %d)", r.drift_step, r.counter_step);
  }
  assert_string_equal(r.digest, r.ref_digest);
  cmp_result_free(&r);
}

/* eEXPERTS: the MLP as a router and three stacked expert tensors, TP within each expert; the numels sum to
 * the count; a spec whose 'e' could be read as an exponent is not. */
static void test_experts(void **st) {
  (void)st;
  cmp_model m;
  assert_ok(cmp_model_parse("4mx2e8", &m));
  assert_int_equal(m.experts, 8);
  assert_int_equal(m.layers, 2);
  const int n = cmp_model_ntensors(&m);
  assert_int_equal(n, 10 * 2 + 3);
  double sum = 0;
  int stacks = 0;
  for (int i = 0; i < n; i++) {
    cmp_model_tensor t;
    cmp_model_tensor_at(&m, i, &t);
    double e = 1;
    for (int k = 0; k < t.ndim; k++) e *= (double)t.shape[k];
    sum += e;
    stacks += t.ndim == 3;
  }
  assert_true(sum == cmp_model_params(&m));
  assert_int_equal(stacks, 3 * 2);
  const int64_t E = 8, h = m.hidden, f = m.inter;
  cmp_model_tensor t;
  cmp_model_tensor_at(&m, 1 + 10 + 4, &t);
  assert_string_equal(t.name, "model.layers.1.mlp.router.weight");
  assert_true(t.ndim == 2 && t.shape[0] == E && t.shape[1] == h && t.role == DOPT_TP_REPLICATED && !t.projected);
  cmp_model_tensor_at(&m, 1 + 10 + 5, &t);
  assert_string_equal(t.name, "model.layers.1.mlp.experts.gate_proj");
  assert_true(t.ndim == 3 && t.shape[0] == E && t.shape[1] == f && t.shape[2] == h && t.role == DOPT_TP_COLUMN);
  cmp_model_tensor_at(&m, 1 + 10 + 7, &t);
  assert_string_equal(t.name, "model.layers.1.mlp.experts.down_proj");
  assert_true(t.ndim == 3 && t.shape[0] == E && t.shape[1] == h && t.shape[2] == f && t.role == DOPT_TP_ROW);
  cmp_model_tensor_at(&m, 1 + 10 + 9, &t);
  assert_string_equal(t.name, "model.layers.1.post_attention_layernorm.weight");
  cmp_model_tensor_at(&m, n - 1, &t);
  assert_string_equal(t.name, "lm_head.weight");
  /* the same count with experts: a smaller hidden size */
  cmp_model d;
  assert_ok(cmp_model_parse("4mx2", &d));
  assert_true(d.experts == 0 && d.hidden > m.hidden);
  /* "20000e4" is 20k parameters in 4 experts, never 2e8 */
  assert_ok(cmp_model_parse("20000e4", &m));
  assert_true(m.experts == 4 && cmp_model_params(&m) < 1e6);
  static const char *const bad[] = {"1mx2e0", "1mx2e257", "1me", "1mx2e", "1mx2e8x2", "1e5", "2e4", "1mx2e+8", "1m e8"};
  expect_bad(bad, sizeof bad / sizeof bad[0]);
}

/* Muon on the MoE model: each stack orthogonalised per expert on its owner, uneven TP blocks within every
 * expert (tp 3), ZeRO 3, bf16, two micro-batches: bitwise on every rank, the stacks' momenta measured. */
static void test_compare_experts(void **st) {
  (void)st;
  cmp_options o;
  cmp_options_default(&o);
  snprintf(o.optimizer, sizeof o.optimizer, "muon");
  snprintf(o.model, sizeof o.model, "300kx2e4");
  o.tp = 3, o.dp = 2, o.zero = 3;
  snprintf(o.plugin, sizeof o.plugin, "fsdp");
  o.micro = 2;
  o.bf16 = 1;
  o.steps = 3;
  o.quiet = 1;
  cmp_result r;
  assert_ok(cmp_run(&o, &r, NULL, NULL));
  int stacks = 0;
  for (int k = 0; k < r.ntensors; k++) {
    if (r.t[k].max_ulp) fail_msg("%s: %llu ULP from step %d", r.t[k].name, (unsigned long long)r.t[k].max_ulp, r.t[k].first_diff);
    stacks += strstr(r.t[k].name, "experts.") && strstr(r.t[k].name, "momentum_buffer");
  }
  assert_int_equal(stacks, 3 * 2);
  assert_true(r.equivalent);
  assert_string_equal(r.digest, r.ref_digest);
  cmp_result_free(&r);
}

/* The --model generator gives the same bytes with each vector variant this CPU has (AVX-512, AVX2) as the
 * portable loop, on dense and expert-stacked (3-D) tensors, whole and in blocks: the values, and so every
 * digest, do not depend on the machine. */
static void test_synth_variants(void **st) {
  (void)st;
  char ran[64];
  assert_int_equal(cmp_synth_variants_differ("2mx2", ran, sizeof ran), 0);
  assert_int_equal(cmp_synth_variants_differ("4mx2e4", ran, sizeof ran), 0);
  if (!ran[0]) print_message("no vector variant on this CPU: the portable generator alone\n");
  else print_message("generator variants checked against the portable one: %s\n", ran);
  assert_int_equal(cmp_synth_variants_differ("no-such-model", ran, sizeof ran), -1);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_presets),      cmocka_unit_test(test_tensors),        cmocka_unit_test(test_sizes),
      cmocka_unit_test(test_compare_291),  cmocka_unit_test(test_compare_blocks), cmocka_unit_test(test_experts),
      cmocka_unit_test(test_compare_experts), cmocka_unit_test(test_mixtral), cmocka_unit_test(test_synth_variants),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

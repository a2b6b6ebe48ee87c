/* The equivalence grid on the GPU (label gpu; skipped without a CUDA device):
 * every CUDA optimizer under every plugin, run by `distopt compare`'s engine
 * with the CUDA device and the device-buffer simulator, bitwise against the
 * CPU reference. */
#include <string.h>

#include "compare.h"
#include "gpucommon.h"
#include "testutil.h"

static void test_grid(void **st) {
  (void)st;
  static const char *const opts[] = {"adamw", "adafactor", "came", "lamb"};
  static const struct {
    const char *plugin;
    int tp, dp, zero, bf16, micro;
    double clip;
  } lay[] = {{"ddp", 1, 2, 0, 0, 1, 0}, {"zero", 1, 3, 1, 1, 1, 1.0}, {"zero", 1, 3, 2, 0, 2, 0},
             {"hybrid", 2, 2, 2, 0, 1, 0.5}, {"fsdp", 2, 2, 3, 1, 1, 0}, {"hybrid", 3, 1, 0, 0, 1, 0}};
  for (size_t o = 0; o < 4; o++)
    for (size_t l = 0; l < sizeof lay / sizeof lay[0]; l++) {
      cmp_options c;
      cmp_options_default(&c);
      snprintf(c.optimizer, sizeof c.optimizer, "%s", opts[o]);
      if (strcmp(opts[o], "came") == 0) snprintf(c.hparams, sizeof c.hparams, "lr=2e-4");
      snprintf(c.plugin, sizeof c.plugin, "%s", lay[l].plugin);
      snprintf(c.device, sizeof c.device, "cuda");
      c.tp = lay[l].tp, c.dp = lay[l].dp, c.zero = lay[l].zero, c.bf16 = lay[l].bf16, c.micro = lay[l].micro;
      c.max_grad_norm = lay[l].clip;
      c.steps = 6;
      cmp_result r;
      dopt_status s = cmp_run(&c, &r, NULL, NULL);
      if (s != DOPT_OK) fail_msg("%s / %s: %s", opts[o], lay[l].plugin, dopt_last_error());
      if (!r.equivalent) {
        for (int t = 0; t < r.ntensors; t++)
          if (r.t[t].max_ulp) printf("  %s: %llu ULP from step %d\n", r.t[t].name, (unsigned long long)r.t[t].max_ulp,
                                     r.t[t].first_diff);
        fail_msg("%s / %s tp=%d dp=%d zero=%d: not bitwise", opts[o], lay[l].plugin, c.tp, c.dp, c.zero);
      }
      cmp_result_free(&r);
    }
}

int main(void) {
  gpu_or_skip("gpu_cuda_grid");
  const struct CMUnitTest tests[] = {cmocka_unit_test(test_grid)};
  return cmocka_run_group_tests(tests, NULL, NULL);
}

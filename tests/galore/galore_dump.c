/* Writes the bytes of galore_adamw's parameters and states after a few
 * steps (every proj_type, exact and randomized SVD, 192x160 at rank 24) to
 * the file argv[1]. tests/galore/threads.cmake runs it under
 * OPENBLAS_NUM_THREADS=1 and =2 and compares the files byte for byte. */
#include <stdio.h>
#include <stdlib.h>

#include "distopt/distopt.h"

static unsigned long long rng = 0x1234567ull;
static float unif(void) {
  rng = rng * 6364136223846793005ull + 1442695040888963407ull;
  return (float)((double)(rng >> 11) * 0x1.0p-53 - 0.5);
}

int main(int argc, char **argv) {
  if (argc != 2) return 2;
  FILE *f = fopen(argv[1], "wb");
  if (!f) return 2;
  const char *types[] = {"std", "reverse_std", "left", "right", "full"};
  const char *svds[] = {"exact", "randomized"};
  enum { M = 192, N = 160 };
  static float w[M * N], g[M * N];
  for (int s = 0; s < 2; s++)
    for (int k = 0; k < 5; k++) {
      char hp[128];
      snprintf(hp, sizeof hp, "rank=24,update_proj_gap=2,scale=0.5,weight_decay=0.01,proj_type=%s,svd=%s", types[k],
               svds[s]);
      dopt_optim *o;
      if (dopt_optim_create("galore_adamw", hp, &o) != DOPT_OK) return 1;
      for (int i = 0; i < M * N; i++) w[i] = unif();
      dopt_param_config pc = DOPT_PARAM_CONFIG_INIT;
      pc.name = "w", pc.ndim = 2, pc.shape[0] = M, pc.shape[1] = N, pc.data = w;
      if (dopt_optim_add_param(o, 0, &pc, NULL) != DOPT_OK) return 1;
      for (int t = 0; t < 5; t++) {
        for (int i = 0; i < M * N; i++) g[i] = unif() * 1e-2f;
        const float *gp[1] = {g};
        if (dopt_optim_step(o, gp) != DOPT_OK) return 1;
      }
      fwrite(w, sizeof w, 1, f);
      for (int i = 0; i < dopt_optim_num_states(o, 0); i++) {
        dopt_state_view v;
        dopt_optim_state(o, 0, i, &v);
        fwrite(v.data, v.bytes, 1, f);
      }
      dopt_optim_destroy(o);
    }
  return fclose(f) == 0 ? 0 : 2;
}

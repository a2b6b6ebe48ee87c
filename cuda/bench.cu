/* dopt_cuda_bench: bandwidth of the CUDA device's kernels against a
 * device-to-device copy measured in the same run (cuda/check.sh).
 *   dopt_cuda_bench [--n ELEMENTS] [--reps N] [--strict]
 * Each line: bytes moved per call (the passes' reads + writes of fp32/bf16
 * arrays; atomics and the small statistics not counted) / median time from
 * CUDA events over reps calls through the public device vtable (host
 * synchronisation included). --strict: exit 1 when an elementwise pass
 * (add, scale, average, to_bf16, adamw) is below 80% of the copy. */
#include <algorithm>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <vector>

extern "C" {
#include "registry.h"
}
#include "distopt/cuda.h"

static float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

#define CHECK(x)                                                                 \
  do {                                                                           \
    if ((x) != DOPT_OK) {                                                        \
      fprintf(stderr, "dopt_cuda_bench: %s: %s\n", #x, dopt_last_error());       \
      exit(1);                                                                   \
    }                                                                            \
  } while (0)

struct timer {
  cudaEvent_t a, b;
  timer() {
    cudaEventCreate(&a);
    cudaEventCreate(&b);
  }
  void start() { cudaEventRecord(a, cudaStreamPerThread); }
  float stop() {
    cudaEventRecord(b, cudaStreamPerThread);
    cudaEventSynchronize(b);
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    return ms;
  }
};

int main(int argc, char **argv) {
  size_t n = (size_t)1 << 26;
  int reps = 20, strict = 0;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--n") && i + 1 < argc) n = strtoull(argv[++i], NULL, 10);
    else if (!strcmp(argv[i], "--reps") && i + 1 < argc) reps = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--strict")) strict = 1;
    else {
      fprintf(stderr, "usage: dopt_cuda_bench [--n ELEMENTS] [--reps N] [--strict]\n");
      return 2;
    }
  }
  const char *why = "";
  if (dopt_cuda_device_count(&why) == 0) {
    printf("dopt_cuda_bench: no CUDA device: skipped (%s)\n", why);
    return 77;
  }
  dopt_device *G;
  CHECK(dopt_device_cuda(0, &G));
  const dopt_device_ops *op = G->ops;
  void *ctx = G->ctx;
  float *x, *y, *s0, *s1, *s2, *ws;
  uint16_t *h;
  size_t side = 1;
  while (side * side < n) side *= 2;
  const size_t rows = n / side; /* 2-D view [rows, side] of the same n for the factored optimizers */
  CHECK(op->alloc(ctx, n * 4, (void **)&x));
  CHECK(op->alloc(ctx, n * 4, (void **)&y));
  CHECK(op->alloc(ctx, n * 4, (void **)&s0));
  CHECK(op->alloc(ctx, n * 4, (void **)&s1));
  CHECK(op->alloc(ctx, (n + 2 * (rows + side) + 8) * 4, (void **)&s2));
  CHECK(op->alloc(ctx, (n + 2 * (rows + side) + 8) * 4, (void **)&ws));
  CHECK(op->alloc(ctx, n * 2, (void **)&h));
  {
    std::vector<float> init(n);
    for (size_t i = 0; i < n; i++) init[i] = (float)((i * 2654435761u) % 1000) * 1e-3f - 0.5f;
    CHECK(op->upload(ctx, x, init.data(), n * 4));
    CHECK(op->upload(ctx, y, init.data(), n * 4));
  }
  timer t;
  auto bench = [&](auto &&fn) {
    std::vector<float> ms;
    fn(); /* warm-up */
    for (int r = 0; r < reps; r++) {
      t.start();
      fn();
      ms.push_back(t.stop());
    }
    return median(ms);
  };
  float copy_ms = bench([&] { cudaMemcpyAsync(y, x, n * 4, cudaMemcpyDeviceToDevice, cudaStreamPerThread); });
  const double copy_bw = 2.0 * (double)n * 4 / (copy_ms * 1e-3);
  printf("dopt_cuda_bench: n = %zu fp32 elements, median of %d runs (CUDA events)\n", n, reps);
  printf("%-26s %10s %12s %10s %8s\n", "kernel", "bytes/elem", "time (ms)", "GB/s", "vs copy");
  printf("%-26s %10d %12.3f %10.1f %7.0f%%\n", "device-to-device copy", 8, copy_ms, copy_bw * 1e-9, 100.0);
  int below = 0;
  auto report = [&](const char *name, double bpe, float ms, int elementwise) {
    double bw = bpe * (double)n / (ms * 1e-3), pct = 100.0 * bw / copy_bw;
    int low = elementwise && pct < 80.0;
    below |= low;
    printf("%-26s %10.0f %12.3f %10.1f %7.0f%%%s\n", name, bpe, ms, bw * 1e-9, pct, low ? "  < 80% target" : "");
  };
  int64_t bad;
  double ss;
  report("add", 12, bench([&] { CHECK(op->add(ctx, y, x, n)); }), 1);
  report("scale", 8, bench([&] { CHECK(op->scale(ctx, y, 1.0f, n)); }), 1);
  report("average (+non-finite)", 8, bench([&] { CHECK(op->average(ctx, y, 1.0f, n, &bad)); }), 1);
  report("to_bf16", 6, bench([&] { CHECK(op->to_bf16(ctx, x, h, n)); }), 1);
  report("sumsq (2 passes)", 8, bench([&] { CHECK(op->sumsq(ctx, x, n, &ss)); }), 0);
  /* optimizer steps on a 1-D piece of n (adamw, lamb) and a 2-D [rows, side] one (adafactor, came) */
  const int64_t s1d[1] = {(int64_t)n}, s2d[2] = {(int64_t)rows, (int64_t)side};
  struct {
    const char *name, *label;
    int ndim;
    double bpe;
    int elementwise;
  } steps[] = {{"adamw", "adamw step", 1, 28, 1},
               {"lamb", "lamb step (4 passes)", 1, 56, 0},
               {"adafactor", "adafactor step (factored)", 2, 52, 0},
               {"came", "came step (factored)", 2, 84, 0}};
  for (auto &sp : steps) {
    const dopt_optim_impl *im = dopt_find_impl(sp.name);
    double hp[DOPT_MAX_HPARAMS];
    for (int k = 0; k < im->nhp; k++) hp[k] = im->hp[k].def;
    if (!strcmp(sp.name, "came")) hp[0] = 2e-4;
    dopt_piece pc;
    dopt_piece_full(sp.ndim, sp.ndim == 1 ? s1d : s2d, &pc);
    dopt_state_spec spec[DOPT_MAX_STATES];
    int ns = im->layout(hp, sp.ndim, sp.ndim == 1 ? s1d : s2d, spec);
    void *st[DOPT_MAX_STATES];
    for (int k = 0; k < ns; k++)
      CHECK(op->alloc(ctx, spec[k].kind == DOPT_STATE_ELEMENTWISE ? n * 4 : spec[k].v.bytes, &st[k]));
    int64_t step = 0;
    dopt_step_args fa = {im, hp, 1, &pc, NULL, NULL, NULL, NULL, NULL, NULL, 0, 0, NULL, NULL, NULL, NULL, 0, NULL, NULL, 0, NULL};
    void *frame;
    CHECK(op->alloc(ctx, op->frame_bytes(ctx, &fa), &frame));
    float ms = bench([&] {
      dopt_step_args a = {im, hp, ++step, &pc, y, x, st, frame, NULL, NULL, 0, 0, NULL, NULL, NULL, NULL, 0, NULL, NULL, 0, NULL};
      CHECK(dopt__run_stages(G, &a));
    });
    op->free(ctx, frame);
    report(sp.label, sp.bpe, ms, sp.elementwise);
    for (int k = 0; k < ns; k++) op->free(ctx, st[k]);
  }
  (void)s0, (void)s1, (void)s2;
  for (void *p : {(void *)x, (void *)y, (void *)s0, (void *)s1, (void *)s2, (void *)ws, (void *)h}) op->free(ctx, p);
  dopt_device_cuda_destroy(G);
  if (below) printf("note: an elementwise pass is below 80%% of the copy bandwidth\n");
  return strict && below ? 1 : 0;
}

/* Streamed traces (dopt_st_open): `distopt compare` on a 2.1 GB trace under an
 * address-space limit of 1.25 GB (ulimit -v), smaller than the file: bitwise,
 * each step's gradients read when the step needs them. The control: the same
 * file read whole (dopt_st_load) under the same limit runs out of memory.
 * Needs 3 GB free where the test writes (TMPDIR); otherwise it says so and
 * reports itself skipped (77). */
#include "testutil.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include "distopt/safetensors.h"

static const char *bin;
static char dir[512], trace[600];

/* w [N, N] and its gradients grad/<t>/<shard>/w for STEPS x SHARDS: (1 + 128) x 16 MiB = 2.16 GB */
enum { N = 2048, STEPS = 32, SHARDS = 4 };
#define LIMIT ((unsigned long)1280 << 20)

/* A pure function of (tensor, element): small values, a few exact zeros. */
static float value(unsigned t, size_t k) {
  uint32_t x = (uint32_t)k * 0x9e3779b9u ^ t * 0x85ebca6bu;
  x ^= x >> 15;
  x *= 0x2c1b3c6du;
  x ^= x >> 12;
  return (x & 31) == 0 ? 0.0f : ((float)(x & 0xffff) - 32768.0f) * 0x1.0p-20f;
}

/* Writes the trace by hand, chunk by chunk (the writer holds every tensor in memory). */
static int write_trace(void) {
  const size_t bytes = (size_t)N * N * sizeof(float);
  const int nt = 1 + STEPS * SHARDS;
  size_t cap = 200 * (size_t)nt + 512, len = 0;
  char *h = malloc(cap);
  if (!h) return -1;
  len += (size_t)snprintf(h + len, cap - len,
                          "{\"__metadata__\":{\"params\":\"w\",\"steps\":\"%d\",\"shards\":\"%d\",\"tp_roles\":\"w:column\"}",
                          STEPS, SHARDS);
  for (int t = 0; t < nt; t++) {
    char name[64];
    if (t == 0) snprintf(name, sizeof name, "init/w");
    else snprintf(name, sizeof name, "grad/%d/%d/w", 1 + (t - 1) / SHARDS, (t - 1) % SHARDS);
    len += (size_t)snprintf(h + len, cap - len, ",\"%s\":{\"dtype\":\"F32\",\"shape\":[%d,%d],\"data_offsets\":[%zu,%zu]}",
                            name, N, N, (size_t)t * bytes, (size_t)(t + 1) * bytes);
  }
  len += (size_t)snprintf(h + len, cap - len, "}");
  while (len % 8) h[len++] = ' ';
  FILE *f = fopen(trace, "wb");
  unsigned char lb[8];
  for (int i = 0; i < 8; i++) lb[i] = (unsigned char)((uint64_t)len >> (8 * i));
  int ok = f && fwrite(lb, 1, 8, f) == 8 && fwrite(h, 1, len, f) == len;
  free(h);
  float *chunk = malloc((size_t)N * sizeof(float));
  for (int t = 0; ok && chunk && t < nt; t++)
    for (size_t r = 0; ok && r < N; r++) {
      for (size_t c = 0; c < N; c++) chunk[c] = t == 0 ? 0.5f * value(0, r * N + c) : value((unsigned)t, r * N + c);
      ok = fwrite(chunk, sizeof(float), N, f) == N;
    }
  free(chunk);
  if (f && fclose(f) != 0) ok = 0;
  return ok && chunk ? 0 : -1;
}

static int setup(void **st) {
  (void)st;
  if (dt_make_tmpdir(dir, sizeof dir, "stream") != 0) return -1;
  snprintf(trace, sizeof trace, "%s/big.safetensors", dir);
  struct statvfs v;
  if (statvfs(dir, &v) == 0 && (double)v.f_bavail * (double)v.f_frsize < 3e9) {
    printf("skipped: %.1f GB free under %s, the 2.1 GB trace needs 3\n", (double)v.f_bavail * (double)v.f_frsize / 1e9, dir);
    dt_remove_tmpdir(dir);
    exit(77);
  }
  return write_trace();
}

static int teardown(void **st) {
  (void)st;
  return dt_remove_tmpdir(dir);
}

static void test_stream_under_limit(void **st) {
  (void)st;
  FILE *f = fopen(trace, "rb");
  assert_non_null(f);
  assert_int_equal(fseek(f, 0, SEEK_END), 0);
  const long size = ftell(f);
  fclose(f);
  assert_true((unsigned long)size > 2000000000ul && (unsigned long)size > LIMIT);
  /* the control: read whole under the limit, it cannot be */
  fflush(stdout);
  pid_t pid = fork();
  assert_true(pid >= 0);
  if (pid == 0) {
    struct rlimit rl = {LIMIT, LIMIT};
    if (setrlimit(RLIMIT_AS, &rl) != 0) _exit(3);
    dopt_st_file *whole = NULL;
    _exit(dopt_st_load(trace, &whole) == DOPT_ERR_NO_MEMORY ? 0 : 1);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) fail_msg("the control loaded the whole file under the limit");
  /* compare streams it: tp 2 x dp 2, the 4 shards as 2 micro-batches per dp rank */
  char out[600], err[600];
  snprintf(out, sizeof out, "%s/out.txt", dir);
  snprintf(err, sizeof err, "%s/err.txt", dir);
  const char *args[] = {"compare", "--trace", trace, "--optimizer", "adamw", "--steps", "32", "--tp", "2", "--dp", "2",
                        "--quiet", NULL};
  dt_run_opts o = {300, 0, NULL, LIMIT};
  int rc = dt_run_with(bin, args, out, err, &o);
  char buf[8192] = "", ebuf[2048] = "";
  FILE *fo = fopen(out, "r"), *fe = fopen(err, "r");
  if (fo) buf[fread(buf, 1, sizeof buf - 1, fo)] = '\0', fclose(fo);
  if (fe) ebuf[fread(ebuf, 1, sizeof ebuf - 1, fe)] = '\0', fclose(fe);
  if (rc != 0 || !strstr(buf, "EQUIVALENT (bitwise, 3 tensors \xC3\x97 32 steps)"))
    fail_msg("compare under ulimit -v %lu MiB: rc %d\n%s\n%s", LIMIT >> 20, rc, buf, ebuf);
}

int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: %s DISTOPT\n", argv[0]);
    return 2;
  }
  bin = argv[1];
  const struct CMUnitTest tests[] = {cmocka_unit_test(test_stream_under_limit)};
  return cmocka_run_group_tests(tests, setup, teardown);
}

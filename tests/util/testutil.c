#include "testutil.h"

#include "distopt/distopt.h"

#include <math.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

static int64_t ordered_bits(float f) {
  int32_t i;
  memcpy(&i, &f, sizeof i);
  /* map the sign-magnitude float ordering onto two's complement */
  return i < 0 ? (int64_t)INT32_MIN - (int64_t)i : (int64_t)i;
}

uint64_t dt_ulp_distance(float a, float b) {
  int64_t d = ordered_bits(a) - ordered_bits(b);
  return (uint64_t)(d < 0 ? -d : d);
}

uint64_t dt_rand_u64(uint64_t *s) {
  uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

static int subset_read(uint64_t *seed, unsigned *every) {
  const char *v = getenv("DOPT_TEST_SUBSET");
  if (!v || !v[0]) return 0;
  char *end = NULL;
  unsigned long long s = strtoull(v, &end, 16);
  if (end == v || *end != '/') fail_msg("DOPT_TEST_SUBSET='%s': want SEED/N (SEED hex, N >= 1)", v);
  const char *np = end + 1;
  unsigned long n = strtoul(np, &end, 10);
  if (end == np || *end != '\0' || n < 1 || n > 1000000) fail_msg("DOPT_TEST_SUBSET='%s': N must be 1..1000000", v);
  *seed = (uint64_t)s;
  *every = (unsigned)n;
  return n > 1;
}

int dt_subset_keep(uint64_t group, int i, int n) {
  uint64_t seed = 0;
  unsigned every = 1;
  if (!subset_read(&seed, &every)) return 1;
  uint64_t h = seed ^ (group * (uint64_t)0x9E3779B97F4A7C15);
  const uint64_t r = dt_rand_u64(&h);
  if ((unsigned)n <= every) return (int)(r % (uint64_t)n) == i; /* a small group: its one item */
  return ((uint64_t)(unsigned)i + r % every) % every == 0;     /* every N-th item from a seeded offset */
}

const char *dt_subset_desc(void) {
  static char buf[160];
  uint64_t seed = 0;
  unsigned every = 1;
  if (!subset_read(&seed, &every)) return "every item";
  snprintf(buf, sizeof buf, "1 in %u: DOPT_TEST_SUBSET=%s, unset for all", every, getenv("DOPT_TEST_SUBSET"));
  return buf;
}

double dt_rand_uniform(uint64_t *s) { return (double)(dt_rand_u64(s) >> 11) * 0x1.0p-53; }

double dt_rand_normal(uint64_t *s) {
  double u1 = dt_rand_uniform(s), u2 = dt_rand_uniform(s);
  if (u1 < 1e-300) u1 = 1e-300;
  return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

const char *dt_source_dir(void) {
  const char *d = getenv("DOPT_SOURCE_DIR");
  return d && *d ? d : ".";
}

int dt_make_tmpdir(char *buf, size_t cap, const char *tag) {
  snprintf(buf, cap, "/tmp/%s_%ld", tag, (long)getpid());
  char cmd[600];
  snprintf(cmd, sizeof cmd, "rm -rf '%s' && mkdir -p '%s'", buf, buf);
  return system(cmd);
}

int dt_remove_tmpdir(const char *dir) {
  char cmd[600];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
  return system(cmd);
}

int dt_run(const char *bin, const char *const *args, const char *out, const char *err) {
  return dt_run_with(bin, args, out, err, NULL);
}

int dt_run_with(const char *bin, const char *const *args, const char *out, const char *err, const dt_run_opts *o) {
  fflush(stdout);
  fflush(stderr);
  pid_t pid = fork();
  if (pid < 0) return -1;
  if (pid == 0) {
    if (!freopen(err ? err : "/dev/null", "w", stderr) || !freopen(out ? out : "/dev/null", "w", stdout)) _exit(126);
    if (o && o->fsize_limit) {
      struct rlimit rl = {o->fsize_limit, o->fsize_limit};
      signal(SIGXFSZ, SIG_IGN); /* kept across exec: the write fails with EFBIG instead */
      if (setrlimit(RLIMIT_FSIZE, &rl) != 0) _exit(125);
    }
    if (o && o->as_limit) {
      struct rlimit rl = {o->as_limit, o->as_limit};
      if (setrlimit(RLIMIT_AS, &rl) != 0) _exit(125);
    }
    for (const char *const *e = o ? o->env : NULL; e && *e; e++) {
      char name[256];
      const char *eq = strchr(*e, '=');
      if (!eq || (size_t)(eq - *e) >= sizeof name) _exit(124);
      memcpy(name, *e, (size_t)(eq - *e));
      name[eq - *e] = '\0';
      if (setenv(name, eq + 1, 1) != 0) _exit(124);
    }
    if (o && o->timeout_s) alarm(o->timeout_s); /* kept across exec: a hang ends with SIGALRM */
    const char *argv[62];
    int n = 0;
    argv[n++] = bin;
    for (; args[n - 1] && n < 61; n++) argv[n] = args[n - 1];
    argv[n] = NULL;
    execv(bin, (char *const *)argv);
    _exit(127);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

char *dt_slurp(const char *path, size_t *n) {
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  char *b = NULL;
  long len = fseek(f, 0, SEEK_END) == 0 ? ftell(f) : -1;
  if (len >= 0 && fseek(f, 0, SEEK_SET) == 0 && (b = malloc((size_t)len + 1)) != NULL &&
      fread(b, 1, (size_t)len, f) != (size_t)len) {
    free(b);
    b = NULL;
  }
  fclose(f);
  if (b) {
    b[len] = '\0';
    if (n) *n = (size_t)len;
  }
  return b;
}

void dt_wrapped_hparams(const char *inner, char *out, size_t cap, const char **alone) {
  const char *ex = "";
  dopt_optim *probe = NULL;
  if (dopt_optim_create(inner, "", &probe) != DOPT_OK)
    for (int i = 0; i < dopt_optim_registry_count(); i++) {
      dopt_optim_info info;
      if (dopt_optim_registry_info(i, &info) == DOPT_OK && strcmp(info.name, inner) == 0) ex = info.example;
    }
  dopt_optim_destroy(probe);
  if (alone) *alone = ex;
  int n = snprintf(out, cap, "inner=%s", inner);
  for (const char *e = ex; *e && n >= 0 && (size_t)n < cap;) {
    const char *c = strchr(e, ',');
    const int len = c ? (int)(c - e) : (int)strlen(e);
    if (strncmp(e, "inner=", 6) != 0) n += snprintf(out + n, cap - (size_t)n, ",inner.%.*s", len, e);
    e += len + (c ? 1 : 0);
  }
}

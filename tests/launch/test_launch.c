/* Launch helpers without a GPU (label unit): the launcher environment parser,
 * the TCP rendezvous on 127.0.0.1 (threads as ranks), and the simulator's
 * memops hook (the path the CUDA device-buffer simulator takes), exercised
 * with a host implementation. */
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <stddef.h>
#include <sys/socket.h>
#include <time.h>
#include <sys/wait.h>
#include <unistd.h>

#include "distopt/launch.h"
#include "distopt/sim.h"
#include "internal.h"
#include "testutil.h"

/* ---- environment -------------------------------------------------------------------- */

typedef struct kv {
  const char *const *pairs; /* name, value, ..., NULL */
} kv;

static const char *kv_get(const char *name, void *user) {
  const kv *e = user;
  for (const char *const *p = e->pairs; *p; p += 2)
    if (strcmp(p[0], name) == 0) return p[1];
  return NULL;
}

static dopt_status parse(const char *const *pairs, dopt_launch_env *out) {
  kv e = {pairs};
  return dopt_launch_env_parse(kv_get, &e, out);
}

static void test_env_torchrun(void **st) {
  (void)st;
  static const char *const p[] = {"RANK", "5", "WORLD_SIZE", "8", "LOCAL_RANK", "1", "MASTER_ADDR", "10.0.0.7",
                                  "MASTER_PORT", "29500", NULL};
  dopt_launch_env e;
  assert_int_equal(parse(p, &e), DOPT_OK);
  assert_string_equal(e.launcher, "torchrun");
  assert_int_equal(e.rank, 5);
  assert_int_equal(e.world_size, 8);
  assert_int_equal(e.local_rank, 1);
  assert_string_equal(e.master_addr, "10.0.0.7");
  assert_int_equal(e.master_port, 29500);
  /* torchrun's TCPStore listens on MASTER_PORT: the rendezvous takes the next port */
  assert_int_equal(e.rdzv_port, 29501);
  static const char *const own[] = {"RANK", "0", "WORLD_SIZE", "2", "MASTER_ADDR", "h", "MASTER_PORT", "29500",
                                    "DOPT_RDZV_PORT", "40000", NULL};
  assert_int_equal(parse(own, &e), DOPT_OK);
  assert_int_equal(e.rdzv_port, 40000);
  static const char *const top[] = {"RANK", "0", "WORLD_SIZE", "2", "MASTER_ADDR", "h", "MASTER_PORT", "65535", NULL};
  assert_status(parse(top, &e), DOPT_ERR_INVALID_ARG, "DOPT_RDZV_PORT");
  static const char *const bad[] = {"RANK", "0", "WORLD_SIZE", "2", "DOPT_RDZV_PORT", "0", NULL};
  assert_status(parse(bad, &e), DOPT_ERR_INVALID_ARG, "DOPT_RDZV_PORT='0'");
}

/* srun --gpus-per-task 1: every task sees one device, whatever its local rank */
static void test_launch_device(void **st) {
  (void)st;
  assert_int_equal(dopt_launch_device(0, 1), 0);
  assert_int_equal(dopt_launch_device(3, 1), 0);
  assert_int_equal(dopt_launch_device(5, 8), 5);
  assert_int_equal(dopt_launch_device(9, 8), 1);
  assert_int_equal(dopt_launch_device(0, 0), -1);
  assert_int_equal(dopt_launch_device(-1, 4), -1);
}

static void test_env_openmpi_slurm(void **st) {
  (void)st;
  static const char *const mpi[] = {"OMPI_COMM_WORLD_RANK", "3", "OMPI_COMM_WORLD_SIZE", "4",
                                    "OMPI_COMM_WORLD_LOCAL_RANK", "3", "MASTER_ADDR", "node0", "MASTER_PORT", "1234",
                                    NULL};
  dopt_launch_env e;
  assert_int_equal(parse(mpi, &e), DOPT_OK);
  assert_string_equal(e.launcher, "openmpi");
  assert_int_equal(e.rank, 3);
  assert_int_equal(e.world_size, 4);
  assert_int_equal(e.local_rank, 3);
  static const char *const slurm[] = {"SLURM_PROCID", "6", "SLURM_NTASKS", "16", "SLURM_LOCALID", "2", NULL};
  assert_int_equal(parse(slurm, &e), DOPT_OK);
  assert_string_equal(e.launcher, "slurm");
  assert_int_equal(e.rank, 6);
  assert_int_equal(e.world_size, 16);
  assert_int_equal(e.local_rank, 2);
  assert_string_equal(e.master_addr, "");
  assert_int_equal(e.master_port, 0);
  static const char *const slurm2[] = {"SLURM_PROCID", "0", "SLURM_NPROCS", "2", "SLURM_LOCALID", "0", NULL};
  assert_int_equal(parse(slurm2, &e), DOPT_OK);
  assert_int_equal(e.world_size, 2);
  /* torchrun wins when several are set */
  static const char *const both[] = {"SLURM_PROCID", "1", "SLURM_NTASKS", "2", "SLURM_LOCALID", "1", "RANK", "0",
                                     "WORLD_SIZE", "1", NULL};
  assert_int_equal(parse(both, &e), DOPT_OK);
  assert_string_equal(e.launcher, "torchrun");
}

static void test_env_errors(void **st) {
  (void)st;
  dopt_launch_env e;
  static const char *const none[] = {"HOME", "/root", NULL};
  assert_status(parse(none, &e), DOPT_ERR_NOT_FOUND, "RANK");
  static const char *const nosize[] = {"RANK", "0", NULL};
  assert_status(parse(nosize, &e), DOPT_ERR_INVALID_ARG, "WORLD_SIZE");
  static const char *const big[] = {"RANK", "4", "WORLD_SIZE", "4", NULL};
  assert_status(parse(big, &e), DOPT_ERR_INVALID_ARG, "RANK='4'");
  static const char *const junk[] = {"RANK", "1x", "WORLD_SIZE", "4", NULL};
  assert_status(parse(junk, &e), DOPT_ERR_INVALID_ARG, "RANK='1x'");
  static const char *const port[] = {"RANK", "0", "WORLD_SIZE", "2", "MASTER_PORT", "70000", NULL};
  assert_status(parse(port, &e), DOPT_ERR_INVALID_ARG, "MASTER_PORT='70000'");
  static const char *const nolocal[] = {"OMPI_COMM_WORLD_RANK", "1", "OMPI_COMM_WORLD_SIZE", "2", NULL};
  assert_status(parse(nolocal, &e), DOPT_ERR_INVALID_ARG, "OMPI_COMM_WORLD_LOCAL_RANK");
}

/* ---- rendezvous ---------------------------------------------------------------------- */

static int free_port(void) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a;
  memset(&a, 0, sizeof a);
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof a) != 0 || getsockname(fd, (struct sockaddr *)&a, &len) != 0)
    return 0;
  close(fd);
  return ntohs(a.sin_port);
}

#define NR 5
typedef struct rdv_arg {
  int port, rank, nranks;
  const char *addr; /* NULL: 127.0.0.1 */
  uint32_t timeout_ms;
  unsigned char blob[128];
  dopt_status s;
  char err[256];
} rdv_arg;

static void *rdv_thread(void *p) {
  rdv_arg *a = p;
  a->s = dopt_rendezvous_blob(a->addr ? a->addr : "127.0.0.1", a->port, a->rank, a->nranks, a->blob, sizeof a->blob,
                              a->timeout_ms);
  snprintf(a->err, sizeof a->err, "%s", dopt_last_error());
  return NULL;
}

static void test_rendezvous(void **st) {
  (void)st;
  int port = free_port();
  assert_true(port > 0);
  rdv_arg a[NR];
  pthread_t th[NR];
  memset(a, 0, sizeof a);
  /* the clients start first: they must retry until rank 0 listens */
  for (int r = NR - 1; r >= 0; r--) {
    a[r].port = port;
    a[r].rank = r;
    a[r].nranks = NR;
    a[r].timeout_ms = 20000;
    if (r == 0)
      for (int k = 0; k < 128; k++) a[r].blob[k] = (unsigned char)(k * 7 + 3);
    assert_int_equal(pthread_create(&th[r], NULL, rdv_thread, &a[r]), 0);
    if (r == 1) nanosleep(&(struct timespec){0, 100000000}, NULL);
  }
  for (int r = 0; r < NR; r++) pthread_join(th[r], NULL);
  for (int r = 0; r < NR; r++) {
    if (a[r].s != DOPT_OK) fail_msg("rank %d: %s", r, a[r].err);
    assert_memory_equal(a[r].blob, a[0].blob, 128);
  }
}

static void test_rendezvous_timeout(void **st) {
  (void)st;
  int port = free_port();
  /* a client with nobody listening */
  rdv_arg c = {port, 1, 2, NULL, 300, {0}, DOPT_OK, ""};
  rdv_thread(&c);
  assert_int_equal(c.s, DOPT_ERR_TIMEOUT);
  assert_non_null(strstr(c.err, "could not reach rank 0"));
  /* rank 0 with a missing peer */
  rdv_arg s = {port, 0, 3, NULL, 300, {0}, DOPT_OK, ""};
  rdv_thread(&s);
  assert_int_equal(s.s, DOPT_ERR_TIMEOUT);
  assert_non_null(strstr(s.err, "0 of 2 ranks connected"));
  assert_status(dopt_rendezvous_blob("", 1, 0, 2, s.blob, 1, 10), DOPT_ERR_INVALID_ARG, "MASTER_ADDR");
}

/* torchrun: its TCPStore holds MASTER_PORT, and the master's own name may
 * resolve to another local address (127.0.1.1 from /etc/hosts) than the one
 * the peers reach: the rendezvous uses the launch environment's rdzv_port and
 * rank 0 listens on every address. */
static void test_rendezvous_torchrun(void **st) {
  (void)st;
  int store = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a;
  memset(&a, 0, sizeof a);
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  assert_true(store >= 0);
  assert_int_equal(bind(store, (struct sockaddr *)&a, sizeof a), 0);
  assert_int_equal(listen(store, 4), 0); /* the "TCPStore" on MASTER_PORT */
  assert_int_equal(getsockname(store, (struct sockaddr *)&a, &len), 0);
  int master_port = ntohs(a.sin_port);
  char mp[16];
  snprintf(mp, sizeof mp, "%d", master_port);
  const char *const env0[] = {"RANK", "0", "WORLD_SIZE", "2", "LOCAL_RANK", "0", "MASTER_ADDR", "127.0.0.2",
                              "MASTER_PORT", mp, NULL};
  dopt_launch_env e;
  assert_int_equal(parse(env0, &e), DOPT_OK);
  if (e.rdzv_port > 65535 || e.rdzv_port != master_port + 1) fail_msg("rdzv_port %d", e.rdzv_port);
  /* the port right above an ephemeral one may be taken by another process: then skip honestly */
  int probe = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in pa = a;
  pa.sin_port = htons((uint16_t)e.rdzv_port);
  int busy = bind(probe, (struct sockaddr *)&pa, sizeof pa) != 0;
  close(probe);
  if (busy) {
    close(store);
    skip(); /* cmocka reports it as skipped */
  }
  rdv_arg r[2];
  memset(r, 0, sizeof r);
  pthread_t th[2];
  for (int k = 0; k < 2; k++) {
    r[k].port = e.rdzv_port;
    r[k].rank = k;
    r[k].nranks = 2;
    r[k].timeout_ms = 10000;
    r[k].addr = k == 0 ? "127.0.0.2" : "127.0.0.1"; /* the master resolves itself differently */
    if (k == 0) memset(r[k].blob, 0x5a, sizeof r[k].blob);
  }
  for (int k = 1; k >= 0; k--) assert_int_equal(pthread_create(&th[k], NULL, rdv_thread, &r[k]), 0);
  for (int k = 0; k < 2; k++) pthread_join(th[k], NULL);
  close(store);
  for (int k = 0; k < 2; k++)
    if (r[k].s != DOPT_OK) fail_msg("rank %d: %s", k, r[k].err);
  assert_memory_equal(r[1].blob, r[0].blob, sizeof r[0].blob);
}

/* ---- the configuration check ---------------------------------------------------------------- */

typedef struct chk_arg {
  dopt_rendezvous r;
  char rank0[256];
  unsigned char blob[16];
  dopt_status s;
  char err[256];
} chk_arg;

static void *chk_thread(void *p) {
  chk_arg *a = p;
  a->r.rank0_check = a->rank0;
  a->r.rank0_cap = sizeof a->rank0;
  a->r.blob = a->blob;
  a->r.bytes = sizeof a->blob;
  a->s = dopt_rendezvous_run(&a->r);
  snprintf(a->err, sizeof a->err, "%s", dopt_last_error());
  return NULL;
}

/* Runs one round over nranks threads with the given texts; every rank's status must be OK. */
static void chk_round(chk_arg *a, int nranks, int port, uint32_t tag, const char *const *texts) {
  pthread_t th[8];
  for (int r = 0; r < nranks; r++) {
    memset(&a[r], 0, sizeof a[r]);
    a[r].r = (dopt_rendezvous)DOPT_RENDEZVOUS_INIT;
    a[r].r.addr = "127.0.0.1";
    a[r].r.port = port;
    a[r].r.rank = r;
    a[r].r.nranks = nranks;
    a[r].r.timeout_ms = 20000;
    a[r].r.tag = tag;
    a[r].r.check = texts[r];
    a[r].r.check_len = texts[r] ? strlen(texts[r]) : 0;
    if (r == 0) memset(a[r].blob, 0xa5, sizeof a[r].blob);
  }
  for (int r = nranks - 1; r >= 0; r--) assert_int_equal(pthread_create(&th[r], NULL, chk_thread, &a[r]), 0);
  for (int r = 0; r < nranks; r++) pthread_join(th[r], NULL);
  for (int r = 0; r < nranks; r++)
    if (a[r].s != DOPT_OK) fail_msg("rank %d: %s", r, a[r].err);
}

/* Every rank learns the lowest rank whose check text differs from rank 0's, and gets rank 0's text
 * (what names the differing option); the blob still arrives. */
static void test_rendezvous_check(void **st) {
  (void)st;
  int port = free_port();
  assert_true(port > 0);
  chk_arg a[4];
  const char *differ[] = {"a=1\nb=2\n", "a=1\nb=2\n", "a=1\nb=3\n", "a=9\n"};
  chk_round(a, 4, port, DOPT_RENDEZVOUS_TAG_CONFIG, differ);
  for (int r = 0; r < 4; r++) {
    assert_int_equal(a[r].r.first_differing, 2);
    assert_memory_equal(a[r].blob, a[0].blob, sizeof a[0].blob);
    if (r > 0) assert_string_equal(a[r].rank0, "a=1\nb=2\n");
  }
  /* the same text everywhere: no difference; the round right after (the NCCL id's) on the same port */
  const char *same[] = {"x=1\n", "x=1\n", "x=1\n", "x=1\n"};
  chk_round(a, 4, port, DOPT_RENDEZVOUS_TAG_CONFIG, same);
  for (int r = 0; r < 4; r++) assert_int_equal(a[r].r.first_differing, -1);
  const char *none[] = {NULL, NULL, NULL, NULL};
  chk_round(a, 4, port, DOPT_RENDEZVOUS_TAG_BLOB, none);
  for (int r = 0; r < 4; r++) assert_int_equal(a[r].r.first_differing, -1);
}

typedef struct stray_arg {
  int port;
  const char *bytes;
} stray_arg;

/* A connection that is no rank of this round (another protocol): rank 0 closes it and carries on. */
static void *stray_thread(void *p) {
  const stray_arg *s = p;
  for (int tries = 0; tries < 200; tries++) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons((uint16_t)s->port);
    if (connect(fd, (struct sockaddr *)&a, sizeof a) == 0) {
      ssize_t w = write(fd, s->bytes, strlen(s->bytes));
      (void)w;
      char buf[16];
      ssize_t k = read(fd, buf, sizeof buf); /* closed by rank 0 */
      (void)k;
      close(fd);
      return NULL;
    }
    close(fd);
    nanosleep(&(struct timespec){0, 10000000}, NULL);
  }
  return NULL;
}

static void test_rendezvous_stray_and_failure(void **st) {
  (void)st;
  int port = free_port();
  assert_true(port > 0);
  stray_arg sa = {port, "GET / HTTP/1.1\r\n\r\n"};
  pthread_t sth;
  assert_int_equal(pthread_create(&sth, NULL, stray_thread, &sa), 0);
  chk_arg a[3];
  const char *texts[] = {"k=v\n", "k=v\n", "k=v\n"};
  chk_round(a, 3, port, DOPT_RENDEZVOUS_TAG_CONFIG, texts);
  pthread_join(sth, NULL);
  for (int r = 0; r < 3; r++) assert_int_equal(a[r].r.first_differing, -1);
  /* a peer that says another world size: rank 0 fails, and the peer that already said hello stops at once
   * (DOPT_ERR_ABORTED), long before its timeout */
  port = free_port();
  pthread_t th[3];
  for (int r = 0; r < 3; r++) {
    memset(&a[r], 0, sizeof a[r]);
    a[r].r = (dopt_rendezvous)DOPT_RENDEZVOUS_INIT;
    a[r].r.addr = "127.0.0.1";
    a[r].r.port = port;
    a[r].r.rank = r == 2 ? 1 : r; /* thread 2: a second "rank 1" */
    a[r].r.nranks = 3;
    a[r].r.timeout_ms = 20000;
  }
  double t0 = (double)time(NULL);
  assert_int_equal(pthread_create(&th[0], NULL, chk_thread, &a[0]), 0);
  assert_int_equal(pthread_create(&th[1], NULL, chk_thread, &a[1]), 0);
  nanosleep(&(struct timespec){0, 300000000}, NULL);
  assert_int_equal(pthread_create(&th[2], NULL, chk_thread, &a[2]), 0);
  for (int r = 0; r < 3; r++) pthread_join(th[r], NULL);
  assert_int_equal(a[0].s, DOPT_ERR_INVALID_ARG);
  assert_non_null(strstr(a[0].err, "duplicate rank"));
  int aborted = (a[1].s == DOPT_ERR_ABORTED) + (a[2].s == DOPT_ERR_ABORTED);
  if (aborted != 2) fail_msg("peers: %s / %s", a[1].err, a[2].err);
  if ((double)time(NULL) - t0 > 10) fail_msg("the peers waited for their timeout");
}

/* `distopt compare --backend nccl`, two processes as torchrun starts them, one given another --optimizer:
 * both exit 2 before anything needs a GPU, with one line in all naming the option (no GPU needed). */
static const char *distopt_bin;
static void test_nccl_ranks_disagree(void **st) {
  (void)st;
  int port = free_port();
  assert_true(port > 0);
  char mp[16], dir[256], err[2][400];
  snprintf(mp, sizeof mp, "%d", port > 1 ? port - 1 : port); /* the rendezvous port is MASTER_PORT + 1 */
  assert_int_equal(dt_make_tmpdir(dir, sizeof dir, "dopt_nccl_disagree"), 0);
  pid_t pid[2];
  for (int r = 0; r < 2; r++) {
    snprintf(err[r], sizeof err[r], "%s/err%d", dir, r);
    char rank[8], master[32];
    snprintf(rank, sizeof rank, "RANK=%d", r);
    snprintf(master, sizeof master, "MASTER_PORT=%s", mp);
    const char *env[] = {rank, "WORLD_SIZE=2", "LOCAL_RANK=0", "MASTER_ADDR=127.0.0.1", master, NULL};
    const char *args[] = {"compare", "--backend", "nccl", "--device", "cuda", "--tp", "1", "--dp", "2", "--plugin", "zero",
                          "--optimizer", r == 1 ? "came" : "adamw", "--hparams", "lr=1e-3", "--steps", "2", "--quiet", NULL};
    dt_run_opts o = {60, 0, env, 0};
    fflush(stdout);
    pid[r] = fork();
    assert_true(pid[r] >= 0);
    if (pid[r] == 0) _exit(dt_run_with(distopt_bin, args, NULL, err[r], &o));
  }
  int rc[2];
  for (int r = 0; r < 2; r++) {
    int status;
    waitpid(pid[r], &status, 0);
    rc[r] = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }
  char text[2][2048];
  int lines = 0;
  for (int r = 0; r < 2; r++) {
    FILE *f = fopen(err[r], "r");
    size_t n = f ? fread(text[r], 1, sizeof text[r] - 1, f) : 0;
    text[r][n] = '\0';
    if (f) fclose(f);
    for (size_t i = 0; i < n; i++) lines += text[r][i] == '\n';
  }
  dt_remove_tmpdir(dir);
  if (rc[0] != 2 || rc[1] != 2 || lines != 1 || !strstr(text[1], "--optimizer is 'came' on rank 1, 'adamw' on rank 0"))
    fail_msg("exit %d / %d, %d lines: rank 0 '%s', rank 1 '%s'", rc[0], rc[1], lines, text[0], text[1]);
}

/* ---- the simulator's memops hook -------------------------------------------------------- */

typedef struct counting {
  pthread_mutex_t mu;
  int copies, reduces, flips;
} counting;

static void h_copy(void *ctx, void *dst, const void *src, size_t bytes) {
  counting *c = ctx;
  pthread_mutex_lock(&c->mu);
  c->copies++;
  pthread_mutex_unlock(&c->mu);
  memcpy(dst, src, bytes);
}
/* float/int64 sums and maxima only (what this test uses), in the given order */
static void h_reduce(void *ctx, dopt_dtype dt, dopt_redop op, void *out, const void *const *srcs, int n, int start,
                     size_t off, size_t count) {
  counting *c = ctx;
  pthread_mutex_lock(&c->mu);
  c->reduces++;
  pthread_mutex_unlock(&c->mu);
  for (size_t k = 0; k < count; k++) {
    if (dt == DOPT_F32) {
      float acc = ((const float *)srcs[start])[off + k];
      for (int j = 1; j < n; j++) {
        float x = ((const float *)srcs[(start + j) % n])[off + k];
        acc = op == DOPT_MAX ? (x > acc ? x : acc) : acc + x;
      }
      ((float *)out)[k] = acc;
    }
  }
}
static void h_flip(void *ctx, void *buf, size_t count, dopt_dtype dt, uint64_t elem, uint32_t bit) {
  counting *c = ctx;
  (void)dt;
  c->flips++;
  ((unsigned char *)buf)[(elem % count) * 4 + (bit % 32) / 8] ^= (unsigned char)(1u << (bit % 8));
}

static dopt_status memops_body(dopt_sim_comm *comm, int rank, void *user) {
  (void)user;
  float send[6], recv[6], g[12];
  for (int k = 0; k < 6; k++) send[k] = (float)(rank * 10 + k) + 0.25f;
  DOPT_TRY(dopt_sim_all_reduce(send, recv, 6, DOPT_F32, DOPT_SUM, comm));
  for (int k = 0; k < 6; k++)
    if (recv[k] != (0.25f + (float)k) + (10.25f + (float)k) + (20.25f + (float)k)) return DOPT_ERR_NUMERIC;
  DOPT_TRY(dopt_sim_all_gather(send, g, 2, DOPT_F32, comm));
  for (int r = 0; r < 3; r++)
    if (g[2 * r] != (float)(r * 10) + 0.25f) return DOPT_ERR_NUMERIC;
  return DOPT_OK;
}

static void test_sim_memops_hook(void **st) {
  (void)st;
  counting cnt = {PTHREAD_MUTEX_INITIALIZER, 0, 0, 0};
  dopt_sim_memops mo = {&cnt, h_copy, h_reduce, h_flip};
  dopt_sim_config cfg = DOPT_SIM_CONFIG_INIT;
  cfg.nranks = 3;
  cfg.memops = &mo;
  dopt_sim_world *w;
  assert_int_equal(dopt_sim_world_create(&cfg, &w), DOPT_OK);
  dopt_status rs[3];
  assert_int_equal(dopt_sim_launch(w, memops_body, NULL, rs), DOPT_OK);
  dopt_sim_world_destroy(w);
  assert_int_equal(cnt.reduces, 3); /* one slice per rank */
  assert_true(cnt.copies >= 3 * 2 + 3 * 3); /* all-reduce: the other slices; all-gather: every block */
  /* a caller compiled before memops was appended: host buffers */
  cfg.struct_size = (uint32_t)offsetof(dopt_sim_config, memops);
  assert_int_equal(dopt_sim_world_create(&cfg, &w), DOPT_OK);
  dopt_sim_world_destroy(w);
}

int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: %s DISTOPT\n", argv[0]);
    return 2;
  }
  distopt_bin = argv[1];
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_env_torchrun),       cmocka_unit_test(test_env_openmpi_slurm),
      cmocka_unit_test(test_env_errors),         cmocka_unit_test(test_rendezvous),
      cmocka_unit_test(test_rendezvous_timeout), cmocka_unit_test(test_sim_memops_hook),
      cmocka_unit_test(test_launch_device),      cmocka_unit_test(test_rendezvous_torchrun),
      cmocka_unit_test(test_rendezvous_check),   cmocka_unit_test(test_rendezvous_stray_and_failure),
      cmocka_unit_test(test_nccl_ranks_disagree),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

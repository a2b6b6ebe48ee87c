/* Multi-process launch helpers (include/distopt/launch.h): the launcher's
 * environment and the TCP rendezvous that distributes the NCCL unique id.
 * Plain C and POSIX sockets: built and unit-tested without CUDA. */
#include "distopt/launch.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "distopt/digest.h"
#include "internal.h"

/* ---- environment ------------------------------------------------------------------- */

static const char *plain_getenv(const char *name, void *user) {
  (void)user;
  return getenv(name);
}

static dopt_status parse_int(const char *name, const char *v, long lo, long hi, int *out) {
  char *end;
  errno = 0;
  long x = strtol(v, &end, 10);
  if (*v == '\0' || *end != '\0' || errno != 0 || x < lo || x > hi)
    return dopt__fail(DOPT_ERR_INVALID_ARG, "launch environment: %s='%s' is not an integer in [%ld, %ld]", name, v, lo,
                      hi);
  *out = (int)x;
  return DOPT_OK;
}

dopt_status dopt_launch_env_parse(dopt_getenv_fn get, void *user, dopt_launch_env *out) {
  DOPT_CHECK_ARG(out != NULL, "dopt_launch_env_parse: out=NULL");
  if (!get) get = plain_getenv;
  memset(out, 0, sizeof *out);
  static const struct {
    const char *launcher, *rank, *size, *size2, *local;
  } L[] = {
      {"torchrun", "RANK", "WORLD_SIZE", NULL, "LOCAL_RANK"},
      {"openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", NULL, "OMPI_COMM_WORLD_LOCAL_RANK"},
      {"slurm", "SLURM_PROCID", "SLURM_NPROCS", "SLURM_NTASKS", "SLURM_LOCALID"},
  };
  for (size_t k = 0; k < sizeof L / sizeof L[0]; k++) {
    const char *r = get(L[k].rank, user);
    if (!r) continue;
    const char *sname = L[k].size, *s = get(sname, user);
    if (!s && L[k].size2) s = get(sname = L[k].size2, user);
    if (!s)
      return dopt__fail(DOPT_ERR_INVALID_ARG, "launch environment (%s): %s is set but %s%s%s is not", L[k].launcher,
                        L[k].rank, L[k].size, L[k].size2 ? " / " : "", L[k].size2 ? L[k].size2 : "");
    out->launcher = L[k].launcher;
    DOPT_TRY(parse_int(sname, s, 1, 1 << 20, &out->world_size));
    DOPT_TRY(parse_int(L[k].rank, r, 0, out->world_size - 1, &out->rank));
    const char *l = get(L[k].local, user);
    out->local_rank = 0;
    if (l) DOPT_TRY(parse_int(L[k].local, l, 0, out->world_size - 1, &out->local_rank));
    else if (out->world_size > 1 && k != 0)
      return dopt__fail(DOPT_ERR_INVALID_ARG, "launch environment (%s): %s is not set", L[k].launcher, L[k].local);
    else out->local_rank = k == 0 ? out->rank : 0; /* torchrun on one node: the global rank */
    const char *a = get("MASTER_ADDR", user), *p = get("MASTER_PORT", user);
    if (a) {
      if (strlen(a) == 0 || strlen(a) >= sizeof out->master_addr)
        return dopt__fail(DOPT_ERR_INVALID_ARG, "launch environment: MASTER_ADDR='%s' (empty or too long)", a);
      memcpy(out->master_addr, a, strlen(a) + 1);
    }
    if (p) DOPT_TRY(parse_int("MASTER_PORT", p, 1, 65535, &out->master_port));
    const char *rp = get("DOPT_RDZV_PORT", user);
    if (rp) {
      DOPT_TRY(parse_int("DOPT_RDZV_PORT", rp, 1, 65535, &out->rdzv_port));
    } else if (out->master_port) {
      if (out->master_port == 65535)
        return dopt__fail(DOPT_ERR_INVALID_ARG,
                          "launch environment: MASTER_PORT=65535 leaves no port for the rendezvous (MASTER_PORT + 1); "
                          "set DOPT_RDZV_PORT");
      out->rdzv_port = out->master_port + 1;
    }
    return DOPT_OK;
  }
  return dopt__fail(DOPT_ERR_NOT_FOUND,
                    "launch environment: none of RANK (torchrun), OMPI_COMM_WORLD_RANK (mpirun), SLURM_PROCID (srun) "
                    "is set");
}

int dopt_launch_device(int local_rank, int ndev) { return ndev < 1 || local_rank < 0 ? -1 : local_rank % ndev; }

/* ---- rendezvous --------------------------------------------------------------------- */

#define RDV_MAGIC 0x32727064u /* "dpr2": the protocol with the configuration check */

static double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

static int left_ms(double deadline) {
  double l = deadline - now_ms();
  return l <= 0 ? 0 : (l > 1e9 ? 1000000000 : (int)l + 1);
}

/* Waits for fd to become readable/writable before the deadline: 1 ready, 0 timeout, -1 error. */
static int wait_fd(int fd, short ev, double deadline) {
  for (;;) {
    struct pollfd p = {fd, ev, 0};
    int ms = left_ms(deadline);
    if (ms == 0) return 0;
    int rc = poll(&p, 1, ms);
    if (rc > 0) return 1;
    if (rc == 0) return 0;
    if (errno != EINTR) return -1;
  }
}

/* Transfers exactly n bytes (send if out) before the deadline. */
static dopt_status xfer(int fd, void *buf, size_t n, int out, double deadline, const char *what) {
  unsigned char *p = buf;
  while (n > 0) {
    int w = wait_fd(fd, out ? POLLOUT : POLLIN, deadline);
    if (w == 0) return dopt__fail(DOPT_ERR_TIMEOUT, "rendezvous: timed out %s", what);
    if (w < 0) return dopt__fail(DOPT_ERR_IO, "rendezvous: poll while %s: %s", what, strerror(errno));
    ssize_t k = out ? send(fd, p, n, MSG_NOSIGNAL) : recv(fd, p, n, 0);
    if (k < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
    if (k <= 0)
      return dopt__fail(DOPT_ERR_IO, "rendezvous: %s: %s", what, k == 0 ? "peer closed the connection" : strerror(errno));
    p += k;
    n -= (size_t)k;
  }
  return DOPT_OK;
}

static void put_u32(unsigned char *b, uint32_t v) {
  for (int i = 0; i < 4; i++) b[i] = (unsigned char)(v >> (8 * i));
}
static uint32_t get_u32(const unsigned char *b) {
  return (uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 | (uint32_t)b[3] << 24;
}

static dopt_status resolve(const char *addr, int port, struct sockaddr_storage *sa, socklen_t *len) {
  struct addrinfo hints, *res = NULL;
  memset(&hints, 0, sizeof hints);
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  char ps[16];
  snprintf(ps, sizeof ps, "%d", port);
  int rc = getaddrinfo(addr, ps, &hints, &res);
  if (rc != 0 || !res) return dopt__fail(DOPT_ERR_IO, "rendezvous: cannot resolve '%s': %s", addr, gai_strerror(rc));
  memcpy(sa, res->ai_addr, res->ai_addrlen);
  *len = res->ai_addrlen;
  freeaddrinfo(res);
  return DOPT_OK;
}

/* hello (peer -> rank 0): magic, tag, rank, nranks, SHA-256 of the check text (48 bytes);
 * answer (rank 0 -> peer): magic, verdict (first differing rank, or NONE), text bytes, blob bytes,
 * then rank 0's text and its blob. */
#define HELLO_BYTES (16 + DOPT_DIGEST_BYTES)
#define NONE 0xffffffffu
#define FAILED 0xfffffffeu /* the verdict of a rank 0 that failed: its peers stop at once instead of retrying */
#define MAX_PAYLOAD ((size_t)1 << 20)

/* Rank 0 failed: the answer that says so (best effort, a short wait). */
static void refuse(int fd) {
  unsigned char reply[16];
  put_u32(reply, RDV_MAGIC);
  put_u32(reply + 4, FAILED);
  put_u32(reply + 8, 0);
  put_u32(reply + 12, 0);
  (void)xfer(fd, reply, sizeof reply, 1, now_ms() + 1000, "refusing a rank");
}

/* Rank 0 listens on every local address of the master's family (the name the
 * peers use may resolve to another local address on the master itself, e.g.
 * 127.0.1.1 from /etc/hosts). */

static dopt_status check_digest(const dopt_rendezvous *r, uint8_t d[DOPT_DIGEST_BYTES]) {
  return dopt_digest_buffer(r->check ? r->check : "", r->check ? r->check_len : 0, d, NULL);
}

/* Rank 0 listens on every local address of the master's family (the name the
 * peers use may resolve to another local address on the master itself, e.g.
 * 127.0.1.1 from /etc/hosts); it answers once every rank has said hello. */
static dopt_status serve(const struct sockaddr_storage *master, dopt_rendezvous *r, double deadline) {
  const int port = r->port, nranks = r->nranks;
  struct sockaddr_storage any;
  socklen_t anylen;
  memset(&any, 0, sizeof any);
  if (master->ss_family == AF_INET6) {
    struct sockaddr_in6 *a6 = (struct sockaddr_in6 *)&any;
    a6->sin6_family = AF_INET6;
    a6->sin6_addr = in6addr_any;
    a6->sin6_port = htons((uint16_t)port);
    anylen = sizeof *a6;
  } else {
    struct sockaddr_in *a4 = (struct sockaddr_in *)&any;
    a4->sin_family = AF_INET;
    a4->sin_addr.s_addr = htonl(INADDR_ANY);
    a4->sin_port = htons((uint16_t)port);
    anylen = sizeof *a4;
  }
  uint8_t mine[DOPT_DIGEST_BYTES];
  DOPT_TRY(check_digest(r, mine));
  int ls = socket(any.ss_family, SOCK_STREAM, 0);
  if (ls < 0) return dopt__fail(DOPT_ERR_IO, "rendezvous: socket: %s", strerror(errno));
  int one = 1;
  setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  dopt_status s = DOPT_OK;
  if (bind(ls, (const struct sockaddr *)&any, anylen) != 0 || listen(ls, nranks) != 0) {
    s = dopt__fail(DOPT_ERR_IO, "rendezvous: rank 0 cannot listen on port %d: %s%s", port, strerror(errno),
                   errno == EADDRINUSE ? " (set DOPT_RDZV_PORT to a free port)" : "");
    close(ls);
    return s;
  }
  fcntl(ls, F_SETFL, fcntl(ls, F_GETFL) | O_NONBLOCK);
  int *fd = malloc((size_t)nranks * sizeof *fd);
  uint32_t verdict = NONE;
  if (!fd) {
    close(ls);
    return dopt__fail(DOPT_ERR_NO_MEMORY, "rendezvous: %d ranks", nranks);
  }
  for (int k = 0; k < nranks; k++) fd[k] = -1;
  for (int done = 0; done < nranks - 1 && s == DOPT_OK;) {
    int w = wait_fd(ls, POLLIN, deadline);
    if (w == 0) {
      s = dopt__fail(DOPT_ERR_TIMEOUT, "rendezvous: rank 0 timed out: %d of %d ranks connected", done, nranks - 1);
      break;
    }
    int c = accept(ls, NULL, NULL);
    if (c < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK || errno == ECONNABORTED) continue;
      s = dopt__fail(DOPT_ERR_IO, "rendezvous: accept: %s%s", strerror(errno),
                     errno == EMFILE ? " (rank 0 holds a connection per rank: raise ulimit -n)" : "");
      break;
    }
    fcntl(c, F_SETFL, fcntl(c, F_GETFL) | O_NONBLOCK);
    unsigned char hello[HELLO_BYTES];
    /* the magic first: a connection of another protocol is closed before it is waited on */
    dopt_status cs = xfer(c, hello, 4, 0, deadline, "reading a rank's hello");
    if (cs == DOPT_OK && get_u32(hello) != RDV_MAGIC) cs = DOPT_ERR_FORMAT;
    if (cs == DOPT_OK) cs = xfer(c, hello + 4, HELLO_BYTES - 4, 0, deadline, "reading a rank's hello");
    uint32_t tag = get_u32(hello + 4), rk = get_u32(hello + 8), n = get_u32(hello + 12);
    if (cs == DOPT_OK && tag != r->tag) cs = DOPT_ERR_FORMAT; /* another round's peer: it retries */
    if (cs == DOPT_OK && ((int)n != nranks || rk == 0 || rk >= (uint32_t)nranks || fd[rk] >= 0)) {
      s = dopt__fail(DOPT_ERR_INVALID_ARG, "rendezvous: a peer says rank %u of %u (rank 0 expects %d ranks%s)", rk, n,
                     nranks, rk < (uint32_t)nranks && rk && fd[rk] >= 0 ? "; duplicate rank" : "");
      refuse(c);
      cs = DOPT_ERR_FORMAT;
    }
    if (cs != DOPT_OK) {
      close(c);
      continue;
    }
    fd[rk] = c;
    if (memcmp(hello + 16, mine, DOPT_DIGEST_BYTES) != 0 && rk < verdict) verdict = rk;
    done++;
  }
  if (s != DOPT_OK) /* the ranks that said hello stop now, not at their timeout */
    for (int k = 1; k < nranks; k++)
      if (fd[k] >= 0) refuse(fd[k]);
  for (int k = 1; k < nranks && s == DOPT_OK; k++) {
    unsigned char reply[16];
    size_t tl = r->check ? r->check_len : 0;
    put_u32(reply, RDV_MAGIC);
    put_u32(reply + 4, verdict);
    put_u32(reply + 8, (uint32_t)tl);
    put_u32(reply + 12, (uint32_t)r->bytes);
    s = xfer(fd[k], reply, sizeof reply, 1, deadline, "answering a rank");
    if (s == DOPT_OK && tl) s = xfer(fd[k], (void *)(uintptr_t)r->check, tl, 1, deadline, "sending the check text");
    if (s == DOPT_OK && r->bytes) s = xfer(fd[k], r->blob, r->bytes, 1, deadline, "sending the blob");
  }
  for (int k = 0; k < nranks; k++)
    if (fd[k] >= 0) close(fd[k]);
  free(fd);
  close(ls);
  if (s == DOPT_OK) r->first_differing = verdict == NONE ? -1 : (int)verdict;
  return s;
}

/* One try of a peer: 1 done (status in *st), 0 not reached yet or closed before answering (retry). */
static int try_fetch(const struct sockaddr_storage *sa, socklen_t salen, dopt_rendezvous *r, const uint8_t *digest,
                     double deadline, dopt_status *st) {
  int fd = socket(sa->ss_family, SOCK_STREAM, 0);
  if (fd < 0) {
    *st = dopt__fail(DOPT_ERR_IO, "rendezvous: socket: %s", strerror(errno));
    return 1;
  }
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
  int rc = connect(fd, (const struct sockaddr *)sa, salen), ok = rc == 0;
  if (!ok && errno == EINPROGRESS && wait_fd(fd, POLLOUT, deadline) == 1) {
    int err = 0;
    socklen_t el = sizeof err;
    getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &el);
    ok = err == 0;
  }
  if (!ok) {
    close(fd);
    return 0;
  }
  unsigned char hello[HELLO_BYTES], reply[16];
  put_u32(hello, RDV_MAGIC);
  put_u32(hello + 4, r->tag);
  put_u32(hello + 8, (uint32_t)r->rank);
  put_u32(hello + 12, (uint32_t)r->nranks);
  memcpy(hello + 16, digest, DOPT_DIGEST_BYTES);
  dopt_status s = xfer(fd, hello, sizeof hello, 1, deadline, "sending the hello");
  if (s == DOPT_OK) s = xfer(fd, reply, sizeof reply, 0, deadline, "waiting for rank 0's answer");
  if (s == DOPT_ERR_IO) { /* closed before answering: another round's listener, or rank 0 not ready */
    close(fd);
    return 0;
  }
  const uint32_t verdict = get_u32(reply + 4), tl = get_u32(reply + 8), bl = get_u32(reply + 12);
  if (s == DOPT_OK && get_u32(reply) == RDV_MAGIC && verdict == FAILED)
    s = dopt__fail(DOPT_ERR_ABORTED, "rendezvous: rank 0 at %s:%d failed the rendezvous (its message has the cause)",
                   r->addr, r->port);
  if (s == DOPT_OK && (get_u32(reply) != RDV_MAGIC || bl != (uint32_t)r->bytes || tl > MAX_PAYLOAD))
    s = dopt__fail(DOPT_ERR_FORMAT, "rendezvous: rank 0 at %s:%d sends a %u-byte blob and a %u-byte text, rank %d "
                   "expects a %zu-byte blob", r->addr, r->port, bl, tl, r->rank, r->bytes);
  char *text = s == DOPT_OK ? malloc(tl + 1) : NULL;
  if (s == DOPT_OK && !text) s = dopt__fail(DOPT_ERR_NO_MEMORY, "rendezvous: %u bytes of rank 0's text", tl);
  if (s == DOPT_OK && tl) s = xfer(fd, text, tl, 0, deadline, "receiving rank 0's text");
  if (s == DOPT_OK && r->bytes) s = xfer(fd, r->blob, r->bytes, 0, deadline, "receiving the blob");
  if (s == DOPT_OK) {
    r->first_differing = verdict == NONE ? -1 : (int)verdict;
    r->rank0_len = tl;
    if (r->rank0_check && r->rank0_cap) {
      size_t n = tl < r->rank0_cap - 1 ? tl : r->rank0_cap - 1;
      memcpy(r->rank0_check, text, n);
      r->rank0_check[n] = '\0';
      r->rank0_len = n;
    }
  }
  free(text);
  close(fd);
  *st = s;
  return 1;
}

static dopt_status fetch(const struct sockaddr_storage *sa, socklen_t salen, dopt_rendezvous *r, double deadline) {
  uint8_t digest[DOPT_DIGEST_BYTES];
  DOPT_TRY(check_digest(r, digest));
  double backoff = 10;
  for (;;) {
    dopt_status s;
    if (try_fetch(sa, salen, r, digest, deadline, &s)) return s;
    if (left_ms(deadline) == 0)
      return dopt__fail(DOPT_ERR_TIMEOUT, "rendezvous: rank %d could not reach rank 0 at %s:%d before the timeout",
                        r->rank, r->addr, r->port);
    struct timespec ts = {0, (long)(backoff * 1e6)};
    nanosleep(&ts, NULL);
    backoff = backoff * 2 > 500 ? 500 : backoff * 2;
  }
}

dopt_status dopt_rendezvous_run(dopt_rendezvous *r) {
  DOPT_CHECK_ARG(r && r->struct_size >= sizeof *r && r->version == DOPT_RENDEZVOUS_VERSION,
                 "rendezvous: struct_size/version (initialise with DOPT_RENDEZVOUS_INIT)");
  DOPT_CHECK_ARG(r->addr && *r->addr, "rendezvous: address is empty (set MASTER_ADDR)");
  DOPT_CHECK_ARG(r->port >= 1 && r->port <= 65535, "rendezvous: port=%d (set MASTER_PORT)", r->port);
  DOPT_CHECK_ARG(r->nranks >= 1 && r->rank >= 0 && r->rank < r->nranks, "rendezvous: rank %d of %d", r->rank, r->nranks);
  DOPT_CHECK_ARG(r->blob || r->bytes == 0, "rendezvous: blob=NULL");
  DOPT_CHECK_ARG(r->bytes <= MAX_PAYLOAD, "rendezvous: %zu bytes (at most 1 MiB)", r->bytes);
  DOPT_CHECK_ARG(!r->check || r->check_len <= MAX_PAYLOAD, "rendezvous: a check text of %zu bytes (at most 1 MiB)",
                 r->check_len);
  r->first_differing = -1;
  r->rank0_len = 0;
  if (r->rank0_check && r->rank0_cap) r->rank0_check[0] = '\0';
  if (r->nranks == 1) return DOPT_OK;
  double deadline = now_ms() + (double)r->timeout_ms;
  struct sockaddr_storage sa;
  socklen_t salen = 0;
  DOPT_TRY(resolve(r->addr, r->port, &sa, &salen));
  if (r->rank == 0) return serve(&sa, r, deadline);
  return fetch(&sa, salen, r, deadline);
}

dopt_status dopt_rendezvous_blob(const char *addr, int port, int rank, int nranks, void *blob, size_t bytes,
                                 uint32_t timeout_ms) {
  dopt_rendezvous r = DOPT_RENDEZVOUS_INIT;
  r.addr = addr;
  r.port = port;
  r.rank = rank;
  r.nranks = nranks;
  r.blob = blob;
  r.bytes = bytes;
  r.timeout_ms = timeout_ms;
  return dopt_rendezvous_run(&r);
}

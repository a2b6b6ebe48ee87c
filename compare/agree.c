/* Ranks that agree (docs/mpi.md, docs/cuda.md): before any work, every
 * process of a multi-process compare (backends mpi and nccl) compares the
 * SHA-256 of its effective configuration — every option after the YAML file
 * and the defaults, the build, the trace's identity — with rank 0's. A
 * difference ends every rank with exit 2 and one line, from the lowest
 * differing rank, naming the first differing option and both values.
 *
 * The configuration text: one "key=value" line per option, in a fixed order,
 * keys spelled as the command-line options; values with control characters
 * and backslashes written as \xNN, so that a line is a line. Rank 0's text
 * reaches the others over the wire and is parsed as untrusted input
 * (cmp_config_diff; fuzzed by tests/fuzz/fuzz_agree.c). */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "compare.h"
#include "distopt/digest.h"
#include "distopt/launch.h"
#include "distopt/mpi.h"
#include "files.h"
#include "internal.h"

/* ---- the text ------------------------------------------------------------------------------ */

typedef struct text {
  char *buf;
  size_t cap, len;
  int over;
} text;

static void put_escaped(text *t, const char *s) {
  for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
    char e[8];
    int n = *p < 0x20 || *p == 0x7f || *p == '\\' ? snprintf(e, sizeof e, "\\x%02x", *p) : (e[0] = (char)*p, e[1] = 0, 1);
    if (t->len + (size_t)n >= t->cap) {
      t->over = 1;
      return;
    }
    memcpy(t->buf + t->len, e, (size_t)n);
    t->len += (size_t)n;
  }
  t->buf[t->len] = '\0';
}

static void line(text *t, const char *key, const char *fmt, ...) DOPT_PRINTF(3, 4);
static void line(text *t, const char *key, const char *fmt, ...) {
  char v[1100];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(v, sizeof v, fmt, ap);
  va_end(ap);
  put_escaped(t, key);
  put_escaped(t, "=");
  put_escaped(t, v);
  if (t->len + 1 >= t->cap) t->over = 1;
  else t->buf[t->len++] = '\n', t->buf[t->len] = '\0';
}

/* The trace's identity: its size and the SHA-256 of its safetensors header (tensor names, dtypes,
 * shapes, data offsets and metadata), not its data; a recording: its index.json. Not the path: the
 * same file may sit elsewhere on each node. A trace this rank cannot read says so in the value,
 * which then differs from rank 0's. */
static void trace_identity(text *t, const cmp_options *o) {
  char hex[DOPT_DIGEST_HEX] = "", why[300] = "";
  uint64_t size = 0;
  if (cmp_trace_is_recording(o->trace_path)) {
    char idx[DOPT_PATH_MAX], *body = NULL;
    size_t n = 0;
    if (dopt__path_join(idx, o->trace_path, "index.json") != DOPT_OK) snprintf(idx, sizeof idx, "%s", o->trace_path);
    const char *base = strrchr(o->trace_path, '/');
    if (strcmp(base ? base + 1 : o->trace_path, "index.json") == 0) snprintf(idx, sizeof idx, "%s", o->trace_path);
    if (dopt__read_all(idx, (size_t)64 << 20, &body, &n) == DOPT_OK && dopt_digest_buffer(body, n, NULL, hex) == DOPT_OK)
      size = n;
    else snprintf(why, sizeof why, "unreadable here: %s", dopt_last_error());
    free(body);
    if (why[0]) line(t, "--trace.index", "%s", why);
    else line(t, "--trace.index", "sha256:%s, %llu bytes", hex, (unsigned long long)size);
    return;
  }
  int fd = -1;
  unsigned char lenb[8];
  uint64_t hlen = 0;
  char *hdr = NULL;
  dopt_status s = dopt__open_read(o->trace_path, &fd, &size);
  if (s == DOPT_OK) s = dopt__pread_all(fd, lenb, 8, 0, o->trace_path);
  for (int i = 7; s == DOPT_OK && i >= 0; i--) hlen = (hlen << 8) | lenb[i];
  if (s == DOPT_OK && (hlen > size - 8 || hlen > ((uint64_t)100 << 20)))
    s = dopt__fail(DOPT_ERR_FORMAT, "%s: header length %llu", o->trace_path, (unsigned long long)hlen);
  if (s == DOPT_OK && !(hdr = malloc((size_t)hlen + 1))) s = dopt__fail(DOPT_ERR_NO_MEMORY, "%s", o->trace_path);
  if (s == DOPT_OK) s = dopt__pread_all(fd, hdr, (size_t)hlen, 8, o->trace_path);
  if (s == DOPT_OK) s = dopt_digest_buffer(hdr, (size_t)hlen, NULL, hex);
  if (fd >= 0) close(fd);
  free(hdr);
  if (s != DOPT_OK) line(t, "--trace.header", "unreadable here: %s", dopt_last_error());
  else line(t, "--trace.header", "sha256:%s, %llu bytes", hex, (unsigned long long)size);
}

int cmp_config_text(const cmp_options *o, char *buf, size_t cap) {
  text t = {buf, cap, 0, cap == 0};
  if (cap) buf[0] = '\0';
#ifdef DOPT_HAVE_CUDA
  const int cuda = 1;
#else
  const int cuda = 0;
#endif
#ifdef DOPT_HAVE_NCCL
  const int nccl = 1;
#else
  const int nccl = 0;
#endif
  line(&t, "distopt", "%d.%d.%d (built with mpi %d, cuda %d, nccl %d)", DOPT_VERSION_MAJOR, DOPT_VERSION_MINOR,
       DOPT_VERSION_PATCH, dopt_mpi_available(), cuda, nccl);
  line(&t, "--optimizer", "%s", o->optimizer);
  line(&t, "--hparams", "%s", o->hparams);
  for (int g = 0; g < o->ngroups; g++) {
    char key[32];
    snprintf(key, sizeof key, "--group.%d", g + 1);
    line(&t, key, "%s:%s", o->groups[g].glob, o->groups[g].hp);
  }
  line(&t, "--plugin", "%s", o->plugin);
  line(&t, "--tp", "%d", o->tp);
  line(&t, "--dp", "%d", o->dp);
  line(&t, "--zero", "%d", o->zero);
  line(&t, "--pp", "%d", o->pp);
  line(&t, "--ep", "%d", o->ep);
  line(&t, "--expert-stacks", "%s", o->expert_stacks);
  line(&t, "--chunk-size", "%zu", o->chunk_size);
  for (int k = 0; k < o->nlps; k++) {
    char key[40];
    snprintf(key, sizeof key, "--layers-per-stage.%d", k);
    line(&t, key, "%d", o->layers_per_stage[k]);
  }
  line(&t, "--ranks", "%d", o->ranks);
  line(&t, "--steps", "%d", o->steps);
  line(&t, "--accumulation", "%d", o->micro);
  line(&t, "--max-grad-norm", "%.17g", o->max_grad_norm);
  line(&t, "--bf16", "%d", o->bf16);
  line(&t, "--gradients", "%s", o->source);
  if (strcmp(o->source, "trace") == 0) trace_identity(&t, o);
  else {
    line(&t, "--seed", "%llu", (unsigned long long)o->seed);
    line(&t, "--model", "%s", o->model);
  }
  line(&t, "--ring-order", "%d", o->ring_order);
  line(&t, "--dp-sum", "%s", cmp_dp_sum_name(o->dp_sum_words));
  line(&t, "--batch-invariant", "%d", o->batch_invariant);
  line(&t, "--checkpoint-at", "%d", o->checkpoint_at);
  line(&t, "--resume-plugin", "%s", o->resume_plugin);
  line(&t, "--resume-tp", "%d", o->resume_tp);
  line(&t, "--resume-dp", "%d", o->resume_dp);
  line(&t, "--resume-zero", "%d", o->resume_zero);
  line(&t, "--resume-pp", "%d", o->resume_pp);
  line(&t, "--resume-chunk-size", "%zu", o->resume_chunk_size);
  line(&t, "--resume-ep", "%d", o->resume_ep);
  line(&t, "--checkpoint-dir", "%s", o->checkpoint_dir);
  line(&t, "--start-over", "%d", o->start_over);
  line(&t, "--json", "%s", o->json_path);
  line(&t, "--plot", "%s", o->svg_path);
  line(&t, "--quiet", "%d", o->quiet);
  line(&t, "--backend", "%s", o->backend);
  line(&t, "--device", "%s", o->device);
  line(&t, "--threads", "%d", o->threads);
  line(&t, "--sweep", "%d", o->sweep);
  line(&t, "--max-tp", "%d", o->max_tp);
  line(&t, "--max-dp", "%d", o->max_dp);
  if (t.over) {
    dopt__fail(DOPT_ERR_INVALID_ARG, "the configuration text is longer than %zu bytes", cap);
    return -1;
  }
  return (int)t.len;
}

/* ---- the comparison ---------------------------------------------------------------------- */

/* Line k of s[n]: [*b, *e), the '=' at *eq. 0 at the end; -1 malformed (msg). A line holds no byte
 * below 0x20 or 0x7f (escaped), ends with '\n', and its key is [A-Za-z0-9._-]+ before the first '='. */
static int next_line(const char *s, size_t n, size_t *pos, const char **b, const char **eq, const char **e, char *msg,
                     size_t cap, const char *who) {
  if (*pos >= n) return 0;
  const char *p = s + *pos, *end = s + n;
  const char *nl = memchr(p, '\n', (size_t)(end - p));
  if (!nl) return snprintf(msg, cap, "%s configuration text: a line without its newline at byte %zu", who, *pos), -1;
  const char *q = p;
  while (q < nl && ((*q >= 'a' && *q <= 'z') || (*q >= 'A' && *q <= 'Z') || (*q >= '0' && *q <= '9') || *q == '.' ||
                    *q == '-' || *q == '_'))
    q++;
  if (q == p || q == nl || *q != '=')
    return snprintf(msg, cap, "%s configuration text: line at byte %zu is not key=value", who, *pos), -1;
  for (const char *c = q; c < nl; c++)
    if ((unsigned char)*c < 0x20 || *c == 0x7f)
      return snprintf(msg, cap, "%s configuration text: a control byte at byte %zu", who, (size_t)(c - s)), -1;
  *b = p, *eq = q, *e = nl;
  *pos = (size_t)(nl - s) + 1;
  return 1;
}

/* A value for a message: at most 120 bytes, then "...". */
static void shown(char *out, size_t cap, const char *b, const char *e) {
  size_t n = (size_t)(e - b);
  if (n > 120) snprintf(out, cap, "'%.*s...'", 120, b);
  else snprintf(out, cap, "'%.*s'", (int)n, b);
}

int cmp_config_diff(const char *mine, size_t nm, const char *theirs, size_t nt, int rank, char *msg, size_t cap) {
  if (cap) msg[0] = '\0';
  if (nt > CMP_CONFIG_MAX)
    return snprintf(msg, cap, "rank 0's configuration text is %zu bytes, more than %d", nt, CMP_CONFIG_MAX), -1;
  size_t pm = 0, pt = 0;
  for (int k = 0; k < 100000; k++) {
    const char *mb, *meq, *me, *tb, *teq, *te;
    int a = next_line(mine, nm, &pm, &mb, &meq, &me, msg, cap, "this rank's");
    if (a < 0) return -1;
    int b = next_line(theirs, nt, &pt, &tb, &teq, &te, msg, cap, "rank 0's");
    if (b < 0) return -1;
    if (!a && !b) return 0;
    char va[140], vb[140];
    if (a && b && meq - mb == teq - tb && memcmp(mb, tb, (size_t)(meq - mb)) == 0) {
      if (me - meq == te - teq && memcmp(meq, teq, (size_t)(me - meq)) == 0) continue;
      shown(va, sizeof va, meq + 1, me);
      shown(vb, sizeof vb, teq + 1, te);
      snprintf(msg, cap, "%.*s is %s on rank %d, %s on rank 0", (int)(meq - mb), mb, va, rank, vb);
      return 1;
    }
    /* a key one side has and the other has not here (a --group more or less) */
    if (a) {
      shown(va, sizeof va, meq + 1, me);
      snprintf(msg, cap, "%.*s is %s on rank %d, not given on rank 0", (int)(meq - mb), mb, va, rank);
    } else {
      shown(vb, sizeof vb, teq + 1, te);
      snprintf(msg, cap, "%.*s is not given on rank %d, %s on rank 0", (int)(teq - tb), tb, rank, vb);
    }
    return 1;
  }
  return snprintf(msg, cap, "configuration text of more than 100000 lines"), -1;
}

/* ---- the exchange ------------------------------------------------------------------------- */

/* After a disagreement: this rank's line (when it is the lowest differing rank). */
static void report(const char *mine, size_t nm, const char *theirs, size_t nt, int rank, char *msg, size_t cap) {
  char why[600];
  int d = cmp_config_diff(mine, nm, theirs, nt, rank, why, sizeof why);
  if (d > 0)
    snprintf(msg, cap, "rank %d runs another configuration than rank 0: %s (every rank must be given the same "
             "options)", rank, why);
  else if (d < 0) snprintf(msg, cap, "rank %d cannot compare its configuration with rank 0's: %s", rank, why);
  else snprintf(msg, cap, "rank %d's configuration differs from rank 0's (SHA-256), though no option does", rank);
}

dopt_status cmp_lowest_flagged(const dopt_transport *world, int flagged, int *lowest) {
  int64_t v = flagged ? world->rank : INT64_MAX;
  DOPT_TRY(world->ops->all_reduce(world->comm, &v, &v, 1, DOPT_I64, DOPT_MIN));
  *lowest = v == INT64_MAX ? -1 : (int)v;
  return DOPT_OK;
}

dopt_status cmp_config_agree(const dopt_transport *world, const char *mine, size_t nm, int *first, char *msg, size_t cap) {
  *first = -1;
  if (cap) msg[0] = '\0';
  DOPT_CHECK_ARG(nm <= CMP_CONFIG_MAX, "configuration text of %zu bytes (at most %d)", nm, CMP_CONFIG_MAX);
  /* rank 0's digest, length and text in one broadcast of a fixed size (every rank passes the same count) */
  const size_t total = DOPT_DIGEST_BYTES + 4 + CMP_CONFIG_MAX;
  unsigned char *b = calloc(1, total), mine_d[DOPT_DIGEST_BYTES];
  if (!b) return dopt__fail(DOPT_ERR_NO_MEMORY, "configuration check: %zu bytes", total);
  dopt_status s = dopt_digest_buffer(mine, nm, mine_d, NULL);
  if (s == DOPT_OK && world->rank == 0) {
    memcpy(b, mine_d, DOPT_DIGEST_BYTES);
    for (int i = 0; i < 4; i++) b[DOPT_DIGEST_BYTES + i] = (unsigned char)(nm >> (8 * i));
    memcpy(b + DOPT_DIGEST_BYTES + 4, mine, nm);
  }
  if (s == DOPT_OK) s = world->ops->broadcast(world->comm, b, b, total, DOPT_U8, 0);
  if (s == DOPT_OK) s = cmp_lowest_flagged(world, memcmp(b, mine_d, DOPT_DIGEST_BYTES) != 0, first);
  if (s == DOPT_OK && *first >= 0) {
    if (world->rank == *first) {
      size_t nt = 0;
      for (int i = 0; i < 4; i++) nt |= (size_t)b[DOPT_DIGEST_BYTES + i] << (8 * i);
      report(mine, nm, (const char *)b + DOPT_DIGEST_BYTES + 4, nt, world->rank, msg, cap);
    }
  }
  free(b);
  return s;
}

dopt_status cmp_config_agree_tcp(const char *mine, size_t nm, int *first, char *msg, size_t cap) {
  *first = -1;
  if (cap) msg[0] = '\0';
  dopt_launch_env env;
  if (dopt_launch_env_parse(NULL, NULL, &env) != DOPT_OK || env.world_size < 2 || !env.master_addr[0] ||
      !env.rdzv_port) {
    dopt_clear_error(); /* no launcher, or no rendezvous address: the NCCL start says so, in one line */
    return DOPT_OK;
  }
  char *rank0 = env.rank == 0 ? NULL : malloc(CMP_CONFIG_MAX + 1);
  if (env.rank != 0 && !rank0) return dopt__fail(DOPT_ERR_NO_MEMORY, "configuration check: rank 0's text");
  dopt_rendezvous rv = DOPT_RENDEZVOUS_INIT;
  rv.addr = env.master_addr;
  rv.port = env.rdzv_port;
  rv.rank = env.rank;
  rv.nranks = env.world_size;
  rv.tag = DOPT_RENDEZVOUS_TAG_CONFIG;
  rv.check = mine;
  rv.check_len = nm;
  rv.rank0_check = rank0;
  rv.rank0_cap = rank0 ? CMP_CONFIG_MAX + 1 : 0;
  dopt_status s = dopt_rendezvous_run(&rv);
  if (s == DOPT_OK && rv.first_differing >= 0) {
    *first = rv.first_differing;
    if (env.rank == *first) report(mine, nm, rank0, rv.rank0_len, env.rank, msg, cap);
  }
  free(rank0);
  return s;
}

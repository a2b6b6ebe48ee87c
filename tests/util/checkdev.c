/* The checking device (checkdev.h). */
#define _GNU_SOURCE /* dladdr */
#include "checkdev.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "distopt/dpsum.h"
#include "distopt/dtype.h"
#include "internal.h"
#include "optim_impl.h"

typedef struct block {
  unsigned char *p;
  size_t bytes;
} block;

typedef struct wrapped {
  dt_checkdev *c;
  dopt_transport in;
} wrapped;

struct dt_checkdev {
  dopt_device dev;
  pthread_mutex_t mu;
  block *b;
  size_t nb, cap;
  size_t violations;
  char first[512];
  wrapped *w[8]; /* the transports it wrapped (freed with it) */
  int host_steps; /* steps through dopt__step_on_host (dt_checkdev_host_steps) */
  int nw;
};

#define C(ctx) ((dt_checkdev *)(ctx))
static const dopt_device_ops *cpu(void) { return dopt_device_cpu()->ops; }

/* [p, p + bytes) inside one live allocation? (bytes 0: always) */
static int inside(dt_checkdev *c, const void *p, size_t bytes) {
  if (bytes == 0) return 1;
  const unsigned char *q = p;
  pthread_mutex_lock(&c->mu);
  int ok = 0;
  for (size_t i = 0; i < c->nb && !ok; i++)
    ok = q >= c->b[i].p && q <= c->b[i].p + c->b[i].bytes && bytes <= (size_t)(c->b[i].p + c->b[i].bytes - q);
  pthread_mutex_unlock(&c->mu);
  return ok;
}

/* Records and reports a buffer that is not device memory. `site`: the return
 * address of the operation, i.e. the caller in the library. */
static dopt_status violation(dt_checkdev *c, const char *op, const char *arg, const void *p, size_t bytes, void *site) {
  Dl_info di;
  char where[160] = "?";
  if (site && dladdr(site, &di) && di.dli_fname) {
    const char *mod = strrchr(di.dli_fname, '/');
    if (di.dli_sname)
      snprintf(where, sizeof where, "%s+0x%lx in %s", di.dli_sname,
               (unsigned long)((uintptr_t)site - (uintptr_t)di.dli_saddr), mod ? mod + 1 : di.dli_fname);
    else
      snprintf(where, sizeof where, "%s+0x%lx", mod ? mod + 1 : di.dli_fname,
               (unsigned long)((uintptr_t)site - (uintptr_t)di.dli_fbase));
  }
  char msg[512];
  snprintf(msg, sizeof msg,
           "checking device: %s: %s=%p (%zu bytes) is not device memory (a host pointer; on a GPU a kernel or NCCL "
           "would read it), called from %s",
           op, arg, p, bytes, where);
  pthread_mutex_lock(&c->mu);
  if (c->violations++ == 0) snprintf(c->first, sizeof c->first, "%s", msg);
  pthread_mutex_unlock(&c->mu);
  return dopt__fail(DOPT_ERR_INVALID_ARG, "%s", msg);
}

#define CHECK(c, op, arg, p, bytes, site)                                                 \
  do {                                                                                    \
    if (!inside((c), (p), (bytes))) return violation((c), (op), (arg), (p), (bytes), (site)); \
  } while (0)

/* ---- memory ----------------------------------------------------------------------------- */

static dopt_status ck_alloc(void *ctx, size_t bytes, void **out) {
  dt_checkdev *c = C(ctx);
  *out = NULL;
  void *p = calloc(1, bytes ? bytes : 1);
  if (!p) return dopt__fail(DOPT_ERR_NO_MEMORY, "checking device: alloc of %zu bytes", bytes);
  pthread_mutex_lock(&c->mu);
  if (c->nb == c->cap) {
    size_t cap = c->cap ? 2 * c->cap : 64;
    block *nb = realloc(c->b, cap * sizeof *nb);
    if (!nb) {
      pthread_mutex_unlock(&c->mu);
      free(p);
      return dopt__fail(DOPT_ERR_NO_MEMORY, "checking device: %zu allocations", cap);
    }
    c->b = nb;
    c->cap = cap;
  }
  c->b[c->nb].p = p;
  c->b[c->nb].bytes = bytes ? bytes : 1;
  c->nb++;
  pthread_mutex_unlock(&c->mu);
  *out = p;
  return DOPT_OK;
}

static void ck_free(void *ctx, void *p) {
  dt_checkdev *c = C(ctx);
  if (!p) return;
  pthread_mutex_lock(&c->mu);
  size_t i = 0;
  while (i < c->nb && c->b[i].p != p) i++;
  int known = i < c->nb;
  if (known) c->b[i] = c->b[--c->nb];
  pthread_mutex_unlock(&c->mu);
  if (known) free(p);
  else violation(c, "free", "ptr", p, 1, __builtin_return_address(0)); /* not ours: leak it rather than corrupt */
}

static dopt_status ck_upload(void *ctx, void *dst, const void *src, size_t bytes) {
  CHECK(C(ctx), "upload", "dst", dst, bytes, __builtin_return_address(0));
  return cpu()->upload(NULL, dst, src, bytes);
}

static dopt_status ck_download(void *ctx, void *dst, const void *src, size_t bytes) {
  CHECK(C(ctx), "download", "src", src, bytes, __builtin_return_address(0));
  return cpu()->download(NULL, dst, src, bytes);
}

static dopt_status ck_copy(void *ctx, void *dst, const void *src, size_t bytes) {
  CHECK(C(ctx), "copy", "dst", dst, bytes, __builtin_return_address(0));
  CHECK(C(ctx), "copy", "src", src, bytes, __builtin_return_address(0));
  return cpu()->copy(NULL, dst, src, bytes);
}

/* ---- kernels ------------------------------------------------------------------------------ */

static dopt_status ck_add(void *ctx, float *acc, const float *x, size_t n) {
  CHECK(C(ctx), "add", "acc", acc, n * 4, __builtin_return_address(0));
  CHECK(C(ctx), "add", "x", x, n * 4, __builtin_return_address(0));
  return cpu()->add(NULL, acc, x, n);
}

static dopt_status ck_scale(void *ctx, float *x, float a, size_t n) {
  CHECK(C(ctx), "scale", "x", x, n * 4, __builtin_return_address(0));
  return cpu()->scale(NULL, x, a, n);
}

static dopt_status ck_average(void *ctx, float *x, float d, size_t n, int64_t *host_nonfinite) {
  CHECK(C(ctx), "average", "x", x, n * 4, __builtin_return_address(0));
  return cpu()->average(NULL, x, d, n, host_nonfinite);
}

static dopt_status ck_sumsq(void *ctx, const float *x, size_t n, double *host_ss) {
  CHECK(C(ctx), "sumsq", "x", x, n * 4, __builtin_return_address(0));
  return cpu()->sumsq(NULL, x, n, host_ss);
}

static dopt_status ck_to_bf16(void *ctx, const float *x, uint16_t *y, size_t n) {
  CHECK(C(ctx), "to_bf16", "x", x, n * 4, __builtin_return_address(0));
  CHECK(C(ctx), "to_bf16", "y", y, n * 2, __builtin_return_address(0));
  return cpu()->to_bf16(NULL, x, y, n);
}

static size_t ck_frame_bytes(void *ctx, const dopt_step_args *a) {
  (void)ctx;
  return cpu()->frame_bytes(NULL, a);
}

/* a step's buffers (dopt__step_buffers: param and grad [len], every state in full, the frame, wstat); with
 * host steps on, the step itself runs through dopt__step_on_host (as the CUDA device's steps without a kernel) */
static dopt_status ck_step(void *ctx, const dopt_step_args *a) {
  dt_checkdev *c = C(ctx);
  void *site = __builtin_return_address(0);
  const size_t fb = cpu()->frame_bytes(NULL, a);
  dopt_step_buf b[DOPT_STEP_BUFS_MAX];
  const int nb = dopt__step_buffers(a, fb, b);
  for (int k = 0; k < nb; k++) CHECK(c, "step", b[k].name, b[k].dev, b[k].bytes, site);
  if (c->host_steps) return dopt__step_on_host(&c->dev, a, fb);
  return cpu()->step(NULL, a);
}

/* the exact dp sum: the piece's elements, its words, its logical blocks' codes */
static dopt_status ck_grid_codes(void *ctx, const float *x, const dopt_piece *pc, int32_t *codes, int64_t *bad) {
  CHECK(C(ctx), "grid_codes", "x", x, pc->len * 4, __builtin_return_address(0));
  CHECK(C(ctx), "grid_codes", "codes", codes, dopt_grid_blocks(pc->numel) * 4, __builtin_return_address(0));
  return cpu()->grid_codes(NULL, x, pc, codes, bad);
}

static dopt_status ck_grid_encode(void *ctx, const float *x, const dopt_piece *pc, const int32_t *codes, int words,
                                  int k, int add, int64_t *w, int64_t *cls) {
  void *site = __builtin_return_address(0);
  CHECK(C(ctx), "grid_encode", "x", x, pc->len * 4, site);
  CHECK(C(ctx), "grid_encode", "codes", codes, dopt_grid_blocks(pc->numel) * 4, site);
  CHECK(C(ctx), "grid_encode", "w", w, pc->len * (size_t)words * 8, site);
  if (cls) CHECK(C(ctx), "grid_encode", "cls", cls, pc->len * 8, site);
  return cpu()->grid_encode(NULL, x, pc, codes, words, k, add, w, cls);
}

static dopt_status ck_grid_decode(void *ctx, const int64_t *w, const int64_t *cls, const dopt_piece *pc,
                                  const int32_t *codes, int words, int k, float *x) {
  void *site = __builtin_return_address(0);
  CHECK(C(ctx), "grid_decode", "x", x, pc->len * 4, site);
  CHECK(C(ctx), "grid_decode", "codes", codes, dopt_grid_blocks(pc->numel) * 4, site);
  CHECK(C(ctx), "grid_decode", "w", w, pc->len * (size_t)words * 8, site);
  if (cls) CHECK(C(ctx), "grid_decode", "cls", cls, pc->len * 8, site);
  return cpu()->grid_decode(NULL, w, cls, pc, codes, words, k, x);
}

static dopt_status ck_grid_sum(void *ctx, const float *const *parts, int nparts, int words, size_t n, float *out) {
  void *site = __builtin_return_address(0);
  for (int d = 0; d < nparts; d++) CHECK(C(ctx), "grid_sum", "parts[d]", parts[d], n * 4, site);
  CHECK(C(ctx), "grid_sum", "out", out, n * 4, site);
  return cpu()->grid_sum(NULL, parts, nparts, words, n, out);
}

static const dopt_device_ops ck_ops = {
    .name = "checking",
    .alloc = ck_alloc,
    .free = ck_free,
    .upload = ck_upload,
    .download = ck_download,
    .copy = ck_copy,
    .add = ck_add,
    .scale = ck_scale,
    .average = ck_average,
    .sumsq = ck_sumsq,
    .to_bf16 = ck_to_bf16,
    .frame_bytes = ck_frame_bytes,
    .step = ck_step,
    .grid_codes = ck_grid_codes,
    .grid_encode = ck_grid_encode,
    .grid_decode = ck_grid_decode,
    /* one block at a time (the CPU: 4096): the tests' tensors cross chunk seams */
    .host_chunk = DOPT_GRID_BLOCK,
    .grid_sum = ck_grid_sum,
};

/* ---- the transport wrapper --------------------------------------------------------------- */

#define W(comm) ((wrapped *)(comm))

static dopt_status w_all_reduce(void *comm, const void *send, void *recv, size_t count, dopt_dtype dt, dopt_redop op) {
  wrapped *w = W(comm);
  size_t b = count * dopt_dtype_size(dt);
  CHECK(w->c, "all_reduce", "send", send, b, __builtin_return_address(0));
  CHECK(w->c, "all_reduce", "recv", recv, b, __builtin_return_address(0));
  return w->in.ops->all_reduce(w->in.comm, send, recv, count, dt, op);
}

static dopt_status w_reduce_scatter(void *comm, const void *send, void *recv, size_t recvcount, dopt_dtype dt,
                                    dopt_redop op) {
  wrapped *w = W(comm);
  size_t b = recvcount * dopt_dtype_size(dt);
  CHECK(w->c, "reduce_scatter", "send", send, b * (size_t)w->in.size, __builtin_return_address(0));
  CHECK(w->c, "reduce_scatter", "recv", recv, b, __builtin_return_address(0));
  return w->in.ops->reduce_scatter(w->in.comm, send, recv, recvcount, dt, op);
}

static dopt_status w_all_gather(void *comm, const void *send, void *recv, size_t sendcount, dopt_dtype dt) {
  wrapped *w = W(comm);
  size_t b = sendcount * dopt_dtype_size(dt);
  CHECK(w->c, "all_gather", "send", send, b, __builtin_return_address(0));
  CHECK(w->c, "all_gather", "recv", recv, b * (size_t)w->in.size, __builtin_return_address(0));
  return w->in.ops->all_gather(w->in.comm, send, recv, sendcount, dt);
}

static dopt_status w_broadcast(void *comm, const void *send, void *recv, size_t count, dopt_dtype dt, int root) {
  wrapped *w = W(comm);
  size_t b = count * dopt_dtype_size(dt);
  if (w->in.rank == root) CHECK(w->c, "broadcast", "send", send, b, __builtin_return_address(0));
  CHECK(w->c, "broadcast", "recv", recv, b, __builtin_return_address(0));
  return w->in.ops->broadcast(w->in.comm, send, recv, count, dt, root);
}

static dopt_status w_reduce(void *comm, const void *send, void *recv, size_t count, dopt_dtype dt, dopt_redop op,
                            int root) {
  wrapped *w = W(comm);
  size_t b = count * dopt_dtype_size(dt);
  if (!w->in.ops->reduce) return dopt__fail(DOPT_ERR_UNSUPPORTED, "checking transport: the wrapped one has no reduce");
  CHECK(w->c, "reduce", "send", send, b, __builtin_return_address(0));
  if (w->in.rank == root) CHECK(w->c, "reduce", "recv", recv, b, __builtin_return_address(0));
  return w->in.ops->reduce(w->in.comm, send, recv, count, dt, op, root);
}

static dopt_status w_all_to_allv(void *comm, const void *send, const size_t *scounts, const size_t *sdispls, void *recv,
                                 const size_t *rcounts, const size_t *rdispls, dopt_dtype dt) {
  wrapped *w = W(comm);
  const size_t esz = dopt_dtype_size(dt);
  if (!w->in.ops->all_to_allv)
    return dopt__fail(DOPT_ERR_UNSUPPORTED, "checking transport: the wrapped one has no all_to_allv");
  for (int j = 0; j < w->in.size; j++) { /* every region with data lies in one device buffer */
    if (scounts[j])
      CHECK(w->c, "all_to_allv", "send", (const char *)send + sdispls[j] * esz, scounts[j] * esz,
            __builtin_return_address(0));
    if (rcounts[j])
      CHECK(w->c, "all_to_allv", "recv", (char *)recv + rdispls[j] * esz, rcounts[j] * esz,
            __builtin_return_address(0));
  }
  return w->in.ops->all_to_allv(w->in.comm, send, scounts, sdispls, recv, rcounts, rdispls, dt);
}

static const dopt_transport_ops w_ops = {w_all_reduce, w_reduce_scatter, w_all_gather, w_broadcast, w_reduce,
                                         w_all_to_allv, NULL, NULL, NULL, NULL, NULL}; /* device memory: no views */
/* a transport of the first interface: no reduce, no all_to_allv (distributed/ falls back) */
static const dopt_transport_ops w_ops_basic = {w_all_reduce, w_reduce_scatter, w_all_gather, w_broadcast,
                                               NULL,         NULL,             NULL,         NULL,
                                               NULL,         NULL,             NULL};

/* ---- lifetime ----------------------------------------------------------------------------- */

dopt_status dt_checkdev_create(dt_checkdev **out) {
  dt_checkdev *c = calloc(1, sizeof *c);
  if (!c) return dopt__fail(DOPT_ERR_NO_MEMORY, "checking device");
  pthread_mutex_init(&c->mu, NULL);
  c->dev.ops = &ck_ops;
  c->dev.ctx = c;
  *out = c;
  return DOPT_OK;
}

void dt_checkdev_destroy(dt_checkdev *c) {
  if (!c) return;
  for (size_t i = 0; i < c->nb; i++) free(c->b[i].p);
  for (int i = 0; i < c->nw; i++) free(c->w[i]);
  free(c->b);
  pthread_mutex_destroy(&c->mu);
  free(c);
}

const dopt_device *dt_checkdev_device(dt_checkdev *c) { return &c->dev; }

dopt_status dt_checkdev_wrap(dt_checkdev *c, const dopt_transport *in, dopt_transport *out) {
  if (c->nw == (int)(sizeof c->w / sizeof c->w[0]))
    return dopt__fail(DOPT_ERR_INVALID_ARG, "checking device: at most %d wrapped transports", c->nw);
  wrapped *w = calloc(1, sizeof *w);
  if (!w) return dopt__fail(DOPT_ERR_NO_MEMORY, "checking device: transport");
  w->c = c;
  w->in = *in;
  c->w[c->nw++] = w;
  *out = *in;
  out->ops = &w_ops;
  out->comm = w;
  return DOPT_OK;
}

void dt_checkdev_basic_ops(dopt_transport *t) {
  if (t->ops == &w_ops) t->ops = &w_ops_basic;
}

void dt_checkdev_host_steps(dt_checkdev *c, int on) { c->host_steps = on != 0; }

size_t dt_checkdev_violations(const dt_checkdev *c, const char **first) {
  if (first) *first = c->first;
  return c->violations;
}

size_t dt_checkdev_live(const dt_checkdev *c) { return c->nb; }

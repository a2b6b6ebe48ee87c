/* A step on the host for a device that has no kernel for it (core/optim_impl.h
 * dopt__step_buffers, dopt__step_on_host): the CUDA device runs the whole-tensor
 * and not-yet-ported steps through the CPU reference this way, bitwise by
 * construction; the checking device runs every optimizer's distributed step
 * through it in the tests, which proves the adapter moves every buffer. */
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "optim_impl.h"

int dopt__step_buffers(const dopt_step_args *a, size_t frame_bytes, dopt_step_buf *out) {
  const size_t n = a->piece->len;
  int k = 0;
  if (a->param) out[k++] = (dopt_step_buf){"param", a->param, n * sizeof(float), 1, DOPT_BUF_PARAM};
  if (a->grad) out[k++] = (dopt_step_buf){"grad", (void *)(uintptr_t)a->grad, n * sizeof(float), 0, DOPT_BUF_GRAD};
  if (a->state && a->impl->layout) { /* the states of the parameter's logical shape (else its piece's [b, h, w]):
                                        * a whole state may follow a dimension the view folds (NorMuon's [d0, 1]) */
    const dopt_piece *pc = a->piece;
    int64_t view[3];
    int ndim;
    const int64_t *shape = dopt_step_shape(a, view, &ndim);
    dopt_state_spec spec[DOPT_MAX_STATES];
    const int ns = a->impl->layout(a->hp, ndim, shape, spec);
    for (int s = 0; s < ns; s++) {
      const size_t es = dopt_dtype_size(spec[s].v.dtype);
      const size_t bytes = spec[s].kind == DOPT_STATE_ELEMENTWISE ? n * es
                           : spec[s].kind == DOPT_STATE_BLOCKWISE ? dopt_piece_blocks(pc, spec[s].block, NULL) * es
                                                                   : spec[s].v.bytes;
      if (a->state[s]) out[k++] = (dopt_step_buf){spec[s].v.name, a->state[s], bytes, 1, DOPT_BUF_STATE + s};
    }
  }
  if (frame_bytes && a->frame) out[k++] = (dopt_step_buf){"frame", a->frame, frame_bytes, 1, DOPT_BUF_FRAME};
  if (a->wstat)
    out[k++] = (dopt_step_buf){"wstat", (void *)(uintptr_t)a->wstat, a->wstat_len * sizeof(float), 0, DOPT_BUF_WSTAT};
  if (a->shared && a->shared->n) { /* the shared blocks' indices and the scratch their maxima are posted from */
    out[k++] = (dopt_step_buf){"shared.idx", (void *)(uintptr_t)a->shared->idx, a->shared->n * sizeof(size_t), 0,
                               DOPT_BUF_SHARED_IDX};
    out[k++] = (dopt_step_buf){"shared.max", a->shared->max, 2 * a->shared->n * sizeof(double), 1,
                               DOPT_BUF_SHARED_MAX};
  }
  return k;
}

/* The reducer a host step posts to: each posted array lies in one of the host copies, and what the caller
 * reduces (and the next stage finds reduced, after the copies are uploaded) is its device counterpart. */
typedef struct host_red {
  const dopt_reducer *red;
  const dopt_step_buf *dev;
  unsigned char *const *host;
  int nb;
} host_red;

static void *device_of(host_red *h, const void *x, size_t bytes) {
  const unsigned char *p = x;
  for (int k = 0; k < h->nb; k++)
    if (h->host[k] && p >= h->host[k] && bytes <= h->dev[k].bytes && (size_t)(p - h->host[k]) <= h->dev[k].bytes - bytes)
      return (unsigned char *)h->dev[k].dev + (p - h->host[k]);
  return NULL;
}

static dopt_status post_max(void *ctx, double *x, size_t n) {
  host_red *h = ctx;
  double *d = device_of(h, x, n * sizeof *x);
  if (!d) return dopt__fail(DOPT_ERR_STATE, "host step: posted MAX array of %zu doubles lies in no step buffer", n);
  return h->red->post_max_f64(h->red->ctx, d, n);
}

static dopt_status post_sum(void *ctx, int64_t *x, size_t n) {
  host_red *h = ctx;
  int64_t *d = device_of(h, x, n * sizeof *x);
  if (!d) return dopt__fail(DOPT_ERR_STATE, "host step: posted SUM array of %zu words lies in no step buffer", n);
  return h->red->post_sum_i64(h->red->ctx, d, n);
}

dopt_status dopt__step_on_host(const dopt_device *dev, const dopt_step_args *a, size_t frame_bytes) {
  dopt_step_buf b[DOPT_STEP_BUFS_MAX];
  const int nb = dopt__step_buffers(a, frame_bytes, b);
  unsigned char *host[DOPT_STEP_BUFS_MAX] = {NULL};
  dopt_status s = DOPT_OK;
  for (int k = 0; k < nb && s == DOPT_OK; k++) {
    host[k] = malloc(b[k].bytes ? b[k].bytes : 1);
    if (!host[k]) s = dopt__fail(DOPT_ERR_NO_MEMORY, "host step: %zu bytes for %s", b[k].bytes, b[k].name);
    else if (b[k].bytes) s = dev->ops->download(dev->ctx, host[k], b[k].dev, b[k].bytes);
  }
  if (s == DOPT_OK) { /* the same step on the host copies, each in the field it came from */
    dopt_step_args h = *a;
    void *state[DOPT_MAX_STATES] = {NULL};
    dopt_block_share shared = a->shared ? *a->shared : (dopt_block_share){0};
    for (int k = 0; k < nb; k++) switch (b[k].slot) {
      case DOPT_BUF_PARAM: h.param = (float *)host[k]; break;
      case DOPT_BUF_GRAD: h.grad = (const float *)host[k]; break;
      case DOPT_BUF_FRAME: h.frame = host[k]; break;
      case DOPT_BUF_WSTAT: h.wstat = (const float *)host[k]; break;
      case DOPT_BUF_SHARED_IDX: shared.idx = (const size_t *)host[k], h.shared = &shared; break;
      case DOPT_BUF_SHARED_MAX: shared.max = (double *)host[k], h.shared = &shared; break;
      default: state[b[k].slot - DOPT_BUF_STATE] = host[k]; break;
      }
    if (a->state) h.state = state; /* a NULL state stays NULL */
    host_red hr = {a->red, b, host, nb};
    dopt_reducer red = {&hr, post_max, post_sum};
    if (a->red) h.red = &red;
    s = a->impl->step(&h);
  }
  for (int k = 0; k < nb && s == DOPT_OK; k++)
    if (b[k].out && b[k].bytes) s = dev->ops->upload(dev->ctx, b[k].dev, host[k], b[k].bytes);
  for (int k = 0; k < nb; k++) free(host[k]);
  return s;
}

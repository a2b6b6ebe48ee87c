/* Shapes and pieces: element counts, the [b, h, w] view, state descriptions,
 * the piece of a whole tensor (distopt/device.h). Below both the optimizer
 * framework (core/optim.c) and the piece statistics (core/stats.c). */
#include <string.h>

#include "optim_impl.h"

size_t dopt_numel(int ndim, const int64_t *shape) {
  size_t n = 1;
  for (int i = 0; i < ndim; i++) n *= (size_t)shape[i];
  return n;
}

void dopt_split_bhw(int ndim, const int64_t *shape, size_t *b, size_t *h, size_t *w) {
  *b = dopt_numel(ndim - 2, shape);
  *h = (size_t)shape[ndim - 2];
  *w = (size_t)shape[ndim - 1];
}

void dopt_state_def(dopt_state_spec *spec, const char *name, int ndim, const int64_t *shape, int elementwise) {
  dopt_state_def_dtype(spec, name, DOPT_F32, ndim, shape, elementwise);
}

void dopt_state_def_dtype(dopt_state_spec *spec, const char *name, dopt_dtype dtype, int ndim, const int64_t *shape,
                          int elementwise) {
  memset(spec, 0, sizeof *spec);
  spec->elementwise = elementwise;
  dopt_state_view *v = &spec->v;
  v->name = name;
  v->dtype = dtype;
  v->ndim = ndim;
  for (int i = 0; i < ndim; i++) v->shape[i] = shape[i];
  v->bytes = dopt_numel(ndim, shape) * dopt_dtype_size(dtype);
}

void dopt_piece_full(int ndim, const int64_t *shape, dopt_piece *pc) {
  memset(pc, 0, sizeof *pc);
  pc->numel = dopt_numel(ndim, shape);
  pc->factored = ndim >= 2;
  if (pc->factored) {
    dopt_split_bhw(ndim, shape, &pc->b, &pc->h, &pc->w);
  } else {
    pc->b = 1;
    pc->h = 1;
    pc->w = pc->numel;
  }
  pc->hl = pc->h;
  pc->wl = pc->w;
  pc->len = pc->numel;
}

int dopt_layer_from_name(const char *name) {
  for (const char *s = name ? strstr(name, "layers.") : NULL; s; s = strstr(s + 1, "layers.")) {
    if (s != name && s[-1] != '.' && s[-1] != '/') continue;
    const char *d = s + 7;
    long v = 0;
    int nd = 0;
    while (*d >= '0' && *d <= '9' && nd < 9) v = v * 10 + (*d++ - '0'), nd++;
    if (nd > 0 && (*d == '.' || *d == '\0')) return (int)v;
  }
  return -1;
}

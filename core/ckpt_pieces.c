/* Checkpoint pieces (core/ckpt_internal.h): a piece's fit to its tensor, the
 * scatter of a saved piece's elements into a wanted one, and the piece table
 * — a rank's list or the merged index — grouped into tensors whose pieces
 * must cover each tensor exactly once. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt_internal.h"
#include "grid.h"

/* ---- small helpers ------------------------------------------------------------ */


void *ck_ar_alloc(arena *a, size_t bytes) {
  if (a->n == a->cap) {
    size_t cap = a->cap ? 2 * a->cap : 32;
    void **nb = realloc(a->b, cap * sizeof *nb);
    if (!nb) return NULL;
    a->b = nb;
    a->cap = cap;
  }
  void *p = calloc(1, bytes ? bytes : 1);
  if (p) a->b[a->n++] = p;
  return p;
}

char *ck_ar_strdup(arena *a, const char *s) {
  size_t n = strlen(s) + 1;
  char *p = ck_ar_alloc(a, n);
  if (p) memcpy(p, s, n);
  return p;
}

void ck_ar_free(arena *a) {
  for (size_t i = 0; i < a->n; i++) free(a->b[i]);
  free(a->b);
  memset(a, 0, sizeof *a);
}
/* ---- pieces -------------------------------------------------------------------- */


void ck_piece_get(const dopt_piece *pc, uint64_t v[PF_N]) {
  v[PF_B] = pc->b, v[PF_H] = pc->h, v[PF_W] = pc->w, v[PF_NUMEL] = pc->numel, v[PF_FACTORED] = pc->factored != 0;
  v[PF_H0] = pc->h0, v[PF_HL] = pc->hl, v[PF_W0] = pc->w0, v[PF_WL] = pc->wl, v[PF_LO] = pc->lo, v[PF_LEN] = pc->len;
}

void ck_piece_set(dopt_piece *pc, const uint64_t v[PF_N]) {
  pc->b = (size_t)v[PF_B], pc->h = (size_t)v[PF_H], pc->w = (size_t)v[PF_W], pc->numel = (size_t)v[PF_NUMEL];
  pc->factored = (int)v[PF_FACTORED];
  pc->h0 = (size_t)v[PF_H0], pc->hl = (size_t)v[PF_HL], pc->w0 = (size_t)v[PF_W0], pc->wl = (size_t)v[PF_WL];
  pc->lo = (size_t)v[PF_LO], pc->len = (size_t)v[PF_LEN];
}

/* A piece must describe the tensor's logical [b, h, w] view and lie inside it. */
dopt_status ck_check_piece(dopt_status err, const char *where, const char *tensor, int ndim, const int64_t *shape,
                           const dopt_piece *pc) {
  dopt_piece f;
  dopt_piece_full(ndim, shape, &f);
  char sh[160];
  if (pc->b != f.b || pc->h != f.h || pc->w != f.w || pc->numel != f.numel || !pc->factored != !f.factored) {
    dopt__shape_text(ndim, shape, sh, sizeof sh);
    return dopt__fail(err, "%s: tensor '%s': piece view [b=%zu, h=%zu, w=%zu] numel=%zu factored=%d does not fit its "
                      "shape %s ([%zu, %zu, %zu])", where, tensor, pc->b, pc->h, pc->w, pc->numel, pc->factored, sh,
                      f.b, f.h, f.w);
  }
  if (pc->hl > f.h || pc->h0 > f.h - pc->hl || pc->wl > f.w || pc->w0 > f.w - pc->wl)
    return dopt__fail(err, "%s: tensor '%s': piece block rows [%zu, +%zu) cols [%zu, +%zu) outside [%zu, %zu]", where,
                      tensor, pc->h0, pc->hl, pc->w0, pc->wl, f.h, f.w);
  size_t blk = f.b * pc->hl * pc->wl;
  if (pc->len > blk || pc->lo > blk - pc->len)
    return dopt__fail(err, "%s: tensor '%s': piece range [%zu, +%zu) outside its block of %zu elements", where, tensor,
                      pc->lo, pc->len, blk);
  return DOPT_OK;
}

int ck_piece_is_whole(const dopt_piece *pc) {
  return pc->h0 == 0 && pc->w0 == 0 && pc->lo == 0 && pc->hl == pc->h && pc->wl == pc->w && pc->len == pc->numel;
}

/* Elements [e0, e1) of saved piece s (src: their data, element e0 first;
 * NULL: only count) that lie in piece w go to out (w's element k at
 * out[k - w->lo]). Returns how many lie in w. Works in row segments: the
 * elements of one block row are consecutive logical elements. */
size_t ck_scatter(const dopt_piece *s, size_t e0, size_t e1, const unsigned char *src, const dopt_piece *w,
                  unsigned char *out, size_t es) {
  size_t count = 0, q = s->lo + e0, qend = s->lo + e1;
  while (q < qend) {
    size_t cc = q % s->wl, seg = s->wl - cc;
    if (seg > qend - q) seg = qend - q;
    size_t L = dopt_grid_logical(s, q); /* the segment's first logical element */
    size_t bb = L / (s->h * s->w), row = (L / s->w) % s->h, c0 = L % s->w, c1 = c0 + seg;
    if (row >= w->h0 && row < w->h0 + w->hl) {
      size_t a = c0 > w->w0 ? c0 : w->w0, z = c1 < w->w0 + w->wl ? c1 : w->w0 + w->wl;
      if (a < z) {
        size_t kq = (bb * w->hl + (row - w->h0)) * w->wl + (a - w->w0), ke = kq + (z - a);
        size_t x0 = kq > w->lo ? kq : w->lo, x1 = ke < w->lo + w->len ? ke : w->lo + w->len;
        if (x0 < x1) {
          count += x1 - x0;
          if (src) memcpy(out + (x0 - w->lo) * es, src + ((q - s->lo - e0) + (a - c0) + (x0 - kq)) * es, (x1 - x0) * es);
        }
      }
    }
    q += seg;
  }
  return count;
}

int ck_blocks_meet(const dopt_piece *a, const dopt_piece *b) {
  return a->h0 < b->h0 + b->hl && b->h0 < a->h0 + a->hl && a->w0 < b->w0 + b->wl && b->w0 < a->w0 + a->wl;
}
/* ---- the piece table (a rank's list, the merged index) ------------------------------ */


void ck_table_free(ck_table *t) {
  free(t->files);
  free(t->p);
  free(t->sorted);
  free(t->t);
  ck_ar_free(&t->ar);
  memset(t, 0, sizeof *t);
}

dopt_status ck_table_add_file(ck_table *t, const char *name, uint64_t bytes, int *idx) {
  if (t->nfiles == t->files_cap) {
    int cap = t->files_cap ? 2 * t->files_cap : 8;
    ck_file *f = realloc(t->files, (size_t)cap * sizeof *f);
    if (!f) return dopt__fail(DOPT_ERR_NO_MEMORY, "checkpoint: %d files", cap);
    t->files = f;
    t->files_cap = cap;
  }
  const char *nm = ck_ar_strdup(&t->ar, name);
  if (!nm) return dopt__fail(DOPT_ERR_NO_MEMORY, "checkpoint: %zu bytes for a file name", strlen(name) + 1);
  t->files[t->nfiles] = (ck_file){nm, bytes};
  *idx = t->nfiles++;
  return DOPT_OK;
}

ck_piece *ck_table_new_piece(ck_table *t) {
  if (t->np == t->pcap) {
    int cap = t->pcap ? 2 * t->pcap : 64;
    ck_piece *p = realloc(t->p, (size_t)cap * sizeof *p);
    if (!p) return NULL;
    t->p = p;
    t->pcap = cap;
  }
  ck_piece *p = &t->p[t->np++];
  memset(p, 0, sizeof *p);
  return p;
}

/* (no global state: ranks open checkpoints concurrently, as threads of the simulator) */
static int cmp_piece(const void *x, const void *y) {
  const ck_piece *a = *(ck_piece *const *)x, *b = *(ck_piece *const *)y;
  int c = strcmp(a->tensor, b->tensor);
  if (c) return c;
  c = strcmp(a->fname, b->fname);
  return c ? c : strcmp(a->key, b->key);
}

static int cmp_block(const void *x, const void *y) {
  const dopt_piece *a = &(*(ck_piece *const *)x)->pc, *b = &(*(ck_piece *const *)y)->pc;
  size_t va[5] = {a->h0, a->hl, a->w0, a->wl, a->lo}, vb[5] = {b->h0, b->hl, b->w0, b->wl, b->lo};
  for (int i = 0; i < 5; i++)
    if (va[i] != vb[i]) return va[i] < vb[i] ? -1 : 1;
  return 0;
}

static int same_block(const dopt_piece *a, const dopt_piece *b) {
  return a->h0 == b->h0 && a->hl == b->hl && a->w0 == b->w0 && a->wl == b->wl;
}

/* The pieces of one tensor cover it exactly once: its [h, w] plane is
 * partitioned into TP blocks, and each block's flat range [0, b·hl·wl) into
 * the ranges of its pieces. */
static dopt_status check_cover(const ck_table *t, ck_tensor *ts, const char *where) {
  int n = ts->npieces;
  ck_piece **v = malloc((size_t)(n ? n : 1) * sizeof *v);
  int *lead = malloc((size_t)(n ? n : 1) * sizeof *lead); /* the first piece of each non-empty block */
  if (!v || !lead) {
    free(v);
    free(lead);
    return dopt__fail(DOPT_ERR_NO_MEMORY, "%s: %d pieces", where, n);
  }
  memcpy(v, ts->pieces, (size_t)n * sizeof *v);
  qsort(v, (size_t)n, sizeof *v, cmp_block);
  dopt_status s = DOPT_OK;
  size_t area = 0, b = n ? v[0]->pc.b : 0;
  int nblocks = 0;
  for (int i = 0; i < n && s == DOPT_OK;) {
    int j = i;
    size_t next = 0, blk = b * v[i]->pc.hl * v[i]->pc.wl;
    const ck_piece *prev = NULL;
    for (; j < n && same_block(&v[j]->pc, &v[i]->pc); j++) {
      const ck_piece *p = v[j];
      if (p->pc.len == 0) continue;
      if (p->pc.lo < next) {
        s = dopt__fail(DOPT_ERR_FORMAT, "%s: tensor '%s': pieces %s:%s and %s:%s overlap (elements [%zu, %zu) of block "
                       "rows [%zu, +%zu) cols [%zu, +%zu))", where, ts->name, t->files[prev->file].name, prev->key,
                       t->files[p->file].name, p->key, p->pc.lo, next, p->pc.h0, p->pc.hl, p->pc.w0, p->pc.wl);
        break;
      }
      if (p->pc.lo > next) {
        s = dopt__fail(DOPT_ERR_FORMAT, "%s: tensor '%s': elements [%zu, %zu) of block rows [%zu, +%zu) cols [%zu, +%zu) "
                       "are in no piece (gap before %s:%s)", where, ts->name, next, p->pc.lo, p->pc.h0, p->pc.hl,
                       p->pc.w0, p->pc.wl, t->files[p->file].name, p->key);
        break;
      }
      next = p->pc.lo + p->pc.len;
      prev = p;
    }
    if (s == DOPT_OK && blk > 0 && next < blk)
      s = dopt__fail(DOPT_ERR_FORMAT, "%s: tensor '%s': elements [%zu, %zu) of block rows [%zu, +%zu) cols [%zu, +%zu) are "
                     "in no piece", where, ts->name, next, blk, v[i]->pc.h0, v[i]->pc.hl, v[i]->pc.w0, v[i]->pc.wl);
    if (s == DOPT_OK && blk > 0) {
      /* a block must not meet another one */
      for (int k = 0; k < nblocks && s == DOPT_OK; k++) {
        const ck_piece *a = v[lead[k]], *c = v[i];
        if (ck_blocks_meet(&a->pc, &c->pc))
          s = dopt__fail(DOPT_ERR_FORMAT, "%s: tensor '%s': pieces %s:%s and %s:%s overlap (blocks rows [%zu, +%zu) "
                         "cols [%zu, +%zu) and rows [%zu, +%zu) cols [%zu, +%zu))", where, ts->name,
                         t->files[a->file].name, a->key, t->files[c->file].name, c->key, a->pc.h0, a->pc.hl, a->pc.w0,
                         a->pc.wl, c->pc.h0, c->pc.hl, c->pc.w0, c->pc.wl);
      }
      area += v[i]->pc.hl * v[i]->pc.wl;
      lead[nblocks++] = i;
    }
    i = j;
  }
  if (s == DOPT_OK && n > 0 && ts->numel > 0 && area != v[0]->pc.h * v[0]->pc.w)
    s = dopt__fail(DOPT_ERR_FORMAT, "%s: tensor '%s': its %d block(s) cover %zu of the %zu x %zu (rows x cols) positions",
                   where, ts->name, nblocks, area, v[0]->pc.h, v[0]->pc.w);
  if (s == DOPT_OK && n == 0 && ts->numel > 0)
    s = dopt__fail(DOPT_ERR_FORMAT, "%s: tensor '%s' has no pieces", where, ts->name);
  free(v);
  free(lead);
  return s;
}

/* Sorts the pieces by tensor, groups them into tensors (one dtype and shape
 * each) and checks each tensor's cover. */
dopt_status ck_table_finish(ck_table *t, const char *where) {
  t->sorted = malloc((size_t)(t->np ? t->np : 1) * sizeof *t->sorted);
  t->t = calloc((size_t)(t->np ? t->np : 1), sizeof *t->t);
  if (!t->sorted || !t->t) return dopt__fail(DOPT_ERR_NO_MEMORY, "%s: %d pieces", where, t->np);
  for (int i = 0; i < t->np; i++) t->sorted[i] = &t->p[i];
  qsort(t->sorted, (size_t)t->np, sizeof *t->sorted, cmp_piece);
  for (int i = 0; i < t->np;) {
    ck_piece *p0 = t->sorted[i];
    ck_tensor *ts = &t->t[t->nt++];
    ts->name = p0->tensor;
    ts->dtype = p0->dtype;
    ts->ndim = p0->ndim;
    memcpy(ts->shape, p0->shape, sizeof ts->shape);
    ts->numel = dopt_numel(p0->ndim, p0->shape);
    ts->pieces = &t->sorted[i];
    int j = i;
    for (; j < t->np && strcmp(t->sorted[j]->tensor, p0->tensor) == 0; j++) {
      const ck_piece *p = t->sorted[j];
      if (p->dtype != p0->dtype || !ck_same_shape(p->ndim, p->shape, p0->ndim, p0->shape)) {
        char a[160], b[160];
        dopt__shape_text(p0->ndim, p0->shape, a, sizeof a);
        dopt__shape_text(p->ndim, p->shape, b, sizeof b);
        return dopt__fail(DOPT_ERR_FORMAT, "%s: tensor '%s' is %s %s in %s:%s but %s %s in %s:%s", where, p0->tensor,
                          dopt_dtype_name(p0->dtype), a, t->files[p0->file].name, p0->key, dopt_dtype_name(p->dtype), b,
                          t->files[p->file].name, p->key);
      }
      if (j > i && p->file == t->sorted[j - 1]->file && strcmp(p->key, t->sorted[j - 1]->key) == 0)
        return dopt__fail(DOPT_ERR_FORMAT, "%s: tensor '%s': piece %s:%s listed twice", where, p->tensor,
                          t->files[p->file].name, p->key);
    }
    ts->npieces = j - i;
    DOPT_TRY(check_cover(t, ts, where));
    i = j;
  }
  return DOPT_OK;
}

const ck_tensor *ck_table_find(const ck_table *t, const char *name) {
  int lo = 0, hi = t->nt;
  while (lo < hi) {
    int mid = lo + (hi - lo) / 2, c = strcmp(t->t[mid].name, name);
    if (c == 0) return &t->t[mid];
    if (c < 0) lo = mid + 1;
    else hi = mid;
  }
  return NULL;
}
/* Every parameter's fp32 values (and bf16 copy) must be in the generation. */
dopt_status ck_check_param_tensors(const ck_table *t, const dopt_ckpt_meta *m, const char *where) {
  char name[1024];
  for (int i = 0; i < m->nparams; i++) {
    const dopt_ckpt_param *p = &m->params[i];
    const ck_tensor *x = ck_table_find(t, p->name);
    if (!x || x->dtype != DOPT_F32 || !ck_same_shape(x->ndim, x->shape, p->ndim, p->shape))
      return dopt__fail(DOPT_ERR_NOT_FOUND, "%s: parameter '%s': no F32 tensor of its shape", where, p->name);
    if (p->has_bf16) {
      snprintf(name, sizeof name, "%s/bf16", p->name);
      x = ck_table_find(t, name);
      if (!x || x->dtype != DOPT_BF16 || !ck_same_shape(x->ndim, x->shape, p->ndim, p->shape))
        return dopt__fail(DOPT_ERR_NOT_FOUND, "%s: parameter '%s': has_bf16 but no BF16 tensor '%s' of its shape",
                          where, p->name, name);
    }
  }
  return DOPT_OK;
}

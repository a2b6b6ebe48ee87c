/* The hash index of core/index.h. */
#include "index.h"

#include <stdlib.h>

#include "internal.h"

uint64_t dopt__hash_str(const char *s) {
  uint64_t h = 1469598103934665603ull;
  for (; *s; s++) h = (h ^ (unsigned char)*s) * 1099511628211ull;
  return h;
}

uint64_t dopt__hash_ptr(const void *p) {
  uint64_t x = (uint64_t)(uintptr_t)p;
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  return x ^ (x >> 33);
}

int dopt__index_find(const dopt_index *ix, uint64_t h, int (*same)(const void *ctx, int i, const void *key),
                     const void *ctx, const void *key) {
  if (!ix->cap) return 0;
  for (size_t s = (size_t)h & (ix->cap - 1);; s = (s + 1) & (ix->cap - 1)) {
    if (!ix->item[s]) return 0;
    if (ix->hash[s] == h && same(ctx, ix->item[s] - 1, key)) return ix->item[s];
  }
}

static void put(uint64_t *hash, int *item, size_t cap, uint64_t h, int v) {
  size_t s = (size_t)h & (cap - 1);
  while (item[s]) s = (s + 1) & (cap - 1);
  hash[s] = h;
  item[s] = v;
}

dopt_status dopt__index_add(dopt_index *ix, uint64_t h, int i) {
  if ((ix->n + 1) * 2 > ix->cap) {
    size_t cap = ix->cap ? 2 * ix->cap : 64;
    uint64_t *nh = malloc(cap * sizeof *nh);
    int *ni = calloc(cap, sizeof *ni);
    if (!nh || !ni) {
      free(nh);
      free(ni);
      return dopt__fail(DOPT_ERR_NO_MEMORY, "index of %zu items", ix->n + 1);
    }
    for (size_t s = 0; s < ix->cap; s++)
      if (ix->item[s]) put(nh, ni, cap, ix->hash[s], ix->item[s]);
    free(ix->hash);
    free(ix->item);
    ix->hash = nh;
    ix->item = ni;
    ix->cap = cap;
  }
  put(ix->hash, ix->item, ix->cap, h, i + 1);
  ix->n++;
  return DOPT_OK;
}

void dopt__index_free(dopt_index *ix) {
  free(ix->hash);
  free(ix->item);
  ix->hash = NULL;
  ix->item = NULL;
  ix->cap = ix->n = 0;
}

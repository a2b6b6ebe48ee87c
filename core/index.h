/* A small open-addressing hash index from 64-bit hashes to item indices
 * (library-internal): what keeps name and pointer lookups over tens of
 * thousands of tensors linear instead of quadratic. The caller owns the items
 * and says how to compare one with a key. */
#ifndef DISTOPT_INDEX_H
#define DISTOPT_INDEX_H

#include <stddef.h>
#include <stdint.h>

#include "distopt/status.h"

typedef struct dopt_index {
  uint64_t *hash; /* [cap] the stored items' hashes */
  int *item;      /* [cap] item index + 1 (0: empty) */
  size_t cap, n;  /* cap: 0 or a power of two; load <= 1/2 */
} dopt_index;

uint64_t dopt__hash_str(const char *s); /* FNV-1a */
uint64_t dopt__hash_ptr(const void *p);

/* The item i with hash h for which same(ctx, i, key) holds, as i + 1; 0 if none. */
int dopt__index_find(const dopt_index *ix, uint64_t h, int (*same)(const void *ctx, int i, const void *key),
                     const void *ctx, const void *key);
/* Adds item i with hash h (grows the table; DOPT_ERR_NO_MEMORY leaves it as it was). */
dopt_status dopt__index_add(dopt_index *ix, uint64_t h, int i);
void dopt__index_free(dopt_index *ix);

#endif

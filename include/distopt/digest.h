/* distopt — the project's one digest: SHA-256 (OpenSSL libcrypto) over a
 * canonical, layout-independent encoding of named tensors, so that two runs
 * (different machines, layouts, processes) compare by one line of hex.
 *
 * Encoding DOPT-DIGEST-1 (docs/digest.md), all integers little-endian:
 *   once, before the first tensor record: the 13 ASCII bytes "DOPT-DIGEST-1"
 *   per tensor record, in the caller's order:
 *     u32 name length, the name's bytes (no terminator)
 *     u32 dtype-name length, the dtype's safetensors name ("F32", "BF16", ...)
 *     u32 ndim, then ndim × i64 dims
 *     u64 byte count, then the elements, each in little-endian byte order
 * dopt_digest_bytes appends raw bytes as given (metadata of the caller's own
 * format); a handle fed only raw bytes yields the plain SHA-256 of them.
 *
 *   dopt_digest *d;
 *   dopt_digest_create(&d);
 *   dopt_digest_tensor(d, "fc1.weight", DOPT_F32, 2, shape, w, bytes);
 *   char hex[DOPT_DIGEST_HEX];
 *   dopt_digest_final(d, NULL, hex);       // then only destroy
 *   dopt_digest_destroy(d);
 */
#ifndef DISTOPT_DIGEST_H
#define DISTOPT_DIGEST_H

#include <stddef.h>
#include <stdint.h>

#include "distopt/dtype.h"
#include "distopt/export.h"
#include "distopt/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DOPT_DIGEST_BYTES 32                 /* SHA-256 */
#define DOPT_DIGEST_HEX 65                   /* 64 lowercase hex digits and a NUL */
#define DOPT_DIGEST_ENCODING "DOPT-DIGEST-1" /* the magic, and the encoding's name in reports */

typedef struct dopt_digest dopt_digest;

DOPT_API dopt_status dopt_digest_create(dopt_digest **out);
/* NULL is allowed. */
DOPT_API void dopt_digest_destroy(dopt_digest *d);
/* Appends n raw bytes (data may be NULL when n is 0). */
DOPT_API dopt_status dopt_digest_bytes(dopt_digest *d, const void *data, size_t n);
/* Appends one tensor record (the magic first, if this is the first record).
 * data holds the elements in host byte order, row-major; bytes must equal
 * numel(shape) × dopt_dtype_size(dt) (DOPT_ERR_SHAPE otherwise). ndim in
 * [0, DOPT_MAX_DIMS]; ndim 0 is a scalar (one element). */
DOPT_API dopt_status dopt_digest_tensor(dopt_digest *d, const char *name, dopt_dtype dt, int ndim, const int64_t *shape,
                                        const void *data, size_t bytes);
/* Finishes: the 32 bytes into out and/or the lowercase hex into hex (either
 * may be NULL). Afterwards every call but destroy is DOPT_ERR_STATE. */
DOPT_API dopt_status dopt_digest_final(dopt_digest *d, uint8_t out[DOPT_DIGEST_BYTES], char hex[DOPT_DIGEST_HEX]);
/* The plain SHA-256 of one buffer, in one call. */
DOPT_API dopt_status dopt_digest_buffer(const void *data, size_t n, uint8_t out[DOPT_DIGEST_BYTES],
                                        char hex[DOPT_DIGEST_HEX]);

#ifdef __cplusplus
}
#endif
#endif

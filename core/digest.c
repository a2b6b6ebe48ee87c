/* The project's digest (include/distopt/digest.h, docs/digest.md): SHA-256
 * from OpenSSL libcrypto's EVP interface over the DOPT-DIGEST-1 encoding.
 * Every field is written little-endian whatever the host, so a digest names
 * the values, not the machine or the layout that produced them. A call that
 * fails on its arguments appends nothing; one that fails inside OpenSSL
 * leaves the handle unusable (DOPT_ERR_STATE afterwards). */
#include "distopt/digest.h"

#include <openssl/evp.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

struct dopt_digest {
  EVP_MD_CTX *ctx;
  int records; /* tensor records so far: the magic precedes the first */
  int done;    /* finished, or OpenSSL failed: only destroy is allowed */
};

static int host_is_le(void) {
  const uint16_t one = 1;
  unsigned char b;
  memcpy(&b, &one, 1);
  return b == 1;
}

static dopt_status feed(dopt_digest *d, const void *p, size_t n, const char *who) {
  if (n == 0) return DOPT_OK;
  if (EVP_DigestUpdate(d->ctx, p, n) != 1) {
    d->done = 1;
    return dopt__fail(DOPT_ERR_BACKEND, "%s: OpenSSL EVP_DigestUpdate failed", who);
  }
  return DOPT_OK;
}

/* v as `width` little-endian bytes (4 or 8). */
static dopt_status feed_le(dopt_digest *d, uint64_t v, int width, const char *who) {
  unsigned char b[8];
  for (int k = 0; k < width; k++) b[k] = (unsigned char)(v >> (8 * k));
  return feed(d, b, (size_t)width, who);
}

static dopt_status check_open(const dopt_digest *d, const char *who) {
  DOPT_CHECK_ARG(d != NULL, "%s: d=NULL", who);
  if (d->done) return dopt__fail(DOPT_ERR_STATE, "%s: the digest was finished (or failed); create a new one", who);
  return DOPT_OK;
}

dopt_status dopt_digest_create(dopt_digest **out) {
  DOPT_CHECK_ARG(out != NULL, "dopt_digest_create: out=NULL");
  *out = NULL;
  dopt_digest *d = calloc(1, sizeof *d);
  if (!d) return dopt__fail(DOPT_ERR_NO_MEMORY, "dopt_digest_create: %zu bytes", sizeof *d);
  d->ctx = EVP_MD_CTX_new();
  if (!d->ctx || EVP_DigestInit_ex(d->ctx, EVP_sha256(), NULL) != 1) {
    EVP_MD_CTX_free(d->ctx);
    free(d);
    return dopt__fail(DOPT_ERR_BACKEND, "dopt_digest_create: OpenSSL could not start a SHA-256 context");
  }
  *out = d;
  return DOPT_OK;
}

void dopt_digest_destroy(dopt_digest *d) {
  if (!d) return;
  EVP_MD_CTX_free(d->ctx);
  free(d);
}

dopt_status dopt_digest_bytes(dopt_digest *d, const void *data, size_t n) {
  DOPT_TRY(check_open(d, "dopt_digest_bytes"));
  DOPT_CHECK_ARG(data != NULL || n == 0, "dopt_digest_bytes: data=NULL with n=%zu", n);
  return feed(d, data, n, "dopt_digest_bytes");
}

dopt_status dopt_digest_tensor(dopt_digest *d, const char *name, dopt_dtype dt, int ndim, const int64_t *shape,
                               const void *data, size_t bytes) {
  static const char who[] = "dopt_digest_tensor";
  DOPT_TRY(check_open(d, who));
  DOPT_CHECK_ARG(name != NULL, "%s: name=NULL", who);
  size_t nl = strlen(name);
  DOPT_CHECK_ARG(nl <= UINT32_MAX, "%s: name of %zu bytes (at most 2^32-1)", who, nl);
  DOPT_CHECK_ARG((int)dt >= 0 && dt < DOPT_DTYPE_COUNT_, "%s '%s': dtype=%d is not a dopt_dtype", who, name, (int)dt);
  DOPT_CHECK_ARG(ndim >= 0 && ndim <= DOPT_MAX_DIMS, "%s '%s': ndim=%d must be in [0, %d]", who, name, ndim,
                 DOPT_MAX_DIMS);
  DOPT_CHECK_ARG(shape != NULL || ndim == 0, "%s '%s': shape=NULL with ndim=%d", who, name, ndim);
  /* the size the shape and dtype define, without overflow */
  const size_t esz = dopt_dtype_size(dt);
  size_t numel = 1;
  for (int k = 0; k < ndim; k++) {
    DOPT_CHECK_ARG(shape[k] >= 0, "%s '%s': shape[%d]=%lld must be >= 0", who, name, k, (long long)shape[k]);
    if (shape[k] != 0 && numel > SIZE_MAX / esz / (uint64_t)shape[k])
      return dopt__fail(DOPT_ERR_SHAPE, "%s '%s': shape[%d]=%lld overflows the byte count", who, name, k,
                        (long long)shape[k]);
    numel *= (size_t)shape[k];
  }
  if (bytes != numel * esz)
    return dopt__fail(DOPT_ERR_SHAPE, "%s '%s': bytes=%zu but %zu %s elements hold %zu", who, name, bytes, numel,
                      dopt_dtype_name(dt), numel * esz);
  DOPT_CHECK_ARG(data != NULL || bytes == 0, "%s '%s': data=NULL with bytes=%zu", who, name, bytes);

  if (d->records == 0) DOPT_TRY(feed(d, DOPT_DIGEST_ENCODING, strlen(DOPT_DIGEST_ENCODING), who));
  d->records++;
  const char *dn = dopt_dtype_name(dt);
  DOPT_TRY(feed_le(d, nl, 4, who));
  DOPT_TRY(feed(d, name, nl, who));
  DOPT_TRY(feed_le(d, strlen(dn), 4, who));
  DOPT_TRY(feed(d, dn, strlen(dn), who));
  DOPT_TRY(feed_le(d, (uint64_t)ndim, 4, who));
  for (int k = 0; k < ndim; k++) DOPT_TRY(feed_le(d, (uint64_t)shape[k], 8, who));
  DOPT_TRY(feed_le(d, bytes, 8, who));
  if (esz == 1 || host_is_le()) return feed(d, data, bytes, who);
  /* a big-endian host: each element's bytes reversed, a block at a time */
  unsigned char blk[4096];
  const unsigned char *p = data;
  for (size_t off = 0; off < bytes;) {
    size_t n = bytes - off < sizeof blk ? bytes - off : sizeof blk; /* a multiple of esz: 4096 and bytes are */
    for (size_t e = 0; e < n; e += esz)
      for (size_t k = 0; k < esz; k++) blk[e + k] = p[off + e + esz - 1 - k];
    DOPT_TRY(feed(d, blk, n, who));
    off += n;
  }
  return DOPT_OK;
}

static void to_hex(const uint8_t *md, char *hex) {
  static const char digits[] = "0123456789abcdef";
  for (int k = 0; k < DOPT_DIGEST_BYTES; k++) {
    hex[2 * k] = digits[md[k] >> 4];
    hex[2 * k + 1] = digits[md[k] & 15];
  }
  hex[2 * DOPT_DIGEST_BYTES] = '\0';
}

dopt_status dopt_digest_final(dopt_digest *d, uint8_t out[DOPT_DIGEST_BYTES], char hex[DOPT_DIGEST_HEX]) {
  DOPT_TRY(check_open(d, "dopt_digest_final"));
  uint8_t md[EVP_MAX_MD_SIZE];
  unsigned len = 0;
  d->done = 1;
  if (EVP_DigestFinal_ex(d->ctx, md, &len) != 1 || len != DOPT_DIGEST_BYTES)
    return dopt__fail(DOPT_ERR_BACKEND, "dopt_digest_final: OpenSSL EVP_DigestFinal_ex failed");
  if (out) memcpy(out, md, DOPT_DIGEST_BYTES);
  if (hex) to_hex(md, hex);
  return DOPT_OK;
}

dopt_status dopt_digest_buffer(const void *data, size_t n, uint8_t out[DOPT_DIGEST_BYTES], char hex[DOPT_DIGEST_HEX]) {
  DOPT_CHECK_ARG(data != NULL || n == 0, "dopt_digest_buffer: data=NULL with n=%zu", n);
  dopt_digest *d;
  DOPT_TRY(dopt_digest_create(&d));
  dopt_status s = dopt_digest_bytes(d, data, n);
  if (s == DOPT_OK) s = dopt_digest_final(d, out, hex);
  dopt_digest_destroy(d);
  return s;
}

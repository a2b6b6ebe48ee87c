/* The digest (include/distopt/digest.h, docs/digest.md): SHA-256 itself on
 * the NIST known answers (FIPS 180-2 examples: "abc", the empty message, the
 * 448- and 896-bit messages, one million 'a' streamed in uneven pieces); the
 * DOPT-DIGEST-1 tensor encoding against a byte stream this file builds by
 * hand from the documented layout, fed in pieces of every size, and against a
 * known answer computed independently (Python hashlib/struct); one flipped
 * bit, a reshape, a dtype, a name boundary or an order changes it; the
 * errors name the argument. */
#include "testutil.h"

#include <stdio.h>
#include <stdlib.h>

#include "distopt/digest.h"

static void hex_of(const uint8_t *md, char *hex) {
  for (int k = 0; k < DOPT_DIGEST_BYTES; k++) snprintf(hex + 2 * k, 3, "%02x", md[k]);
}

/* data fed in pieces of the given sizes (cycled) through one handle */
static void sha_pieces(const void *data, size_t n, const size_t *sizes, int nsizes, char hex[DOPT_DIGEST_HEX]) {
  dopt_digest *d;
  assert_ok(dopt_digest_create(&d));
  const unsigned char *p = data;
  for (size_t off = 0, k = 0; off < n; k++) {
    size_t m = sizes[k % (size_t)nsizes];
    if (m > n - off) m = n - off;
    assert_ok(dopt_digest_bytes(d, p + off, m));
    off += m;
  }
  uint8_t md[DOPT_DIGEST_BYTES];
  assert_ok(dopt_digest_final(d, md, hex));
  char again[DOPT_DIGEST_HEX];
  hex_of(md, again); /* the raw bytes and the hex agree */
  assert_string_equal(again, hex);
  dopt_digest_destroy(d);
}

static void test_nist_vectors(void **st) {
  (void)st;
  static const struct {
    const char *msg, *want;
  } V[] = {
      {"abc", "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"},
      {"", "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"},
      {"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq",
       "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1"},
      {"abcdefghbcdefghicdefghijdefghijkefghijklfghijklmghijklmnhijklmnoijklmnopjklmnopqklmnopqrlmnopqrsmnopqrstnopqrstu",
       "cf5b16a778af8380036ce59e7b0492370b249b11e8f07a51afac45037afee9d1"},
  };
  const size_t whole[] = {1 << 20}, ones[] = {1};
  char hex[DOPT_DIGEST_HEX];
  for (size_t i = 0; i < sizeof V / sizeof V[0]; i++) {
    sha_pieces(V[i].msg, strlen(V[i].msg), whole, 1, hex);
    assert_string_equal(hex, V[i].want);
    sha_pieces(V[i].msg, strlen(V[i].msg), ones, 1, hex);
    assert_string_equal(hex, V[i].want);
    assert_ok(dopt_digest_buffer(V[i].msg, strlen(V[i].msg), NULL, hex));
    assert_string_equal(hex, V[i].want);
  }
  /* one million 'a', in pieces that straddle the 64-byte block in every way */
  const size_t n = 1000000;
  char *a = malloc(n);
  assert_non_null(a);
  memset(a, 'a', n);
  const size_t uneven[] = {1, 63, 64, 65, 127, 3, 1000, 4096, 7};
  sha_pieces(a, n, uneven, (int)(sizeof uneven / sizeof uneven[0]), hex);
  assert_string_equal(hex, "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
  uint8_t md[DOPT_DIGEST_BYTES];
  assert_ok(dopt_digest_buffer(a, n, md, NULL));
  hex_of(md, hex);
  assert_string_equal(hex, "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
  free(a);
}

/* ---- the tensor encoding, built by hand from docs/digest.md ---------------------------- */

typedef struct stream {
  unsigned char b[4096];
  size_t n;
} stream;

static void put(stream *s, const void *p, size_t n) {
  assert_true(s->n + n <= sizeof s->b);
  memcpy(s->b + s->n, p, n);
  s->n += n;
}
static void put_le(stream *s, uint64_t v, int width) {
  for (int k = 0; k < width; k++) s->b[s->n++] = (unsigned char)(v >> (8 * k));
}
static void put_record(stream *s, const char *name, const char *dtype, int ndim, const int64_t *shape,
                       const unsigned char *le_bytes, size_t bytes) {
  put_le(s, strlen(name), 4);
  put(s, name, strlen(name));
  put_le(s, strlen(dtype), 4);
  put(s, dtype, strlen(dtype));
  put_le(s, (uint64_t)ndim, 4);
  for (int k = 0; k < ndim; k++) put_le(s, (uint64_t)shape[k], 8);
  put_le(s, bytes, 8);
  put(s, le_bytes, bytes);
}

/* The fixture: an F32 [2,3] weight, its BF16 copy [3] and its I64 step scalar. */
static const float W[6] = {1.0f, -2.5f, 0.0f, -0.0f, 0.125f, 3.0e30f};
static const uint16_t B[3] = {0x3f80, 0xc000, 0x0001};
static const int64_t STEP = 5;
static const int64_t WSHAPE[2] = {2, 3}, BSHAPE[1] = {3};
/* hashlib.sha256(b"DOPT-DIGEST-1" + records) with struct.pack('<...') in Python */
#define FIXTURE_SHA256 "a3a5f1a0208ae2fb17f8451ee28e03db5770fee8b38a136a17e5af9958a7311c"

static void fixture_tensors(dopt_digest *d) {
  assert_ok(dopt_digest_tensor(d, "fc1.weight", DOPT_F32, 2, WSHAPE, W, sizeof W));
  assert_ok(dopt_digest_tensor(d, "fc1.weight/bf16", DOPT_BF16, 1, BSHAPE, B, sizeof B));
  assert_ok(dopt_digest_tensor(d, "fc1.weight/step", DOPT_I64, 0, NULL, &STEP, sizeof STEP));
}

static void fixture_stream(stream *s) {
  unsigned char le[64];
  s->n = 0;
  put(s, "DOPT-DIGEST-1", 13);
  for (int k = 0; k < 6; k++) { /* each float's bits, little-endian, whatever the host */
    uint32_t u;
    memcpy(&u, &W[k], 4);
    for (int j = 0; j < 4; j++) le[4 * k + j] = (unsigned char)(u >> (8 * j));
  }
  put_record(s, "fc1.weight", "F32", 2, WSHAPE, le, 24);
  for (int k = 0; k < 3; k++) le[2 * k] = (unsigned char)B[k], le[2 * k + 1] = (unsigned char)(B[k] >> 8);
  put_record(s, "fc1.weight/bf16", "BF16", 1, BSHAPE, le, 6);
  for (int j = 0; j < 8; j++) le[j] = (unsigned char)((uint64_t)STEP >> (8 * j));
  put_record(s, "fc1.weight/step", "I64", 0, NULL, le, 8);
}

static void tensors_hex(void (*feed)(dopt_digest *), char hex[DOPT_DIGEST_HEX]) {
  dopt_digest *d;
  assert_ok(dopt_digest_create(&d));
  feed(d);
  assert_ok(dopt_digest_final(d, NULL, hex));
  dopt_digest_destroy(d);
}

static void test_tensor_encoding(void **st) {
  (void)st;
  char api[DOPT_DIGEST_HEX], hand[DOPT_DIGEST_HEX];
  tensors_hex(fixture_tensors, api);
  assert_string_equal(api, FIXTURE_SHA256);
  stream s;
  fixture_stream(&s);
  assert_int_equal(s.n, 185);
  /* the documented stream, fed whole, byte by byte and in every piece size up to 70 */
  assert_ok(dopt_digest_buffer(s.b, s.n, NULL, hand));
  assert_string_equal(hand, api);
  for (size_t piece = 1; piece <= 70; piece++) {
    sha_pieces(s.b, s.n, &piece, 1, hand);
    assert_string_equal(hand, api);
  }
  /* raw metadata through dopt_digest_bytes before the first record: the magic still precedes the record */
  dopt_digest *d;
  assert_ok(dopt_digest_create(&d));
  assert_ok(dopt_digest_bytes(d, "meta", 4));
  fixture_tensors(d);
  assert_ok(dopt_digest_final(d, NULL, api));
  dopt_digest_destroy(d);
  stream m = {.n = 0};
  put(&m, "meta", 4);
  put(&m, s.b, s.n);
  assert_ok(dopt_digest_buffer(m.b, m.n, NULL, hand));
  assert_string_equal(api, hand);
}

/* ---- what must change the digest ------------------------------------------------------- */

typedef struct variant {
  const char *name1, *name2;
  dopt_dtype dt;
  int ndim;
  int64_t shape[2];
  int flip; /* bit of W to flip, -1: none */
  int swap; /* the two records in the other order */
} variant;

static void variant_hex(const variant *v, char hex[DOPT_DIGEST_HEX]) {
  float w[6];
  memcpy(w, W, sizeof w);
  if (v->flip >= 0) ((unsigned char *)w)[v->flip / 8] ^= (unsigned char)(1u << (v->flip % 8));
  dopt_digest *d;
  assert_ok(dopt_digest_create(&d));
  for (int r = 0; r < 2; r++) {
    if ((r == 0) != (v->swap != 0)) assert_ok(dopt_digest_tensor(d, v->name1, v->dt, v->ndim, v->shape, w, sizeof w));
    else assert_ok(dopt_digest_tensor(d, v->name2, DOPT_I64, 0, NULL, &STEP, sizeof STEP));
  }
  assert_ok(dopt_digest_final(d, NULL, hex));
  dopt_digest_destroy(d);
}

static void test_changes(void **st) {
  (void)st;
  const variant base = {"w", "w/step", DOPT_F32, 2, {2, 3}, -1, 0};
  char b[DOPT_DIGEST_HEX], h[DOPT_DIGEST_HEX];
  variant_hex(&base, b);
  variant_hex(&base, h);
  assert_string_equal(b, h); /* deterministic */
  for (int bit = 0; bit < 6 * 32; bit += 7) { /* one flipped bit, anywhere in the data */
    variant v = base;
    v.flip = bit;
    variant_hex(&v, h);
    if (strcmp(b, h) == 0) fail_msg("flipping bit %d of the data left the digest unchanged", bit);
  }
  variant v = base;
  v.shape[0] = 3, v.shape[1] = 2; /* the same bytes, another shape */
  variant_hex(&v, h);
  assert_string_not_equal(b, h);
  v = base;
  v.ndim = 1, v.shape[0] = 6;
  variant_hex(&v, h);
  assert_string_not_equal(b, h);
  v = base;
  v.dt = DOPT_I32; /* the same bytes, another dtype */
  variant_hex(&v, h);
  assert_string_not_equal(b, h);
  v = base;
  v.name1 = "W";
  variant_hex(&v, h);
  assert_string_not_equal(b, h);
  v = base;
  v.swap = 1;
  variant_hex(&v, h);
  assert_string_not_equal(b, h);
  /* a boundary between fields moved: ("ab", "c") vs ("a", "bc"), two empty tensors */
  const int64_t zero[1] = {0};
  char h1[DOPT_DIGEST_HEX], h2[DOPT_DIGEST_HEX];
  dopt_digest *d;
  assert_ok(dopt_digest_create(&d));
  assert_ok(dopt_digest_tensor(d, "ab", DOPT_U8, 1, zero, NULL, 0));
  assert_ok(dopt_digest_tensor(d, "c", DOPT_U8, 1, zero, NULL, 0));
  assert_ok(dopt_digest_final(d, NULL, h1));
  dopt_digest_destroy(d);
  assert_ok(dopt_digest_create(&d));
  assert_ok(dopt_digest_tensor(d, "a", DOPT_U8, 1, zero, NULL, 0));
  assert_ok(dopt_digest_tensor(d, "bc", DOPT_U8, 1, zero, NULL, 0));
  assert_ok(dopt_digest_final(d, NULL, h2));
  dopt_digest_destroy(d);
  assert_string_not_equal(h1, h2);
  /* a scalar is not a one-element vector */
  const int64_t one[1] = {1};
  assert_ok(dopt_digest_create(&d));
  assert_ok(dopt_digest_tensor(d, "s", DOPT_I64, 0, NULL, &STEP, 8));
  assert_ok(dopt_digest_final(d, NULL, h1));
  dopt_digest_destroy(d);
  assert_ok(dopt_digest_create(&d));
  assert_ok(dopt_digest_tensor(d, "s", DOPT_I64, 1, one, &STEP, 8));
  assert_ok(dopt_digest_final(d, NULL, h2));
  dopt_digest_destroy(d);
  assert_string_not_equal(h1, h2);
}

/* ---- errors ------------------------------------------------------------------------------ */

static void test_errors(void **st) {
  (void)st;
  dopt_digest *d;
  char hex[DOPT_DIGEST_HEX];
  assert_status(dopt_digest_create(NULL), DOPT_ERR_INVALID_ARG, "out=NULL");
  assert_status(dopt_digest_bytes(NULL, "x", 1), DOPT_ERR_INVALID_ARG, "d=NULL");
  assert_status(dopt_digest_final(NULL, NULL, hex), DOPT_ERR_INVALID_ARG, "d=NULL");
  assert_status(dopt_digest_buffer(NULL, 3, NULL, hex), DOPT_ERR_INVALID_ARG, "data=NULL");
  assert_ok(dopt_digest_create(&d));
  assert_status(dopt_digest_bytes(d, NULL, 2), DOPT_ERR_INVALID_ARG, "data=NULL");
  assert_ok(dopt_digest_bytes(d, NULL, 0));
  const int64_t sh[2] = {2, 3}, neg[1] = {-1}, huge[2] = {INT64_MAX / 2, 4};
  assert_status(dopt_digest_tensor(d, NULL, DOPT_F32, 2, sh, W, 24), DOPT_ERR_INVALID_ARG, "name=NULL");
  assert_status(dopt_digest_tensor(d, "w", (dopt_dtype)99, 2, sh, W, 24), DOPT_ERR_INVALID_ARG, "dtype=99");
  assert_status(dopt_digest_tensor(d, "w", DOPT_F32, 9, sh, W, 24), DOPT_ERR_INVALID_ARG, "ndim=9");
  assert_status(dopt_digest_tensor(d, "w", DOPT_F32, -1, sh, W, 24), DOPT_ERR_INVALID_ARG, "ndim=-1");
  assert_status(dopt_digest_tensor(d, "w", DOPT_F32, 2, NULL, W, 24), DOPT_ERR_INVALID_ARG, "shape=NULL");
  assert_status(dopt_digest_tensor(d, "w", DOPT_F32, 1, neg, W, 24), DOPT_ERR_INVALID_ARG, "shape[0]=-1");
  assert_status(dopt_digest_tensor(d, "w", DOPT_F32, 2, sh, W, 20), DOPT_ERR_SHAPE, "'w': bytes=20");
  assert_status(dopt_digest_tensor(d, "w", DOPT_F32, 2, huge, W, 24), DOPT_ERR_SHAPE, "overflows");
  assert_status(dopt_digest_tensor(d, "w", DOPT_F32, 2, sh, NULL, 24), DOPT_ERR_INVALID_ARG, "data=NULL");
  /* the failed calls appended nothing: the fixture still hashes to its known answer */
  fixture_tensors(d);
  assert_ok(dopt_digest_final(d, NULL, hex));
  assert_string_equal(hex, FIXTURE_SHA256);
  /* finished: only destroy */
  assert_status(dopt_digest_bytes(d, "x", 1), DOPT_ERR_STATE, "dopt_digest_bytes");
  assert_status(dopt_digest_tensor(d, "w", DOPT_F32, 2, sh, W, 24), DOPT_ERR_STATE, "dopt_digest_tensor");
  assert_status(dopt_digest_final(d, NULL, hex), DOPT_ERR_STATE, "finished");
  dopt_digest_destroy(d);
  dopt_digest_destroy(NULL);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_nist_vectors),
      cmocka_unit_test(test_tensor_encoding),
      cmocka_unit_test(test_changes),
      cmocka_unit_test(test_errors),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

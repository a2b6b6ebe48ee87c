/* safetensors: round trip, and every malformed input rejected with a message
 * naming the file and the problem; a failed save leaves no file. */
#include "testutil.h"

#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "distopt/safetensors.h"

static char dir[256];

static int setup(void **st) {
  (void)st;
  return dt_make_tmpdir(dir, sizeof dir, "dopt_st");
}

static int teardown(void **st) {
  (void)st;
  return dt_remove_tmpdir(dir);
}

/* Writes an 8-byte length, the header text and `data_len` bytes of data. */
static const char *write_raw(const char *name, const char *header, size_t data_len, long len_override) {
  static char path[512];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  FILE *f = fopen(path, "wb");
  uint64_t n = len_override >= 0 ? (uint64_t)len_override : strlen(header);
  unsigned char b[8];
  for (int i = 0; i < 8; i++) b[i] = (unsigned char)(n >> (8 * i));
  fwrite(b, 1, 8, f);
  fwrite(header, 1, strlen(header), f);
  for (size_t i = 0; i < data_len; i++) fputc(0, f);
  fclose(f);
  return path;
}

static void test_round_trip(void **st) {
  (void)st;
  dopt_st_writer *w;
  assert_ok(dopt_st_writer_create(&w));
  float a[6] = {1, 2, 3, 4, 5, 6};
  int64_t step = 42;
  const int64_t sa[2] = {2, 3};
  assert_ok(dopt_st_writer_add(w, "param/w", DOPT_F32, 2, sa, a));
  assert_ok(dopt_st_writer_add(w, "state/w/step", DOPT_I64, 0, NULL, &step));
  assert_status(dopt_st_writer_add(w, "param/w", DOPT_F32, 2, sa, a), DOPT_ERR_INVALID_ARG, "twice");
  assert_status(dopt_st_writer_add(w, "__metadata__", DOPT_F32, 2, sa, a), DOPT_ERR_INVALID_ARG, "reserved");
  assert_ok(dopt_st_writer_meta(w, "optimizer", "came"));
  char path[512];
  snprintf(path, sizeof path, "%s/rt.safetensors", dir);
  assert_ok(dopt_st_writer_save(w, path));
  dopt_st_writer_free(w);
  dopt_st_file *f;
  assert_ok(dopt_st_load(path, &f));
  assert_int_equal(dopt_st_count(f), 2);
  assert_string_equal(dopt_st_meta(f, "optimizer"), "came");
  assert_null(dopt_st_meta(f, "nope"));
  float back[6];
  assert_ok(dopt_st_read_f32(f, "param/w", back, 6));
  assert_memory_equal(back, a, sizeof a);
  assert_status(dopt_st_read_f32(f, "param/w", back, 5), DOPT_ERR_SHAPE, "param/w");
  assert_status(dopt_st_read_f32(f, "state/w/step", back, 1), DOPT_ERR_UNSUPPORTED, "I64");
  dopt_st_tensor t;
  assert_ok(dopt_st_find(f, "state/w/step", &t));
  assert_int_equal(t.ndim, 0);
  assert_int_equal(t.numel, 1);
  int64_t s2;
  memcpy(&s2, t.data, 8);
  assert_int_equal(s2, 42);
  assert_status(dopt_st_find(f, "param/x", &t), DOPT_ERR_NOT_FOUND, "param/x");
  dopt_st_free(f);
}

static void test_malformed(void **st) {
  (void)st;
  dopt_st_file *f = (dopt_st_file *)1;
  struct {
    const char *header;
    size_t data;
    long len;
    dopt_status want;
    const char *needle;
  } bad[] = {
      {"{}", 0, 4096, DOPT_ERR_FORMAT, "exceeds the file"},
      {"[1,2]", 0, -1, DOPT_ERR_FORMAT, "not a JSON object"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]", 8, -1, DOPT_ERR_FORMAT, "not a JSON object"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,16]}}", 8, -1, DOPT_ERR_FORMAT, "outside"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]}}", 8, -1, DOPT_ERR_FORMAT, "'a': 8 bytes"},
      /* a range longer than shape x dtype needs (16 bytes for 2 F32) is refused too */
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,16]}}", 16, -1, DOPT_ERR_FORMAT, "'a': 16 bytes"},
      {"{\"a\":{\"dtype\":\"Q7\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8, -1, DOPT_ERR_UNSUPPORTED, "'Q7'"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[-2],\"data_offsets\":[0,8]}}", 8, -1, DOPT_ERR_FORMAT, "shape[0]"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2]}}", 8, -1, DOPT_ERR_FORMAT, "data_offsets"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
       "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}",
       12, -1, DOPT_ERR_FORMAT, "overlap"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
       "\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,16]}}",
       16, -1, DOPT_ERR_FORMAT, "twice"},
      {"{\"__metadata__\":{\"k\":1}}", 0, -1, DOPT_ERR_FORMAT, "__metadata__['k']"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,0]}}", 8, -1, DOPT_ERR_FORMAT, "reversed"},
      /* a tensor name with an escaped NUL: parsed, it would be the name "a" */
      {"{\"a\\u0000b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8, -1, DOPT_ERR_FORMAT,
       "a NUL character at byte 11"},
      /* numel = 2^62, bytes = 2^64 ≡ 0: accepted (and crashing later) before the byte count was overflow-checked */
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2147483648,2147483648],\"data_offsets\":[0,0]}}", 0, -1,
       DOPT_ERR_FORMAT, "overflow the byte count"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    char name[32];
    snprintf(name, sizeof name, "bad%zu.safetensors", i);
    const char *p = write_raw(name, bad[i].header, bad[i].data, bad[i].len);
    dopt_status s = dopt_st_load(p, &f);
    if (s != bad[i].want || !strstr(dopt_last_error(), bad[i].needle) || !strstr(dopt_last_error(), name))
      fail_msg("case %zu: %s '%s'", i, dopt_status_name(s), dopt_last_error());
    assert_null(f);
  }
  /* an escaped backslash before u0000 is no NUL: the name 'a\u0000' (six characters) loads in full */
  const char *bs = write_raw("bs.safetensors", "{\"a\\\\u0000\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}",
                             8, -1);
  assert_int_equal(dopt_st_load(bs, &f), DOPT_OK);
  dopt_st_tensor x;
  assert_int_equal(dopt_st_find(f, "a\\u0000", &x), DOPT_OK);
  dopt_st_free(f);
  /* truncated: fewer than 8 bytes */
  char path[512];
  snprintf(path, sizeof path, "%s/short.safetensors", dir);
  FILE *fp = fopen(path, "wb");
  fputs("abc", fp);
  fclose(fp);
  assert_status(dopt_st_load(path, &f), DOPT_ERR_FORMAT, "truncated");
  snprintf(path, sizeof path, "%s/missing.safetensors", dir);
  assert_status(dopt_st_load(path, &f), DOPT_ERR_IO, "missing.safetensors");
  assert_status(dopt_st_load(dir, &f), DOPT_ERR_IO, "not a regular file"); /* was "truncated: 9223372036854775807" */
}

static void test_failed_save_leaves_nothing(void **st) {
  (void)st;
  dopt_st_writer *w;
  assert_ok(dopt_st_writer_create(&w));
  float a[2] = {1, 2};
  const int64_t s[1] = {2};
  assert_ok(dopt_st_writer_add(w, "a", DOPT_F32, 1, s, a));
  char path[512];
  snprintf(path, sizeof path, "%s/no/such/dir/out.safetensors", dir);
  assert_status(dopt_st_writer_save(w, path), DOPT_ERR_IO, "out.safetensors");
  assert_int_not_equal(access(path, F_OK), 0);
  dopt_st_writer_free(w);
}

/* Streamed files (dopt_st_open) read the same bytes as loaded ones, whole and by block; a file cut after
 * it was opened is an I/O error at the read, not garbage. */
static void test_stream_and_blocks(void **st) {
  (void)st;
  enum { B = 2, H = 5, W = 7 };
  float a[B * H * W];
  for (int k = 0; k < B * H * W; k++) a[k] = (float)k * 0.5f - 3.0f;
  const int64_t sa[3] = {B, H, W};
  dopt_st_writer *w;
  assert_ok(dopt_st_writer_create(&w));
  assert_ok(dopt_st_writer_add(w, "x", DOPT_F32, 3, sa, a));
  assert_ok(dopt_st_writer_add(w, "y", DOPT_F32, 1, sa + 2, a));
  char path[512];
  snprintf(path, sizeof path, "%s/blocks.safetensors", dir);
  assert_ok(dopt_st_writer_save(w, path));
  dopt_st_writer_free(w);
  dopt_st_file *f[2];
  assert_ok(dopt_st_load(path, &f[0]));
  assert_ok(dopt_st_open(path, &f[1]));
  dopt_st_tensor t;
  assert_ok(dopt_st_find(f[1], "x", &t));
  assert_null(t.data); /* streamed: no buffer */
  static const size_t blocks[][4] = {{0, H, 0, W}, {1, 3, 0, W}, {0, H, 2, 4}, {4, 1, 6, 1}, {2, 2, 1, 5}, {0, 0, 0, W}};
  for (int m = 0; m < 2; m++) {
    float whole[B * H * W];
    assert_ok(dopt_st_read_f32(f[m], "x", whole, B * H * W));
    assert_memory_equal(whole, a, sizeof a);
    for (size_t q = 0; q < sizeof blocks / sizeof blocks[0]; q++) {
      const size_t h0 = blocks[q][0], hl = blocks[q][1], w0 = blocks[q][2], wl = blocks[q][3];
      float got[B * H * W + 1], want[B * H * W + 1];
      size_t n = 0;
      for (size_t bi = 0; bi < B; bi++)
        for (size_t r = 0; r < hl; r++)
          for (size_t c = 0; c < wl; c++) want[n++] = a[(bi * H + h0 + r) * W + w0 + c];
      got[n] = want[n] = 42.0f; /* nothing beyond the block is written */
      assert_ok(dopt_st_read_f32_block(f[m], "x", B, H, W, h0, hl, w0, wl, got));
      assert_memory_equal(got, want, (n + 1) * sizeof(float));
    }
    float one[3];
    assert_ok(dopt_st_read_f32_block(f[m], "y", 1, 1, W, 0, 1, 4, 3, one)); /* a 1-D tensor as [1, 1, n] */
    assert_memory_equal(one, a + 4, sizeof one);
    assert_status(dopt_st_read_f32_block(f[m], "x", B, H, W, 3, 3, 0, W, one), DOPT_ERR_INVALID_ARG, "outside");
    assert_status(dopt_st_read_f32_block(f[m], "x", B, H, W + 1, 0, 1, 0, 1, one), DOPT_ERR_SHAPE, "the view");
    assert_status(dopt_st_read_f32_block(f[m], "z", 1, 1, 1, 0, 1, 0, 1, one), DOPT_ERR_NOT_FOUND, "'z'");
  }
  /* cut after opening: the streamed read says so */
  assert_int_equal(truncate(path, 80), 0);
  float whole[B * H * W];
  assert_status(dopt_st_read_f32(f[1], "x", whole, B * H * W), DOPT_ERR_IO, "the file ends");
  assert_ok(dopt_st_read_f32(f[0], "x", whole, B * H * W)); /* the loaded copy is in memory */
  dopt_st_free(f[0]);
  dopt_st_free(f[1]);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_stream_and_blocks),
      cmocka_unit_test(test_round_trip),
      cmocka_unit_test(test_malformed),
      cmocka_unit_test(test_failed_save_leaves_nothing),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}

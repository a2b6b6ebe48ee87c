/* Fuzz target: the one escaping rule (core/escape.c, dopt__escape). For any bytes, at any buffer size: the
 * result is valid UTF-8 (libunistring's u8_check), one line, holds no control, format or separator character
 * (Unicode categories Cc, Cf, Zl, Zp), and undoing the escapes (\xNN a byte, \uXXXX and \UXXXXXXXX a code
 * point) gives back the input — whole when the buffer is large enough, a prefix otherwise (never a split
 * escape or character). Inputs holding a backslash are checked for all but the round trip (a backslash is
 * echoed as it is, so "\x41" in the input reads back as "A"). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <unictype.h>
#include <unistr.h>

#include "internal.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static int hex(int c) { return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1; }

/* Undoes the escapes of out[0..n) into back (its length); -1 on a malformed escape. */
static long unescape(const char *out, size_t n, uint8_t *back) {
  size_t k = 0;
  for (size_t i = 0; i < n;) {
    if (out[i] != '\\') {
      back[k++] = (uint8_t)out[i++];
      continue;
    }
    const int digits = i + 1 < n && out[i + 1] == 'x' ? 2 : i + 1 < n && out[i + 1] == 'u' ? 4
                                                        : i + 1 < n && out[i + 1] == 'U' ? 8 : 0;
    if (!digits || i + 2 + (size_t)digits > n) return -1;
    uint32_t v = 0;
    for (int d = 0; d < digits; d++) {
      const int h = hex((unsigned char)out[i + 2 + (size_t)d]);
      if (h < 0) return -1;
      v = v * 16 + (uint32_t)h;
    }
    if (digits == 2) back[k++] = (uint8_t)v;
    else {
      const int m = u8_uctomb(back + k, v, 8); /* back has room: each escape is longer than its bytes */
      if (m <= 0) return -1;
      k += (size_t)m;
    }
    i += 2 + (size_t)digits;
  }
  return (long)k;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1 || size > 4096) return 0;
  const size_t cap = data[0] == 0 ? 10 * size + 1 : (size_t)data[0]; /* the first byte: a buffer size, or "room" */
  const char *in = (const char *)data + 1;
  const size_t n = size - 1;
  char *out = malloc(cap);
  uint8_t *back = malloc(10 * size + 16);
  if (!out || !back) abort();
  const size_t w = dopt__escape(in, n, out, cap);
  if (w >= cap || out[w] != '\0' || strlen(out) != w) abort();
  if (u8_check((const uint8_t *)out, w) != NULL) abort(); /* not UTF-8 */
  for (size_t i = 0; i < w;) {
    ucs4_t uc;
    const int k = u8_mbtoucr(&uc, (const uint8_t *)out + i, w - i);
    if (k <= 0) abort();
    if (uc_is_general_category(uc, UC_CATEGORY_Cc) || uc_is_general_category(uc, UC_CATEGORY_Cf) ||
        uc_is_general_category(uc, UC_CATEGORY_Zl) || uc_is_general_category(uc, UC_CATEGORY_Zp))
      abort(); /* a character a terminal would act on */
    i += (size_t)k;
  }
  if (!memchr(in, '\\', n)) {
    const long b = unescape(out, w, back);
    if (b < 0 || (size_t)b > n || memcmp(back, in, (size_t)b) != 0) abort(); /* not the input, or a split escape */
    if (data[0] == 0 && (size_t)b != n) abort();                              /* room for all: all of it */
  }
  free(out);
  free(back);
  return 0;
}

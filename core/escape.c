/* The one escaping rule for everything distopt echoes (internal.h, dopt__escape): error lines, the messages
 * of the recording reader, the tables' names. What a terminal or a CI log would act on instead of showing —
 * control characters, the format characters that reorder or hide text (bidi embeddings, overrides and
 * isolates: the "Trojan Source" characters; zero-width characters; the BOM), line and paragraph separators,
 * bytes that are not UTF-8 — is written as an escape; everything else, non-ASCII text included, passes as it
 * is. UTF-8 decoding and the Unicode general categories are libunistring's. */
#include "internal.h"

#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <unictype.h>
#include <unistr.h>

static int hidden(ucs4_t uc) {
  return uc_is_general_category(uc, UC_CATEGORY_Cc) || uc_is_general_category(uc, UC_CATEGORY_Cf) ||
         uc_is_general_category(uc, UC_CATEGORY_Zl) || uc_is_general_category(uc, UC_CATEGORY_Zp);
}

size_t dopt__escape(const char *s, size_t n, char *out, size_t cap) {
  if (!cap) return 0;
  const uint8_t *p = (const uint8_t *)s;
  size_t i = 0, o = 0;
  while (i < n) {
    char esc[16];
    const char *put = NULL;
    size_t len;
    ucs4_t uc;
    const int k = u8_mbtoucr(&uc, p + i, n - i);
    if (k < 0) { /* invalid or cut short: this byte, escaped; decoding resumes at the next */
      snprintf(esc, sizeof esc, "\\x%02x", p[i]);
      put = esc, len = 4, i += 1;
    } else if (hidden(uc)) {
      if (uc < 0x80) snprintf(esc, sizeof esc, "\\x%02x", (unsigned)uc); /* C0 and DEL: \xNN as before */
      else snprintf(esc, sizeof esc, uc <= 0xffff ? "\\u%04x" : "\\U%08x", (unsigned)uc);
      put = esc, len = strlen(esc), i += (size_t)k;
    } else {
      put = (const char *)p + i, len = (size_t)k, i += (size_t)k;
    }
    if (o + len + 1 > cap) break; /* never a split escape or character */
    memcpy(out + o, put, len);
    o += len;
  }
  out[o] = '\0';
  return o;
}

/* Fuzz target: the checkpoint reader (dopt_ckpt_open, _get, _verify and
 * dopt_optim_load). A valid generation of a small AdamW is made once; byte 0
 * of the input picks the file the rest replaces — even: index.json, odd: the
 * rank's safetensors file — while the other file stays valid. A generation
 * that opens must serve every tensor whole and as a piece, and a load either
 * succeeds or changes nothing that crashes. DOPT_FUZZ_CKPT_SEEDS=DIR writes
 * the two seeds (the valid files) into DIR. */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "distopt/checkpoint.h"
#include "fuzzcommon.h"

static char gen[600];
static const char *const files[2] = {"index.json", "rank-00000-of-00001.safetensors"};
static unsigned char *orig[2];
static size_t orig_len[2];

static dopt_optim *make(float *w, float *b) {
  dopt_optim *o = NULL;
  if (dopt_optim_create("adamw", "lr=0.01", &o) != DOPT_OK) abort();
  int g = 0;
  if (dopt_optim_add_group(o, "weight_decay=0", &g) != DOPT_OK) abort();
  dopt_param_config pc = DOPT_PARAM_CONFIG_INIT;
  pc.name = "w";
  pc.ndim = 2;
  pc.shape[0] = 3;
  pc.shape[1] = 4;
  pc.data = w;
  if (dopt_optim_add_param(o, 0, &pc, NULL) != DOPT_OK) abort();
  pc.name = "b";
  pc.ndim = 1;
  pc.shape[0] = 4;
  pc.data = b;
  if (dopt_optim_add_param(o, g, &pc, NULL) != DOPT_OK) abort();
  return o;
}

static void put_file(const char *path, const unsigned char *d, size_t n) {
  FILE *f = fopen(path, "wb");
  if (!f) abort();
  if (n && fwrite(d, 1, n, f) != n) abort();
  fclose(f);
}

static void init(void) {
  const char *tmp = getenv("TMPDIR");
  char ck[512], cmd[700];
  snprintf(ck, sizeof ck, "%s/dopt_fuzz_ckpt_%ld", tmp && *tmp ? tmp : "/tmp", (long)getpid());
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", ck);
  if (system(cmd) != 0) abort();
  float w[12], b[4], gw[12], gb[4];
  for (int i = 0; i < 12; i++) w[i] = 0.1f * (float)i - 0.5f, gw[i] = 0.01f * (float)(i % 5) - 0.02f;
  for (int i = 0; i < 4; i++) b[i] = 0.2f * (float)i, gb[i] = -0.03f;
  dopt_optim *o = make(w, b);
  const float *g[2] = {gw, gb};
  if (dopt_optim_step(o, g) != DOPT_OK || dopt_optim_step(o, g) != DOPT_OK || dopt_optim_save(o, ck, NULL) != DOPT_OK)
    abort();
  dopt_optim_destroy(o);
  snprintf(gen, sizeof gen, "%s/step-000000002", ck);
  const char *seeds = getenv("DOPT_FUZZ_CKPT_SEEDS");
  for (int k = 0; k < 2; k++) {
    char path[700];
    snprintf(path, sizeof path, "%s/%s", gen, files[k]);
    FILE *f = fopen(path, "rb");
    if (!f) abort();
    fseek(f, 0, SEEK_END);
    orig_len[k] = (size_t)ftell(f);
    rewind(f);
    orig[k] = malloc(orig_len[k] + 1);
    orig[k][0] = (unsigned char)k; /* the seed's selector byte, then the file */
    if (!orig[k] || fread(orig[k] + 1, 1, orig_len[k], f) != orig_len[k]) abort();
    fclose(f);
    if (seeds) {
      snprintf(path, sizeof path, "%s/%s", seeds, k ? "rank" : "index");
      put_file(path, orig[k], orig_len[k] + 1);
    }
  }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (!gen[0]) init();
  if (size < 1) return 0;
  int which = data[0] & 1;
  char path[700];
  for (int k = 0; k < 2; k++) {
    snprintf(path, sizeof path, "%s/%s", gen, files[k]);
    if (k == which) put_file(path, data + 1, size - 1);
    else put_file(path, orig[k] + 1, orig_len[k]);
  }
  dopt_ckpt_reader *r = NULL;
  if (dopt_ckpt_open(gen, &r) != DOPT_OK) return 0;
  const dopt_ckpt_meta *m = NULL;
  if (dopt_ckpt_read_meta(r, &m) != DOPT_OK || !m || !m->optimizer) abort();
  for (int i = 0; i < dopt_ckpt_num_tensors(r); i++) {
    dopt_ckpt_tensor_info ti;
    if (dopt_ckpt_tensor(r, i, &ti) != DOPT_OK) abort(); /* an index below the count must exist */
    if (ti.bytes > ((size_t)1 << 26)) continue;
    unsigned char *buf = malloc(ti.bytes + 1);
    if (!buf) abort();
    dopt_piece pc;
    dopt_piece_full(ti.ndim, ti.shape, &pc);
    (void)dopt_ckpt_get(r, ti.name, &pc, buf); /* a corrupted piece fails its SHA-256: fine */
    pc.lo = pc.len / 3; /* and a flat range of the whole block */
    pc.len -= pc.lo;
    (void)dopt_ckpt_get(r, ti.name, &pc, buf);
    free(buf);
  }
  (void)dopt_ckpt_verify(r);
  dopt_ckpt_close(r);
  float w[12] = {0}, b[4] = {0};
  dopt_optim *o = make(w, b);
  (void)dopt_optim_load(o, gen);
  dopt_optim_destroy(o);
  return 0;
}

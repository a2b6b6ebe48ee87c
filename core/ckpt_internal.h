/* Internal to the checkpoint code (core/ckpt_*.c; include/distopt/checkpoint.h,
 * docs/checkpoints.md): limits, the piece table that both the writer (a rank's
 * list, the merged index) and the reader build, the metadata box, and the
 * functions the files share. Who owns what:
 *   ckpt_pieces.c  pieces of a tensor, the piece table and its cover check, the arena
 *   ckpt_format.c  the JSON formats: index.json, rank-<r>.json, metadata, hyperparameters
 *   ckpt_write.c   a rank's writer and the generations (begin, commit)
 *   ckpt_read.c    the reader: generations, rank files, pieces served from overlapping pieces
 *   ckpt_optim.c   an optimizer's metadata and its check; single-device save and load
 * Files are read and written through core/files.h. */
#ifndef DISTOPT_CKPT_INTERNAL_H
#define DISTOPT_CKPT_INTERNAL_H

#include <cjson/cJSON.h>
#include <stddef.h>
#include <stdint.h>

#include "distopt/checkpoint.h"
#include "distopt/digest.h"
#include "files.h"
#include "internal.h"
#include "optim_impl.h"

#define CK_PATH DOPT_PATH_MAX
/* Header space reserved before the data of a rank file, so that pieces are
 * written as they come; a longer header (about 7000 pieces) moves the data once. */
#define CK_HEADER_RESERVE ((size_t)1 << 20)
#define CK_CHUNK ((size_t)4 << 20)         /* read/copy granularity */
#define CK_COMPACT ((uint64_t)16 << 20)    /* a rank file with less data is rewritten without the reserve */
#define CK_MAX_JSON ((size_t)1 << 30)      /* index.json / rank-*.json */
#define CK_MAX_HEADER ((uint64_t)100 << 20) /* safetensors' own limit */
#define CK_MAX_INT 9007199254740992.0      /* 2^53: integers exact in JSON doubles */
#define CK_RANK_FORMAT "distopt-checkpoint-rank"

/* ---- the arena: allocations freed together ---------------------------------------- */

typedef struct arena {
  void **b;
  size_t n, cap;
} arena;

/* ---- pieces and the piece table (ckpt_pieces.c) ------------------------------------- */

enum { PF_B, PF_H, PF_W, PF_NUMEL, PF_FACTORED, PF_H0, PF_HL, PF_W0, PF_WL, PF_LO, PF_LEN, PF_N };

typedef struct ck_piece {
  const char *tensor;
  dopt_dtype dtype;
  int ndim;
  int64_t shape[DOPT_MAX_DIMS];
  dopt_piece pc;
  int file;             /* index into the table's files */
  const char *fname;    /* that file's name */
  const char *key;      /* its safetensors key */
  size_t bytes;
  char sha[DOPT_DIGEST_HEX];
  uint64_t offset;      /* reader: the data's absolute offset in its file */
} ck_piece;

typedef struct ck_tensor {
  const char *name;
  dopt_dtype dtype;
  int ndim;
  int64_t shape[DOPT_MAX_DIMS];
  size_t numel;
  ck_piece **pieces;
  int npieces;
} ck_tensor;

typedef struct ck_file {
  const char *name;
  uint64_t bytes;
} ck_file;

typedef struct ck_table {
  arena ar;
  ck_file *files;
  int nfiles, files_cap;
  ck_piece *p;
  int np, pcap;
  ck_piece **sorted; /* by tensor, file, key */
  ck_tensor *t;      /* by name */
  int nt;
} ck_table;

void *ck_ar_alloc(arena *a, size_t bytes);
void ck_ar_free(arena *a);
char *ck_ar_strdup(arena *a, const char *s);
int ck_blocks_meet(const dopt_piece *a, const dopt_piece *b);
dopt_status ck_check_param_tensors(const ck_table *t, const dopt_ckpt_meta *m, const char *where);
dopt_status ck_check_piece(dopt_status err, const char *where, const char *tensor, int ndim, const int64_t *shape,
                           const dopt_piece *pc);
void ck_piece_get(const dopt_piece *pc, uint64_t v[PF_N]);
int ck_piece_is_whole(const dopt_piece *pc);
void ck_piece_set(dopt_piece *pc, const uint64_t v[PF_N]);
size_t ck_scatter(const dopt_piece *s, size_t e0, size_t e1, const unsigned char *src, const dopt_piece *w,
                  unsigned char *out, size_t es);
dopt_status ck_table_add_file(ck_table *t, const char *name, uint64_t bytes, int *idx);
const ck_tensor *ck_table_find(const ck_table *t, const char *name);
dopt_status ck_table_finish(ck_table *t, const char *where);
void ck_table_free(ck_table *t);
ck_piece *ck_table_new_piece(ck_table *t);

/* ---- formats (ckpt_format.c) ----------------------------------------------------------- */

typedef struct meta_box {
  dopt_ckpt_meta m; /* first: a dopt_ckpt_meta * is a meta_box * */
  arena ar;
} meta_box;

dopt_status ck_check_meta_input(const dopt_ckpt_meta *m, const char *fn);
void ck_hp_str(const dopt_ckpt_hparam *h, char *out, size_t cap);
char *ck_index_json(const ck_table *t, const dopt_ckpt_meta *m);
cJSON *ck_jadd(cJSON *obj, const char *key, cJSON *item, int *oom);
void ck_jadd_piece(cJSON *obj, const dopt_piece *pc, int *oom);
void ck_jadd_shape(cJSON *obj, const char *key, int ndim, const int64_t *shape, int *oom);
dopt_status ck_jdtype(const cJSON *obj, const char *key, const char *where, const char *ctx, dopt_dtype *out);
dopt_status ck_jget(const cJSON *obj, const char *key, const char *where, const char *ctx, const cJSON **out);
dopt_status ck_jint(const cJSON *obj, const char *key, double lo, double hi, const char *where, const char *ctx,
                    int64_t *out);
cJSON *ck_jnum(double v);
dopt_status ck_jshape(const cJSON *obj, const char *key, const char *where, const char *ctx, int *ndim,
                      int64_t *shape);
dopt_status ck_jstr(const cJSON *obj, const char *key, const char *where, const char *ctx, const char **out);
dopt_status ck_parse_meta(const cJSON *r, const char *where, meta_box *mb);
dopt_status ck_parse_piece(ck_table *t, const cJSON *e, int file, int with_tensor, const ck_tensor *owner,
                           const char *where);
int ck_rank_file_name_ok(const char *s);
dopt_status ck_read_json(const char *path, cJSON **out);
int ck_same_shape(int na, const int64_t *a, int nb, const int64_t *b);

/* ---- the reader (ckpt_read.c) ------------------------------------------------------------ */

struct dopt_ckpt_reader {
  char gen[CK_PATH];
  char index_path[CK_PATH];
  meta_box meta;
  ck_table t;
  unsigned char *buf; /* CK_CHUNK */
};

#endif

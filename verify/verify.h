/* `distopt verify`: the index of a recorded PyTorch run (docs/verify.md).
 *
 * A recording is a directory: index.json (this schema) and safetensors files,
 * each a contiguous block of steps of one rank. vr_index_parse reads the index
 * text and checks everything that can be checked without the tensor files:
 * the schema, every size against the limits below, names, shapes, groups, the
 * rank layouts (each parameter covered exactly, pieces inside it) and the file
 * list (contiguous blocks from step 1, safe relative paths). */
#ifndef DOPT_VERIFY_H
#define DOPT_VERIFY_H

#include <stddef.h>
#include <stdint.h>

#include "distopt/dtype.h"
#include "distopt/layout.h"
#include "distopt/safetensors.h"

#define VR_SCHEMA_VERSION 6     /* the newest this distopt writes and reads */
#define VR_SCHEMA_OLDEST 1      /* schema 1 (no window, F32 gradients, no projectors) still reads */
#define VR_KIND "distopt-record"

/* Limits: an index beyond one is rejected (one line naming the key, the value and the limit). */
#define VR_MAX_INDEX_BYTES (64L << 20) /* index.json */
#define VR_MAX_PARAMS 65536
#define VR_MAX_GROUPS 256
#define VR_MAX_RANKS 4096
#define VR_MAX_PIECES (1L << 20)       /* all ranks together */
#define VR_MAX_FILES 1000000L          /* all ranks together */
#define VR_MAX_STEPS 10000000L         /* as `distopt run` */
#define VR_MAX_CHANGES 1000000L        /* hyperparameter changes (an lr schedule) */
#define VR_MAX_NAME 255                /* parameter names, bytes */
#define VR_MAX_KEY 63                  /* state keys, hyperparameter keys */
#define VR_MAX_HPARAMS 4096            /* a group's k=v string */
#define VR_MAX_PATH 255                /* a file's path relative to the recording */
#define VR_MAX_PIECE_STATES 16         /* declared state ranges per piece */
#define VR_MAX_NUMEL (1LL << 40)

typedef struct vr_state_range {
  char key[VR_MAX_KEY + 1];
  int64_t lo, len; /* flat range of the reference's state tensor */
} vr_state_range;

/* What one rank's recorded tensors of one parameter are: the parameter's piece in the layout description
 * (distopt/layout.h: schema 3 adds a tensor-parallel block, schema 4 the pipeline stage and expert id); state
 * ranges as declared (elementwise states default to the piece's elements, others to the whole state when the
 * piece is the whole parameter). */
typedef struct vr_piece {
  int param;
  int source;       /* 1: this piece supplies the initial value and gradient of its elements */
  int nstates;
  vr_state_range states[VR_MAX_PIECE_STATES];
  dopt_layout_piece lp;
  int ndim;              /* the parameter's shape (ix->params[param]) */
  const int64_t *shape;
} vr_piece;

/* The parameter's flat index of element j (0 <= j < len) of piece pc. */
static inline int64_t vr_piece_elem(const vr_piece *pc, int64_t j) {
  return pc->lp.block_dim < 0 ? pc->lp.lo + j : dopt_layout_piece_elem(pc->ndim, pc->shape, &pc->lp, j);
}
/* The run of piece pc's elements from element j that lies contiguous in the parameter: its length (0 when j is
 * the end) and *at, the parameter's flat index of element j. A flat range is one run; a block's runs are its
 * rows of the dimensions after the block's own. */
int64_t vr_piece_run(const vr_piece *pc, int64_t j, int64_t *at);
/* Piece pc's len elements src[] to their places in the parameter's flat array (put), or from them (get). */
void vr_piece_put(const vr_piece *pc, const void *src, float *param);
void vr_piece_get(const vr_piece *pc, const float *param, float *dst);

typedef struct vr_file {
  char path[VR_MAX_PATH + 1];
  long first, last; /* steps first..last (inclusive) */
} vr_file;

typedef struct vr_rank {
  int npieces;
  vr_piece *pieces;
  int nfiles;
  vr_file *files;
} vr_rank;

typedef struct vr_param {
  char name[VR_MAX_NAME + 1];
  int ndim;
  int64_t shape[DOPT_MAX_DIMS];
  int64_t numel;
  int group;
} vr_param;

typedef struct vr_change {
  long step;  /* applied before this step */
  int group;
  char key[VR_MAX_KEY + 1];
  double value; /* NaN: none (an unset optional key) */
} vr_change;

/* How gradients are stored (record.grads, schema 2): grad/<t>/<p> F32 (default) or BF16 (rounded to nearest
 * even by the recorder: lossy, docs/verify.md). Steps not replayed may hold only grad_digest/<t>/<p>, the
 * SHA-256 of the piece's F32 gradient bytes (U8, 32 bytes). */
enum { VR_GRADS_F32 = 0, VR_GRADS_BF16 = 1 };

typedef struct vr_index {
  int schema_version;
  char optimizer[64];     /* "" : optimizer.name null (schema 2: a class with no distopt optimizer, replay only) */
  char upstream[128];     /* the recorded class, e.g. torch.optim.AdamW ("" if absent) */
  char torch_version[64]; /* "" if absent */
  char cpu_capability[64];
  int ngroups;
  char **group_hparams;   /* [ngroups] "k=v,..." (group 0: the optimizer's; others override it) */
  int nparams;
  vr_param *params;
  int world_size;
  vr_rank *ranks;         /* [world_size], by rank */
  long start_step;        /* schema 2 window: the steps before it were not recorded (0: from the start) */
  long steps;             /* the last step recorded (every rank's files cover start_step+1..steps) */
  long every;             /* parameters and states recorded every `every` steps */
  int complete;           /* the recorder was closed (0: an interrupted run's prefix) */
  int record_params;      /* record.params: every recorded step (t % every == 0) holds param/<t>/<p> of every piece */
  int record_states;      /* record.states */
  int grads;              /* record.grads: VR_GRADS_F32 or VR_GRADS_BF16 */
  int projectors;         /* record.projectors: GaLore projectors as proj/<t>/<p>/<key> at refresh steps */
  int grad_agree;         /* record.grad_agree (schema 3): every rank's whole gradient of every parameter it has one
                             of, as grad_agree/<t>/<p> (SHA-256, 32 U8), whether or not it holds a piece; schema
                             5: the digest of the rank's pieces of p in its pieces' order (of the whole gradient
                             where it holds no piece of p), compared among the ranks holding the same pieces */
  double clip_max_norm;   /* schema 6 record.clip.max_norm: the gradients are recorded before clipping, each clipped
                             step's total norm and coefficient as clip/<t>/norm, clip/<t>/coef on every rank and the
                             clipped gradient's digest as clipped_digest/<t>/<p>; the replay clips (0: not recorded) */
  long construction_steps;/* schema 6: of the start_step steps before the window, how many the framework's optimizer
                             took before training (a step at construction, a warm-up): not training steps */
  long twin_terms;        /* schema 6, a twin's recording (distopt.twin): the micro-batch gradients summed into each
                             step's gradient (world x accumulation), grad_abs/<t>/<p> their absolute sum; 0: no twin */
  long twin_construction; /* the construction steps the twin was told the framework takes by design */
  int twin_bf16;          /* twin.grad_dtype "BF16": the run sums its micro-batch gradients in bf16 (unit 2^-8) */
  int stages;             /* schema 4: pipeline stages (0: not pipelined); every piece then names its stage */
  int experts;            /* schema 4: experts (0: none); a piece's expert id is below it */
  long nchanges;
  vr_change *changes;     /* by step */
  /* schema 4: the recorder found another rank's hyperparameters different from rank 0's (which the replay
   * uses): the first difference (step 0: none); value, rank0 NaN for an unset key */
  struct {
    long step;
    int rank, group;
    char key[VR_MAX_KEY + 1];
    double value, rank0;
  } disagree;
  int *by_name;           /* [nparams] parameter indices sorted by name (vr_index_find_param) */
} vr_index;

/* Parses index.json text (len bytes; need not be NUL-terminated). `where`
 * names the file in messages. On error returns -1 and writes one line into
 * err (cap bytes): "WHERE: key.path: problem (value ...)"; out is then empty
 * (vr_index_free is still safe). */
int vr_index_parse(const char *text, size_t len, const char *where, vr_index *out, char *err, size_t cap);
void vr_index_free(vr_index *ix);

/* Index of the parameter called name, or -1 (O(log n)). */
int vr_index_find_param(const vr_index *ix, const char *name);

/* The piece of `param` that rank r records, or NULL. */
const vr_piece *vr_rank_piece(const vr_index *ix, int r, int param);

/* ---- reading a recording (verify/verify_reader.c) ----------------------------------------
 *
 * Used by `distopt verify` and by `distopt compare --trace` on a recording. The
 * reader keeps at most one open tensor file per rank: the block holding the
 * step last asked for (vr_reader_seek loads the next block when a step moves
 * past it, or an earlier one when it moves back), so memory is one block per
 * rank besides the index. Every file is checked when it is loaded against the
 * index (metadata rank, tensor names init/, grad/<t>/, param/<t>/, state/<t>/.../<key>
 * and, schema 2, init_state/<p>/<key> (first file), grad_digest/<t>/<p>, proj/<t>/<p>/<key>; schema 6 with
 * record.clip clip/<t>/norm|coef and clipped_digest/<t>/<p>, in a twin's recording grad_abs/<t>/<p>,
 * with t inside the file's block, parameters of the rank's layout, F32 (BF16 gradients when
 * record.grads says so) with the piece's element count; step counts one F32/F64/I32/I64
 * element; a digest 32 U8). Not thread
 * safe. Functions return DOPT_OK or an error status with one line in rd->err
 * naming the file, tensor or key and the value (unescaped: the printer escapes). */

typedef struct vr_source {
  int rank;
  const vr_piece *pc;
} vr_source;

/* Called for every state tensor of a file when it is loaded (rank, the index of
 * the piece in the rank's layout, the state key, the file's path, the tensor's
 * name); nonzero: the load fails with the message written into err. */
typedef int (*vr_state_fn)(void *user, int rank, int piece, const char *key, const char *fpath, const char *tensor,
                           char *err, size_t cap);

typedef struct vr_reader {
  vr_index ix;
  char dir[4096];          /* the recording's directory */
  char index_path[4200];   /* its index.json */
  int *nsrc;               /* [nparams] source pieces of each parameter */
  vr_source **src;         /* [nparams][nsrc], by rank */
  int *cur;                /* [world_size] the loaded file of each rank (-1: none) */
  dopt_st_file **f;        /* [world_size] */
  long loads;              /* tensor files loaded so far */
  vr_state_fn on_state;    /* optional */
  int allow_digest;        /* vr_reader_grad may answer -1 (a digest only); 0: that is an error */
  void *user;
  char err[1024];
} vr_reader;

/* Opens the recording at path (its directory or its index.json): reads and
 * parses the index (at most VR_MAX_INDEX_BYTES; vr_index_parse's checks) and
 * finds each parameter's source pieces. No tensor file is loaded yet. On error
 * rd is still safe to vr_reader_close. */
dopt_status vr_reader_open(vr_reader *rd, const char *path);
void vr_reader_close(vr_reader *rd);

/* Makes rank r's loaded file the one holding step t (1..steps), loading and
 * checking it when another is loaded. */
dopt_status vr_reader_seek(vr_reader *rd, int r, long t);

/* The initial value of parameter p (numel floats) from its source pieces'
 * init/<p> (each in its rank's first file). */
dopt_status vr_reader_init(vr_reader *rd, int p, float *out);

/* The gradient of parameter p at step t (numel floats), assembled from its
 * source pieces' grad/<t>/<p> (BF16 widened exactly). *present: 1, or 0 when
 * no source records one (the step had no gradient; out is then untouched), or
 * -1 when the sources hold only its digest (grad_digest/<t>/<p>: a step
 * recorded for its states, not for a replay; out untouched) if
 * rd->allow_digest, else an error naming the step; the sources must agree. */
dopt_status vr_reader_grad(vr_reader *rd, int p, long t, float *out, int *present);

/* The bytes of the recorded F32 tensor `name` (maybe unaligned: memcpy them) of rank r's file holding step t
 * (seeked), or NULL (absent, or another dtype). */
const void *vr_reader_f32(vr_reader *rd, int r, long t, const char *name, size_t *numel);
/* Rank r's 32-byte U8 tensor `name` of step t (a SHA-256 digest), or NULL when it has none. */
const unsigned char *vr_reader_digest(vr_reader *rd, int r, long t, const char *name);

#endif

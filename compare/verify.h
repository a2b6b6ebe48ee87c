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

#define VR_SCHEMA_VERSION 1
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

/* What one rank's recorded tensors of one parameter are: the flat elements
 * [lo, lo + len) of the parameter (and of its gradient); state ranges as
 * declared (elementwise states default to [lo, lo + len), others to the whole
 * state when the piece is the whole parameter). */
typedef struct vr_piece {
  int param;
  int64_t lo, len;
  int source;      /* 1: this piece supplies the initial value and gradient of its elements */
  int nstates;
  vr_state_range states[VR_MAX_PIECE_STATES];
} vr_piece;

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

typedef struct vr_index {
  int schema_version;
  char optimizer[64];
  char upstream[128];     /* the recorded class, e.g. torch.optim.AdamW ("" if absent) */
  char torch_version[64]; /* "" if absent */
  char cpu_capability[64];
  int ngroups;
  char **group_hparams;   /* [ngroups] "k=v,..." (group 0: the optimizer's; others override it) */
  int nparams;
  vr_param *params;
  int world_size;
  vr_rank *ranks;         /* [world_size], by rank */
  long steps;             /* steps recorded (every rank's files cover 1..steps) */
  long every;             /* parameters and states recorded every `every` steps */
  int complete;           /* the recorder was closed (0: an interrupted run's prefix) */
  long nchanges;
  vr_change *changes;     /* by step */
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

#endif

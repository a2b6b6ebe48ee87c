/* distopt — reshardable optimizer checkpoints (docs/checkpoints.md).
 *
 * A checkpoint directory CKPT holds generations step-<global step, 9 digits>/
 * and a file `latest` naming the newest one. A generation holds one
 * safetensors file per writing rank (rank-<r>-of-<n>.safetensors, 5 digits
 * each), that rank's piece list (rank-<r>.json) and index.json, written last
 * by rank 0. Every tensor — a parameter's fp32 values `<param>`, its bf16
 * working copy `<param>/bf16`, each optimizer state `<param>/<state key>` —
 * is stored as one or more *pieces* (distopt/device.h's dopt_piece: a TP
 * block of the logical [b, h, w] view and a flat range of it), under the
 * safetensors key `<tensor>@<piece index>`; a reader asks for any other piece
 * of the same tensor, so a checkpoint written under one layout loads under
 * another.
 *
 * Distributed save (every rank writes its pieces; the caller synchronises):
 *   rank 0:     dopt_ckpt_begin(ckpt, step, tmp, cap)      (creates tmp)
 *   barrier;    every rank: dopt_ckpt_tmp_dir(ckpt, step, tmp, cap)
 *               dopt_ckpt_writer_open(tmp, rank, nranks, &w)
 *               dopt_ckpt_put(w, ...) per piece; dopt_ckpt_writer_close(w)
 *   barrier;    rank 0: dopt_ckpt_commit(ckpt, tmp, meta)  (index, rename, latest)
 * A failure anywhere: every rank aborts its writer, then rank 0
 * dopt_ckpt_discard(tmp). A crash anywhere before the commit's rename leaves
 * the previous generation and `latest` as they were. Nothing in ckpt but the
 * generation folders, `latest` and the temporary folder is touched, and no
 * symbolic link there is followed (docs/files.md). Load: dopt_ckpt_open + dopt_ckpt_get per piece.
 * Single device: dopt_optim_save / dopt_optim_load. */
#ifndef DISTOPT_CHECKPOINT_H
#define DISTOPT_CHECKPOINT_H

#include <stddef.h>
#include <stdint.h>

#include "distopt/device.h"
#include "distopt/dtype.h"
#include "distopt/export.h"
#include "distopt/optim.h"
#include "distopt/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DOPT_CKPT_FORMAT "distopt-checkpoint" /* index.json "format" */
#define DOPT_CKPT_FORMAT_VERSION 1            /* index.json "version" */

/* ---- metadata -------------------------------------------------------------- */

/* How a hyperparameter is written in index.json. */
typedef enum dopt_ckpt_hp_kind {
  DOPT_CKPT_HP_NUMBER = 0, /* a finite number */
  DOPT_CKPT_HP_BOOL = 1,   /* true/false (value 1/0) */
  DOPT_CKPT_HP_NONE = 2,   /* an optional key that is unset (JSON null; value NaN) */
  DOPT_CKPT_HP_CHOICE = 3, /* an enumeration, by name (`choice`; value = its index) */
} dopt_ckpt_hp_kind;

typedef struct dopt_ckpt_hparam {
  const char *key;
  dopt_ckpt_hp_kind kind;
  double value;
  const char *choice; /* DOPT_CKPT_HP_CHOICE: the choice's name; NULL otherwise */
  int is_default;     /* the optimizer's side (dopt_ckpt_meta_from_optim): the key holds its default, so a
                         checkpoint written before the key existed, which lacks it, matches */
} dopt_ckpt_hparam;

typedef struct dopt_ckpt_group {
  int nhparams;
  dopt_ckpt_hparam *hparams;
} dopt_ckpt_group;

typedef struct dopt_ckpt_param {
  const char *name;
  dopt_dtype dtype;  /* DOPT_F32, or DOPT_BF16 (fp32 master + bf16 working copy) */
  int ndim;
  int64_t shape[DOPT_MAX_DIMS];
  int group;
  int layer;         /* dopt_param_config.layer */
  int64_t step;      /* the parameter's step count */
  int has_bf16;      /* a `<name>/bf16` tensor is stored */
  int has_state;     /* its states are allocated (0: never stepped, or freed by LISA) */
} dopt_ckpt_param;

/* The world that wrote a checkpoint: informational only (any world loads any
 * checkpoint). plugin "reference" for the single device. */
typedef struct dopt_ckpt_world {
  const char *plugin;
  int tp, dp, zero;
} dopt_ckpt_world;

/* Everything index.json says besides the tensors. An input of
 * dopt_ckpt_commit (initialise with DOPT_CKPT_META_INIT, or build it from an
 * optimizer with dopt_ckpt_meta_from_optim) and an output of the reader. */
typedef struct dopt_ckpt_meta {
  uint32_t struct_size;
  uint32_t version;
  const char *optimizer;       /* the optimizer that steps (a wrapper's inner one) */
  int ngroups;
  dopt_ckpt_group *groups;     /* group g's hyperparameters, every key of the optimizer */
  const char *wrapper;         /* "lisa", or NULL */
  int nwrapper_hparams;
  dopt_ckpt_hparam *wrapper_hparams;
  int64_t global_step;         /* the training loop's step count (the generation's name) */
  int64_t optimizer_steps;     /* dopt_optim_step calls taken: the wrapper's (LISA's) clock */
  int64_t skipped_steps;       /* steps skipped for non-finite gradients */
  int nparams;
  dopt_ckpt_param *params;     /* in the optimizer's parameter order */
  dopt_ckpt_world world;
  int eval_mode;               /* 1: saved in evaluation mode (dopt_optim_set_mode: the parameters hold the
                                * evaluation point; index.json "mode": "eval"), 0: train mode (no key) */
} dopt_ckpt_meta;

#define DOPT_CKPT_META_VERSION 1
#define DOPT_CKPT_META_INIT \
  { sizeof(dopt_ckpt_meta), DOPT_CKPT_META_VERSION, NULL, 0, NULL, NULL, 0, NULL, 0, 0, 0, 0, NULL, {"reference", 1, 1, 0}, 0 }

/* What the caller adds to a save (all optional). */
typedef struct dopt_ckpt_info {
  uint32_t struct_size;
  uint32_t version;
  int64_t global_step;   /* -1: the optimizer's steps + skipped_steps */
  int64_t skipped_steps;
} dopt_ckpt_info;

#define DOPT_CKPT_INFO_VERSION 1
#define DOPT_CKPT_INFO_INIT { sizeof(dopt_ckpt_info), DOPT_CKPT_INFO_VERSION, -1, 0 }

/* The metadata of a (plain, single-device) optimizer: its groups with every
 * hyperparameter, wrapper, parameters with their steps; world "reference".
 * extra may be NULL. The distributed save builds it from the plain optimizer
 * it was created from and patches steps, has_state and world. Free with
 * dopt_ckpt_meta_free (only metadata made by this call). */
DOPT_API dopt_status dopt_ckpt_meta_from_optim(const dopt_optim *o, const dopt_ckpt_info *extra, dopt_ckpt_meta **out);
DOPT_API void dopt_ckpt_meta_free(dopt_ckpt_meta *m);
/* Checks that a checkpoint's metadata `saved` (read from `where`) fits an
 * optimizer described by `live`: the optimizer and wrapper names, the
 * wrapper's and every group's hyperparameters (exact; the message names the
 * group, key and both values), the parameters' number, order, names, dtypes,
 * shapes and groups (and layers under a wrapper). One-line errors. */
DOPT_API dopt_status dopt_ckpt_meta_check(const dopt_ckpt_meta *saved, const dopt_ckpt_meta *live, const char *where);

/* ---- writing ---------------------------------------------------------------- */

/* The temporary generation directory of (ckpt_dir, global_step):
 * CKPT/.tmp-step-<9 digits>; every rank can compute it. */
DOPT_API dopt_status dopt_ckpt_tmp_dir(const char *ckpt_dir, int64_t global_step, char *tmp_dir_out, size_t cap);
/* Rank 0, before any writer opens: creates ckpt_dir if needed and the
 * temporary generation directory (a stale one from a crashed save is removed
 * first: a symbolic link there as a link); its path into tmp_dir_out. A
 * regular file, FIFO or other non-folder where the generation step-<N> or
 * the temporary belongs, or a folder where `latest` belongs, is
 * DOPT_ERR_IO naming it, before anything is written. */
DOPT_API dopt_status dopt_ckpt_begin(const char *ckpt_dir, int64_t global_step, char *tmp_dir_out, size_t cap);
/* What dopt_ckpt_begin checks before it writes, without creating anything:
 * ckpt_dir is a folder or can be made, and no non-folder stands where the
 * generation of global_step or its temporary belongs, nor a folder where
 * `latest` does. For a tool to refuse a save before its work begins. */
DOPT_API dopt_status dopt_ckpt_check_dir(const char *ckpt_dir, int64_t global_step);
/* A folder knows what wrote it (docs/checkpoints.md, "Whose folder"): whether a command that will save the
 * run `live` describes after steps first_step.. (and no earlier) may write into ckpt_dir. Yes when it holds no
 * generation (missing, empty, or only other files); else its `latest` must be a generation of the same run —
 * dopt_ckpt_meta_check: optimizer, wrapper, every hyperparameter, the parameters' names, dtypes, shapes and
 * groups; not the layout, which may change on resume — and every save must come after it (first_step >
 * its global step): no generation it did not write is replaced and `latest` never moves back. A folder with
 * generations but no `latest` cannot say whose it is: refused. DOPT_ERR_STATE with one line naming the folder,
 * the difference or the steps; nothing is written. */
DOPT_API dopt_status dopt_ckpt_claim(const char *ckpt_dir, const dopt_ckpt_meta *live, int64_t first_step);
/* Starting over in a folder (a tool's explicit option): removes its `latest`, every generation step-<N> and
 * every temporary .tmp-step-<N> (links as links, never followed; a generation holding a folder is not
 * distopt's: an error, nothing of it removed); other files stay. */
DOPT_API dopt_status dopt_ckpt_clear(const char *ckpt_dir);
/* Rank 0, after a failed save (every writer closed or aborted): removes the
 * temporary generation directory, so that nothing of the save is left. */
DOPT_API dopt_status dopt_ckpt_discard(const char *tmp_dir);

typedef struct dopt_ckpt_writer dopt_ckpt_writer;

/* One rank's writer into the temporary generation directory. */
DOPT_API dopt_status dopt_ckpt_writer_open(const char *gen_tmp_dir, int rank, int nranks, dopt_ckpt_writer **w);
/* Appends one piece of a tensor (shape: its logical shape; pc: the piece, as
 * dopt_piece_full(ndim, shape) for the whole tensor) with pc->len elements of
 * dt in host_data. The data is written to the rank's file at once (memory
 * stays O(pieces)). Pieces of one tensor must have one dtype and shape. */
DOPT_API dopt_status dopt_ckpt_put(dopt_ckpt_writer *w, const char *tensor, dopt_dtype dt, int ndim,
                                   const int64_t *shape, const dopt_piece *pc, const void *host_data);
/* Finishes the rank's safetensors file and rank-<r>.json (both fsynced) and
 * frees w (also on failure). */
DOPT_API dopt_status dopt_ckpt_writer_close(dopt_ckpt_writer *w);
/* Drops a writer and its partial file (NULL allowed). */
DOPT_API void dopt_ckpt_abort_writer(dopt_ckpt_writer *w);

/* Rank 0, after every rank closed its writer: merges the rank-*.json of
 * tmp_dir (every rank 0..n-1 must be there and the pieces must cover every
 * tensor exactly once), writes index.json, renames tmp_dir to
 * step-<meta->global_step> (replacing an existing one atomically) and points
 * `latest` at it; everything fsynced. */
DOPT_API dopt_status dopt_ckpt_commit(const char *ckpt_dir, const char *tmp_dir, const dopt_ckpt_meta *meta);

/* ---- reading ------------------------------------------------------------------ */

typedef struct dopt_ckpt_reader dopt_ckpt_reader;

/* path: a checkpoint directory (follows `latest`) or one generation
 * step-<N>. Parses and checks index.json (format, version, every piece
 * inside its tensor, exact cover), every rank file's size and safetensors
 * header. Data is verified (SHA-256) on every read. */
DOPT_API dopt_status dopt_ckpt_open(const char *path, dopt_ckpt_reader **r);
DOPT_API void dopt_ckpt_close(dopt_ckpt_reader *r);
/* The generation directory actually opened. */
DOPT_API const char *dopt_ckpt_path(const dopt_ckpt_reader *r);
DOPT_API dopt_status dopt_ckpt_read_meta(const dopt_ckpt_reader *r, const dopt_ckpt_meta **m);

typedef struct dopt_ckpt_tensor_info {
  const char *name;
  dopt_dtype dtype;
  int ndim;
  int64_t shape[DOPT_MAX_DIMS];
  int npieces;
  size_t bytes; /* numel × dtype size */
} dopt_ckpt_tensor_info;
DOPT_API int dopt_ckpt_num_tensors(const dopt_ckpt_reader *r);
/* Tensors sorted by name. */
DOPT_API dopt_status dopt_ckpt_tensor(const dopt_ckpt_reader *r, int index, dopt_ckpt_tensor_info *out);
/* DOPT_ERR_NOT_FOUND (naming the tensor and index.json) if absent. */
DOPT_API dopt_status dopt_ckpt_find(const dopt_ckpt_reader *r, const char *tensor, dopt_ckpt_tensor_info *out);
/* Fills out[want->len] (elements of the tensor's dtype) with the piece
 * `want` of the tensor (any TP block and flat range of its logical [b, h, w]
 * view), reading only the saved pieces that overlap it, each whole and
 * checked against its SHA-256 (out is unspecified on failure). */
DOPT_API dopt_status dopt_ckpt_get(dopt_ckpt_reader *r, const char *tensor, const dopt_piece *want, void *out);
/* Reads every piece and checks its SHA-256. */
DOPT_API dopt_status dopt_ckpt_verify(dopt_ckpt_reader *r);

/* ---- the single device ------------------------------------------------------- */

/* Saves parameters (fp32, and bf16 copies), states, step counts and the
 * global step as a new generation of ckpt_dir (extra may be NULL). */
DOPT_API dopt_status dopt_optim_save(dopt_optim *o, const char *ckpt_dir, const dopt_ckpt_info *extra);
/* Loads a checkpoint (a directory or one generation) into an optimizer built
 * with the same optimizer, hyperparameters, groups and parameters (names,
 * shapes, dtypes, order): parameters, bf16 copies, states, step counts and
 * the optimizer's step clock. Everything is read and verified before
 * anything is written: on failure the optimizer is unchanged. */
DOPT_API dopt_status dopt_optim_load(dopt_optim *o, const char *path);

#ifdef __cplusplus
}
#endif
#endif

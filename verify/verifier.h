/* The recording verifier's run (distopt verify; docs/verify.md): the state of one verification and what its
 * files share. Who does what:
 *   stats.c       the declared tolerances and each recorded tensor's statistics (the floor of the verifier)
 *   setup.c       the recording's index, its tensor files, the reference optimizer created and started from it
 *   projectors.c  GaLore: each recorded projector checked against ours (sin theta) and adopted; the refreshes
 *   replay.c      the replay step by step, the verdict
 *   continues.c   --continues PREV: a window's start against the recording it continues
 *   report.c      the table, --json and --plot
 * The command (arguments, exit codes) is cli/cmd_verify.c; the recording's reader is verify.h. */
#ifndef DOPT_VERIFY_VERIFIER_H
#define DOPT_VERIFY_VERIFIER_H

#include <stdio.h>

#include "cli.h"
#include "verify.h"

static const char *const CMD = "verify";

/* ---- declared tolerances --------------------------------------------------------------
 *
 * Normwise relative error max|rec - ref| / max|ref| of a parameter and of a
 * state piece, after every recorded step. Each entry is docs/golden.md's
 * tolerance for the same upstream class, justified there by the operations
 * that round differently (torch fuses add_(alpha=) and sums means and norms in
 * fp32; distopt does not fuse and sums exactly): ~10 one-ulp differences per
 * step (6e-8 each) over ~20 steps give ~1.2e-5 on the update, damped by the
 * learning rate (<= 1e-2 of the parameter) to ~1e-7 on parameters; states are
 * undamped. Measured by test_golden (torch 1.13 AVX2; docs/golden.md, docs/precision.md)
 * for all four: parameters 6e-8 .. 3.3e-7 (20-step cases <= 3.3e-7, 200-step <= 2.2e-7),
 * states <= 5.5e-7 (20 steps) and <= 6.9e-7 (200 steps); adafactor's 200-step case
 * 1.5e-7 / 3.3e-7. Against 1e-6 / 1e-5: margins >= 3 (parameters) and >= 14 (states).
 * Measured by distopt verify itself on real clients (tests/verify, docs/verify.md):
 *   torch AdamW, MLP, 30 steps       params 1.6e-7, states 2.7e-7
 *   ZeRO(AdamW), 2 gloo ranks, 20     params 1.5e-7, states 3.2e-7
 *   HF Adafactor 4.36.2, 30 steps     params 1.7e-7, states 2.9e-7
 *   sharded Adafactor (all_reduce)    params 1.1e-7, states 1.2e-7
 * margins >= 5.9 (params) and >= 31 (states); the planted local-statistics
 * bug gives 0.9 on exp_avg_sq_col at step 1.
 * A wrong formula (a missing bias correction, eps misplaced, a mean over the
 * wrong rows) shows at 1e-3 or worse. The bound is for runs of the golden
 * length (<= 200 steps) at training learning rates; longer runs may need
 * --rtol (roundings compound at worst linearly with the steps).
 * Optimizers without an entry (8-bit, GaLore, Q-GaLore, LISA: discontinuous
 * or projected updates, no golden bound against torch here) need --rtol. */
typedef struct verify_tol {
  const char *optimizer;
  double param, state;           /* accumulated (the default mode; 0: no declared bound, --rtol needed) */
  double step_param, step_state; /* --stepwise: one step from the recorded states (0: no declared bound) */
  const char *upstream;          /* the recorded class's prefix this entry is for (NULL: any class) */
  const char *exact;             /* state keys the arithmetic makes exact ("a,b"): compared bitwise whatever the
                                    other bounds (--rtol included); NULL: none */
  double update;                 /* > 0: a parameter whose step counted update_counter is also allowed this
                                    fraction of each step's change of the reference's parameter, summed over the
                                    steps (accumulated) or of this step's (--stepwise): an update computed in a
                                    coarser arithmetic than the parameter (Muon's bf16 Newton-Schulz) */
  int update_counter;            /* the dopt_counter (its last step's count > 0) that marks such a step */
} verify_tol;
/* ---- state of one run ------------------------------------------------------------------- */

#define VR_MAX_KEYS 32               /* distinct state keys per piece */
#define VR_MAX_POINTS (16L << 20)    /* per-step errors kept for --json and --plot, all tensors together */
#define VR_JSON_SCHEMA 8              /* 8: gradient_side, verdict kinds gradient, clip, step_counter (twin.c); 2: mode, reference, start_step, grads, not_replayed, tolerance per stat; 3: the events verdict and rows; 4: tensors' stage, expert, the hparams verdict; 5: gradients_compared a count; 6: continues, the resume verdict; 7: tolerance.update, update_counter */

typedef struct vstat {
  int rank, param;
  const vr_piece *pc;
  char key[VR_MAX_KEY + 1]; /* "" = the parameter itself */
  double max_abs, max_rel;
  uint64_t max_ulp;
  uint64_t nan_pairs;       /* elements NaN in both (equal, docs/nan-policy.md) */
  long compared;            /* recorded steps compared */
  long first_beyond;        /* first step beyond tolerance (0: never) */
  int no_ref;               /* the reference has no state of this key: not compared */
  double tol_first;         /* the tolerance at first_beyond (a projector's sin theta bound varies per refresh) */
  double allow;             /* a parameter's: the update allowance so far (absolute; verify_tol.update) */
  double worst_frac;        /* a parameter's: the largest error / bound of a step (with an update allowance) */
  int64_t ev_ours, ev_rec;  /* an events(...) statistic at first_beyond: our count and the recording's */
  long npts, cappts;
  long *pt_step;
  double *pt_rel;
} vstat;

typedef struct vpiece_keys {
  int nkeys;
  int stat[VR_MAX_KEYS + 1]; /* [0] the parameter; then one per state key, in first-seen order */
} vpiece_keys;

typedef struct vrank_rt {
  vpiece_keys *keys;   /* [npieces] */
} vrank_rt;

typedef struct vctx {
  const char *trace;
  const char *json_path, *svg_path;
  const char *ref_path;   /* --reference: a recording of the reference values (distopt.replay) */
  const char *twin_path;  /* --twin: a single-process twin's recording (distopt.twin) */
  vr_reader twin;
  /* twin.c: the first failure on the gradient side (0: none), its category ("gradient", "clip", "step_counter"),
   * parameter, rank (-1: none) and one line; what was compared */
  long tw_step;
  const char *tw_kind;
  int tw_param, tw_rank;
  char tw_why[2 * VR_MAX_NAME + 400];
  double tw_grad_worst;   /* the largest |g - G| / bound of a gradient element */
  int64_t tw_grad_compared, tw_counters_compared;
  double clip_worst;      /* the largest recorded norm's relative error / its bound */
  long clip_steps, clip_digests;
  double rtol;         /* > 0: --rtol */
  double rtol_param, rtol_state; /* > 0: --rtol-param, --rtol-state (each kind's own bound) */
  int quiet;
  int stepwise;           /* --stepwise: teacher-forced */
  vr_reader rd;         /* the recording: its index, source pieces and one open file per rank */
  vr_reader ref;          /* --reference's recording */
  const char *cont_path;  /* --continues: the recording this window continues */
  vr_reader cont;
  long cont_step;         /* the window's start when its recorded values are not PREV's (0: they are, or unchecked) */
  int cont_rank;
  char cont_tensor[VR_MAX_NAME + VR_MAX_KEY + 2];
  char cont_why[VR_MAX_KEY + 320];
  int64_t cont_compared;  /* elements (and step counts) compared */
  int *proj_stat;         /* [nparams] the sin theta statistic of a GaLore parameter's projector (-1: none yet) */
  int *ev_stat;           /* [nparams] its events(galore.refreshes) statistic (-1: none yet) */
  /* record.grad_agree: the first step at which two ranks' gradients of a parameter differ (0: none), the
   * parameter, the rank and the lowest rank it differs from; steps whose digests were looked at, and the
   * digests compared with another rank's (schema 5: only ranks holding the same pieces compare) */
  long agree_step, agree_checked, agree_compared;
  int agree_param, agree_rank, agree_base;
  int *agree_rep, *agree_first;     /* [nparams · world] each rank's form class (its lowest rank); [world] scratch */
  const unsigned char **agree_dig;  /* [world] scratch: each class's first digest of a step */
  float *scratch;         /* the largest parameter's elements: a reference tensor of --reference, a state */
  float *gath;            /* as many: a block piece's reference elements, gathered to compare */
  unsigned char *mask;    /* as many flags: which elements the ranks' pieces covered */
  size_t scratch_n;
  long not_replayed;      /* --stepwise: steps skipped (only a gradient digest, or no recorded state before) */
  long proj_adopted, proj_none; /* recorded projectors adopted / refreshes with no recorded projector */
  float **basis_prev;     /* [nparams · DOPT_MAX_STATES] SOAP: each basis' last recorded value (NULL: none yet) */
  long bases_adopted;     /* SOAP: recorded bases checked and adopted */
  char hook_err[5120];    /* the projector hook's failure (exit 2) */
  double tol_param, tol_state;
  double tol_update;      /* verify_tol.update when the declared bounds apply (0: none) */
  int update_counter;
  float **prev;           /* [nparams] with tol_update: the reference's parameters before the step */
  int *stepped_ns;        /* [nparams] with tol_update: the last step counted update_counter */
  float *gath_prev;       /* with tol_update: a block piece's elements of prev, gathered */
  const char *tol_source;
  const char *exact_states; /* the declared exact state keys ("a,b"; NULL: none), checked with bound 0 */
  dopt_optim *opt;
  float **data, **grad;   /* [nparams] */
  const float **gptr;     /* [nparams] by optimizer id (= index order) */
  vrank_rt *rt;           /* [world_size] */
  vstat *st;
  int nst, capst;
  long points;
  int truncated;
  long verdict_step;      /* 0: within tolerance */
  int verdict_stat;
  double verdict_value;
  long compared_steps;
} vctx;

/* A verdict found before the values: the recorder's hyperparameter disagreement (schema 4), or the gradients'
 * digests; the first of them at or before the values' first divergence, at its step the hyperparameters
 * first (a cause precedes its consequences: a wrong gradient, values). */
typedef struct early {
  const char *kind; /* "resume", "hparams", "gradients", "gradient", "clip", "step_counter"; NULL: none */
  long step;
  int rank;
  const char *tensor; /* the key or the parameter */
  char text[2 * VR_MAX_NAME + VR_MAX_KEY + 480];
} early;

/* ---- stats.c ---- */
/* One line "distopt verify: WHAT: <the library's last error>", CLI_USAGE. */
int vf_lib_error(const char *what, dopt_status s);
const verify_tol *vf_find_tol(const char *name);
/* The declared exact state keys of this optimizer and recorded class (NULL: none). */
const char *vf_exact_states(const char *name, const char *upstream);
/* The bound a state key is judged against: 0 for a declared exact one, else c->tol_state. */
double vf_state_tol(const vctx *c, const char *key);
int vf_new_stat(vctx *c, int rank, const vr_piece *pc, const char *key);
void vf_add_point(vctx *c, vstat *s, long step, double rel);
double vf_compare_f32(vstat *s, const void *rec_bytes, const float *ref, size_t n, double *maxref_out);
void vf_record_result(vctx *c, int si, long t, double rel, double tol);

/* ---- setup.c ---- */
int vf_file_for_step(vctx *c, int r, long t);
int vf_force_states(vctx *c, long t, int strict);
int vf_load_index(vctx *c);
int vf_piece_index(const vctx *c, int r, int param);
const float *vf_ref_param(vctx *c, int p, long t);
double vf_scalar_value(const dopt_st_tensor *x);
int vf_setup(vctx *c);
/* `other` (--reference REF, --twin TWIN: opt) is a one-process recording of the recording's parameters (names,
 * shapes, groups) over at least its steps; else CLI_USAGE after one line ("expected 1 (what)"). */
int vf_single_device_of(const vctx *c, const vr_reader *other, const char *opt, const char *what);
int vf_state_range(const vctx *c, const vr_piece *pc, const char *key, int64_t n, int64_t *lo, int64_t *len, int *mapped);
int vf_piece_state_range(const vr_piece *pc, int64_t numel, const char *key, int64_t n, int64_t *lo, int64_t *len,
                         int *mapped);

/* ---- projectors.c ---- */
int vf_check_refreshes(vctx *c, long t);
double vf_sin_theta(const float *Q, size_t ldq, const float *P, size_t rows, size_t r, int tr, double *defect);

/* The projector hook (dopt_projector_fn): the recorded projector of this refresh, checked and adopted. */
/* SOAP (optimizer.name soap): after the reference's step t, every basis Q<k> whose recorded value changed at t
 * (the first step's eigendecomposition, each QR refresh) is checked (dopt__soap_basis_check) and adopted; the
 * reference must have computed a new one at the same step. Statistic bases(Q) per parameter. */
int vf_adopt_bases(vctx *c, long t);
int vf_proj_hook(void *user, int param, int64_t step, const float *grad, int64_t m, int64_t n, int64_t r, float *left,
                 float *right);

/* ---- twin.c ---- */
/* --twin TWIN opened and checked against the recording (CLI_USAGE after one line). */
int vf_twin_open(vctx *c);
/* Step t, its gradients assembled (before the reference's step): against the twin's, the recorded clipping
 * checked and applied to them, the step counts against the twin's. */
int vf_twin_step(vctx *c, long t);

/* ---- continues.c ---- */
/* --continues: every element of the window's start (init/, init_state/) against PREV's after step start_step,
 * bitwise, matched by global index; a difference sets cont_step (the verdict); CLI_USAGE after one line. */
int vf_check_continues(vctx *c);

/* ---- replay.c ---- */
int vf_early_verdict(const vctx *c, early *e);
int vf_replay(vctx *c);

/* ---- report.c ---- */
void vf_print_table(const vctx *c);
void vf_stat_name(const vctx *c, const vstat *s, char *buf, size_t cap);
/* vf_stat_name escaped by the one rule (dopt__escape), for the terminal (cap: 4× the name's bytes suffice) */
void vf_stat_label(const vctx *c, const vstat *s, char *buf, size_t cap);
/* --json FILE, --plot FILE.svg: CLI_OK, or CLI_USAGE (2) after one line. */
int vf_write_json(const vctx *c, const char *path);
int vf_write_svg(const vctx *c, const char *path);

#endif

/* distopt verify: replay a recorded PyTorch run (distopt.record, docs/verify.md)
 * through the reference optimizer and compare.
 *
 *   distopt verify TRACE [--stepwise] [--reference REF] [--continues PREV] [--rtol X] [--json FILE]
 *                  [--plot FILE.svg] [--quiet]
 *
 * TRACE is the recording's directory (or its index.json). The reference
 * optimizer is created with the recorded name, hyperparameters and groups;
 * the initial parameters and, every step, the gradients are assembled from
 * the ranks' pieces (the lowest rank of identical pieces supplies them); after
 * every step each recorded parameter and state piece of every rank is
 * compared with the reference's elements: max abs error, max ULP distance and
 * the normwise relative error max|rec - ref| / max|ref| (docs/golden.md's
 * metric), against the optimizer's declared tolerance (verify_tolerances
 * below) or --rtol. Step counters ("step" states) must be equal.
 *
 * --stepwise (teacher-forced): before each step the reference takes the
 * recorded parameters and states of the step before (assembled from the
 * ranks' pieces), so each comparison measures one step's rounding and the
 * verdict names the step where the computations first parted; the per-step
 * tolerances below apply. --reference REF: the reference is not the C
 * optimizer but a recording REF of the reference values (distopt.replay
 * writes it from the user's own single-device torch optimizer); the same
 * comparison and report. A window (start_step > 0) starts the reference from
 * the recorded states at its start; GaLore recordings with projectors have
 * each recorded projector checked against ours (sin theta) and adopted. --continues PREV: the window's start
 * must be, bit for bit, what PREV (the recording of the run up to it, any world size and layout) recorded
 * after that step (a resume that carried a state over wrongly is named at the window's start).
 *
 * The verifier is verify/ (verifier.h: setup, projectors, replay and verdict, reports); the recording is
 * read through verify/verify_reader.c (verify.h; shared with `distopt compare --trace` on a recording): one
 * loaded block per rank.
 *
 * Exit 0: every compared tensor within tolerance at every recorded step;
 * 1: one is not (the verdict names the first step, tensor and rank);
 * 2: bad usage or input (one line; the reference could not replay it). */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "cli.h"
#include "files.h"
#include "verifier.h"


static void usage(FILE *f) {
  fputs("usage: distopt verify TRACE [--stepwise] [--reference REF] [--twin TWIN] [--continues PREV] [--rtol X]\n"
        "                      [--rtol-param X] [--rtol-state X] [--json FILE] [--plot FILE.svg] [--quiet]\n"
        "  Replays a run recorded by distopt.record (TRACE: its directory, or its index.json; docs/verify.md)\n"
        "  through the reference optimizer: the recorded initial parameters and gradients, step by step, and\n"
        "  compares every recorded parameter and state (per rank for sharded recordings) with the reference:\n"
        "  max abs error, max ULP distance, normwise relative error max|rec-ref|/max|ref|, first step beyond the\n"
        "  tolerance. Tolerance: the optimizer's declared one (normwise relative, parameters and states), or\n"
        "  --rtol X for both, --rtol-param X / --rtol-state X for one kind (the other: --rtol, else declared).\n"
        "  States the arithmetic makes exact (declared per optimizer and upstream class: Muon's momentum_buffer)\n"
        "  are compared bitwise whatever the bounds. Step counters must be equal.\n"
        "  --stepwise: teacher-forced; each step starts from the recorded parameters and states of the step before,\n"
        "  so the error is one step's rounding and the verdict names the step where the computations parted.\n"
        "  --reference REF: compare with REF, a recording of reference values (distopt.replay), not the C reference.\n"
        "  --twin TWIN: also check each step's gradient against TWIN, a single-process twin of the training\n"
        "  (distopt.twin), and every step count against its training steps. A recording made with clipping\n"
        "  (record.clip) has its norms, coefficients and clipped gradients checked, and the replay clips.\n"
        "  --continues PREV: TRACE is a window (a resumed run) of the run PREV recorded up to its start: every value\n"
        "  it starts from must be PREV's after that step, bit for bit, whatever each side's layout.\n"
        "  --json FILE: the per-step record (\"schema_version\": 8); --plot FILE.svg: error vs step per tensor.\n"
        "  Exit: 0 within tolerance, 1 diverged (names the first step, tensor and rank), 2 bad usage or input.\n",
        f);
}

static int parse_args(vctx *c, int argc, char **argv) {
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
      usage(stdout);
      exit(CLI_OK);
    }
    if (strcmp(a, "--quiet") == 0) {
      c->quiet = 1;
      continue;
    }
    if (strcmp(a, "--stepwise") == 0) {
      c->stepwise = 1;
      continue;
    }
    if (a[0] == '-' && a[1] == '-') {
      if (i + 1 >= argc) return cli_errorf(CMD, "option '%s' needs a value (or is unknown)", a);
      const char *v = argv[++i];
      if (strcmp(a, "--json") == 0) c->json_path = v;
      else if (strcmp(a, "--plot") == 0) c->svg_path = v;
      else if (strcmp(a, "--reference") == 0) c->ref_path = v;
      else if (strcmp(a, "--continues") == 0) c->cont_path = v;
      else if (strcmp(a, "--twin") == 0) c->twin_path = v;
      else if (strcmp(a, "--rtol") == 0 || strcmp(a, "--rtol-param") == 0 || strcmp(a, "--rtol-state") == 0) {
        double *dst = a[6] == '\0' ? &c->rtol : a[7] == 'p' ? &c->rtol_param : &c->rtol_state;
        char *end;
        errno = 0;
        *dst = strtod(v, &end);
        if (end == v || *end || errno || !(*dst > 0.0) || !isfinite(*dst))
          return cli_errorf(CMD, "%s '%s': expected a positive number", a, v);
      } else return cli_errorf(CMD, "unknown option '%s' (see --help)", a);
      continue;
    }
    if (c->trace) return cli_errorf(CMD, "more than one TRACE given ('%s' and '%s')", c->trace, a);
    c->trace = a;
  }
  if (!c->trace) return cli_errorf(CMD, "TRACE (a recording's directory) is required (see --help)");
  if (c->json_path && !c->json_path[0]) return cli_errorf(CMD, "--json: empty path");
  if (c->svg_path && !c->svg_path[0]) return cli_errorf(CMD, "--plot: empty path");
  if (c->ref_path && !c->ref_path[0]) return cli_errorf(CMD, "--reference: empty path");
  if (c->cont_path && !c->cont_path[0]) return cli_errorf(CMD, "--continues: empty path");
  if (c->twin_path && !c->twin_path[0]) return cli_errorf(CMD, "--twin: empty path");
  if (c->twin_path && c->ref_path)
    return cli_errorf(CMD, "--twin with --reference: the twin's check runs beside the C reference's replay only");
  /* the one rule for outputs; neither may be, or lie inside, the recording (its folder) */
  char rec[4096];
  struct stat st;
  if (stat(c->trace, &st) == 0 && !S_ISDIR(st.st_mode)) dopt__path_parent(c->trace, rec); /* TRACE/index.json */
  else snprintf(rec, sizeof rec, "%s", c->trace);
  char refdir[4096];
  if (c->ref_path && stat(c->ref_path, &st) == 0 && !S_ISDIR(st.st_mode)) dopt__path_parent(c->ref_path, refdir);
  else snprintf(refdir, sizeof refdir, "%s", c->ref_path ? c->ref_path : "");
  char twindir[4096];
  if (c->twin_path && stat(c->twin_path, &st) == 0 && !S_ISDIR(st.st_mode)) dopt__path_parent(c->twin_path, twindir);
  else snprintf(twindir, sizeof twindir, "%s", c->twin_path ? c->twin_path : "");
  char contdir[4096];
  if (c->cont_path && stat(c->cont_path, &st) == 0 && !S_ISDIR(st.st_mode)) dopt__path_parent(c->cont_path, contdir);
  else snprintf(contdir, sizeof contdir, "%s", c->cont_path ? c->cont_path : "");
  const cli_path outs[] = {{"--json", c->json_path, 0}, {"--plot", c->svg_path, 0}};
  const cli_path ins[] = {{"TRACE", rec, 1}, {"--reference", c->ref_path ? refdir : NULL, 1},
                          {"--continues", c->cont_path ? contdir : NULL, 1}, {"--twin", c->twin_path ? twindir : NULL, 1}};
  return cli_check_paths(CMD, outs, 2, ins, 4);
}

/* ---- entry --------------------------------------------------------------------------- */

static void cleanup(vctx *c) {
  for (int p = 0; p < c->rd.ix.nparams; p++) {
    if (c->data) free(c->data[p]);
    if (c->grad) free(c->grad[p]);
  }
  free(c->data);
  free(c->grad);
  free(c->agree_rep); /* agree_first lies in it */
  free((void *)c->agree_dig);
  free(c->gptr);
  for (int r = 0; c->rt && r < c->rd.ix.world_size; r++) free(c->rt[r].keys);
  free(c->rt);
  for (int i = 0; i < c->nst; i++) {
    free(c->st[i].pt_step);
    free(c->st[i].pt_rel);
  }
  free(c->st);
  free(c->proj_stat);
  free(c->ev_stat);
  free(c->scratch);
  free(c->gath);
  for (int p = 0; c->prev && p < c->rd.ix.nparams; p++) free(c->prev[p]);
  free(c->prev);
  free(c->stepped_ns);
  free(c->gath_prev);
  free(c->mask);
  dopt_optim_destroy(c->opt);
  vr_reader_close(&c->rd);
  if (c->ref_path) vr_reader_close(&c->ref);
  if (c->cont_path) vr_reader_close(&c->cont);
  if (c->twin_path) vr_reader_close(&c->twin);
}

int cmd_verify(int argc, char **argv) {
  vctx c;
  memset(&c, 0, sizeof c);
  int rc = parse_args(&c, argc, argv);
  if (rc == CLI_OK) rc = vf_load_index(&c);
  if (rc == CLI_OK) rc = vf_setup(&c);
  if (rc == CLI_OK && c.cont_path) rc = vf_check_continues(&c);
  if (rc == CLI_OK) rc = vf_replay(&c);
  if (rc == CLI_OK && !c.quiet) vf_print_table(&c);
  if (rc == CLI_OK && c.json_path) rc = vf_write_json(&c, c.json_path);
  if (rc == CLI_OK && c.svg_path) rc = vf_write_svg(&c, c.svg_path);
  if (rc == CLI_OK && c.quiet) {
    /* the verdict line alone */
    early e;
    if (vf_early_verdict(&c, &e)) {
      char et[4 * sizeof e.text];
      cli_escaped(e.text, et, sizeof et);
      printf("verdict: %s\n", et);
    } else if (c.verdict_step) {
      char name[4 * (VR_MAX_NAME + VR_MAX_KEY + 2)];
      vf_stat_label(&c, &c.st[c.verdict_stat], name, sizeof name);
      printf("verdict: DIVERGED at step %ld (tensor %s, rank %d)\n", c.verdict_step, name, c.st[c.verdict_stat].rank);
    } else {
      printf("verdict: WITHIN TOLERANCE\n");
    }
  }
  if (rc == CLI_OK && (c.verdict_step || c.agree_step || c.rd.ix.disagree.step || c.cont_step || c.tw_step))
    rc = CLI_FAIL;
  fflush(stdout);
  cleanup(&c);
  return rc;
}

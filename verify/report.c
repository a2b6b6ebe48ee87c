/* distopt verify, the reports (verifier.h): the table, the --json record and the --plot SVG. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "files.h"
#include "verifier.h"

/* ---- reports ------------------------------------------------------------------------- */

void vf_stat_name(const vctx *c, const vstat *s, char *buf, size_t cap) {
  const char *pn = c->rd.ix.params[s->param].name;
  if (s->key[0]) snprintf(buf, cap, "%s/%s", pn, s->key);
  else snprintf(buf, cap, "%s", pn);
}

/* What the terminal report echoes from the recording (names, keys, hyperparameter and version strings) goes
 * through cli_escaped; the JSON and SVG reports carry the raw text in their own escaping. */
void vf_stat_label(const vctx *c, const vstat *s, char *buf, size_t cap) {
  char raw[VR_MAX_NAME + VR_MAX_KEY + 2];
  vf_stat_name(c, s, raw, sizeof raw);
  cli_escaped(raw, buf, cap);
}

static void piece_text(const vctx *c, const vstat *s, char *buf, size_t cap) {
  const vr_param *vp = &c->rd.ix.params[s->param];
  const dopt_layout_piece *lp = &s->pc->lp;
  int k;
  if (lp->block_dim < 0 && lp->lo == 0 && lp->len == vp->numel) k = snprintf(buf, cap, "whole");
  else if (lp->block_dim < 0) k = snprintf(buf, cap, "[%lld,%lld)", (long long)lp->lo, (long long)(lp->lo + lp->len));
  else if (lp->lo == 0 && lp->len == dopt_layout_piece_extent(vp->ndim, vp->shape, lp))
    k = snprintf(buf, cap, "d%d[%lld,%lld)", lp->block_dim, (long long)lp->block_lo, (long long)(lp->block_lo + lp->block_len));
  else k = snprintf(buf, cap, "d%d[%lld,%lld)[%lld,%lld)", lp->block_dim, (long long)lp->block_lo,
                    (long long)(lp->block_lo + lp->block_len), (long long)lp->lo, (long long)(lp->lo + lp->len));
  if (k >= 0 && (size_t)k < cap && lp->stage >= 0) k += snprintf(buf + k, cap - (size_t)k, " s%d", lp->stage);
  if (k >= 0 && (size_t)k < cap && lp->expert >= 0) snprintf(buf + k, cap - (size_t)k, " e%d", lp->expert);
}

static int text_width(const char *s) {
  int w = 0;
  for (; *s; s++) w += ((unsigned char)*s & 0xC0) != 0x80;
  return w;
}

/* Rows: parameters in index order, each rank's piece, its states indented. */
static int *row_order(const vctx *c) {
  int *o = malloc((size_t)(c->nst > 0 ? c->nst : 1) * sizeof *o), k = 0;
  if (!o) return NULL;
  for (int p = 0; p < c->rd.ix.nparams; p++)
    for (int r = 0; r < c->rd.ix.world_size; r++) {
      int i = vf_piece_index(c, r, p);
      if (i < 0) continue;
      const vpiece_keys *pk = &c->rt[r].keys[i];
      for (int j = 0; j <= pk->nkeys; j++) o[k++] = pk->stat[j];
    }
  return o;
}

void vf_print_table(const vctx *c) {
  const vr_index *ix = &c->rd.ix;
  char e1[4 * sizeof ix->optimizer], e2[4 * sizeof ix->group_hparams[0]], e3[4 * sizeof ix->upstream];
  cli_escaped(ix->optimizer[0] ? ix->optimizer : "(no distopt optimizer)", e1, sizeof e1);
  cli_escaped(ix->group_hparams[0][0] ? ix->group_hparams[0] : "(defaults)", e2, sizeof e2);
  cli_escaped(ix->upstream, e3, sizeof e3);
  printf("verify: %s %s%s%s\n", e1, e2, ix->upstream[0] ? " | recorded from " : "", e3);
  for (int g = 1; g < ix->ngroups; g++) {
    cli_escaped(ix->group_hparams[g], e2, sizeof e2);
    printf("  group %d: %s\n", g, e2);
  }
  char e4[4 * sizeof ix->torch_version], e5[4 * sizeof ix->cpu_capability];
  cli_escaped(ix->torch_version[0] ? ix->torch_version : "?", e4, sizeof e4);
  cli_escaped(ix->cpu_capability[0] ? ix->cpu_capability : "?", e5, sizeof e5);
  printf("  torch %s (CPU capability %s) | world size %d | %ld step%s, parameters and states every %ld | %s%s\n", e4,
         e5, ix->world_size, ix->steps, ix->steps == 1 ? "" : "s", ix->every, c->trace,
         ix->complete ? "" : " (interrupted: a prefix)");
  if (c->ref_path) printf("  reference: %s (a recording of reference values, distopt.replay)\n", c->ref_path);
  printf("  mode: %s\n", c->stepwise ? "stepwise (teacher-forced: each step starts from the recorded state before it)"
                                     : "accumulated (the reference runs freely from the recorded start)");
  if (ix->start_step) printf("  window: steps %ld..%ld (the reference starts from the states recorded at step %ld)\n",
                             ix->start_step + 1, ix->steps, ix->start_step);
  if (ix->grads == VR_GRADS_BF16) printf("  gradients recorded as bf16 (the replay's gradients are rounded)\n");
  if (c->not_replayed) printf("  %ld step%s not replayed (only gradient digests, or no recorded state before)\n",
                              c->not_replayed, c->not_replayed == 1 ? "" : "s");
  if (c->bases_adopted)
    printf("  SOAP bases: %ld recorded one%s adopted after the check (the first: an eigenbasis of our preconditioner; "
           "refreshes: within the QR's bound of ours)\n", c->bases_adopted, c->bases_adopted == 1 ? "" : "s");
  if ((c->proj_adopted || c->proj_none) && strcmp(ix->optimizer, "apollo") == 0)
    printf("  APOLLO projections: %ld recorded draw%s adopted, %ld refresh%s without one (our generator)\n",
           c->proj_adopted, c->proj_adopted == 1 ? "" : "s", c->proj_none, c->proj_none == 1 ? "" : "es");
  else if (c->proj_adopted || c->proj_none)
    printf("  GaLore projectors: %ld recorded one%s adopted after the subspace check, %ld refresh%s without one (our "
           "SVD)\n", c->proj_adopted, c->proj_adopted == 1 ? "" : "s", c->proj_none, c->proj_none == 1 ? "" : "es");
  if (ix->clip_max_norm > 0)
    printf("  clipping (record.clip, max_norm %g): %ld clipped step%s replayed from the gradients before clipping; "
           "recorded norms at most %.3g of their bound, %ld clipped piece%s equal to the piece times its coefficient\n",
           ix->clip_max_norm, c->clip_steps, c->clip_steps == 1 ? "" : "s", c->clip_worst, c->clip_digests,
           c->clip_digests == 1 ? "" : "s");
  if (ix->construction_steps)
    printf("  construction steps: %ld of the %ld steps before the window were the framework's, not training steps\n",
           ix->construction_steps, ix->start_step);
  if (c->twin_path)
    printf("  twin: %s (%ld micro-batch gradients a step, %ld construction step%s declared): %lld gradient elements "
           "at most %.3g of their bound, %lld step counts compared\n",
           c->twin_path, c->twin.ix.twin_terms, c->twin.ix.twin_construction,
           c->twin.ix.twin_construction == 1 ? "" : "s", (long long)c->tw_grad_compared, c->tw_grad_worst,
           (long long)c->tw_counters_compared);
  if (ix->nchanges && !c->ref_path)
    printf("  %ld hyperparameter change%s replayed (an lr schedule)\n", ix->nchanges, ix->nchanges == 1 ? "" : "s");
  printf("  tolerance (normwise relative max|rec-ref|/max|ref|): parameters %g, states %g (%s%s%s); step counts exact"
         "%s%s%s\n",
         c->tol_param, c->tol_state, c->tol_source, strncmp(c->tol_source, "declared", 8) == 0 ? " for " : "",
         strncmp(c->tol_source, "declared", 8) == 0 ? ix->optimizer : "", c->exact_states ? "; exact (declared): " : "",
         c->exact_states ? c->exact_states : "", c->exact_states ? " bitwise" : "");
  if (c->tol_update > 0)
    printf("  parameters whose step ran %s: + %g of %s change of the reference's parameter (a bf16 update; "
           "docs/verify.md)\n", dopt_counter_name(c->update_counter), c->tol_update,
           c->stepwise ? "the step's" : "each step's, summed,");
  int *order = row_order(c);
  int namew = 6;
  char name[4 * (VR_MAX_NAME + VR_MAX_KEY + 2)], piece[128];
  for (int i = 0; i < c->nst; i++) {
    vf_stat_label(c, &c->st[i], name, sizeof name);
    int w = text_width(name) + (c->st[i].key[0] ? 2 : 0);
    if (w > namew) namew = w;
  }
  printf("%4s  %-*s  %-13s  %11s  %10s  %11s  %2s  %s\n", "rank", namew, "tensor", "piece", "max abs err", "max ULP",
         "max rel err", "ok", "first beyond");
  for (int k = 0; k < c->nst; k++) {
    const vstat *s = &c->st[order ? order[k] : k];
    if (s->compared == 0 && !s->no_ref) continue; /* nothing recorded for it */
    vf_stat_label(c, s, name, sizeof name);
    piece_text(c, s, piece, sizeof piece);
    int ind = s->key[0] ? 2 : 0;
    printf("%4d  %*s%s%*s  %-13s", s->rank, ind, "", name, namew - ind - text_width(name), "", s->key[0] ? "" : piece);
    if (s->no_ref) {
      printf("  (not compared: the reference keeps no F32 state '%s')\n", s->key);
      continue;
    }
    char first[24] = "-";
    if (s->first_beyond) snprintf(first, sizeof first, "%ld", s->first_beyond);
    printf("  %11.3g  %10llu  %11.3g  %s   %s\n", s->max_abs, (unsigned long long)s->max_ulp, s->max_rel,
           s->first_beyond ? "\xE2\x9C\x97" : "\xE2\x9C\x93", first);
  }
  free(order);
  uint64_t nan = 0;
  for (int i = 0; i < c->nst; i++) nan += c->st[i].nan_pairs;
  if (nan) printf("NaN on both sides (equal under the NaN policy): %llu element-steps at most\n", (unsigned long long)nan);
  double wp = 0, ws = 0;
  int ncmp = 0, np = 0, ns = 0;
  for (int i = 0; i < c->nst; i++) {
    const vstat *s = &c->st[i];
    if (!s->compared) continue;
    ncmp++;
    if (strcmp(s->key, "step") == 0) continue;
    if (strncmp(s->key, "bases(", 6) == 0) continue; /* a check against its own bound (its row says how close) */
    if (s->key[0]) ws = s->max_rel > ws ? s->max_rel : ws, ns++;
    else wp = s->max_rel > wp ? s->max_rel : wp, np++;
  }
  if (c->rd.ix.grad_agree && c->agree_compared == 0) /* never "equal" for a comparison that did not happen */
    printf("gradients: no digest compared at %ld step%s (no two ranks hold the same piece of any parameter)\n",
           c->agree_checked, c->agree_checked == 1 ? "" : "s");
  else if (c->rd.ix.grad_agree)
    printf("gradients: %ld digest%s compared with another rank's at %ld step%s%s\n", c->agree_compared,
           c->agree_compared == 1 ? "" : "s", c->agree_checked, c->agree_checked == 1 ? "" : "s",
           c->agree_step ? " (until the first difference)" : ", all equal");
  if (c->cont_path)
    printf("continues %s: %lld values the window starts from compared with the values it recorded after step %ld, %s\n",
           c->cont.index_path, (long long)c->cont_compared, ix->start_step,
           c->cont_step ? "not all equal" : "all equal, bit for bit");
  early e;
  if (vf_early_verdict(c, &e)) {
    char et[4 * sizeof e.text];
    cli_escaped(e.text, et, sizeof et);
    printf("verdict: %s\n", et);
  } else if (!c->verdict_step) {
    char pw[64] = "none recorded", sw[64] = "none recorded";
    double frac = 0;
    for (int i = 0; i < c->nst; i++) frac = c->st[i].worst_frac > frac ? c->st[i].worst_frac : frac;
    if (np && c->tol_update > 0) snprintf(pw, sizeof pw, "%.3g, at most %.2g of its bound", wp, frac);
    else if (np) snprintf(pw, sizeof pw, "%.3g of %g", wp, c->tol_param);
    if (ns) snprintf(sw, sizeof sw, "%.3g of %g", ws, c->tol_state);
    printf("verdict: WITHIN TOLERANCE (worst normwise relative error: parameters %s, states %s; "
           "%d tensor%s, %ld recorded step%s, %d rank%s)\n",
           pw, sw, ncmp, ncmp == 1 ? "" : "s", c->compared_steps, c->compared_steps == 1 ? "" : "s", ix->world_size,
           ix->world_size == 1 ? "" : "s");
  } else {
    const vstat *s = &c->st[c->verdict_stat];
    vf_stat_label(c, s, name, sizeof name);
    if (strcmp(s->key, "step") == 0)
      printf("verdict: DIVERGED at step %ld (tensor %s, rank %d: the step count differs from the reference's)\n",
             c->verdict_step, name, s->rank);
    else if (strncmp(s->key, "sin_theta(", 10) == 0)
      printf("verdict: DIVERGED at step %ld (tensor %s, rank %d: the recorded projector's subspace is %.3g from ours, "
             "beyond the bound %.3g)\n", c->verdict_step, name, s->rank, c->verdict_value, s->tol_first);
    else if (strncmp(s->key, "bases(", 6) == 0)
      printf("verdict: DIVERGED at step %ld (tensor %s, rank %d: a recorded SOAP basis fails its check against ours "
             "(%.3g of its bound; inf: changed on one side only))\n", c->verdict_step, name, s->rank,
             c->verdict_value);
    else if (strncmp(s->key, "events(", 7) == 0)
      printf("verdict: DIVERGED at step %ld (events: galore.refreshes of %s: reference %lld, recorded %lld)\n",
             c->verdict_step, ix->params[s->param].name, (long long)s->ev_ours, (long long)s->ev_rec);
    else
      printf("verdict: DIVERGED at step %ld (%stensor %s, rank %d: normwise relative error %.3g > %.3g)\n",
             c->verdict_step, c->twin_path || ix->clip_max_norm > 0 ? "update: " : "", name, s->rank,
             c->verdict_value, s->tol_first);
  }
}

/* --json / --plot after the replay: written atomically by the one rule for outputs (core/files.h); a failure
 * here is the run's (exit 1), its input was checked before the replay. */
static int write_output(const vctx *c, const char *path, int (*body)(FILE *f, const void *ctx), const char *what) {
  dopt_status s = dopt__write_stream(path, DOPT_W_OUTPUT, body, c);
  if (s == DOPT_OK) return CLI_OK;
  return vf_lib_error(what, s); /* an I/O failure: 2, never the divergence's 1 */
}

static int json_body(FILE *f, const void *ctx) {
  const vctx *c = ctx;
  const vr_index *ix = &c->rd.ix;
  cJSON *root = cJSON_CreateObject();
  if (!root) return 0;
  char name[VR_MAX_NAME + VR_MAX_KEY + 2];
  cJSON_AddNumberToObject(root, "schema_version", VR_JSON_SCHEMA);
  cJSON_AddStringToObject(root, "kind", "distopt-verify");
  cJSON_AddStringToObject(root, "trace", c->trace);
  cJSON_AddStringToObject(root, "optimizer", ix->optimizer);
  cJSON *groups = cJSON_AddArrayToObject(root, "hparams");
  for (int g = 0; groups && g < ix->ngroups; g++) cJSON_AddItemToArray(groups, cJSON_CreateString(ix->group_hparams[g]));
  cJSON_AddStringToObject(root, "upstream", ix->upstream);
  cJSON_AddStringToObject(root, "torch_version", ix->torch_version);
  cJSON_AddStringToObject(root, "cpu_capability", ix->cpu_capability);
  cJSON_AddNumberToObject(root, "world_size", ix->world_size);
  cJSON_AddNumberToObject(root, "steps", (double)ix->steps);
  cJSON_AddBoolToObject(root, "complete", ix->complete);
  cJSON_AddStringToObject(root, "mode", c->stepwise ? "stepwise" : "accumulated");
  cJSON_AddStringToObject(root, "reference", c->ref_path ? "recording" : "distopt");
  cJSON_AddNumberToObject(root, "start_step", (double)ix->start_step);
  cJSON_AddStringToObject(root, "grads", ix->grads == VR_GRADS_BF16 ? "BF16" : "F32");
  cJSON_AddNumberToObject(root, "not_replayed", (double)c->not_replayed);
  cJSON_AddNumberToObject(root, "projectors_adopted", (double)c->proj_adopted);
  cJSON_AddNumberToObject(root, "bases_adopted", (double)c->bases_adopted);
  cJSON *tol = cJSON_AddObjectToObject(root, "tolerance");
  if (tol) {
    cJSON_AddStringToObject(tol, "metric", "normwise_relative");
    cJSON_AddNumberToObject(tol, "param", c->tol_param);
    cJSON_AddNumberToObject(tol, "state", c->tol_state);
    cJSON_AddStringToObject(tol, "source", c->tol_source);
    cJSON_AddNumberToObject(tol, "update", c->tol_update); /* schema 7: the update allowance (0: none) */
    if (c->tol_update > 0) cJSON_AddStringToObject(tol, "update_counter", dopt_counter_name(c->update_counter));
    cJSON *ex = cJSON_AddArrayToObject(tol, "exact_states"); /* schema 6: compared with bound 0 */
    for (const char *e = c->exact_states; ex && e && *e;) {
      const char *comma = strchr(e, ',');
      char key[VR_MAX_KEY + 1];
      snprintf(key, sizeof key, "%.*s", (int)(comma ? comma - e : (long)strlen(e)), e);
      cJSON_AddItemToArray(ex, cJSON_CreateString(key));
      e = comma ? comma + 1 : NULL;
    }
  }
  cJSON_AddBoolToObject(root, "per_step_truncated", c->truncated);
  cJSON *ts = cJSON_AddArrayToObject(root, "tensors");
  int *order = row_order(c);
  for (int k = 0; ts && k < c->nst; k++) {
    const vstat *s = &c->st[order ? order[k] : k];
    if (s->compared == 0 && !s->no_ref) continue;
    cJSON *o = cJSON_CreateObject();
    if (!o) break;
    cJSON_AddItemToArray(ts, o);
    vf_stat_name(c, s, name, sizeof name);
    cJSON_AddStringToObject(o, "name", name);
    cJSON_AddStringToObject(o, "param", ix->params[s->param].name);
    if (s->key[0]) cJSON_AddStringToObject(o, "state", s->key);
    else cJSON_AddNullToObject(o, "state");
    cJSON_AddNumberToObject(o, "rank", s->rank);
    cJSON_AddNumberToObject(o, "lo", (double)s->pc->lp.lo);
    cJSON_AddNumberToObject(o, "len", (double)s->pc->lp.len);
    if (s->pc->lp.block_dim >= 0) {
      cJSON *bj = cJSON_AddObjectToObject(o, "block");
      if (bj) {
        cJSON_AddNumberToObject(bj, "dim", s->pc->lp.block_dim);
        cJSON_AddNumberToObject(bj, "lo", (double)s->pc->lp.block_lo);
        cJSON_AddNumberToObject(bj, "len", (double)s->pc->lp.block_len);
      }
    }
    if (s->pc->lp.stage >= 0) cJSON_AddNumberToObject(o, "stage", s->pc->lp.stage);
    if (s->pc->lp.expert >= 0) cJSON_AddNumberToObject(o, "expert", s->pc->lp.expert);
    cJSON_AddBoolToObject(o, "compared", !s->no_ref);
    cJSON_AddNumberToObject(o, "max_abs", s->max_abs);
    cJSON_AddNumberToObject(o, "max_ulp", (double)s->max_ulp); /* above 2^53 rounded; UINT64_MAX: NaN vs number */
    cJSON_AddNumberToObject(o, "max_rel", s->max_rel);
    cJSON_AddNumberToObject(o, "nan_pairs", (double)s->nan_pairs);
    if (s->first_beyond) cJSON_AddNumberToObject(o, "first_beyond", (double)s->first_beyond);
    else cJSON_AddNullToObject(o, "first_beyond");
    if (s->first_beyond) cJSON_AddNumberToObject(o, "tolerance_at_first_beyond", s->tol_first);
    cJSON *st = cJSON_AddArrayToObject(o, "steps"), *rl = cJSON_AddArrayToObject(o, "rel_per_step");
    for (long i = 0; st && rl && i < s->npts; i++) {
      cJSON_AddItemToArray(st, cJSON_CreateNumber((double)s->pt_step[i]));
      cJSON_AddItemToArray(rl, cJSON_CreateNumber(s->pt_rel[i]));
    }
  }
  free(order);
  cJSON *v = cJSON_AddObjectToObject(root, "verdict");
  cJSON_AddNumberToObject(root, "gradients_compared", (double)c->agree_compared); /* digests compared (schema 5) */
  if (c->twin_path || c->rd.ix.clip_max_norm > 0) { /* schema 8: the gradient side (twin.c) */
    cJSON *o = cJSON_AddObjectToObject(root, "gradient_side");
    if (o) {
      if (c->twin_path) cJSON_AddStringToObject(o, "twin", c->twin.index_path);
      else cJSON_AddNullToObject(o, "twin");
      cJSON_AddNumberToObject(o, "gradient_elements", (double)c->tw_grad_compared);
      cJSON_AddNumberToObject(o, "gradient_worst_of_bound", c->tw_grad_worst);
      cJSON_AddNumberToObject(o, "step_counts", (double)c->tw_counters_compared);
      cJSON_AddNumberToObject(o, "clip_steps", (double)c->clip_steps);
      cJSON_AddNumberToObject(o, "clip_norm_worst_of_bound", c->clip_worst);
      cJSON_AddNumberToObject(o, "clipped_pieces", (double)c->clip_digests);
    }
  } else {
    cJSON_AddNullToObject(root, "gradient_side");
  }
  if (c->cont_path) { /* schema 6: --continues PREV */
    cJSON *o = cJSON_AddObjectToObject(root, "continues");
    if (o) {
      cJSON_AddStringToObject(o, "recording", c->cont.index_path);
      cJSON_AddNumberToObject(o, "step", (double)c->rd.ix.start_step);
      cJSON_AddNumberToObject(o, "compared", (double)c->cont_compared);
      cJSON_AddBoolToObject(o, "equal", !c->cont_step);
    }
  } else {
    cJSON_AddNullToObject(root, "continues");
  }
  early e;
  if (v && vf_early_verdict(c, &e)) {
    cJSON_AddStringToObject(v, "kind", e.kind);
    cJSON_AddNumberToObject(v, "step", (double)e.step);
    cJSON_AddStringToObject(v, "tensor", e.tensor);
    cJSON_AddNumberToObject(v, "rank", e.rank);
  } else if (v && !c->verdict_step) {
    cJSON_AddStringToObject(v, "kind", "within_tolerance");
    cJSON_AddNullToObject(v, "step");
    cJSON_AddNullToObject(v, "tensor");
    cJSON_AddNullToObject(v, "rank");
  } else if (v) {
    const vstat *s = &c->st[c->verdict_stat];
    vf_stat_name(c, s, name, sizeof name);
    cJSON_AddStringToObject(v, "kind", strcmp(s->key, "step") == 0                ? "step_counter"
                                       : strncmp(s->key, "sin_theta(", 10) == 0 ? "projector"
                                       : strncmp(s->key, "bases(", 6) == 0      ? "basis"
                                       : strncmp(s->key, "events(", 7) == 0     ? "events"
                                                                                : "diverged");
    cJSON_AddNumberToObject(v, "step", (double)c->verdict_step);
    cJSON_AddStringToObject(v, "tensor", name);
    cJSON_AddNumberToObject(v, "rank", s->rank);
    cJSON_AddNumberToObject(v, "rel", c->verdict_value);
  }
  char *text = cJSON_Print(root);
  cJSON_Delete(root);
  if (!text) return 0;
  int ok = fputs(text, f) >= 0 && fputc('\n', f) != EOF;
  free(text);
  return ok;
}

/* ---- SVG: normwise relative error against step, per tensor, with the tolerances ------------- */


#define SV_W 960
#define SV_H 540
#define SV_L 80.0
#define SV_R 660.0
#define SV_T 70.0
#define SV_B 470.0

static double sv_y(double v, int dlo, int dhi) {
  if (!(v > 0.0)) return SV_B;
  if (isinf(v)) return SV_T;
  double y = SV_B - (log10(v) - dlo) / (double)(dhi - dlo) * (SV_B - SV_T);
  return y < SV_T ? SV_T : y > SV_B ? SV_B : y;
}

static int svg_body(FILE *f, const void *ctx) {
  const vctx *c = ctx;
  static const char *const pal[] = {"#1f77b4", "#d62728", "#ff7f0e", "#9467bd", "#2ca02c",
                                    "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f"};
  double mn = INFINITY, mx = 0;
  for (int i = 0; i < c->nst; i++)
    for (long k = 0; k < c->st[i].npts; k++) {
      double v = c->st[i].pt_rel[k];
      if (v > 0 && isfinite(v)) {
        if (v < mn) mn = v;
        if (v > mx) mx = v;
      }
    }
  double lo_t = c->tol_param < c->tol_state ? c->tol_param : c->tol_state;
  double hi_t = c->tol_param > c->tol_state ? c->tol_param : c->tol_state;
  if (lo_t < mn) mn = lo_t;
  if (hi_t > mx) mx = hi_t;
  int dlo = (int)floor(log10(mn)), dhi = (int)ceil(log10(mx));
  if (dhi <= dlo) dhi = dlo + 1;
  double x0 = 1, x1 = c->rd.ix.steps > 1 ? (double)c->rd.ix.steps : 2;
#define SX(s) (SV_L + ((double)(s) - x0) / (x1 - x0) * (SV_R - SV_L))
  char name[VR_MAX_NAME + VR_MAX_KEY + 2];
  fprintf(f, "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" "
             "height=\"%d\" viewBox=\"0 0 %d %d\" font-family=\"sans-serif\" font-size=\"12\">\n",
          SV_W, SV_H, SV_W, SV_H);
  fprintf(f, "<rect width=\"%d\" height=\"%d\" fill=\"#ffffff\"/>\n<text x=\"%.0f\" y=\"26\" font-size=\"16\" "
             "font-weight=\"bold\">distopt verify: ", SV_W, SV_H, SV_L);
  cmp_xml_text(f, c->rd.ix.optimizer, 0);
  fputs(c->rd.ix.upstream[0] ? " vs recorded " : "", f);
  cmp_xml_text(f, c->rd.ix.upstream, 0);
  fprintf(f, " (world size %d)</text>\n<text x=\"%.0f\" y=\"46\" fill=\"#444444\">normwise relative error "
             "max|recorded \xE2\x88\x92 reference| / max|reference| per recorded step (log scale); dashed: tolerances</text>\n",
          c->rd.ix.world_size, SV_L);
  fprintf(f, "<rect x=\"%.0f\" y=\"%.0f\" width=\"%.0f\" height=\"%.0f\" fill=\"none\" stroke=\"#333333\"/>\n", SV_L,
          SV_T, SV_R - SV_L, SV_B - SV_T);
  for (int d = dlo; d <= dhi; d++) {
    double y = sv_y(pow(10.0, d), dlo, dhi);
    fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#e4e4e4\"/><text x=\"%.1f\" y=\"%.1f\" "
               "text-anchor=\"end\">1e%d</text>\n", SV_L, y, SV_R, y, SV_L - 6, y + 4, d);
  }
  fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">0</text>\n", SV_L - 6, SV_B + 4);
  fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">1</text><text x=\"%.1f\" y=\"%.1f\" "
             "text-anchor=\"middle\">%ld</text><text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">step</text>\n",
          SX(1), SV_B + 18, SX(x1), SV_B + 18, (long)x1, (SV_L + SV_R) / 2, SV_B + 36);
  fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#b00000\" stroke-dasharray=\"6 4\"/>"
             "<text x=\"%.1f\" y=\"%.1f\" fill=\"#b00000\" font-size=\"10\">parameters %g</text>\n",
          SV_L, sv_y(c->tol_param, dlo, dhi), SV_R, sv_y(c->tol_param, dlo, dhi), SV_L + 4,
          sv_y(c->tol_param, dlo, dhi) - 3, c->tol_param);
  fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#e6a100\" stroke-dasharray=\"2 3\"/>"
             "<text x=\"%.1f\" y=\"%.1f\" fill=\"#a07000\" font-size=\"10\">states %g</text>\n",
          SV_L, sv_y(c->tol_state, dlo, dhi), SV_R, sv_y(c->tol_state, dlo, dhi), SV_L + 140,
          sv_y(c->tol_state, dlo, dhi) - 3, c->tol_state);
  int drawn = 0;
  double ly = SV_T + 4;
  for (int i = 0; i < c->nst; i++) {
    const vstat *s = &c->st[i];
    if (s->npts == 0 || strcmp(s->key, "step") == 0) continue;
    const char *col = pal[drawn % 10];
    fprintf(f, "<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"1.4\"%s points=\"", col,
            s->key[0] ? " stroke-dasharray=\"5 2\"" : "");
    for (long k = 0; k < s->npts; k++)
      fprintf(f, "%s%.1f,%.1f", k ? " " : "", SX(s->pt_step[k]), sv_y(s->pt_rel[k], dlo, dhi));
    vf_stat_name(c, s, name, sizeof name);
    fprintf(f, "\"><title>rank %d ", s->rank);
    cmp_xml_text(f, name, 0);
    fputs("</title></polyline>\n", f);
    if (drawn < 24) {
      fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"%s\" stroke-width=\"2\"/><text x=\"%.1f\" "
                 "y=\"%.1f\" font-size=\"11\">rank %d ", SV_R + 16, ly - 4, SV_R + 36, ly - 4, col, SV_R + 42, ly, s->rank);
      cmp_xml_text(f, name, 0);
      fputs("</text>\n", f);
      ly += 16;
    }
    drawn++;
  }
  if (drawn > 24) fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" font-size=\"11\">\xE2\x80\xA6 and %d more</text>\n", SV_R + 42, ly, drawn - 24);
  early e;
  if (vf_early_verdict(c, &e)) {
    fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#b00000\"/>\n", SX(e.step), SV_T,
            SX(e.step), SV_B);
    fprintf(f, "<text x=\"%.0f\" y=\"%d\" font-weight=\"bold\" fill=\"#b00000\">verdict: ", SV_L, SV_H - 14);
    cmp_xml_text(f, e.text, 0);
    fputs("</text>\n", f);
  } else if (c->verdict_step) {
    const vstat *s = &c->st[c->verdict_stat];
    vf_stat_name(c, s, name, sizeof name);
    fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#b00000\"/>\n", SX(c->verdict_step), SV_T,
            SX(c->verdict_step), SV_B);
    fprintf(f, "<text x=\"%.0f\" y=\"%d\" font-weight=\"bold\" fill=\"#b00000\">verdict: DIVERGED at step %ld (tensor ",
            SV_L, SV_H - 14, c->verdict_step);
    cmp_xml_text(f, name, 0);
    fprintf(f, ", rank %d)</text>\n", s->rank);
  } else {
    fprintf(f, "<text x=\"%.0f\" y=\"%d\" font-weight=\"bold\" fill=\"#2a7a2a\">verdict: WITHIN TOLERANCE</text>\n", SV_L,
            SV_H - 14);
  }
#undef SX
  fputs("</svg>\n", f);
  return !ferror(f);
}

int vf_write_json(const vctx *c, const char *path) { return write_output(c, path, json_body, "--json"); }

int vf_write_svg(const vctx *c, const char *path) { return write_output(c, path, svg_body, "--plot"); }

/* Reports of `distopt compare`: a text table, a JSON record (cJSON) and an SVG
 * plot of error against step (written directly).
 *
 * Decisions:
 *  - A tensor is bitwise equal when max_ulp == 0 and first_diff == 0.
 *  - The verdict: EQUIVALENT (bitwise, ...) when r->equivalent and every
 *    tensor is bitwise equal; EQUIVALENT within D ULP (D = declared_ulp) when
 *    r->equivalent otherwise; DIVERGED at step K (tensor X) naming the first
 *    step at which a tensor exceeds declared_ulp (the first such tensor in
 *    r->t order); DIVERGED (skipped steps differ ...) when no tensor exceeds
 *    it but the result is not equivalent.
 *  - Table rows: parameters in r->t order, each followed by its states
 *    ("param/state", indented); states whose parameter is absent come last.
 *  - After the verdict: the reference's nonzero counters over the run ("events ..."). The table ends with
 *    the digest line, "digest sha256:HEX (reference: equal)"
 *    or "... (reference: sha256:HEX2, differs)"; none when r->digest is "".
 *  - The JSON record carries "schema_version" (CMP_JSON_SCHEMA; 2 added
 *    "digest"; 3 per-tensor "nan_pairs", the verdict kinds "replica_drift"
 *    and "step_counter" and the verdict's "rank"; 4 "gradients.model"; 5 "events" (the
 *    counters) and the verdict kind "events"; 6 "cpu_seconds", docs/cli.md); a consumer
 *    checks it before reading fields.
 *  - JSON and SVG files are written to "PATH.tmp.PID" and renamed into place;
 *    on failure the temporary file is removed and PATH is untouched.
 *    Non-finite errors appear as null in JSON (cJSON's rendering).
 */
#include "cli.h"
#include "compare.h"
#include "files.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "internal.h"

/* The JSON record's layout version: 1 (unversioned) until the digest, 2 with "digest". */
#define CMP_JSON_SCHEMA 6

/* " | gradients: ..." of the header lines: the trace, or the synthetic model and seed. */
static void print_gradients(FILE *f, const cmp_options *o) {
  if (strcmp(o->source, "trace") == 0) fprintf(f, " | gradients: trace %s", o->trace_path);
  else fprintf(f, " | gradients: %s%s%s (seed %llu)", o->source, o->model[0] ? " " : "", o->model,
               (unsigned long long)o->seed);
}

/* ---- verdict ------------------------------------------------------------ */

typedef enum { V_BITWISE, V_WITHIN, V_DIVERGED, V_SKIPS, V_DRIFT, V_COUNTER, V_EVENTS } verdict_kind;

typedef struct verdict {
  verdict_kind kind;
  int step;        /* V_DIVERGED: 1-based step */
  int tensor;      /* V_DIVERGED: index into r->t */
  uint64_t worst;  /* max ULP over all tensors */
} verdict;

static int is_bitwise(const cmp_tensor_stat *t) { return t->max_ulp == 0 && t->first_diff == 0; }

static verdict compute_verdict(const cmp_result *r) {
  verdict v = {V_BITWISE, 0, -1, 0};
  int all_bitwise = 1;
  for (int i = 0; i < r->ntensors; i++) {
    const cmp_tensor_stat *t = &r->t[i];
    if (t->max_ulp > v.worst) v.worst = t->max_ulp;
    if (!is_bitwise(t)) all_bitwise = 0;
  }
  if (r->equivalent) {
    v.kind = all_bitwise && r->skipped_ref == r->skipped_dist ? V_BITWISE : V_WITHIN;
    return v;
  }
  for (int i = 0; i < r->ntensors; i++) {
    const cmp_tensor_stat *t = &r->t[i];
    int step = 0;
    if (t->ulp_per_step) {
      for (int s = 0; s < r->steps && !step; s++)
        if (t->ulp_per_step[s] > r->declared_ulp || isnan(t->abs_per_step ? t->abs_per_step[s] : 0.0)) step = s + 1;
    } else if (t->max_ulp > r->declared_ulp) {
      step = t->first_diff > 0 ? t->first_diff : 1;
    }
    if (step && (v.tensor < 0 || step < v.step)) {
      v.step = step;
      v.tensor = i;
    }
  }
  v.kind = v.tensor >= 0 ? V_DIVERGED : V_SKIPS;
  /* a rank's own copy or a step counter that went wrong first is the finding */
  if (r->counter_step > 0 && (v.kind != V_DIVERGED || r->counter_step < v.step)) {
    v.kind = V_COUNTER;
    v.step = r->counter_step;
  }
  if (r->drift_step > 0 && ((v.kind != V_DIVERGED && v.kind != V_COUNTER) || r->drift_step < v.step)) {
    v.kind = V_DRIFT;
    v.step = r->drift_step;
  }
  /* a wrong amount of work names the cause: first at its step, even when the bits differ there too */
  if (r->events_step > 0 && ((v.kind != V_DIVERGED && v.kind != V_COUNTER && v.kind != V_DRIFT) ||
                             r->events_step <= v.step)) {
    v.kind = V_EVENTS;
    v.step = r->events_step;
  }
  return v;
}

/* The tensor (or parameter) a divergence names; NULL when the verdict names none. */
static const char *verdict_tensor(const cmp_result *r, const verdict *v) {
  switch (v->kind) {
  case V_DIVERGED: return r->t[v->tensor].name;
  case V_DRIFT: return r->drift_tensor;
  case V_COUNTER: return r->counter_param;
  case V_EVENTS: return r->events_param;
  default: return NULL;
  }
}

static const char *plural(long n) { return n == 1 ? "" : "s"; }

static void verdict_text(const cmp_result *r, const verdict *v, char *buf, size_t cap) {
  switch (v->kind) {
  case V_BITWISE:
    snprintf(buf, cap, "EQUIVALENT (bitwise, %d tensor%s \xC3\x97 %d step%s)", r->ntensors, plural(r->ntensors),
             r->steps, plural(r->steps));
    break;
  case V_WITHIN:
    snprintf(buf, cap, "EQUIVALENT within %llu ULP (worst %llu ULP, %d tensor%s \xC3\x97 %d step%s)",
             (unsigned long long)r->declared_ulp, (unsigned long long)v->worst, r->ntensors, plural(r->ntensors),
             r->steps, plural(r->steps));
    break;
  case V_DIVERGED:
    snprintf(buf, cap, "DIVERGED at step %d (tensor %s)", v->step, r->t[v->tensor].name);
    break;
  case V_SKIPS:
    snprintf(buf, cap, "DIVERGED (skipped steps differ: reference %lld, distributed %lld)",
             (long long)r->skipped_ref, (long long)r->skipped_dist);
    break;
  case V_DRIFT:
    snprintf(buf, cap, "DIVERGED at step %d (rank %d's copy of %s differs from rank 0's: replica drift)", v->step,
             r->drift_rank, r->drift_tensor);
    break;
  case V_COUNTER:
    snprintf(buf, cap, "DIVERGED at step %d (step counter of %s: reference %lld, distributed %lld)", v->step,
             r->counter_param, (long long)r->counter_ref, (long long)r->counter_dist);
    break;
  case V_EVENTS: {
    char who[40] = "";
    if (r->events_rank >= 0) snprintf(who, sizeof who, " on rank %d", r->events_rank);
    snprintf(buf, cap, "DIVERGED at step %d (events: %s of %s: reference %lld, distributed %lld%s)", v->step,
             dopt_counter_name(r->events_counter), r->events_param, (long long)r->events_ref,
             (long long)r->events_dist, who);
    break;
  }
  }
}

/* ---- table -------------------------------------------------------------- */

/* Parameters in order, each followed by its states; orphan states last.
 * order[] has r->ntensors entries; returns 0 on allocation failure. */
static int *row_order(const cmp_result *r) {
  int n = r->ntensors;
  int *order = malloc((size_t)(n > 0 ? n : 1) * sizeof *order);
  char *used = calloc((size_t)(n > 0 ? n : 1), 1);
  if (!order || !used) {
    free(order);
    free(used);
    return NULL;
  }
  int k = 0;
  for (int i = 0; i < n; i++) {
    if (r->t[i].is_state) continue;
    order[k++] = i;
    used[i] = 1;
    size_t len = strlen(r->t[i].name);
    for (int j = 0; j < n; j++)
      if (!used[j] && r->t[j].is_state && strncmp(r->t[j].name, r->t[i].name, len) == 0 && r->t[j].name[len] == '/') {
        order[k++] = j;
        used[j] = 1;
      }
  }
  for (int i = 0; i < n; i++)
    if (!used[i]) order[k++] = i;
  free(used);
  return order;
}

/* Display width of UTF-8 text (code points). */
static int text_width(const char *s) {
  int w = 0;
  for (; *s; s++) w += ((unsigned char)*s & 0xC0) != 0x80;
  return w;
}

static void pad(FILE *f, int n) {
  for (; n > 0; n--) fputc(' ', f);
}

static void print_header(FILE *f, const cmp_options *o, const cmp_result *r) {
  fprintf(f, "compare: %s", o->optimizer);
  if (o->hparams[0]) fprintf(f, " %s", o->hparams);
  fprintf(f, " | %s ", o->plugin);
  if (o->pp > 1) fprintf(f, "pp%d\xC3\x97", o->pp);
  fprintf(f, "tp%d\xC3\x97" "dp%d\xC3\x97zero%d", o->tp, o->dp, o->zero);
  if (strcmp(o->plugin, "gemini") == 0) fprintf(f, " chunk %zu", o->chunk_size ? o->chunk_size : CMP_GEMINI_CHUNK_DEFAULT);
  if (o->ep > 1) fprintf(f, " ep %d (moe_dp %d)", o->ep, o->dp / o->ep);
  fprintf(f, " | %d step%s", r->steps, plural(r->steps));
  if (r->micro > 1) fprintf(f, " \xC3\x97 %d micro-batches", r->micro);
  if (o->checkpoint_at > 0) { /* the resume layout, as cmp_run completes it */
    cmp_options ob;
    cmp_resume_options(o, &ob);
    fprintf(f, " | resumed after step %d in %s ", o->checkpoint_at, ob.plugin);
    if (ob.pp > 1) fprintf(f, "pp%d\xC3\x97", ob.pp);
    fprintf(f, "tp%d\xC3\x97" "dp%d\xC3\x97zero%d", ob.tp, ob.dp, ob.zero);
    if (strcmp(ob.plugin, "gemini") == 0) fprintf(f, " chunk %zu", ob.chunk_size ? ob.chunk_size : CMP_GEMINI_CHUNK_DEFAULT);
    if (ob.ep > 1) fprintf(f, " ep %d", ob.ep);
  }
  print_gradients(f, o);
  if (o->max_grad_norm > 0.0) fprintf(f, " | max_grad_norm %g", o->max_grad_norm);
  if (o->bf16) fprintf(f, " | bf16");
  fputc('\n', f);
  for (int g = 0; g < o->ngroups; g++)
    fprintf(f, "  group %d: %s: %s\n", g + 1, o->groups[g].glob, o->groups[g].hp[0] ? o->groups[g].hp : "(defaults)");
}

void cli_escaped(const char *s, char *buf, size_t cap) { dopt__escape(s, strlen(s), buf, cap); }

void cmp_print_table(FILE *f, const cmp_options *o, const cmp_result *r) {
  if (!f || !o || !r) return;
  print_header(f, o, r);
  int *order = row_order(r);
  int namew = 6;
  char nm[4 * sizeof r->t[0].name];
  for (int i = 0; i < r->ntensors; i++) {
    cli_escaped(r->t[i].name, nm, sizeof nm);
    int w = text_width(nm) + (r->t[i].is_state ? 2 : 0);
    if (w > namew) namew = w;
  }
  fprintf(f, "%-*s  %12s  %10s  %7s  %10s\n", namew, "tensor", "max abs err", "max ULP", "bitwise", "first diff");
  for (int k = 0; k < r->ntensors; k++) {
    const cmp_tensor_stat *t = &r->t[order ? order[k] : k];
    int ind = t->is_state ? 2 : 0;
    pad(f, ind);
    cli_escaped(t->name, nm, sizeof nm);
    fputs(nm, f);
    pad(f, namew - ind - text_width(nm));
    char first[24];
    if (t->first_diff > 0) snprintf(first, sizeof first, "%d", t->first_diff);
    else snprintf(first, sizeof first, "-");
    /* ✓ / ✗ are one column wide, three bytes: pad by hand. */
    fprintf(f, "  %12.3g  %10llu  %s%6s  %10s\n", t->max_abs, (unsigned long long)t->max_ulp,
            is_bitwise(t) ? "\xE2\x9C\x93" : "\xE2\x9C\x97", "", first);
  }
  free(order);
  verdict v = compute_verdict(r);
  char text[512], etext[4 * sizeof text];
  verdict_text(r, &v, text, sizeof text);
  cli_escaped(text, etext, sizeof etext);
  fprintf(f, "verdict: %s\n", etext);
  int nanrows = 0; /* NaN on both sides is equal (docs/nan-policy.md), and listed */
  for (int k = 0; k < r->ntensors; k++)
    if (r->t[k].nan_pairs) {
      cli_escaped(r->t[k].name, nm, sizeof nm);
      fprintf(f, "%s %s: %llu", nanrows++ ? "," : "NaN on both sides (equal under the NaN policy):", nm,
              (unsigned long long)r->t[k].nan_pairs);
    }
  if (nanrows) fputc('\n', f);
  if (r->skipped_ref || r->skipped_dist)
    fprintf(f, "skipped steps (non-finite gradients): reference %lld, distributed %lld\n", (long long)r->skipped_ref,
            (long long)r->skipped_dist);
  /* what the steps did: the reference's nonzero counters over the run (the distributed run's are checked
   * against them after every step: the verdict names a difference) */
  int nev = 0;
  for (int k = 0; k < DOPT_NCOUNTERS; k++)
    if (r->event_totals[k])
      fprintf(f, "%s %s %lld", nev++ ? "," : "events (reference, every step checked on every rank):", dopt_counter_name(k),
              (long long)r->event_totals[k]);
  if (nev) fputc('\n', f);
  /* the one line two runs compare by (docs/digest.md) */
  if (r->digest[0] && strcmp(r->digest, r->ref_digest) == 0)
    fprintf(f, "digest sha256:%s (reference: equal)\n", r->digest);
  else if (r->digest[0])
    fprintf(f, "digest sha256:%s (reference: %s%s, differs)\n", r->digest, r->ref_digest[0] ? "sha256:" : "",
            r->ref_digest[0] ? r->ref_digest : "none");
}

/* ---- atomic file writing: core/files.h (one rule for every output) ------ */

static dopt_status write_atomic(const char *path, int (*body)(FILE *f, const void *ctx), const void *ctx) {
  return dopt__write_stream(path, DOPT_W_OUTPUT, body, ctx);
}

/* ---- JSON --------------------------------------------------------------- */

typedef struct jb {
  int ok;
} jb;

static cJSON *jadd(jb *b, cJSON *parent, const char *key, cJSON *item) {
  if (!item) {
    b->ok = 0;
    return NULL;
  }
  if (key) {
    if (!cJSON_AddItemToObject(parent, key, item)) {
      cJSON_Delete(item);
      b->ok = 0;
      return NULL;
    }
  } else if (!cJSON_AddItemToArray(parent, item)) {
    cJSON_Delete(item);
    b->ok = 0;
    return NULL;
  }
  return item;
}


/* uint64 as a number when exact in a double, otherwise as a decimal string. */
static cJSON *ju64(uint64_t v) {
  if (v <= (UINT64_C(1) << 53)) return cJSON_CreateNumber((double)v);
  char buf[24];
  snprintf(buf, sizeof buf, "%llu", (unsigned long long)v);
  return cJSON_CreateString(buf);
}

/* The options both records share: the optimizer, its hyperparameters and groups; the gradients' source. */
static void json_optimizer(jb *b, cJSON *op, const cmp_options *o) {
  jadd(b, op, "optimizer", cJSON_CreateString(o->optimizer));
  jadd(b, op, "hparams", cJSON_CreateString(o->hparams));
  cJSON *gs = jadd(b, op, "groups", cJSON_CreateArray());
  for (int g = 0; gs && g < o->ngroups; g++) {
    cJSON *gi = jadd(b, gs, NULL, cJSON_CreateObject());
    if (!gi) break;
    jadd(b, gi, "params", cJSON_CreateString(o->groups[g].glob));
    jadd(b, gi, "hparams", cJSON_CreateString(o->groups[g].hp));
  }
}

static void json_gradients(jb *b, cJSON *op, const cmp_options *o) {
  cJSON *gr = jadd(b, op, "gradients", cJSON_CreateObject());
  if (gr) {
    jadd(b, gr, "source", cJSON_CreateString(o->source));
    if (strcmp(o->source, "trace") == 0) jadd(b, gr, "path", cJSON_CreateString(o->trace_path));
    else {
      jadd(b, gr, "seed", ju64(o->seed));
      if (o->model[0]) jadd(b, gr, "model", cJSON_CreateString(o->model));
    }
  }
}

static cJSON *build_json(const cmp_options *o, const cmp_result *r, jb *b) {
  cJSON *root = cJSON_CreateObject();
  if (!root) {
    b->ok = 0;
    return NULL;
  }
  jadd(b, root, "schema_version", cJSON_CreateNumber(CMP_JSON_SCHEMA));
  cJSON *op = jadd(b, root, "options", cJSON_CreateObject());
  if (op) {
    json_optimizer(b, op, o);
    jadd(b, op, "plugin", cJSON_CreateString(o->plugin));
    jadd(b, op, "tp", cJSON_CreateNumber(o->tp));
    jadd(b, op, "dp", cJSON_CreateNumber(o->dp));
    jadd(b, op, "zero", cJSON_CreateNumber(o->zero));
    jadd(b, op, "pp", cJSON_CreateNumber(o->pp));
    jadd(b, op, "ep", cJSON_CreateNumber(o->ep));
    jadd(b, op, "chunk_size", strcmp(o->plugin, "gemini") == 0
                                  ? cJSON_CreateNumber((double)(o->chunk_size ? o->chunk_size : CMP_GEMINI_CHUNK_DEFAULT))
                                  : cJSON_CreateNull());
    jadd(b, op, "dp_sum", cJSON_CreateString(cmp_dp_sum_name(o->dp_sum_words)));
    jadd(b, op, "ring_order", cJSON_CreateBool(o->ring_order != 0));
    jadd(b, op, "batch_invariant", cJSON_CreateBool(o->batch_invariant != 0));
    jadd(b, op, "ranks", cJSON_CreateNumber(o->ranks > 0 ? o->ranks : o->pp * o->tp * o->dp));
    jadd(b, op, "steps", cJSON_CreateNumber(o->steps));
    jadd(b, op, "accumulation", cJSON_CreateNumber(r->micro > 0 ? r->micro : o->micro));
    jadd(b, op, "max_grad_norm", cJSON_CreateNumber(o->max_grad_norm));
    jadd(b, op, "bf16", cJSON_CreateBool(o->bf16 != 0));
    json_gradients(b, op, o);
  }
  jadd(b, root, "steps", cJSON_CreateNumber(r->steps));
  jadd(b, root, "seconds", cJSON_CreateNumber(r->seconds));
  cJSON *cpu = cJSON_CreateObject(); /* schema 6 */
  jadd(b, cpu, "steps", cJSON_CreateNumber(r->cpu_steps));
  jadd(b, cpu, "process", cJSON_CreateNumber(r->cpu_process));
  jadd(b, cpu, "reference", cJSON_CreateNumber(r->cpu_reference));
  jadd(b, root, "cpu_seconds", cpu);
  jadd(b, root, "declared_ulp", ju64(r->declared_ulp));
  cJSON *sk = jadd(b, root, "skipped", cJSON_CreateObject());
  if (sk) {
    jadd(b, sk, "reference", cJSON_CreateNumber((double)r->skipped_ref));
    jadd(b, sk, "distributed", cJSON_CreateNumber((double)r->skipped_dist));
  }
  cJSON *ts = jadd(b, root, "tensors", cJSON_CreateArray());
  for (int i = 0; ts && i < r->ntensors && b->ok; i++) {
    const cmp_tensor_stat *t = &r->t[i];
    cJSON *ti = jadd(b, ts, NULL, cJSON_CreateObject());
    if (!ti) break;
    jadd(b, ti, "name", cJSON_CreateString(t->name));
    jadd(b, ti, "is_state", cJSON_CreateBool(t->is_state != 0));
    jadd(b, ti, "max_abs", cJSON_CreateNumber(t->max_abs));
    jadd(b, ti, "max_ulp", ju64(t->max_ulp));
    jadd(b, ti, "bitwise", cJSON_CreateBool(is_bitwise(t)));
    jadd(b, ti, "first_diff", t->first_diff > 0 ? cJSON_CreateNumber(t->first_diff) : cJSON_CreateNull());
    jadd(b, ti, "nan_pairs", ju64(t->nan_pairs));
    cJSON *ab = jadd(b, ti, "abs_per_step", cJSON_CreateArray());
    cJSON *ul = jadd(b, ti, "ulp_per_step", cJSON_CreateArray());
    for (int s = 0; ab && t->abs_per_step && s < r->steps && b->ok; s++)
      jadd(b, ab, NULL, cJSON_CreateNumber(t->abs_per_step[s]));
    for (int s = 0; ul && t->ulp_per_step && s < r->steps && b->ok; s++) jadd(b, ul, NULL, ju64(t->ulp_per_step[s]));
  }
  verdict v = compute_verdict(r);
  char text[256];
  verdict_text(r, &v, text, sizeof text);
  cJSON *vj = jadd(b, root, "verdict", cJSON_CreateObject());
  if (vj) {
    static const char *const kinds[] = {"bitwise", "within_tolerance", "diverged", "skips_differ", "replica_drift",
                                        "step_counter", "events"};
    jadd(b, vj, "equivalent", cJSON_CreateBool(r->equivalent != 0));
    jadd(b, vj, "kind", cJSON_CreateString(kinds[v.kind]));
    jadd(b, vj, "text", cJSON_CreateString(text));
    jadd(b, vj, "worst_ulp", ju64(v.worst));
    jadd(b, vj, "step", v.step > 0 ? cJSON_CreateNumber(v.step) : cJSON_CreateNull());
    const char *vt = verdict_tensor(r, &v);
    jadd(b, vj, "tensor", vt ? cJSON_CreateString(vt) : cJSON_CreateNull());
    jadd(b, vj, "rank", v.kind == V_DRIFT                        ? cJSON_CreateNumber(r->drift_rank)
                        : v.kind == V_EVENTS && r->events_rank >= 0 ? cJSON_CreateNumber(r->events_rank)
                                                                    : cJSON_CreateNull());
  }
  /* the counters: the reference's totals over the run, the first difference, the refresh steps */
  cJSON *ev = jadd(b, root, "events", cJSON_CreateObject());
  if (ev) {
    cJSON *tot = jadd(b, ev, "reference_totals", cJSON_CreateObject());
    for (int k = 0; tot && k < DOPT_NCOUNTERS && b->ok; k++)
      jadd(b, tot, dopt_counter_name(k), cJSON_CreateNumber((double)r->event_totals[k]));
    cJSON *fd = jadd(b, ev, "first_difference", r->events_step > 0 ? cJSON_CreateObject() : cJSON_CreateNull());
    if (fd && r->events_step > 0) {
      jadd(b, fd, "step", cJSON_CreateNumber(r->events_step));
      jadd(b, fd, "parameter", cJSON_CreateString(r->events_param));
      jadd(b, fd, "counter", cJSON_CreateString(dopt_counter_name(r->events_counter)));
      jadd(b, fd, "scope", cJSON_CreateString(dopt_counter_scope(r->events_counter) == DOPT_COUNT_SUM ? "sum" : "each"));
      jadd(b, fd, "rank", r->events_rank >= 0 ? cJSON_CreateNumber(r->events_rank) : cJSON_CreateNull());
      jadd(b, fd, "reference", cJSON_CreateNumber((double)r->events_ref));
      jadd(b, fd, "distributed", cJSON_CreateNumber((double)r->events_dist));
    }
    cJSON *rs = jadd(b, ev, "refresh_steps", cJSON_CreateArray());
    for (int k = 0; rs && k < r->nrefresh && b->ok; k++) jadd(b, rs, NULL, cJSON_CreateNumber(r->refresh_steps[k]));
  }
  /* the final tensors' SHA-256 (docs/digest.md); null when this process measured nothing */
  cJSON *dj = jadd(b, root, "digest", r->digest[0] ? cJSON_CreateObject() : cJSON_CreateNull());
  if (dj && r->digest[0]) {
    jadd(b, dj, "algorithm", cJSON_CreateString("sha256"));
    jadd(b, dj, "encoding", cJSON_CreateString(DOPT_DIGEST_ENCODING));
    jadd(b, dj, "distributed", cJSON_CreateString(r->digest));
    jadd(b, dj, "reference", r->ref_digest[0] ? cJSON_CreateString(r->ref_digest) : cJSON_CreateNull());
    jadd(b, dj, "equal", cJSON_CreateBool(strcmp(r->digest, r->ref_digest) == 0));
  }
  return root;
}

static int put_text(FILE *f, const void *ctx) {
  const char *s = ctx;
  size_t n = strlen(s);
  return fwrite(s, 1, n, f) == n && fputc('\n', f) != EOF;
}

dopt_status cmp_write_json(const char *path, const cmp_options *o, const cmp_result *r) {
  DOPT_CHECK_ARG(path != NULL && path[0], "cmp_write_json: path is empty");
  DOPT_CHECK_ARG(o != NULL && r != NULL, "cmp_write_json: options or result is NULL");
  DOPT_CHECK_ARG(r->ntensors == 0 || r->t != NULL, "cmp_write_json: r->t=NULL with ntensors=%d", r->ntensors);
  jb b = {1};
  cJSON *root = build_json(o, r, &b);
  char *text = b.ok && root ? cJSON_Print(root) : NULL;
  cJSON_Delete(root);
  if (!text) return dopt__fail(DOPT_ERR_NO_MEMORY, "%s: building the JSON report", path);
  dopt_status s = write_atomic(path, put_text, text);
  cJSON_free(text);
  return s;
}

/* ---- sweep (distopt compare --sweep) ------------------------------------- */

/* The sweep record's layout version: 1, its own (it has "kind": "sweep"; the
 * per-run record above has no "kind"). */
#define CMP_SWEEP_JSON_SCHEMA 1

void cmp_sweep_cell_set(cmp_sweep_cell *c, const cmp_result *r) {
  verdict v = compute_verdict(r);
  static const cmp_cell_kind kinds[] = {CMP_CELL_BITWISE,  CMP_CELL_WITHIN,   CMP_CELL_DIVERGED, CMP_CELL_DIVERGED,
                                        CMP_CELL_DIVERGED, CMP_CELL_DIVERGED, CMP_CELL_DIVERGED};
  c->kind = kinds[v.kind];
  c->step = v.step;
  const char *vt = verdict_tensor(r, &v);
  snprintf(c->tensor, sizeof c->tensor, "%.127s", vt ? vt : "");
  c->worst_ulp = v.worst;
  c->declared_ulp = r->declared_ulp;
  snprintf(c->message, sizeof c->message, "%s",
           v.kind == V_SKIPS    ? "skipped steps differ between the reference and the distributed run"
           : v.kind == V_DRIFT  ? "a rank's own copy differs from rank 0's (replica drift)"
           : v.kind == V_COUNTER ? "a step counter differs from the reference's"
                                 : "");
  memcpy(c->digest, r->digest, sizeof c->digest);
  memcpy(c->ref_digest, r->ref_digest, sizeof c->ref_digest);
  c->seconds = r->seconds;
}

/* Text of one grid cell (display width <= 14). */
static void cell_text(const cmp_sweep_cell *c, char *buf, size_t cap) {
  switch (c->kind) {
  case CMP_CELL_BITWISE: snprintf(buf, cap, "\xE2\x9C\x94"); break; /* ✔ */
  case CMP_CELL_WITHIN: snprintf(buf, cap, "\xE2\x9C\x94 \xE2\x89\xA4%llu ULP", (unsigned long long)c->declared_ulp); break;
  case CMP_CELL_DIVERGED:
    if (c->step > 0) snprintf(buf, cap, "\xE2\x9C\x97 step %d", c->step); /* ✗ */
    else snprintf(buf, cap, "\xE2\x9C\x97 skips");
    break;
  case CMP_CELL_ERROR: snprintf(buf, cap, "\xE2\x9C\x97 error"); break;
  case CMP_CELL_SKIPPED: snprintf(buf, cap, "- skipped"); break;
  }
}

/* s escaped by the one rule (cli_escaped; messages echo input). */
static void put_escaped(FILE *f, const char *s) {
  char line[4096];
  cli_escaped(s, line, sizeof line);
  fputs(line, f);
}

void cmp_print_sweep(FILE *f, const cmp_options *o, const cmp_sweep_cell *cells, int ncells) {
  if (!f || !o || (!cells && ncells > 0)) return;
  const int stages = o->max_pp > 1;
  fprintf(f, "sweep: %s %s | ", o->optimizer, o->hparams[0] ? o->hparams : "(upstream defaults)");
  if (stages) fprintf(f, "pp 1-%d \xC3\x97 ", o->max_pp);
  fprintf(f, "tp 1-%d \xC3\x97 dp 1-%d \xC3\x97 zero 0-3 | %d step%s", o->max_tp, o->max_dp, o->steps, plural(o->steps));
  if (o->micro > 1) fprintf(f, " \xC3\x97 %d micro-batches", o->micro);
  print_gradients(f, o);
  if (o->max_grad_norm > 0.0) fprintf(f, " | max_grad_norm %g", o->max_grad_norm);
  if (o->bf16) fprintf(f, " | bf16");
  fputs(" | against the single-device reference\n", f);
  fputs(stages ? "pp\xC3\x97tp\xC3\x97" "dp" : "tp\xC3\x97" "dp   ", f); /* 8 columns */
  for (int z = 0; z <= 3; z++) fprintf(f, z < 3 ? "  zero %d        " : "  zero %d\n", z);
  int nrun = 0, nbit = 0, nwithin = 0, nskip = 0, nbad = 0;
  for (int k = 0; k < ncells; k++) {
    const cmp_sweep_cell *c = &cells[k];
    if (c->zero == 0) {
      char row[16];
      if (stages) snprintf(row, sizeof row, "%d\xC3\x97%d\xC3\x97%d", c->pp, c->tp, c->dp);
      else snprintf(row, sizeof row, "%d\xC3\x97%d", c->tp, c->dp);
      fprintf(f, "%s", row);
      pad(f, 8 - text_width(row));
    }
    char t[64];
    cell_text(c, t, sizeof t);
    fprintf(f, "  %s", t);
    if (c->zero < 3) pad(f, 14 - text_width(t));
    if (c->zero == 3) fputc('\n', f);
    nrun += c->kind != CMP_CELL_SKIPPED;
    nbit += c->kind == CMP_CELL_BITWISE;
    nwithin += c->kind == CMP_CELL_WITHIN;
    nskip += c->kind == CMP_CELL_SKIPPED;
    nbad += c->kind == CMP_CELL_DIVERGED || c->kind == CMP_CELL_ERROR;
  }
  fputs("plugins: ddp (tp 1, zero 0), zero (tp 1, zero 1-2), hybrid (tp >= 2, zero 0-2), fsdp (zero 3): "
        "every layout of the grid has one\n",
        f);
  if (nbad + nskip + nwithin > 0) {
    fputs("details:\n", f);
    for (int k = 0; k < ncells; k++) {
      const cmp_sweep_cell *c = &cells[k];
      if (c->kind == CMP_CELL_BITWISE) continue;
      fputs("  ", f);
      if (stages) fprintf(f, "pp %d \xC3\x97 ", c->pp);
      fprintf(f, "tp %d \xC3\x97 dp %d \xC3\x97 zero %d (%s): ", c->tp, c->dp, c->zero, c->plugin);
      switch (c->kind) {
      case CMP_CELL_WITHIN:
        fprintf(f, "within the declared %llu ULP (worst %llu ULP)\n", (unsigned long long)c->declared_ulp,
                (unsigned long long)c->worst_ulp);
        break;
      case CMP_CELL_DIVERGED:
        if (c->step > 0) {
          char tn[4 * sizeof c->tensor];
          cli_escaped(c->tensor, tn, sizeof tn);
          fprintf(f, "diverged at step %d, tensor %s (worst %llu ULP)\n", c->step, tn,
                  (unsigned long long)c->worst_ulp);
        } else {
          fputs("diverged: ", f);
          put_escaped(f, c->message);
          fputc('\n', f);
        }
        break;
      case CMP_CELL_ERROR:
      case CMP_CELL_SKIPPED:
        fputs(c->kind == CMP_CELL_ERROR ? "error: " : "skipped: ", f);
        put_escaped(f, c->message);
        fputc('\n', f);
        break;
      default: break;
      }
    }
  }
  fprintf(f, "%d of %d layout%s bitwise", nbit, nrun, plural(nrun));
  if (nwithin) fprintf(f, ", %d within the declared tolerance", nwithin);
  if (nskip) fprintf(f, " (%d skipped)", nskip);
  fputc('\n', f);
}

static cJSON *build_sweep_json(const cmp_options *o, const cmp_sweep_cell *cells, int ncells, jb *b) {
  cJSON *root = cJSON_CreateObject();
  if (!root) {
    b->ok = 0;
    return NULL;
  }
  static const char *const kinds[] = {"bitwise", "within_tolerance", "diverged", "error", "skipped"};
  jadd(b, root, "schema_version", cJSON_CreateNumber(CMP_SWEEP_JSON_SCHEMA));
  jadd(b, root, "kind", cJSON_CreateString("sweep"));
  cJSON *op = jadd(b, root, "options", cJSON_CreateObject());
  if (op) {
    json_optimizer(b, op, o);
    jadd(b, op, "max_tp", cJSON_CreateNumber(o->max_tp));
    jadd(b, op, "max_dp", cJSON_CreateNumber(o->max_dp));
    jadd(b, op, "max_pp", cJSON_CreateNumber(o->max_pp));
    jadd(b, op, "steps", cJSON_CreateNumber(o->steps));
    jadd(b, op, "accumulation", cJSON_CreateNumber(o->micro));
    jadd(b, op, "max_grad_norm", cJSON_CreateNumber(o->max_grad_norm));
    jadd(b, op, "bf16", cJSON_CreateBool(o->bf16 != 0));
    jadd(b, op, "dp_sum", cJSON_CreateString(cmp_dp_sum_name(o->dp_sum_words)));
    jadd(b, op, "ring_order", cJSON_CreateBool(o->ring_order != 0));
    jadd(b, op, "batch_invariant", cJSON_CreateBool(o->batch_invariant != 0));
    json_gradients(b, op, o);
  }
  int nrun = 0, nbit = 0, nwithin = 0, ndiv = 0, nerr = 0, nskip = 0;
  cJSON *ls = jadd(b, root, "layouts", cJSON_CreateArray());
  for (int k = 0; ls && k < ncells && b->ok; k++) {
    const cmp_sweep_cell *c = &cells[k];
    cJSON *li = jadd(b, ls, NULL, cJSON_CreateObject());
    if (!li) break;
    jadd(b, li, "pp", cJSON_CreateNumber(c->pp));
    jadd(b, li, "tp", cJSON_CreateNumber(c->tp));
    jadd(b, li, "dp", cJSON_CreateNumber(c->dp));
    jadd(b, li, "zero", cJSON_CreateNumber(c->zero));
    jadd(b, li, "plugin", cJSON_CreateString(c->plugin));
    jadd(b, li, "result", cJSON_CreateString(kinds[c->kind]));
    const int ran = c->kind != CMP_CELL_ERROR && c->kind != CMP_CELL_SKIPPED;
    jadd(b, li, "step", c->kind == CMP_CELL_DIVERGED && c->step > 0 ? cJSON_CreateNumber(c->step) : cJSON_CreateNull());
    jadd(b, li, "tensor", c->kind == CMP_CELL_DIVERGED && c->tensor[0] ? cJSON_CreateString(c->tensor) : cJSON_CreateNull());
    jadd(b, li, "worst_ulp", ran ? ju64(c->worst_ulp) : cJSON_CreateNull());
    jadd(b, li, "message", c->message[0] ? cJSON_CreateString(c->message) : cJSON_CreateNull());
    jadd(b, li, "digest", ran && c->digest[0] ? cJSON_CreateString(c->digest) : cJSON_CreateNull());
    jadd(b, li, "reference_digest", ran && c->ref_digest[0] ? cJSON_CreateString(c->ref_digest) : cJSON_CreateNull());
    jadd(b, li, "seconds", cJSON_CreateNumber(c->seconds));
    nrun += c->kind != CMP_CELL_SKIPPED;
    nbit += c->kind == CMP_CELL_BITWISE;
    nwithin += c->kind == CMP_CELL_WITHIN;
    ndiv += c->kind == CMP_CELL_DIVERGED;
    nerr += c->kind == CMP_CELL_ERROR;
    nskip += c->kind == CMP_CELL_SKIPPED;
  }
  cJSON *sm = jadd(b, root, "summary", cJSON_CreateObject());
  if (sm) {
    jadd(b, sm, "layouts", cJSON_CreateNumber(ncells));
    jadd(b, sm, "run", cJSON_CreateNumber(nrun));
    jadd(b, sm, "bitwise", cJSON_CreateNumber(nbit));
    jadd(b, sm, "within_tolerance", cJSON_CreateNumber(nwithin));
    jadd(b, sm, "diverged", cJSON_CreateNumber(ndiv));
    jadd(b, sm, "errors", cJSON_CreateNumber(nerr));
    jadd(b, sm, "skipped", cJSON_CreateNumber(nskip));
    jadd(b, sm, "all_equivalent", cJSON_CreateBool(ndiv == 0 && nerr == 0));
  }
  return root;
}

dopt_status cmp_write_sweep_json(const char *path, const cmp_options *o, const cmp_sweep_cell *cells, int ncells) {
  DOPT_CHECK_ARG(path != NULL && path[0], "cmp_write_sweep_json: path is empty");
  DOPT_CHECK_ARG(o != NULL && (cells != NULL || ncells == 0), "cmp_write_sweep_json: options or cells is NULL");
  jb b = {1};
  cJSON *root = build_sweep_json(o, cells, ncells, &b);
  char *text = b.ok && root ? cJSON_Print(root) : NULL;
  cJSON_Delete(root);
  if (!text) return dopt__fail(DOPT_ERR_NO_MEMORY, "%s: building the sweep's JSON record", path);
  dopt_status s = write_atomic(path, put_text, text);
  cJSON_free(text);
  return s;
}

/* ---- SVG ---------------------------------------------------------------- */

#define SVG_W 960
#define SVG_H 540
#define PL 84.0              /* plot area */
#define PR (SVG_W - 280.0)
#define PT 70.0
#define PB (SVG_H - 110.0)
#define BAND_T (PB + 8.0)    /* "bitwise equal" baseline band */
#define BAND_B (PB + 38.0)
#define BAND_Y (BAND_B - 9.0)  /* where zero errors are drawn */
#define LEGEND_X (PR + 20.0)
#define LEGEND_ROW 17.0

void cmp_xml_text(FILE *f, const char *s, int maxw) {
  int w = 0;
  for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
    if ((*p & 0xC0) != 0x80) {
      if (maxw > 0 && w == maxw) {
        fputs("\xE2\x80\xA6", f);
        return;
      }
      w++;
    }
    switch (*p) {
    case '&': fputs("&amp;", f); break;
    case '<': fputs("&lt;", f); break;
    case '>': fputs("&gt;", f); break;
    case '"': fputs("&quot;", f); break;
    case '\'': fputs("&apos;", f); break;
    default:
      if (*p < 0x20 || *p == 0x7F) fputc('?', f);
      else fputc(*p, f);
    }
  }
}

/* Like cmp_xml_text, but a name wider than maxw code points keeps its start and
 * its end around a "…" (tensor names differ at both ends). */
static void xml_name(FILE *f, const char *s, int maxw) {
  int w = text_width(s);
  if (w <= maxw) {
    cmp_xml_text(f, s, 0);
    return;
  }
  int head = (maxw - 1) / 2, tail = maxw - 1 - head;
  cmp_xml_text(f, s, head); /* writes the head and a "…" */
  const char *p = s + strlen(s);
  for (int k = 0; k < tail && p > s;) {
    p--;
    if (((unsigned char)*p & 0xC0) != 0x80) k++;
  }
  cmp_xml_text(f, p, 0);
}

typedef struct svg_ctx {
  const cmp_options *o;
  const cmp_result *r;
} svg_ctx;

static int ever_differs(const cmp_tensor_stat *t, int steps) {
  if (!is_bitwise(t) || t->max_abs != 0.0) return 1;
  for (int s = 0; t->abs_per_step && s < steps; s++)
    if (t->abs_per_step[s] != 0.0) return 1;
  return 0;
}

static double map_x(double step, double lo, double hi) { return PL + (step - lo) / (hi - lo) * (PR - PL); }

static double map_y(double v, int dlo, int dhi) {
  if (v == 0.0) return BAND_Y;
  if (!(v > 0.0) || isinf(v)) return PT; /* non-finite: pinned to the top */
  double y = PB - (log10(v) - dlo) / (double)(dhi - dlo) * (PB - PT);
  return y < PT ? PT : y > PB ? PB : y;
}

static const char *const palette[] = {"#1f77b4", "#d62728", "#ff7f0e", "#9467bd", "#000000",
                                      "#8c564b", "#e377c2", "#17becf", "#e6a100", "#7f7f7f"};
static const char *const dashes[] = {"", "6 3", "2 2", "8 3 2 3"};

static int svg_body(FILE *f, const void *vctx) {
  const svg_ctx *c = vctx;
  const cmp_options *o = c->o;
  const cmp_result *r = c->r;
  int steps = r->steps > 0 ? r->steps : 1;
  /* y range over the finite nonzero errors, whole decades */
  double mn = INFINITY, mx = 0.0;
  int nonfinite = 0;
  for (int i = 0; i < r->ntensors; i++)
    for (int s = 0; r->t[i].abs_per_step && s < r->steps; s++) {
      double v = r->t[i].abs_per_step[s];
      if (!isfinite(v)) nonfinite = 1;
      else if (v > 0.0) {
        if (v < mn) mn = v;
        if (v > mx) mx = v;
      }
    }
  int dlo = -8, dhi = 0;
  if (mx > 0.0) {
    dlo = (int)floor(log10(mn));
    dhi = (int)ceil(log10(mx));
    if (dhi <= dlo) dhi = dlo + 1;
  }
  double xlo = 1.0, xhi = (double)steps;
  if (steps == 1) {
    xlo = 0.0;
    xhi = 2.0;
  }
  verdict v = compute_verdict(r);
  char vtext[256];
  verdict_text(r, &v, vtext, sizeof vtext);

  fprintf(f, "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n");
  fprintf(f,
          "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" viewBox=\"0 0 %d %d\" "
          "font-family=\"sans-serif\" font-size=\"12\">\n",
          SVG_W, SVG_H, SVG_W, SVG_H);
  fprintf(f, "<title>distopt compare: ");
  cmp_xml_text(f, o->optimizer, 0);
  fprintf(f, " on ");
  cmp_xml_text(f, o->plugin, 0);
  fprintf(f, "</title>\n<rect width=\"%d\" height=\"%d\" fill=\"#ffffff\"/>\n", SVG_W, SVG_H);
  /* title and subtitle */
  fprintf(f, "<text x=\"%.1f\" y=\"26\" font-size=\"16\" font-weight=\"bold\">", PL);
  cmp_xml_text(f, o->optimizer, 0);
  if (o->hparams[0]) {
    fputs(" (", f);
    cmp_xml_text(f, o->hparams, 60);
    fputs(")", f);
  }
  fputs(" \xE2\x80\x94 ", f);
  cmp_xml_text(f, o->plugin, 0);
  fprintf(f, " tp%d\xC3\x97" "dp%d\xC3\x97zero%d</text>\n", o->tp, o->dp, o->zero);
  fprintf(f, "<text x=\"%.1f\" y=\"46\" fill=\"#444444\">max |distributed \xE2\x88\x92 reference| per step, ", PL);
  fprintf(f, "%d step%s", r->steps, plural(r->steps));
  if (r->micro > 1) fprintf(f, " \xC3\x97 %d micro-batches", r->micro);
  fputs(", gradients: ", f);
  cmp_xml_text(f, o->source, 0);
  if (o->bf16) fputs(", bf16", f);
  if (o->max_grad_norm > 0.0) fprintf(f, ", max_grad_norm %g", o->max_grad_norm);
  fputs("</text>\n", f);
  fprintf(f, "<text x=\"%.1f\" y=\"%d\" font-weight=\"bold\" fill=\"%s\">verdict: ", PL, SVG_H - 14,
          v.kind == V_BITWISE || v.kind == V_WITHIN ? "#2a7a2a" : "#b00000");
  cmp_xml_text(f, vtext, 110);
  fputs("</text>\n", f);

  /* y grid, ticks and labels (decades) */
  int ystep = (dhi - dlo + 9) / 10;
  fprintf(f, "<g stroke=\"#e4e4e4\" stroke-width=\"1\">\n");
  for (int d = dlo; d <= dhi; d += ystep) {
    double y = PB - (double)(d - dlo) / (double)(dhi - dlo) * (PB - PT);
    fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\"/>\n", PL, y, PR, y);
  }
  fprintf(f, "</g>\n<g text-anchor=\"end\" fill=\"#333333\">\n");
  for (int d = dlo; d <= dhi; d += ystep) {
    double y = PB - (double)(d - dlo) / (double)(dhi - dlo) * (PB - PT);
    fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#333333\"/>", PL - 5, y, PL, y);
    fprintf(f, "<text x=\"%.1f\" y=\"%.1f\">1e%d</text>\n", PL - 8, y + 4, d);
  }
  fprintf(f, "</g>\n");
  /* x ticks: 1, 2 or 5 × 10^k, about 8 of them */
  double raw = (double)steps / 8.0, mag = pow(10.0, floor(log10(raw > 1.0 ? raw : 1.0)));
  long xstep = (long)mag;
  if (xstep < 1) xstep = 1;
  if ((double)xstep < raw) xstep = (long)(2 * mag);
  if ((double)xstep < raw) xstep = (long)(5 * mag);
  if ((double)xstep < raw) xstep = (long)(10 * mag);
  fprintf(f, "<g text-anchor=\"middle\" fill=\"#333333\">\n");
  for (long s = xstep == 1 ? 1 : xstep; s <= steps; s += xstep) {
    double x = map_x((double)s, xlo, xhi);
    fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#333333\"/>", x, BAND_B, x, BAND_B + 5);
    fprintf(f, "<text x=\"%.1f\" y=\"%.1f\">%ld</text>\n", x, BAND_B + 19, s);
  }
  fprintf(f, "</g>\n");
  /* axes, baseline band, labels */
  fprintf(f, "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"#eaf5ea\" stroke=\"#9ccc9c\"/>\n", PL,
          BAND_T, PR - PL, BAND_B - BAND_T);
  fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" fill=\"#3c7a3c\" font-size=\"10\">bitwise equal (error 0)</text>\n", PL + 6,
          BAND_T + 11);
  fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\" fill=\"#333333\">0</text>\n", PL - 8, BAND_Y + 4);
  fprintf(f, "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"none\" stroke=\"#333333\"/>\n", PL, PT,
          PR - PL, PB - PT);
  fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">step</text>\n", (PL + PR) / 2, BAND_B + 38);
  fprintf(f,
          "<text transform=\"translate(22 %.1f) rotate(-90)\" text-anchor=\"middle\">"
          "max abs error (log scale)</text>\n",
          (PT + PB) / 2);
  if (mx == 0.0)
    fprintf(f,
            "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\" fill=\"#777777\">"
            "no step differs from the reference</text>\n",
            (PL + PR) / 2, (PT + PB) / 2);
  if (nonfinite)
    fprintf(f,
            "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\" fill=\"#b00000\" font-size=\"11\">"
            "non-finite errors drawn at the top</text>\n",
            PR - 4, PT + 14);

  /* projector refreshes: a dotted vertical line at each refresh step (at most 200 drawn, the rest counted) */
  for (int k = 0; k < r->nrefresh && k < 200; k++) {
    const double rx = map_x((double)r->refresh_steps[k], xlo, xhi);
    fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#9aa0a6\" stroke-dasharray=\"1 3\">"
               "<title>projector refresh at step %d</title></line>\n", rx, PT, rx, PB, r->refresh_steps[k]);
  }
  if (r->nrefresh > 0)
    fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" fill=\"#6b7075\" font-size=\"11\">dotted: %d projector refresh%s</text>\n",
            PL + 4, PT + 14, r->nrefresh, r->nrefresh == 1 ? "" : "es");

  /* one polyline per tensor that ever differs; the rest share the baseline */
  int ndiff = 0, nequal = 0;
  for (int i = 0; i < r->ntensors; i++) {
    if (ever_differs(&r->t[i], r->steps)) ndiff++;
    else nequal++;
  }
  int drawn = 0;
  for (int i = 0; i < r->ntensors; i++) {
    const cmp_tensor_stat *t = &r->t[i];
    if (!ever_differs(t, r->steps)) continue;
    const char *col = palette[drawn % 10], *dash = dashes[(drawn / 10) % 4];
    drawn++;
    if (!t->abs_per_step || r->steps <= 0) continue;
    fprintf(f, "<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"1.6\" stroke-linejoin=\"round\"", col);
    if (dash[0]) fprintf(f, " stroke-dasharray=\"%s\"", dash);
    fputs(" points=\"", f);
    for (int s = 0; s < r->steps; s++)
      fprintf(f, "%s%.1f,%.1f", s ? " " : "", map_x((double)(s + 1), xlo, xhi), map_y(t->abs_per_step[s], dlo, dhi));
    fputs("\"><title>", f);
    cmp_xml_text(f, t->name, 0);
    fputs("</title></polyline>\n", f);
    if (r->steps <= 40)
      for (int s = 0; s < r->steps; s++)
        fprintf(f, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"2.5\" fill=\"%s\"/>\n", map_x((double)(s + 1), xlo, xhi),
                map_y(t->abs_per_step[s], dlo, dhi), col);
  }
  if (nequal > 0 && r->steps == 1)
    fprintf(f, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"3\" fill=\"#3c7a3c\"/>\n", map_x(1, xlo, xhi), BAND_Y);
  else if (nequal > 0 && r->steps > 1)
    fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#3c7a3c\" stroke-width=\"2\"/>\n",
            map_x(1, xlo, xhi), BAND_Y, map_x((double)r->steps, xlo, xhi), BAND_Y);

  /* legend: tensors that ever differ, then the count of bitwise-equal ones */
  int rows_fit = (int)((SVG_H - PT - 60.0) / LEGEND_ROW) - 2;
  double y = PT + 4;
  fprintf(f, "<g font-size=\"11\">\n<text x=\"%.1f\" y=\"%.1f\" font-weight=\"bold\">tensor (max ULP)</text>\n",
          LEGEND_X, y);
  y += LEGEND_ROW;
  int shown = 0, k = 0;
  for (int i = 0; i < r->ntensors; i++) {
    const cmp_tensor_stat *t = &r->t[i];
    if (!ever_differs(t, r->steps)) continue;
    int idx = k++;
    if (shown >= rows_fit && ndiff > shown + 1) continue;
    const char *col = palette[idx % 10], *dash = dashes[(idx / 10) % 4];
    fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"%s\" stroke-width=\"2\"", LEGEND_X,
            y - 4, LEGEND_X + 22, y - 4, col);
    if (dash[0]) fprintf(f, " stroke-dasharray=\"%s\"", dash);
    fprintf(f, "/><text x=\"%.1f\" y=\"%.1f\">", LEGEND_X + 28, y);
    xml_name(f, t->name, 30);
    fprintf(f, " (%llu)</text>\n", (unsigned long long)t->max_ulp);
    y += LEGEND_ROW;
    shown++;
  }
  if (shown < ndiff) {
    fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" fill=\"#555555\">\xE2\x80\xA6 and %d more that differ</text>\n",
            LEGEND_X + 28, y, ndiff - shown);
    y += LEGEND_ROW;
  }
  if (nequal > 0) {
    fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#3c7a3c\" stroke-width=\"2\"/>",
            LEGEND_X, y - 4, LEGEND_X + 22, y - 4);
    fprintf(f, "<text x=\"%.1f\" y=\"%.1f\">%d tensor%s bitwise equal</text>\n", LEGEND_X + 28, y,
            nequal, nequal == 1 ? "" : "s");
  }
  fprintf(f, "</g>\n</svg>\n");
  return !ferror(f);
}

dopt_status cmp_write_svg(const char *path, const cmp_options *o, const cmp_result *r) {
  DOPT_CHECK_ARG(path != NULL && path[0], "cmp_write_svg: path is empty");
  DOPT_CHECK_ARG(o != NULL && r != NULL, "cmp_write_svg: options or result is NULL");
  DOPT_CHECK_ARG(r->ntensors == 0 || r->t != NULL, "cmp_write_svg: r->t=NULL with ntensors=%d", r->ntensors);
  svg_ctx c = {o, r};
  return write_atomic(path, svg_body, &c);
}

/* ---- the progress line ------------------------------------------------------------------------------- */

void cli_progress_init(cli_progress *p, int quiet) {
  memset(p, 0, sizeof *p);
  p->on = !quiet && isatty(STDERR_FILENO);
  p->t0 = cmp_now_s();
  p->after = CLI_PROGRESS_AFTER_S;
  p->unit = "step";
  const char *e = getenv("DOPT_PROGRESS_AFTER"); /* seconds before the first line (tests: 0) */
  char *end = NULL;
  const double v = e && *e ? strtod(e, &end) : -1.0;
  if (end && *end == '\0' && v >= 0.0 && v <= 86400.0) p->after = v;
}

/* "1h02m", "3m07s", "12s" */
static void eta_text(double s, char *out, size_t cap) {
  const long t = s < 0 ? 0 : (long)(s + 0.5);
  if (t >= 3600) snprintf(out, cap, "%ldh%02ldm", t / 3600, t / 60 % 60);
  else if (t >= 60) snprintf(out, cap, "%ldm%02lds", t / 60, t % 60);
  else snprintf(out, cap, "%lds", t);
}

void cli_progress_step(cli_progress *p, const char *what, long done, long total, const char *extra) {
  if (!p->on) return;
  const double now = cmp_now_s();
  if (done == 1 || p->t1 == 0.0) p->t1 = now;
  if (now - p->t0 < p->after || (p->shown && now - p->last < 0.25 && done < total)) return;
  const double per = done > 1 && now > p->t1 ? (now - p->t1) / (double)(done - 1) : (now - p->t0) / (double)(done ? done : 1);
  char eta[32];
  eta_text(per * (double)(total - done), eta, sizeof eta);
  fprintf(stderr, "\r%s: %s %ld/%ld  %.2f s/%s  ETA %s  %s   ", what, p->unit, done, total, per, p->unit, eta,
          extra ? extra : "");
  fflush(stderr);
  p->shown = 1, p->last = now;
}

void cli_progress_end(cli_progress *p) {
  if (!p->shown) return;
  fprintf(stderr, "\r%100s\r", "");
  fflush(stderr);
  p->shown = 0;
}

/* cli/report.c on a synthetic result (a bitwise-equal parameter and its
 * state diverging at step 3): the table's marks, rows and verdict; the JSON
 * parses with cJSON, has schema_version 6 and carries per-step arrays of the
 * right length; the digest is the table's last line and the JSON's "digest"
 * object (equal or differing from the reference's); the SVG
 * is well-formed XML (a C check always, plus Python's xml.etree when python3
 * is on PATH) with one polyline per differing tensor and escaped names; failed
 * writes leave no file. */
#include "testutil.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"
#include "compare.h"

#define STEPS 5

static char dir[256];

static int setup(void **st) {
  (void)st;
  return dt_make_tmpdir(dir, sizeof dir, "dopt_cmprep");
}

static int teardown(void **st) {
  (void)st;
  return dt_remove_tmpdir(dir);
}

static void options(cmp_options *o) {
  memset(o, 0, sizeof *o);
  snprintf(o->optimizer, sizeof o->optimizer, "came");
  snprintf(o->hparams, sizeof o->hparams, "lr=2e-4,weight_decay=0.01");
  snprintf(o->plugin, sizeof o->plugin, "hybrid");
  o->tp = 2;
  o->dp = 2;
  o->zero = 2;
  o->steps = STEPS;
  o->micro = 1;
  snprintf(o->source, sizeof o->source, "synthetic");
  o->seed = 7;
}

static double abs0[STEPS], abs1[STEPS] = {0, 0, 1.5e-8, 3e-7, 2.5e-6};
static uint64_t ulp0[STEPS], ulp1[STEPS] = {0, 0, 1, 12, 300};
static cmp_tensor_stat tens[2];

/* The state is listed first in r->t: the table must still print the
 * parameter first. */
static void result(cmp_result *r) {
  memset(r, 0, sizeof *r);
  memset(tens, 0, sizeof tens);
  snprintf(tens[0].name, sizeof tens[0].name, "fc1.weight/exp_avg");
  tens[0].is_state = 1;
  tens[0].max_abs = 2.5e-6;
  tens[0].max_ulp = 300;
  tens[0].first_diff = 3;
  tens[0].abs_per_step = abs1;
  tens[0].ulp_per_step = ulp1;
  snprintf(tens[1].name, sizeof tens[1].name, "fc1.weight");
  tens[1].abs_per_step = abs0;
  tens[1].ulp_per_step = ulp0;
  r->steps = STEPS;
  r->ntensors = 2;
  r->t = tens;
  r->declared_ulp = 0;
  r->equivalent = 0;
}

static char *table_text(const cmp_options *o, const cmp_result *r) {
  char *buf = NULL;
  size_t len = 0;
  FILE *f = open_memstream(&buf, &len);
  assert_non_null(f);
  cmp_print_table(f, o, r);
  fclose(f);
  char *out = strdup(buf); /* a plain heap copy (GCC tracks buf's address as a stack slot) */
  free(buf);
  return out;
}

static char *slurp(const char *path) {
  FILE *f = fopen(path, "rb");
  assert_non_null(f);
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  char *b = malloc((size_t)n + 1);
  assert_non_null(b);
  assert_int_equal(fread(b, 1, (size_t)n, f), (size_t)n);
  b[n] = '\0';
  fclose(f);
  return b;
}

/* No "*.tmp.*" file left in dir. */
static void assert_no_temporaries(void) {
  DIR *d = opendir(dir);
  assert_non_null(d);
  struct dirent *e;
  while ((e = readdir(d)) != NULL)
    if (strstr(e->d_name, ".tmp.")) fail_msg("temporary file left: %s", e->d_name);
  closedir(d);
}

static void test_table(void **st) {
  (void)st;
  cmp_options o;
  cmp_result r;
  options(&o);
  result(&r);
  char *t = table_text(&o, &r);
  assert_non_null(strstr(t, "came lr=2e-4,weight_decay=0.01"));
  assert_non_null(strstr(t, "hybrid tp2\xC3\x97" "dp2\xC3\x97zero2"));
  assert_non_null(strstr(t, "synthetic"));
  assert_non_null(strstr(t, "\xE2\x9C\x93")); /* ✓ */
  assert_non_null(strstr(t, "\xE2\x9C\x97")); /* ✗ */
  const char *param = strstr(t, "\nfc1.weight "), *state = strstr(t, "\n  fc1.weight/exp_avg ");
  assert_non_null(param);
  assert_non_null(state);
  assert_true(param < state);
  assert_non_null(strstr(state, "2.5e-06"));
  assert_non_null(strstr(state, "300"));
  assert_non_null(strstr(t, "verdict: DIVERGED at step 3 (tensor fc1.weight/exp_avg)\n"));
  assert_null(strstr(t, "skipped"));
  free(t);

  /* a name from a hostile trace: its ESC (C0), CSI (C1) and bidi override are escaped in the table and the
   * verdict, one rule (dopt__escape); the columns still line up */
  snprintf(r.t[0].name, sizeof r.t[0].name, "fc1.w\x1b[2J\xC2\x9B\xE2\x80\xAE/exp_avg");
  t = table_text(&o, &r);
  if (strchr(t, '\x1b') || strstr(t, "\xC2\x9B") || strstr(t, "\xE2\x80\xAE") ||
      !strstr(t, "fc1.w\\x1b[2J\\u009b\\u202e/exp_avg") ||
      !strstr(t, "verdict: DIVERGED at step 3 (tensor fc1.w\\x1b[2J\\u009b\\u202e/exp_avg)"))
    fail_msg("the table echoes a tensor name unescaped: %s", t);
  free(t);
  snprintf(r.t[0].name, sizeof r.t[0].name, "fc1.weight/exp_avg");

  /* a declared tolerance moves the divergence to the first step beyond it */
  r.declared_ulp = 16;
  t = table_text(&o, &r);
  assert_non_null(strstr(t, "verdict: DIVERGED at step 5 (tensor fc1.weight/exp_avg)"));
  free(t);
  r.declared_ulp = 512;
  r.equivalent = 1;
  t = table_text(&o, &r);
  assert_non_null(strstr(t, "verdict: EQUIVALENT within 512 ULP"));
  free(t);

  /* everything bitwise */
  tens[0].max_abs = 0;
  tens[0].max_ulp = 0;
  tens[0].first_diff = 0;
  tens[0].abs_per_step = abs0;
  tens[0].ulp_per_step = ulp0;
  r.declared_ulp = 0;
  t = table_text(&o, &r);
  assert_non_null(strstr(t, "verdict: EQUIVALENT (bitwise, 2 tensors \xC3\x97 5 steps)"));
  assert_null(strstr(t, "\xE2\x9C\x97"));
  free(t);

  /* skipped steps reported; a mismatch is a divergence */
  r.equivalent = 0;
  r.skipped_ref = 1;
  r.skipped_dist = 2;
  t = table_text(&o, &r);
  assert_non_null(strstr(t, "verdict: DIVERGED (skipped steps differ: reference 1, distributed 2)"));
  assert_non_null(strstr(t, "skipped steps (non-finite gradients): reference 1, distributed 2"));
  free(t);
}

static void test_json(void **st) {
  (void)st;
  cmp_options o;
  cmp_result r;
  options(&o);
  result(&r);
  char path[512];
  snprintf(path, sizeof path, "%s/r.json", dir);
  assert_ok(cmp_write_json(path, &o, &r));
  assert_no_temporaries();
  char *text = slurp(path);
  cJSON *j = cJSON_Parse(text);
  free(text);
  assert_non_null(j);
  cJSON *op = cJSON_GetObjectItemCaseSensitive(j, "options");
  assert_string_equal(cJSON_GetObjectItemCaseSensitive(op, "optimizer")->valuestring, "came");
  assert_int_equal(cJSON_GetObjectItemCaseSensitive(op, "tp")->valueint, 2);
  cJSON *ts = cJSON_GetObjectItemCaseSensitive(j, "tensors");
  assert_int_equal(cJSON_GetArraySize(ts), 2);
  for (int i = 0; i < 2; i++) {
    cJSON *ti = cJSON_GetArrayItem(ts, i);
    cJSON *ab = cJSON_GetObjectItemCaseSensitive(ti, "abs_per_step");
    cJSON *ul = cJSON_GetObjectItemCaseSensitive(ti, "ulp_per_step");
    assert_true(cJSON_IsArray(ab) && cJSON_IsArray(ul));
    assert_int_equal(cJSON_GetArraySize(ab), STEPS);
    assert_int_equal(cJSON_GetArraySize(ul), STEPS);
  }
  cJSON *t0 = cJSON_GetArrayItem(ts, 0);
  assert_string_equal(cJSON_GetObjectItemCaseSensitive(t0, "name")->valuestring, "fc1.weight/exp_avg");
  assert_true(cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(t0, "abs_per_step"), 4)->valuedouble == 2.5e-6);
  assert_int_equal(cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(t0, "ulp_per_step"), 3)->valueint, 12);
  assert_int_equal(cJSON_GetObjectItemCaseSensitive(t0, "first_diff")->valueint, 3);
  assert_true(cJSON_IsFalse(cJSON_GetObjectItemCaseSensitive(t0, "bitwise")));
  cJSON *t1 = cJSON_GetArrayItem(ts, 1);
  assert_true(cJSON_IsNull(cJSON_GetObjectItemCaseSensitive(t1, "first_diff")));
  assert_true(cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(t1, "bitwise")));
  cJSON *v = cJSON_GetObjectItemCaseSensitive(j, "verdict");
  assert_true(cJSON_IsFalse(cJSON_GetObjectItemCaseSensitive(v, "equivalent")));
  assert_int_equal(cJSON_GetObjectItemCaseSensitive(v, "step")->valueint, 3);
  assert_string_equal(cJSON_GetObjectItemCaseSensitive(v, "tensor")->valuestring, "fc1.weight/exp_avg");
  assert_non_null(strstr(cJSON_GetObjectItemCaseSensitive(v, "text")->valuestring, "DIVERGED at step 3"));
  assert_int_equal(cJSON_GetObjectItemCaseSensitive(j, "schema_version")->valueint, 6); /* 3: nan_pairs, drift; 4: gradients.model; 5: events; 6: cpu_seconds */
  assert_true(cJSON_IsObject(cJSON_GetObjectItemCaseSensitive(j, "events")));
  cJSON *cpu = cJSON_GetObjectItemCaseSensitive(j, "cpu_seconds");
  assert_true(cJSON_IsObject(cpu) && cJSON_IsNumber(cJSON_GetObjectItemCaseSensitive(cpu, "steps")) &&
              cJSON_IsNumber(cJSON_GetObjectItemCaseSensitive(cpu, "process")) &&
              cJSON_IsNumber(cJSON_GetObjectItemCaseSensitive(cpu, "reference")));
  assert_true(cJSON_IsNull(cJSON_GetObjectItemCaseSensitive(j, "digest"))); /* this result has none */
  cJSON_Delete(j);

  /* a failed write leaves nothing behind */
  snprintf(path, sizeof path, "%s/no/such/dir/r.json", dir);
  assert_status(cmp_write_json(path, &o, &r), DOPT_ERR_IO, "r.json");
  assert_int_not_equal(access(path, F_OK), 0);
}

/* The digest: the table's last line and the JSON "digest" object, equal and differing. */
/* Replica drift and step counters decide the verdict when they come first; NaN
 * on both sides is equal and listed (docs/nan-policy.md). */
static cJSON *json_of(const cmp_options *o, const cmp_result *r) {
  char path[300];
  snprintf(path, sizeof path, "%s/v.json", dir);
  assert_ok(cmp_write_json(path, o, r));
  char *txt = slurp(path);
  cJSON *j = cJSON_Parse(txt);
  free(txt);
  assert_non_null(j);
  return j;
}

static void test_verdict_kinds(void **st) {
  (void)st;
  cmp_options o;
  cmp_result r;
  options(&o);
  /* drift at step 2, before the tensor divergence at step 3 */
  result(&r);
  r.drift_step = 2;
  r.drift_rank = 3;
  snprintf(r.drift_tensor, sizeof r.drift_tensor, "fc1.weight");
  char *t = table_text(&o, &r);
  assert_non_null(strstr(t, "verdict: DIVERGED at step 2 (rank 3's copy of fc1.weight differs from rank 0's: replica drift)\n"));
  free(t);
  cJSON *j = json_of(&o, &r), *v = cJSON_GetObjectItemCaseSensitive(j, "verdict");
  assert_string_equal(cJSON_GetObjectItemCaseSensitive(v, "kind")->valuestring, "replica_drift");
  assert_int_equal(cJSON_GetObjectItemCaseSensitive(v, "rank")->valueint, 3);
  assert_int_equal(cJSON_GetObjectItemCaseSensitive(v, "step")->valueint, 2);
  cJSON_Delete(j);
  /* a step counter off at step 4, after the divergence at 3: the divergence is the finding */
  result(&r);
  r.counter_step = 4;
  t = table_text(&o, &r);
  assert_non_null(strstr(t, "verdict: DIVERGED at step 3 (tensor fc1.weight/exp_avg)\n"));
  free(t);
  /* every value bitwise but a counter: the counter */
  result(&r);
  tens[0].max_ulp = 0, tens[0].first_diff = 0, tens[0].max_abs = 0, tens[0].ulp_per_step = ulp0, tens[0].abs_per_step = abs0;
  r.counter_step = 4;
  snprintf(r.counter_param, sizeof r.counter_param, "fc1.weight");
  r.counter_ref = 4, r.counter_dist = 3;
  t = table_text(&o, &r);
  assert_non_null(strstr(t, "verdict: DIVERGED at step 4 (step counter of fc1.weight: reference 4, distributed 3)\n"));
  free(t);
  j = json_of(&o, &r);
  assert_string_equal(cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(j, "verdict"), "kind")->valuestring,
                      "step_counter");
  cJSON_Delete(j);
  /* NaN on both sides: equivalent, bitwise, and counted in the table and JSON */
  result(&r);
  tens[0].max_ulp = 0, tens[0].first_diff = 0, tens[0].max_abs = 0, tens[0].ulp_per_step = ulp0, tens[0].abs_per_step = abs0;
  tens[0].nan_pairs = 5;
  r.equivalent = 1;
  t = table_text(&o, &r);
  assert_non_null(strstr(t, "verdict: EQUIVALENT (bitwise"));
  assert_non_null(strstr(t, "NaN on both sides (equal under the NaN policy): fc1.weight/exp_avg: 5\n"));
  free(t);
  j = json_of(&o, &r);
  cJSON *t0 = cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(j, "tensors"), 0);
  assert_int_equal(cJSON_GetObjectItemCaseSensitive(t0, "nan_pairs")->valueint, 5);
  cJSON_Delete(j);
}

static void test_digest(void **st) {
  (void)st;
  cmp_options o;
  cmp_result r;
  options(&o);
  result(&r);
  const char *a = "c9c1d6fdf9ec758bd04e08b2027d66b2f55af9eb023133ac43761b96c216049d";
  const char *b = "0000000000000000000000000000000000000000000000000000000000000001";
  char *t = table_text(&o, &r);
  assert_null(strstr(t, "digest")); /* none measured: no line */
  free(t);
  for (int same = 1; same >= 0; same--) {
    snprintf(r.digest, sizeof r.digest, "%s", a);
    snprintf(r.ref_digest, sizeof r.ref_digest, "%s", same ? a : b);
    t = table_text(&o, &r);
    char want[256];
    if (same) snprintf(want, sizeof want, "\ndigest sha256:%s (reference: equal)\n", a);
    else snprintf(want, sizeof want, "\ndigest sha256:%s (reference: sha256:%s, differs)\n", a, b);
    const char *line = strstr(t, want);
    if (!line || line[strlen(want)] != '\0') fail_msg("the table does not end with '%s':\n%s", want + 1, t);
    free(t);
    char path[512];
    snprintf(path, sizeof path, "%s/d.json", dir);
    assert_ok(cmp_write_json(path, &o, &r));
    char *text = slurp(path);
    cJSON *j = cJSON_Parse(text);
    free(text);
    assert_non_null(j);
    cJSON *d = cJSON_GetObjectItemCaseSensitive(j, "digest");
    assert_true(cJSON_IsObject(d));
    assert_string_equal(cJSON_GetObjectItemCaseSensitive(d, "algorithm")->valuestring, "sha256");
    assert_string_equal(cJSON_GetObjectItemCaseSensitive(d, "encoding")->valuestring, "DOPT-DIGEST-1");
    assert_string_equal(cJSON_GetObjectItemCaseSensitive(d, "distributed")->valuestring, a);
    assert_string_equal(cJSON_GetObjectItemCaseSensitive(d, "reference")->valuestring, same ? a : b);
    assert_true(cJSON_IsBool(cJSON_GetObjectItemCaseSensitive(d, "equal")));
    assert_int_equal(cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(d, "equal")), same);
    cJSON_Delete(j);
  }
}

/* Minimal XML well-formedness: one root element, balanced and matching tags,
 * quoted attributes, no raw '<' in text or attributes, only the five
 * predefined entities or character references after '&'. */
static int entity_ok(const char *p) {
  static const char *const ents[] = {"&amp;", "&lt;", "&gt;", "&quot;", "&apos;"};
  for (int i = 0; i < 5; i++)
    if (strncmp(p, ents[i], strlen(ents[i])) == 0) return 1;
  return p[1] == '#' && strchr(p, ';') != NULL;
}

static const char *xml_well_formed(const char *s) {
  static char err[128];
  char stack[64][64];
  int depth = 0, roots = 0;
  const char *p = s;
  if (strncmp(p, "<?xml", 5) == 0) {
    p = strstr(p, "?>");
    if (!p) return "unterminated declaration";
    p += 2;
  }
  while (*p) {
    if (*p == '&') {
      if (!entity_ok(p)) return "bad entity in text";
      p++;
      continue;
    }
    if (*p != '<') {
      if (depth == 0 && !strchr(" \t\r\n", *p)) return "text outside the root";
      p++;
      continue;
    }
    if (strncmp(p, "<!--", 4) == 0) {
      p = strstr(p, "-->");
      if (!p) return "unterminated comment";
      p += 3;
      continue;
    }
    int closing = p[1] == '/';
    p += closing ? 2 : 1;
    char name[64];
    size_t n = 0;
    while (*p && !strchr(" \t\r\n/>", *p) && n < sizeof name - 1) name[n++] = *p++;
    name[n] = '\0';
    if (n == 0) return "empty tag name";
    int self = 0;
    while (*p && *p != '>') {
      if (*p == '"' || *p == '\'') {
        char q = *p++;
        while (*p && *p != q) {
          if (*p == '<') return "'<' in an attribute";
          if (*p == '&' && !entity_ok(p)) return "bad entity in an attribute";
          p++;
        }
        if (!*p) return "unterminated attribute";
      } else if (*p == '/') {
        self = 1;
      } else if (*p == '<') {
        return "'<' inside a tag";
      }
      p++;
    }
    if (!*p) return "unterminated tag";
    p++;
    if (closing) {
      if (depth == 0 || strcmp(stack[depth - 1], name) != 0) {
        snprintf(err, sizeof err, "mismatched </%s>", name);
        return err;
      }
      depth--;
    } else if (!self) {
      if (depth == 0) roots++;
      if (depth == 64) return "too deep";
      snprintf(stack[depth++], sizeof stack[0], "%s", name);
    } else if (depth == 0) {
      roots++;
    }
  }
  if (depth != 0) return "unclosed element";
  if (roots != 1) return "not exactly one root element";
  return NULL;
}

static int count(const char *s, const char *needle) {
  int c = 0;
  for (const char *p = strstr(s, needle); p; p = strstr(p + 1, needle)) c++;
  return c;
}

/* Python's parser as a second opinion, when python3 exists: 1 ran and
 * passed, 0 not available; fails the test when it ran and rejected. */
static int python_check(const char *path, int polylines) {
  if (system("command -v python3 >/dev/null 2>&1") != 0) return 0;
  char cmd[1200];
  snprintf(cmd, sizeof cmd,
           "python3 -c \"import sys, xml.etree.ElementTree as E; r = E.parse(sys.argv[1]).getroot(); "
           "ns = '{http://www.w3.org/2000/svg}'; "
           "assert r.tag == ns + 'svg', r.tag; assert r.get('viewBox'), 'viewBox'; "
           "assert len(r.findall('.//' + ns + 'polyline')) == int(sys.argv[2]), 'polylines'\" '%s' %d",
           path, polylines);
  int rc = system(cmd);
  if (rc != 0) fail_msg("python3 xml.etree rejected %s (rc %d)", path, rc);
  return 1;
}

static void test_svg(void **st) {
  (void)st;
  cmp_options o;
  cmp_result r;
  options(&o);
  result(&r);
  char path[512];
  snprintf(path, sizeof path, "%s/r.svg", dir);
  assert_ok(cmp_write_svg(path, &o, &r));
  assert_no_temporaries();
  char *svg = slurp(path);
  const char *why = xml_well_formed(svg);
  if (why) fail_msg("SVG not well-formed: %s", why);
  assert_non_null(strstr(svg, "viewBox=\"0 0 "));
  assert_int_equal(count(svg, "<polyline"), 1); /* only the tensor that differs */
  assert_non_null(strstr(svg, "fc1.weight/exp_avg"));
  assert_non_null(strstr(svg, "bitwise equal"));
  assert_non_null(strstr(svg, "1 tensor bitwise equal")); /* legend count */
  assert_non_null(strstr(svg, "came"));
  int py = python_check(path, 1);
  free(svg);

  /* names and options with XML metacharacters are escaped */
  snprintf(tens[0].name, sizeof tens[0].name, "a<b>&\"c'/exp_avg");
  snprintf(tens[1].name, sizeof tens[1].name, "a<b>&\"c'");
  snprintf(o.hparams, sizeof o.hparams, "lr=1&x<2");
  assert_ok(cmp_write_svg(path, &o, &r));
  svg = slurp(path);
  why = xml_well_formed(svg);
  if (why) fail_msg("SVG with metacharacters not well-formed: %s", why);
  assert_non_null(strstr(svg, "a&lt;b&gt;&amp;&quot;c&apos;/exp_avg"));
  free(svg);
  python_check(path, 1);

  /* many steps, all bitwise; a single step; non-finite errors */
  static double big_abs[1000];
  static uint64_t big_ulp[1000];
  tens[0].abs_per_step = big_abs;
  tens[0].ulp_per_step = big_ulp;
  tens[1].abs_per_step = big_abs;
  tens[1].ulp_per_step = big_ulp;
  tens[0].max_abs = 0;
  tens[0].max_ulp = 0;
  tens[0].first_diff = 0;
  r.steps = 1000;
  r.equivalent = 1;
  assert_ok(cmp_write_svg(path, &o, &r));
  svg = slurp(path);
  assert_null(xml_well_formed(svg));
  assert_int_equal(count(svg, "<polyline"), 0);
  assert_non_null(strstr(svg, "2 tensors bitwise equal"));
  free(svg);
  python_check(path, 0);
  r.steps = 1;
  r.equivalent = 0;
  big_abs[0] = INFINITY;
  big_ulp[0] = 5;
  tens[0].max_abs = big_abs[0];
  tens[0].max_ulp = 5;
  tens[0].first_diff = 1;
  assert_ok(cmp_write_svg(path, &o, &r));
  svg = slurp(path);
  assert_null(xml_well_formed(svg));
  assert_null(strstr(svg, "nan"));
  assert_null(strstr(svg, "inf\""));
  free(svg);
  python_check(path, 2); /* both tensors share big_abs: both differ */
  print_message("SVG checked with the C well-formedness check%s\n", py ? " and python3 xml.etree" : " only");

  snprintf(path, sizeof path, "%s/no/such/dir/r.svg", dir);
  assert_status(cmp_write_svg(path, &o, &r), DOPT_ERR_IO, "r.svg");
  assert_int_not_equal(access(path, F_OK), 0);
}

/* The progress line (cli_progress, compare's and verify's): nothing where standard error is not a terminal (here) or
 * before CLI_PROGRESS_AFTER_S; then "what: step d/n  X s/step  ETA ..." with the rate of the steps after the
 * first, at most every 0.25 s but always the last step, and a clearing line at the end. */
static void test_progress_line(void **st) {
  (void)st;
  char path[] = "/tmp/dopt_progress_XXXXXX";
  const int fd = mkstemp(path);
  assert_true(fd >= 0);
  fflush(stderr);
  const int saved = dup(STDERR_FILENO);
  assert_true(saved >= 0 && dup2(fd, STDERR_FILENO) >= 0);
  cli_progress p;
  cli_progress_init(&p, 0);
  const int tty = p.on;
  cli_progress_step(&p, "verify", 1, 10, NULL); /* not a terminal: nothing */
  cli_progress_init(&p, 0);
  p.on = 1;                                       /* as on a terminal */
  cli_progress_step(&p, "verify", 1, 10, NULL);   /* the first step, under 3 s: nothing */
  p.t0 -= 10.0, p.t1 -= 4.0;                      /* 10 s since the start, 4 s since step 1 */
  cli_progress_step(&p, "verify", 3, 10, "x=1");  /* 2 s/step over the 2 steps after the first: ETA 14 s */
  cli_progress_step(&p, "verify", 4, 10, NULL);   /* within 0.25 s of the last line: nothing */
  cli_progress_step(&p, "verify", 10, 10, NULL);  /* the last step: shown */
  cli_progress_end(&p);
  fflush(stderr);
  assert_true(dup2(saved, STDERR_FILENO) >= 0);
  close(saved);
  char buf[1024] = {0};
  FILE *f = fdopen(fd, "r");
  assert_non_null(f);
  rewind(f);
  const size_t n = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  unlink(path);
  assert_false(tty);
  const char *a = strstr(buf, "\rverify: step 3/10  2.00 s/step  ETA 14s  x=1");
  if (!a || strstr(buf, "step 1/10") || strstr(buf, "step 4/10") || !strstr(a, "\rverify: step 10/10") ||
      buf[n - 1] != '\r')
    fail_msg("progress lines: '%s'", buf);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_table),
      cmocka_unit_test(test_progress_line),
      cmocka_unit_test(test_json),
      cmocka_unit_test(test_verdict_kinds),
      cmocka_unit_test(test_digest),
      cmocka_unit_test(test_svg),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}

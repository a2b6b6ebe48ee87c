/* The MPI transport (mpi/mpi.c), run as one process per rank under
 * `mpirun -np 3` (CTest mpi_transport, label mpi):
 *  - every collective × dtype (F32, F64, BF16, I32, I64, U8) × op (SUM, PROD,
 *    MAX, MIN, AVG), out of place and in place (reduce_scatter: recv = this
 *    rank's block of send, as distributed/dp_sum.c calls it), counts 0, 1, 5
 *    and 300, with the default chunk and a chunk of 7 elements (the path of
 *    counts above INT_MAX), bitwise against expectations computed here from
 *    every rank's known inputs (floats: x0 op x1 op x2 in rank order);
 *  - floating-point SUM/AVG in rank order on inputs where the order changes
 *    the result (checked to be so), against x0 + x1 + x2 computed here;
 *  - partly overlapping buffers, splits (key order, color < 0), refusals;
 *  - a timeout: the last rank skips a collective, the others get
 *    DOPT_ERR_TIMEOUT within the timeout, then the skipper joins late.
 * Every collective of a test runs before any assertion, so that a failing
 * rank does not leave its peers waiting; cmocka runs on each rank (only rank
 * 0's progress is printed, every rank's failures reach stderr). */
#include "testutil.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "distopt/mpi.h"

static dopt_mpi_comm *g_world;
static dopt_transport g_wt;
static int g_rank, g_size;

/* ---- inputs and expectations ------------------------------------------------------- */

static uint64_t mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/* bf16 of f (round to nearest even; no NaN here), independent of the library */
static uint16_t to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static float from_bf16(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

/* A float of rank r, element e: near 1 for PROD; otherwise signed, with
 * exponents over 2^-8..2^8 so that the order of a sum changes its rounding. */
static double float_input(dopt_redop op, uint64_t h) {
  double u = (double)(h >> 11) * 0x1.0p-53;
  if (op == DOPT_PROD) return 1.0 + (u - 0.5) / 8.0;
  return (u - 0.5) * (double)(1u << (h % 17)) / 256.0;
}

/* Element e of rank r's input, written as element i of buf. */
static void input(dopt_dtype dt, dopt_redop op, int r, size_t e, void *buf, size_t i) {
  uint64_t h = mix(((uint64_t)dt << 56) ^ ((uint64_t)op << 48) ^ ((uint64_t)r << 32) ^ (uint64_t)e);
  int64_t small = op == DOPT_PROD ? (int64_t)(h % 5) - 2 : (int64_t)(h % 2001) - 1000;
  switch (dt) {
  case DOPT_F32: ((float *)buf)[i] = (float)float_input(op, h); break;
  case DOPT_F64: ((double *)buf)[i] = float_input(op, h) * (1.0 + 0x1.0p-40); break;
  case DOPT_BF16: ((uint16_t *)buf)[i] = to_bf16((float)float_input(op, h)); break;
  case DOPT_I32: ((int32_t *)buf)[i] = (int32_t)small; break;
  case DOPT_I64: ((int64_t *)buf)[i] = small * (op == DOPT_PROD ? 1 : 1000003); break;
  case DOPT_U8: ((uint8_t *)buf)[i] = (uint8_t)(h % 256); break; /* sums wrap */
  default: break;
  }
}

/* The reduction of element e over ranks 0..n-1 in rank order, as the
 * transport defines it: floats x0 op x1 op ... (BF16 in fp32, rounded once),
 * AVG one division by n; integers wrap. */
#define COMBINE(acc, v)                       \
  switch (op) {                               \
  case DOPT_PROD: acc = acc * v; break;       \
  case DOPT_MAX: acc = v > acc ? v : acc; break; \
  case DOPT_MIN: acc = v < acc ? v : acc; break; \
  default: acc = acc + v; break;              \
  }
static void expect(dopt_dtype dt, dopt_redop op, int n, size_t e, void *out, size_t i) {
  unsigned char x[8];
  if (dt == DOPT_F32 || dt == DOPT_F64 || dt == DOPT_BF16) {
    double dacc = 0;
    float facc = 0;
    for (int j = 0; j < n; j++) {
      input(dt, op, j, e, x, 0);
      if (dt == DOPT_F64) {
        double v = ((double *)x)[0];
        if (j == 0) dacc = v;
        else COMBINE(dacc, v)
      } else {
        float v = dt == DOPT_F32 ? ((float *)x)[0] : from_bf16(((uint16_t *)x)[0]);
        if (j == 0) facc = v;
        else COMBINE(facc, v)
      }
    }
    if (op == DOPT_AVG) dacc = dacc / (double)n, facc = facc / (float)n;
    if (dt == DOPT_F64) ((double *)out)[i] = dacc;
    else if (dt == DOPT_F32) ((float *)out)[i] = facc;
    else ((uint16_t *)out)[i] = to_bf16(facc);
    return;
  }
  /* integers in int64 with the element type's wrap-around (unsigned arithmetic) */
  uint64_t acc = 0;
  int64_t sacc = 0;
  for (int j = 0; j < n; j++) {
    input(dt, op, j, e, x, 0);
    int64_t v = dt == DOPT_I32 ? ((int32_t *)x)[0] : dt == DOPT_I64 ? ((int64_t *)x)[0] : ((uint8_t *)x)[0];
    if (j == 0) {
      sacc = v;
      continue;
    }
    if (op == DOPT_MAX) sacc = v > sacc ? v : sacc;
    else if (op == DOPT_MIN) sacc = v < sacc ? v : sacc;
    else {
      acc = op == DOPT_PROD ? (uint64_t)sacc * (uint64_t)v : (uint64_t)sacc + (uint64_t)v;
      sacc = dt == DOPT_I32 ? (int32_t)(uint32_t)acc : dt == DOPT_U8 ? (int64_t)(uint8_t)acc : (int64_t)acc;
    }
  }
  if (op == DOPT_AVG) sacc = sacc / n;
  if (dt == DOPT_I32) ((int32_t *)out)[i] = (int32_t)sacc;
  else if (dt == DOPT_I64) ((int64_t *)out)[i] = sacc;
  else ((uint8_t *)out)[i] = (uint8_t)sacc;
}

/* ---- the grid ------------------------------------------------------------------------ */

typedef enum { K_ALL_REDUCE, K_REDUCE_SCATTER, K_ALL_GATHER, K_BROADCAST, K_REDUCE } kind;
static const char *const KIND[] = {"all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce"};
static const char *const OPS[] = {"SUM", "PROD", "MAX", "MIN", "AVG"};

typedef struct tally {
  int cases, failed;
  char first[400];
} tally;

#if defined(__GNUC__)
__attribute__((format(printf, 2, 3)))
#endif
static void note(tally *t, const char *fmt, ...) {
  if (t->failed++ == 0) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(t->first, sizeof t->first, fmt, ap);
    va_end(ap);
  }
}

enum { GUARD = 8 }; /* bytes after every output, which must stay untouched */

/* One case on this rank: runs the collective and compares with the expectation. */
static void run_case(tally *t, kind k, dopt_dtype dt, dopt_redop op, size_t count, int inplace, int root) {
  const int n = g_size, r = g_rank;
  const size_t esz = dopt_dtype_size(dt), nin = k == K_REDUCE_SCATTER ? count * (size_t)n : count,
               nout = k == K_ALL_GATHER ? count * (size_t)n : count;
  const size_t big = (nin > nout ? nin : nout) + 1;
  unsigned char *in = malloc(big * esz), *res = malloc(big * esz + GUARD), *want = malloc(big * esz);
  assert_non_null(in);
  assert_non_null(res);
  assert_non_null(want);
  memset(res, 0xab, big * esz + GUARD);
  unsigned char *out = res; /* where the result lands */
  dopt_status s;
  const dopt_redop gen_op = k == K_ALL_GATHER || k == K_BROADCAST ? DOPT_SUM : op;
  switch (k) {
  case K_ALL_REDUCE: {
    unsigned char *src = inplace ? res : in;
    for (size_t e = 0; e < count; e++) input(dt, op, r, e, src, e);
    for (size_t e = 0; e < count; e++) expect(dt, op, n, e, want, e);
    s = g_wt.ops->all_reduce(g_wt.comm, src, res, count, dt, op);
    break;
  }
  case K_REDUCE: { /* the root's recv holds the reduction; the others' recv stays untouched */
    unsigned char *src = inplace ? res : in;
    for (size_t e = 0; e < count; e++) input(dt, op, r, e, src, e);
    if (r == root)
      for (size_t e = 0; e < count; e++) expect(dt, op, n, e, want, e);
    else
      memcpy(want, res, count * esz); /* as it was: the input (in place) or the 0xab fill */
    s = g_wt.ops->reduce(g_wt.comm, src, res, count, dt, op, root);
    break;
  }
  case K_REDUCE_SCATTER: {
    unsigned char *src = inplace ? res : in;
    for (size_t e = 0; e < nin; e++) input(dt, op, r, e, src, e);
    for (size_t e = 0; e < count; e++) expect(dt, op, n, (size_t)r * count + e, want, e);
    if (inplace) out = res + (size_t)r * count * esz;
    s = g_wt.ops->reduce_scatter(g_wt.comm, src, out, count, dt, op);
    break;
  }
  case K_ALL_GATHER: {
    unsigned char *src = inplace ? res + (size_t)r * count * esz : in;
    for (size_t e = 0; e < count; e++) input(dt, gen_op, r, e, src, e);
    for (int j = 0; j < n; j++)
      for (size_t e = 0; e < count; e++) input(dt, gen_op, j, e, want, (size_t)j * count + e);
    s = g_wt.ops->all_gather(g_wt.comm, src, res, count, dt);
    break;
  }
  default: { /* broadcast: only the root's send is read */
    unsigned char *src = inplace ? res : in;
    if (r == root)
      for (size_t e = 0; e < count; e++) input(dt, gen_op, root, e, src, e);
    for (size_t e = 0; e < count; e++) input(dt, gen_op, root, e, want, e);
    s = g_wt.ops->broadcast(g_wt.comm, src, res, count, dt, root);
    break;
  }
  }
  t->cases++;
  const char *tag = k == K_ALL_GATHER || k == K_BROADCAST ? "-" : OPS[op];
  if (s != DOPT_OK) {
    note(t, "rank %d: %s %s %s count %zu inplace %d: %s", r, KIND[k], dopt_dtype_name(dt), tag, count, inplace,
         dopt_last_error());
  } else {
    size_t bad = SIZE_MAX;
    for (size_t e = 0; e < nout && bad == SIZE_MAX; e++)
      if (memcmp(out + e * esz, want + e * esz, esz) != 0) bad = e;
    const unsigned char *end = res + (k == K_REDUCE_SCATTER && inplace ? nin : nout) * esz;
    int guard_ok = 1;
    for (size_t g = 0; g < GUARD; g++) guard_ok &= end[g] == 0xab;
    if (k == K_REDUCE_SCATTER && inplace) guard_ok = 1; /* the whole input buffer is the caller's */
    if (bad != SIZE_MAX)
      note(t, "rank %d: %s %s %s count %zu inplace %d: element %zu differs", r, KIND[k], dopt_dtype_name(dt), tag,
           count, inplace, bad);
    else if (!guard_ok)
      note(t, "rank %d: %s %s %s count %zu inplace %d: wrote past the output", r, KIND[k], dopt_dtype_name(dt), tag,
           count, inplace);
  }
  free(in);
  free(res);
  free(want);
}

static const dopt_dtype DTYPES[] = {DOPT_F32, DOPT_F64, DOPT_BF16, DOPT_I32, DOPT_I64, DOPT_U8};
static const size_t COUNTS[] = {0, 1, 5, 300};

static void grid(kind k, size_t chunk) {
  assert_ok(dopt_mpi_set_chunk(g_world, chunk));
  tally t = {0, 0, ""};
  const int nops = k == K_ALL_REDUCE || k == K_REDUCE_SCATTER || k == K_REDUCE ? DOPT_REDOP_COUNT_ : 1;
  for (size_t d = 0; d < sizeof DTYPES / sizeof DTYPES[0]; d++)
    for (int op = 0; op < nops; op++)
      for (size_t c = 0; c < sizeof COUNTS / sizeof COUNTS[0]; c++)
        for (int inplace = 0; inplace < 2; inplace++)
          run_case(&t, k, DTYPES[d], (dopt_redop)op, COUNTS[c], inplace, (int)(c % (size_t)g_size));
  assert_ok(dopt_mpi_set_chunk(g_world, SIZE_MAX));
  if (t.failed) fail_msg("%d of %d cases failed; first: %s", t.failed, t.cases, t.first);
  assert_true(t.cases >= 48);
}

static void test_all_reduce(void **state) {
  (void)state;
  grid(K_ALL_REDUCE, SIZE_MAX);
  grid(K_ALL_REDUCE, 7);
}
static void test_reduce_scatter(void **state) {
  (void)state;
  grid(K_REDUCE_SCATTER, SIZE_MAX);
  grid(K_REDUCE_SCATTER, 7);
}
static void test_all_gather(void **state) {
  (void)state;
  grid(K_ALL_GATHER, SIZE_MAX);
  grid(K_ALL_GATHER, 7);
}
static void test_broadcast(void **state) {
  (void)state;
  grid(K_BROADCAST, SIZE_MAX);
  grid(K_BROADCAST, 7);
}
static void test_reduce(void **state) {
  (void)state;
  grid(K_REDUCE, SIZE_MAX);
  grid(K_REDUCE, 7);
}

/* all_to_allv with irregular counts (some zero, self included) and gaps in
 * both buffers: every received region exact, the gaps untouched; a count
 * above INT_MAX refused on the rank that passes it, before any MPI call. */
static size_t av_count(int i, int j) { return (size_t)((i * 3 + j * 5) % 4) * (size_t)(1 + (i + j) % 3); }

static void test_all_to_allv(void **state) {
  (void)state;
  enum { CAP = 256, GAP = 2 };
  const int n = g_size, r = g_rank;
  assert_true(n <= 8);
  size_t sc[8], sd[8], rc[8], rd[8], so = 1, ro = 1;
  int32_t send[CAP], got[CAP], want[CAP];
  for (int e = 0; e < CAP; e++) send[e] = got[e] = want[e] = -7;
  for (int j = 0; j < n; j++) {
    sc[j] = av_count(r, j);
    sd[j] = so;
    so += sc[j] + GAP;
    rc[j] = av_count(j, r);
    rd[j] = ro;
    ro += rc[j] + GAP;
    for (size_t e = 0; e < sc[j]; e++) send[sd[j] + e] = r * 1000 + j * 100 + (int32_t)e;
    for (size_t e = 0; e < rc[j]; e++) want[rd[j] + e] = j * 1000 + r * 100 + (int32_t)e;
  }
  assert_ok(g_wt.ops->all_to_allv(g_wt.comm, send, sc, sd, got, rc, rd, DOPT_I32));
  assert_memory_equal(got, want, sizeof want);
  size_t big[8];
  for (int j = 0; j < n; j++) big[j] = 0;
  big[0] = (size_t)INT_MAX + 1;
  size_t zero[8] = {0};
  assert_status(g_wt.ops->all_to_allv(g_wt.comm, send, big, zero, got, zero, zero, DOPT_I32), DOPT_ERR_UNSUPPORTED,
                "INT_MAX");
}

/* ---- rank order ----------------------------------------------------------------------- */

/* Floating sums in rank order, on inputs where the order matters: a large
 * value, nearly its negation and a small one per element. Checked bitwise
 * against x0 + x1 + ... computed here, and checked to differ from the sum in
 * reverse order somewhere (so that an order change would be caught). */
static float order_input(int r, size_t e) {
  uint64_t h = mix(0x5eedull ^ ((uint64_t)r << 32) ^ (uint64_t)e);
  float big = (float)(1u << (10 + h % 14)) * (1.0f + (float)(h >> 40) * 0x1.0p-24f);
  float v = (float)((double)(h >> 11) * 0x1.0p-53 - 0.5);
  if (r == 0) return big;
  if (r == 1) return -big * (1.0f - 0x1.0p-20f) + v;
  return v * (float)(1u << (h % 5));
}

static void test_rank_order_float_sum(void **state) {
  (void)state;
  enum { N = 96 };
  const int n = g_size, r = g_rank;
  float x[N], ar[N], avg[N], rs[N * 8], want[N], want_avg[N], rev[N];
  double xd[N], ard[N], wantd[N];
  assert_true(n <= 8);
  for (size_t e = 0; e < N; e++) {
    x[e] = order_input(r, e);
    xd[e] = (double)x[e] * (1.0 + 0x1.0p-35);
    float acc = order_input(0, e), back = order_input(n - 1, e);
    double accd = (double)order_input(0, e) * (1.0 + 0x1.0p-35);
    for (int j = 1; j < n; j++) {
      acc = acc + order_input(j, e);
      accd = accd + (double)order_input(j, e) * (1.0 + 0x1.0p-35);
      back = back + order_input(n - 1 - j, e);
    }
    want[e] = acc;
    want_avg[e] = acc / (float)n;
    wantd[e] = accd;
    rev[e] = back;
  }
  /* reduce_scatter in place, as distributed/dp_sum.c calls it: n blocks of N
   * elements, block j of rank i = order_input(i, .) + j; this rank keeps block r */
  for (int j = 0; j < n; j++)
    for (size_t e = 0; e < N; e++) rs[(size_t)j * N + e] = order_input(r, e) + (float)j;
  dopt_status s1 = g_wt.ops->all_reduce(g_wt.comm, x, ar, N, DOPT_F32, DOPT_SUM);
  dopt_status s2 = g_wt.ops->all_reduce(g_wt.comm, x, avg, N, DOPT_F32, DOPT_AVG);
  dopt_status s3 = g_wt.ops->all_reduce(g_wt.comm, xd, ard, N, DOPT_F64, DOPT_SUM);
  dopt_status s4 = g_wt.ops->reduce_scatter(g_wt.comm, rs, rs + (size_t)r * N, N, DOPT_F32, DOPT_SUM);
  float red[N]; /* reduce to the last rank, in place there (dp_sum.c's owner sum) */
  memcpy(red, x, sizeof red);
  dopt_status s5 = g_wt.ops->reduce(g_wt.comm, red, red, N, DOPT_F32, DOPT_SUM, n - 1);
  assert_ok(s5);
  if (r == n - 1) assert_memory_equal(red, want, sizeof red);
  assert_ok(s1);
  assert_ok(s2);
  assert_ok(s3);
  assert_ok(s4);
  int order_matters = 0;
  for (size_t e = 0; e < N; e++) {
    float rsw = order_input(0, e) + (float)r;
    for (int j = 1; j < n; j++) rsw = rsw + (order_input(j, e) + (float)r);
    if (memcmp(&ar[e], &want[e], sizeof(float)) != 0)
      fail_msg("rank %d: F32 SUM element %zu: %a, rank order gives %a", r, e, (double)ar[e], (double)want[e]);
    if (memcmp(&avg[e], &want_avg[e], sizeof(float)) != 0)
      fail_msg("rank %d: F32 AVG element %zu: %a, rank order gives %a", r, e, (double)avg[e], (double)want_avg[e]);
    if (memcmp(&ard[e], &wantd[e], sizeof(double)) != 0)
      fail_msg("rank %d: F64 SUM element %zu: %a, rank order gives %a", r, e, ard[e], wantd[e]);
    if (memcmp(&rs[(size_t)r * N + e], &rsw, sizeof(float)) != 0)
      fail_msg("rank %d: in-place reduce_scatter F32 SUM element %zu: %a, rank order gives %a", r, e,
               (double)rs[(size_t)r * N + e], (double)rsw);
    order_matters |= memcmp(&rev[e], &want[e], sizeof(float)) != 0;
  }
  if (n >= 3) assert_true(order_matters); /* a sum of two is commutative: no order to check */
}

/* ---- overlap, splits, refusals ------------------------------------------------------- */

static void test_partial_overlap(void **state) {
  (void)state;
  enum { N = 10 };
  float buf[N + 2], want[N];
  for (size_t e = 0; e < N; e++) {
    input(DOPT_F32, DOPT_SUM, g_rank, e, buf, e);
    expect(DOPT_F32, DOPT_SUM, g_size, e, want, e);
  }
  /* recv starts 2 elements into send: the reduction of the original send */
  assert_ok(g_wt.ops->all_reduce(g_wt.comm, buf, buf + 2, N, DOPT_F32, DOPT_SUM));
  assert_memory_equal(buf + 2, want, sizeof want);
}

static void test_split(void **state) {
  (void)state;
  const int n = g_size, r = g_rank;
  dopt_mpi_comm *half = NULL, *most = NULL;
  dopt_transport ht, mt;
  /* colors by parity, keys reversed: the highest world rank comes first */
  dopt_status s1 = dopt_mpi_split(g_world, r % 2, -r, &half);
  /* rank 1 takes no part (color < 0) */
  dopt_status s2 = dopt_mpi_split(g_world, r == 1 ? -1 : 0, r, &most);
  int32_t me = r, got[8] = {0};
  dopt_status s3 = s1 == DOPT_OK ? dopt_mpi_transport(half, &ht) : s1;
  if (s3 == DOPT_OK) s3 = ht.ops->all_gather(ht.comm, &me, got, 1, DOPT_I32);
  int64_t one = 1, cnt = 0;
  dopt_status s4 = DOPT_OK;
  if (most) s4 = dopt_mpi_transport(most, &mt);
  if (most && s4 == DOPT_OK) s4 = mt.ops->all_reduce(mt.comm, &one, &cnt, 1, DOPT_I64, DOPT_SUM);
  assert_ok(s1);
  assert_ok(s2);
  assert_ok(s3);
  assert_ok(s4);
  int hsize = (n - r % 2 + 1) / 2; /* ranks of my parity */
  assert_int_equal(ht.size, hsize);
  for (int j = 0; j < hsize; j++) /* descending world ranks of my parity */
    assert_int_equal(got[j], (hsize - 1 - j) * 2 + r % 2);
  if (r == 1) {
    assert_null(most);
  } else {
    assert_non_null(most);
    assert_int_equal(mt.size, n - 1);
    assert_int_equal(cnt, n - 1);
  }
  dopt_mpi_destroy(half);
  dopt_mpi_destroy(most);
}

static void test_refusals(void **state) {
  (void)state;
  float x = 1, y = 0;
  assert_int_equal(dopt_mpi_available(), 1);
  assert_status(g_wt.ops->all_reduce(g_wt.comm, &x, &y, 1, DOPT_F16, DOPT_SUM), DOPT_ERR_UNSUPPORTED, "F16");
  assert_status(g_wt.ops->all_reduce(g_wt.comm, &x, &y, 1, DOPT_F32, (dopt_redop)99), DOPT_ERR_UNSUPPORTED, "op 99");
  assert_status(g_wt.ops->broadcast(g_wt.comm, &x, &y, 1, DOPT_F32, g_size), DOPT_ERR_INVALID_ARG, "root");
  assert_status(g_wt.ops->all_gather(NULL, &x, &y, 1, DOPT_F32), DOPT_ERR_INVALID_ARG, "comm=NULL");
  assert_status(dopt_mpi_split(g_world, 0, 0, NULL), DOPT_ERR_INVALID_ARG, "out=NULL");
  dopt_mpi_comm *c = NULL;
  assert_status(dopt_mpi_init(0, &c), DOPT_ERR_INVALID_ARG, "timeout_ms");
  assert_status(dopt_mpi_set_chunk(g_world, 0), DOPT_ERR_INVALID_ARG, "elems");
}

/* ---- timeout --------------------------------------------------------------------------- */

static double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

/* The last rank skips an all_reduce on a communicator with a 400 ms timeout:
 * the others fail with DOPT_ERR_TIMEOUT after 400 ms (not much later), and
 * the communicator refuses the next call. Then the skipper joins late, so the
 * abandoned operation completes inside MPI (its sum shows every rank took
 * part) and nothing is left pending at MPI_Finalize. */
static void test_timeout(void **state) {
  (void)state;
  enum { TIMEOUT_MS = 400 };
  const int last = g_size - 1, me = g_rank;
  dopt_mpi_comm *sc = NULL;
  dopt_transport st;
  assert_ok(dopt_mpi_init(TIMEOUT_MS, &sc)); /* a second duplicate of the world, with its own timeout */
  assert_ok(dopt_mpi_transport(sc, &st));
  int64_t x = 1, y = 0;
  dopt_status s = DOPT_OK, again = DOPT_OK;
  double ms = 0;
  char msg[512] = "";
  if (me != last) {
    double t0 = now_ms();
    s = st.ops->all_reduce(st.comm, &x, &y, 1, DOPT_I64, DOPT_SUM);
    ms = now_ms() - t0;
    snprintf(msg, sizeof msg, "%s", dopt_last_error());
    again = st.ops->all_reduce(st.comm, &x, &y, 1, DOPT_I64, DOPT_SUM);
  }
  /* everyone past the timeout; then the late join while the others wait on the world
   * (their waiting drives MPI's progress of the abandoned operation) */
  int64_t z = 0, zz = 0;
  dopt_status w1 = g_wt.ops->all_reduce(g_wt.comm, &z, &zz, 1, DOPT_I64, DOPT_MAX);
  dopt_status late = DOPT_OK;
  if (me == last) late = st.ops->all_reduce(st.comm, &x, &y, 1, DOPT_I64, DOPT_SUM);
  dopt_status w2 = g_wt.ops->all_reduce(g_wt.comm, &z, &zz, 1, DOPT_I64, DOPT_MAX);
  dopt_mpi_destroy(sc);
  assert_ok(w1);
  assert_ok(w2);
  if (me != last) {
    if (s != DOPT_ERR_TIMEOUT) fail_msg("rank %d: %s, want DOPT_ERR_TIMEOUT (%s)", me, dopt_status_name(s), msg);
    if (ms < TIMEOUT_MS || ms > TIMEOUT_MS + 1500)
      fail_msg("rank %d: timed out after %.0f ms (timeout %d)", me, ms, TIMEOUT_MS);
    char want[128];
    snprintf(want, sizeof want, "all_reduce: rank %d of %d:", me, g_size);
    if (!strstr(msg, want) || !strstr(msg, "400 ms") || strchr(msg, '\n'))
      fail_msg("rank %d: message '%s' should name the operation, rank, size and timeout on one line", me, msg);
    assert_int_equal(again, DOPT_ERR_ABORTED);
  } else {
    assert_ok(late);
    assert_int_equal(y, g_size);
  }
}

int main(void) {
  if (dopt_mpi_init(30000, &g_world) != DOPT_OK || dopt_mpi_transport(g_world, &g_wt) != DOPT_OK) {
    fprintf(stderr, "mpi_transport: %s\n", dopt_last_error());
    return 1;
  }
  g_rank = g_wt.rank;
  g_size = g_wt.size;
  if (g_size < 2 || g_size > 8) {
    fprintf(stderr, "mpi_transport: run under mpirun -np 2..8 (got %d processes)\n", g_size);
    return 1;
  }
  if (g_rank != 0 && !freopen("/dev/null", "w", stdout)) return 1; /* cmocka's progress: rank 0 only */
  char name[64];
  snprintf(name, sizeof name, "mpi_transport rank %d of %d", g_rank, g_size);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_all_reduce),    cmocka_unit_test(test_reduce_scatter),
      cmocka_unit_test(test_all_gather),    cmocka_unit_test(test_broadcast),
      cmocka_unit_test(test_reduce),        cmocka_unit_test(test_all_to_allv),
      cmocka_unit_test(test_rank_order_float_sum), cmocka_unit_test(test_partial_overlap),
      cmocka_unit_test(test_split),         cmocka_unit_test(test_refusals),
      cmocka_unit_test(test_timeout),
  };
  int failed = cmocka_run_group_tests_name(name, tests, NULL, NULL);
  dopt_mpi_destroy(g_world);
  dopt_mpi_finalize();
  return failed ? 1 : 0;
}

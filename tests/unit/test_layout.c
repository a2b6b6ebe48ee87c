/* The layout description (distopt/layout.h): a piece's elements against an
 * enumeration of its block's multi-indices, the distributed piece's TP block
 * against the gather's own index formula, and the coverage rule on random
 * tilings (accepted, sources the lowest rank's copy) and on each way a layout
 * can be wrong (refused in one line naming the parameter and ranks). */
#include "testutil.h"

#include <stdlib.h>
#include <string.h>

#include "distopt/layout.h"

static dopt_layout_piece piece(int dim, int64_t blo, int64_t blen, int64_t lo, int64_t len) {
  dopt_layout_piece p = DOPT_LAYOUT_PIECE_INIT;
  p.block_dim = dim, p.block_lo = blo, p.block_len = blen, p.lo = lo, p.len = len;
  return p;
}

/* Piece elements in order = the block's multi-indices in row-major order, flat range [lo, lo + len) of them. */
static void test_elem_matches_enumeration(void **st) {
  (void)st;
  uint64_t rng = 11;
  for (int trial = 0; trial < 300; trial++) {
    const int ndim = 1 + (int)(dt_rand_u64(&rng) % 4);
    int64_t shape[4], numel = 1;
    for (int k = 0; k < ndim; k++) numel *= shape[k] = 1 + (int64_t)(dt_rand_u64(&rng) % 5);
    const int dim = (int)(dt_rand_u64(&rng) % (uint64_t)(ndim + 1)) - 1; /* -1: no block */
    int64_t blo = 0, blen = 0;
    if (dim >= 0) {
      blo = (int64_t)(dt_rand_u64(&rng) % (uint64_t)shape[dim]);
      blen = 1 + (int64_t)(dt_rand_u64(&rng) % (uint64_t)(shape[dim] - blo));
    }
    /* the block's elements, row-major over its multi-indices */
    int64_t *blk = malloc((size_t)numel * sizeof *blk), nb = 0;
    for (int64_t e = 0; e < numel; e++) {
      int64_t rem = e, idx[4];
      for (int k = ndim - 1; k >= 0; k--) idx[k] = rem % shape[k], rem /= shape[k];
      if (dim < 0 || (idx[dim] >= blo && idx[dim] < blo + blen)) blk[nb++] = e;
    }
    const int64_t lo = (int64_t)(dt_rand_u64(&rng) % (uint64_t)nb);
    dopt_layout_piece p = piece(dim, blo, blen, lo, -1);
    assert_ok(dopt_layout_piece_check(ndim, shape, &p));
    assert_int_equal(p.len, nb - lo); /* len -1: to the end of the block */
    assert_int_equal(dopt_layout_piece_extent(ndim, shape, &p), nb);
    for (int64_t j = 0; j < p.len; j++) assert_int_equal(dopt_layout_piece_elem(ndim, shape, &p, j), blk[lo + j]);
    free(blk);
  }
}

/* dopt_layout_from_piece: a [b, h, w] tensor's TP block (rows: column-parallel; columns: row-parallel) and a
 * ZeRO range of it name the elements the distributed gather writes: ((bi * h + h0 + i) * w + w0 + k) for the
 * block element (bi * hl + i) * wl + k. */
static void test_from_distributed_piece(void **st) {
  (void)st;
  const int64_t shape[3] = {2, 5, 7};
  for (int split = 0; split < 3; split++)
    for (size_t a = 0; a < 4; a++) {
      dopt_piece dp;
      dopt_piece_full(3, shape, &dp);
      if (split == 1) dp.h0 = a, dp.hl = 2;  /* rows [a, a + 2) */
      if (split == 2) dp.w0 = a, dp.wl = 3;  /* columns [a, a + 3) */
      const size_t bl = dp.b * dp.hl * dp.wl;
      dp.lo = a, dp.len = bl - a - 1;        /* a ZeRO range of the block */
      dopt_layout_piece lp;
      assert_ok(dopt_layout_from_piece(&dp, 3, &lp));
      assert_int_equal(lp.block_dim, split == 0 ? -1 : split == 1 ? 1 : 2);
      assert_ok(dopt_layout_piece_check(3, shape, &lp));
      for (size_t j = 0; j < dp.len; j++) {
        const size_t e = dp.lo + j, bi = e / (dp.hl * dp.wl), i = e / dp.wl % dp.hl, k = e % dp.wl;
        assert_int_equal(dopt_layout_piece_elem(3, shape, &lp, (int64_t)j),
                         (int64_t)((bi * dp.h + dp.h0 + i) * dp.w + dp.w0 + k));
      }
    }
  /* a 1-D column-parallel bias: its split is dimension 0 */
  const int64_t s1[1] = {9};
  dopt_piece dp;
  dopt_piece_full(1, s1, &dp);
  dp.w0 = 4, dp.wl = 5, dp.lo = 0, dp.len = 5;
  dopt_layout_piece lp;
  assert_ok(dopt_layout_from_piece(&dp, 1, &lp));
  assert_int_equal(lp.block_dim, 0);
  assert_int_equal(dopt_layout_piece_elem(1, s1, &lp, 0), 4);
  /* both dimensions split is no TP layout */
  dopt_piece_full(3, shape, &dp);
  dp.hl = 2, dp.wl = 3;
  assert_status(dopt_layout_from_piece(&dp, 3, &lp), DOPT_ERR_INVALID_ARG, "both split");
}

static void test_check_refuses(void **st) {
  (void)st;
  const int64_t shape[2] = {4, 6};
  dopt_layout_piece p = piece(2, 0, 1, 0, 1);
  assert_status(dopt_layout_piece_check(2, shape, &p), DOPT_ERR_INVALID_ARG, "block dim 2: the tensor has 2 dimensions");
  p = piece(1, 4, 3, 0, 1);
  assert_status(dopt_layout_piece_check(2, shape, &p), DOPT_ERR_INVALID_ARG, "block dim 1 [4, 7) is outside [0, 6)");
  p = piece(1, 0, 3, 0, 13);
  assert_status(dopt_layout_piece_check(2, shape, &p), DOPT_ERR_INVALID_ARG, "elements [0, 13) are outside its 12 (the block)");
  p = piece(-1, 0, 0, 24, 1);
  assert_status(dopt_layout_piece_check(2, shape, &p), DOPT_ERR_INVALID_ARG, "lo 24 is outside [0, 24)");
  p = piece(-1, 0, 0, 0, 1);
  p.stage = -2;
  assert_status(dopt_layout_piece_check(2, shape, &p), DOPT_ERR_INVALID_ARG, "stage -2");
  p = piece(-1, 0, 0, 0, 1);
  p.version = 0;
  assert_status(dopt_layout_piece_check(2, shape, &p), DOPT_ERR_INVALID_ARG, "DOPT_LAYOUT_PIECE_INIT");
}

/* Random tilings of a [6, 10] tensor by blocks of one dimension, each block's range cut into ZeRO shards,
 * some replicated on a second rank: accepted, the lowest rank's copy the source. */
static void test_cover_random_tilings(void **st) {
  (void)st;
  const int64_t shape[2] = {6, 10};
  uint64_t rng = 5;
  for (int trial = 0; trial < 200; trial++) {
    dopt_layout_piece pcs[64];
    int ranks[64], src[64];
    size_t n = 0;
    const int dim = (int)(dt_rand_u64(&rng) % 3) - 1;
    const int64_t dl = dim < 0 ? 1 : shape[dim];
    for (int64_t b0 = 0; b0 < dl;) {
      const int64_t bl = dim < 0 ? 1 : 1 + (int64_t)(dt_rand_u64(&rng) % (uint64_t)(dl - b0));
      dopt_layout_piece whole = piece(dim, b0, bl, 0, -1);
      assert_ok(dopt_layout_piece_check(2, shape, &whole));
      for (int64_t lo = 0; lo < whole.len;) {
        const int64_t len = 1 + (int64_t)(dt_rand_u64(&rng) % (uint64_t)(whole.len - lo));
        const int replicas = 1 + (int)(dt_rand_u64(&rng) % 2);
        for (int r = 0; r < replicas; r++) {
          pcs[n] = piece(dim, b0, bl, lo, len);
          ranks[n] = (int)(n % 5) + 10 * r; /* the second copy on a higher rank */
          n++;
        }
        lo += len;
      }
      b0 += bl;
    }
    /* shuffled: the rule does not depend on the order pieces are listed in */
    for (size_t i = n; i > 1; i--) {
      const size_t j = (size_t)(dt_rand_u64(&rng) % i);
      dopt_layout_piece t = pcs[i - 1];
      pcs[i - 1] = pcs[j], pcs[j] = t;
      int tr = ranks[i - 1];
      ranks[i - 1] = ranks[j], ranks[j] = tr;
    }
    assert_ok(dopt_layout_cover("w", 2, shape, pcs, ranks, n, src));
    /* every element has exactly one source, the lowest rank holding it */
    int owner[60];
    for (int e = 0; e < 60; e++) owner[e] = -1;
    for (size_t i = 0; i < n; i++)
      for (int64_t j = 0; j < pcs[i].len; j++) {
        const int64_t e = dopt_layout_piece_elem(2, shape, &pcs[i], j);
        if (src[i]) {
          assert_int_equal(owner[e], -1);
          owner[e] = ranks[i];
        }
      }
    for (size_t i = 0; i < n; i++)
      for (int64_t j = 0; j < pcs[i].len; j++) assert_true(owner[dopt_layout_piece_elem(2, shape, &pcs[i], j)] <= ranks[i]);
    for (int e = 0; e < 60; e++) assert_true(owner[e] >= 0);
    /* dropping one piece that has no replica leaves a gap; shortening one an overlap or a gap */
    for (size_t i = 0; i < n; i++) {
      int copies = 0;
      for (size_t k = 0; k < n; k++) copies += pcs[k].block_lo == pcs[i].block_lo && pcs[k].lo == pcs[i].lo;
      if (copies > 1) continue;
      dopt_layout_piece keep = pcs[i];
      pcs[i] = pcs[n - 1];
      assert_status(dopt_layout_cover("w", 2, shape, pcs, ranks, n - 1, NULL), DOPT_ERR_INVALID_ARG,
                    "are held by no rank");
      pcs[i] = keep;
      break;
    }
  }
}

static void test_cover_refuses(void **st) {
  (void)st;
  const int64_t shape[2] = {4, 6};
  int ranks[3] = {0, 1, 2};
  dopt_layout_piece two[2] = {piece(0, 0, 2, 0, -1), piece(0, 1, 3, 0, -1)};
  for (int k = 0; k < 2; k++) assert_ok(dopt_layout_piece_check(2, shape, &two[k]));
  assert_status(dopt_layout_cover("w", 2, shape, two, ranks, 2, NULL), DOPT_ERR_INVALID_ARG,
                "parameter w: rank 1's elements dim 0 [1, 4) [0, 18) overlap rank 0's dim 0 [0, 2) [0, 12) partially");
  two[1] = piece(1, 3, 3, 0, 12);
  assert_status(dopt_layout_cover("w", 2, shape, two, ranks, 2, NULL), DOPT_ERR_INVALID_ARG, "one dimension per parameter");
  two[0] = piece(-1, 0, 0, 0, 12), two[1] = piece(1, 3, 3, 0, 12);
  assert_status(dopt_layout_cover("w", 2, shape, two, ranks, 2, NULL), DOPT_ERR_INVALID_ARG, "give it as a block too");
  /* flat ranges mix with blocks of dimension 0 (the same order) */
  two[0] = piece(-1, 0, 0, 0, 12), two[1] = piece(0, 2, 2, 0, 12);
  assert_ok(dopt_layout_cover("w", 2, shape, two, ranks, 2, NULL));
  /* stages: a tied embedding whole on the first and the last stage is accepted; the halves of a split
   * parameter on two stages are not */
  dopt_layout_piece tied[2] = {piece(-1, 0, 0, 0, 24), piece(-1, 0, 0, 0, 24)};
  tied[0].stage = 0, tied[1].stage = 3;
  assert_ok(dopt_layout_cover("emb", 2, shape, tied, ranks, 2, NULL));
  dopt_layout_piece three[3] = {piece(0, 0, 2, 0, 12), piece(0, 2, 2, 0, 12), piece(0, 2, 2, 0, 12)};
  three[0].stage = 0, three[1].stage = 1, three[2].stage = 1;
  assert_status(dopt_layout_cover("w", 2, shape, three, ranks, 3, NULL), DOPT_ERR_INVALID_ARG,
                "parameter w: rank 1's piece is on stage 1, rank 0's on stage 0");
  /* experts: one per parameter, the replicas over its expert-data-parallel group included */
  three[1].stage = three[2].stage = 0;
  three[0].expert = three[1].expert = three[2].expert = 5;
  assert_ok(dopt_layout_cover("experts.5.w", 2, shape, three, ranks, 3, NULL));
  three[2].expert = 4;
  assert_status(dopt_layout_cover("experts.5.w", 2, shape, three, ranks, 3, NULL), DOPT_ERR_INVALID_ARG,
                "rank 2's piece is of expert 4, rank 0's of expert 5");
  /* a name with a control character comes back escaped, on one line */
  two[0] = piece(-1, 0, 0, 0, 5), two[1] = piece(-1, 0, 0, 6, 18);
  assert_status(dopt_layout_cover("a\nb", 2, shape, two, ranks, 2, NULL), DOPT_ERR_INVALID_ARG,
                "parameter a\\x0ab: elements [5, 6) are held by no rank");
}

/* distopt's TP split (dopt_tp_block): every rank's block against the split written out by hand — the first
 * n mod tp ranks one more, rows of a column-parallel matrix, columns of a row-parallel one and of a 1-D
 * column-parallel vector, the whole tensor when replicated or tp 1 — and the blocks tile the split dimension.
 * The worked cases below are not torch's chunk rule (10 rows over 4 ranks: torch 3, 3, 3, 1; distopt 3, 3, 2, 2). */
static void test_tp_block_rule(void **st) {
  (void)st;
  const int64_t m10x6[2] = {10, 6}, s3[3] = {2, 7, 5}, v9[1] = {9};
  const size_t rows[4][2] = {{0, 3}, {3, 3}, {6, 2}, {8, 2}};
  for (int r = 0; r < 4; r++) {
    dopt_piece pc;
    dopt_tp_block(2, m10x6, DOPT_TP_COLUMN, 4, r, &pc);
    assert_int_equal(pc.h0, rows[r][0]), assert_int_equal(pc.hl, rows[r][1]);
    assert_int_equal(pc.w0, 0), assert_int_equal(pc.wl, 6);
    assert_int_equal(pc.lo, 0), assert_int_equal(pc.len, rows[r][1] * 6);
  }
  const size_t cols[4][2] = {{0, 2}, {2, 2}, {4, 1}, {5, 1}}; /* 6 columns over 4 */
  for (int r = 0; r < 4; r++) {
    dopt_piece pc;
    dopt_tp_block(2, m10x6, DOPT_TP_ROW, 4, r, &pc);
    assert_int_equal(pc.w0, cols[r][0]), assert_int_equal(pc.wl, cols[r][1]);
    assert_int_equal(pc.h0, 0), assert_int_equal(pc.hl, 10), assert_int_equal(pc.len, 10 * cols[r][1]);
  }
  const size_t v[2][2] = {{0, 5}, {5, 4}}; /* a 1-D column-parallel vector: its only dimension */
  for (int r = 0; r < 2; r++) {
    dopt_piece pc;
    dopt_tp_block(1, v9, DOPT_TP_COLUMN, 2, r, &pc);
    assert_int_equal(pc.w0, v[r][0]), assert_int_equal(pc.wl, v[r][1]), assert_int_equal(pc.len, v[r][1]);
  }
  for (int r = 0; r < 3; r++) { /* a 3-D stack [2, 7, 5], column-parallel: rows of every leading index */
    dopt_piece pc;
    dopt_tp_block(3, s3, DOPT_TP_COLUMN, 3, r, &pc);
    assert_int_equal(pc.b, 2), assert_int_equal(pc.h0, r == 0 ? 0 : r == 1 ? 3 : 5), assert_int_equal(pc.hl, r == 0 ? 3 : 2);
    assert_int_equal(pc.len, 2 * pc.hl * 5);
  }
  dopt_piece rep, one;
  dopt_tp_block(2, m10x6, DOPT_TP_REPLICATED, 4, 3, &rep);
  dopt_tp_block(2, m10x6, DOPT_TP_COLUMN, 1, 0, &one);
  assert_int_equal(rep.len, 60), assert_int_equal(one.len, 60), assert_int_equal(one.hl, 10);
  for (size_t n = 0; n < 40; n++) /* the split tiles [0, n) in order, sizes within one of each other */
    for (int parts = 1; parts <= 9; parts++) {
      size_t at = 0, lo_len = n, hi_len = 0;
      for (int r = 0; r < parts; r++) {
        size_t off, len;
        dopt_split_range(n, parts, r, &off, &len);
        assert_int_equal(off, at);
        at += len;
        if (len < lo_len) lo_len = len;
        if (len > hi_len) hi_len = len;
      }
      assert_int_equal(at, n);
      assert_true(hi_len - lo_len <= 1);
    }
}

/* World-rank coordinates: every rank of every pp x dp x tp (ep dividing dp) layout maps to distinct coordinates
 * in range, back to itself, with tp fastest, then ep inside dp, then moe_dp, then the stage. */
static void test_rank_coords(void **st) {
  (void)st;
  for (int pp = 1; pp <= 3; pp++)
    for (int tp = 1; tp <= 4; tp++)
      for (int dp = 1; dp <= 6; dp++)
        for (int ep = 1; ep <= dp; ep++) {
          if (dp % ep) continue;
          int64_t w = 0;
          for (int s = 0; s < pp; s++)
            for (int m = 0; m < dp / ep; m++)
              for (int e = 0; e < ep; e++)
                for (int t = 0; t < tp; t++, w++) {
                  const dopt_rank_coords c = dopt_rank_coords_of(w, tp, dp, ep);
                  if (c.stage != s || c.moe_dp != m || c.ep != e || c.tp != t || c.dp != m * ep + e)
                    fail_msg("pp %d tp %d dp %d ep %d: rank %lld -> stage %d dp %d tp %d ep %d moe_dp %d", pp, tp, dp,
                             ep, (long long)w, c.stage, c.dp, c.tp, c.ep, c.moe_dp);
                  assert_int_equal(dopt_world_rank_of(&c, tp, dp), w);
                }
        }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_elem_matches_enumeration), cmocka_unit_test(test_from_distributed_piece),
      cmocka_unit_test(test_check_refuses), cmocka_unit_test(test_cover_random_tilings),
      cmocka_unit_test(test_cover_refuses), cmocka_unit_test(test_tp_block_rule), cmocka_unit_test(test_rank_coords),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

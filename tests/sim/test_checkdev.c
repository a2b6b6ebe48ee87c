/* The checking device (tests/util/checkdev.h) itself: device memory passes,
 * a host pointer or an out-of-range buffer handed to a kernel or a wrapped
 * collective is reported with the operation and argument, and fails the
 * call. Collectives run on a 1-rank simulator world; the rank body only
 * returns what it saw, the main thread asserts. */
#include "testutil.h"

#include <stdio.h>
#include <string.h>

#include "checkdev.h"
#include "internal.h"
#include "distopt/sim.h"

typedef struct seen {
  dopt_status dev_ok, host_send, host_recv, short_recv;
  char msg_send[512], msg_short[512];
  size_t violations;
} seen;

static dopt_status body(dopt_sim_comm *comm, int rank, void *user) {
  (void)rank;
  seen *o = user;
  dt_checkdev *c;
  DOPT_TRY(dt_checkdev_create(&c));
  dopt_transport raw, t;
  dopt_status s = dopt_sim_transport(comm, &raw);
  if (s == DOPT_OK) s = dt_checkdev_wrap(c, &raw, &t);
  const dopt_device *dev = dt_checkdev_device(c);
  int64_t *buf = NULL, host = 3;
  if (s == DOPT_OK) s = dev->ops->alloc(dev->ctx, 4 * sizeof *buf, (void **)&buf);
  if (s == DOPT_OK) {
    o->dev_ok = t.ops->all_reduce(t.comm, buf, buf, 4, DOPT_I64, DOPT_SUM);
    o->host_send = t.ops->all_reduce(t.comm, &host, buf, 1, DOPT_I64, DOPT_SUM); /* the old non-finite count */
    snprintf(o->msg_send, sizeof o->msg_send, "%s", dopt_last_error());
    o->host_recv = t.ops->all_reduce(t.comm, buf, &host, 1, DOPT_I64, DOPT_SUM);
    o->short_recv = t.ops->all_reduce(t.comm, buf, buf + 1, 4, DOPT_I64, DOPT_SUM); /* 1 word past the end */
    snprintf(o->msg_short, sizeof o->msg_short, "%s", dopt_last_error());
    o->violations = dt_checkdev_violations(c, NULL);
    dev->ops->free(dev->ctx, buf);
  }
  dt_checkdev_destroy(c);
  return s;
}

static void test_collectives(void **st) {
  (void)st;
  dopt_sim_config cfg = DOPT_SIM_CONFIG_INIT;
  cfg.nranks = 1;
  dopt_sim_world *w;
  assert_ok(dopt_sim_world_create(&cfg, &w));
  seen o;
  memset(&o, 0, sizeof o);
  dopt_status rs[1];
  assert_ok(dopt_sim_launch(w, body, &o, rs));
  dopt_sim_world_destroy(w);
  assert_int_equal(o.dev_ok, DOPT_OK);
  assert_int_equal(o.host_send, DOPT_ERR_INVALID_ARG);
  assert_non_null(strstr(o.msg_send, "all_reduce: send="));
  assert_non_null(strstr(o.msg_send, "is not device memory"));
  assert_non_null(strstr(o.msg_send, "called from"));
  assert_int_equal(o.host_recv, DOPT_ERR_INVALID_ARG);
  assert_int_equal(o.short_recv, DOPT_ERR_INVALID_ARG);
  assert_non_null(strstr(o.msg_short, "recv="));
  assert_non_null(strstr(o.msg_short, "(32 bytes)"));
  assert_int_equal(o.violations, 3);
}

static void test_kernels(void **st) {
  (void)st;
  dt_checkdev *c;
  assert_ok(dt_checkdev_create(&c));
  const dopt_device *dev = dt_checkdev_device(c);
  float *x, host[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  assert_ok(dev->ops->alloc(dev->ctx, sizeof host, (void **)&x));
  assert_ok(dev->ops->upload(dev->ctx, x, host, sizeof host)); /* host source: fine */
  assert_ok(dev->ops->add(dev->ctx, x, x, 8));
  assert_status(dev->ops->add(dev->ctx, host, x, 8), DOPT_ERR_INVALID_ARG, "add: acc=");
  assert_status(dev->ops->scale(dev->ctx, x, 2.0f, 9), DOPT_ERR_INVALID_ARG, "scale: x="); /* one past the end */
  assert_status(dev->ops->upload(dev->ctx, host, x, 4), DOPT_ERR_INVALID_ARG, "upload: dst=");
  double ss;
  assert_ok(dev->ops->sumsq(dev->ctx, x, 8, &ss));
  assert_true(ss == 4.0 * (1 + 4 + 9 + 16 + 25 + 36 + 49 + 64)); /* (2x)^2 after x + x */
  assert_int_equal(dt_checkdev_violations(c, NULL), 3);
  assert_int_equal(dt_checkdev_live(c), 1);
  dev->ops->free(dev->ctx, x);
  assert_int_equal(dt_checkdev_live(c), 0);
  dt_checkdev_destroy(c);
}

int main(void) {
  const struct CMUnitTest tests[] = {cmocka_unit_test(test_collectives), cmocka_unit_test(test_kernels)};
  return cmocka_run_group_tests(tests, NULL, NULL);
}

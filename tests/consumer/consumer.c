/* A program outside the project that uses the installed library (tests/consumer/run_consumer.sh builds it
 * with pkg-config and with find_package(distopt), against the shared and the static library): three AdamW
 * steps on one parameter, checked against the update computed here in double, the state names, the step
 * count, and a rejected hyperparameter with its message. Prints one line; exit 0 = all checks held. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include <distopt/distopt.h>

enum { N = 5, STEPS = 3 };

static double sqrt_newton(double x) { /* x > 0; to double precision, without libm */
  double r = x > 1.0 ? x : 1.0;
  for (int i = 0; i < 200; i++) r = 0.5 * (r + x / r);
  return r;
}
static double powi(double b, int t) {
  double r = 1.0;
  while (t-- > 0) r *= b;
  return r;
}
static double absd(double x) { return x < 0 ? -x : x; }

static int failed(const char *what) {
  fprintf(stderr, "consumer: FAILED: %s (last error: %s)\n", what, dopt_last_error());
  return 1;
}

int main(void) {
  const double lr = 0.01, b1 = 0.9, b2 = 0.999, eps = 1e-8, wd = 0.1;
  float w[N], g[N];
  double ref[N], m[N], v[N];
  for (int i = 0; i < N; i++) {
    w[i] = 0.25f * (float)(i + 1);
    g[i] = (i % 2 ? -0.5f : 0.75f) * (float)(i + 1);
    ref[i] = w[i];
    m[i] = v[i] = 0.0;
  }
  dopt_optim *o;
  if (dopt_optim_create("adamw", "lr=0.01,weight_decay=0.1", &o) != DOPT_OK) return failed("create adamw");
  dopt_param_config pc = DOPT_PARAM_CONFIG_INIT;
  pc.name = "w";
  pc.ndim = 1;
  pc.shape[0] = N;
  pc.data = w;
  int pid;
  if (dopt_optim_add_param(o, 0, &pc, &pid) != DOPT_OK) return failed("add_param");
  const float *grads[1] = {g};
  for (int t = 1; t <= STEPS; t++) {
    if (dopt_optim_step(o, grads) != DOPT_OK) return failed("step");
    for (int i = 0; i < N; i++) { /* torch.optim.AdamW's update, in double */
      ref[i] *= 1.0 - lr * wd;
      m[i] = b1 * m[i] + (1.0 - b1) * g[i];
      v[i] = b2 * v[i] + (1.0 - b2) * g[i] * g[i];
      double mh = m[i] / (1.0 - powi(b1, t)), vh = v[i] / (1.0 - powi(b2, t));
      ref[i] -= lr * mh / (sqrt_newton(vh) + eps);
    }
  }
  double maxrel = 0.0;
  for (int i = 0; i < N; i++) {
    double rel = absd((double)w[i] - ref[i]) / absd(ref[i]);
    if (rel > maxrel) maxrel = rel;
  }
  if (!(maxrel < 1e-5)) return failed("parameters differ from AdamW computed in double by more than 1e-5");
  int64_t step = 0;
  if (dopt_optim_get_step(o, pid, &step) != DOPT_OK || step != STEPS) return failed("step count");
  if (dopt_optim_num_states(o, pid) != 2) return failed("number of states");
  dopt_state_view sv;
  if (dopt_optim_state(o, pid, 1, &sv) != DOPT_OK || strcmp(sv.name, "exp_avg_sq") != 0) return failed("state name");
  dopt_optim_destroy(o);
  dopt_clear_error();
  dopt_status s = dopt_optim_create("adamw", "lr=-1", &o);
  if (s != DOPT_ERR_INVALID_ARG || o != NULL || strstr(dopt_last_error(), "lr=-1") == NULL)
    return failed("lr=-1 must be rejected with a message naming it");
  printf("consumer: ok (distopt %d.%d.%d, %d optimizers, adamw %d steps, max rel err vs double %.2e; lr=-1: %s)\n",
         DOPT_VERSION_MAJOR, DOPT_VERSION_MINOR, DOPT_VERSION_PATCH, dopt_optim_registry_count(), STEPS, maxrel,
         dopt_last_error());
  return 0;
}

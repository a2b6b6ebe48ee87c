/* distopt — command-line entry point. */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli.h"
#include "files.h"
#include "pool.h"

int cli_error(const char *cmd, dopt_status s) {
  const char *msg = dopt_last_error();
  fprintf(stderr, "distopt %s: %s\n", cmd, *msg ? msg : dopt_status_str(s));
  return CLI_USAGE;
}

/* One line on stderr: the message (echoed input) escaped by the one rule (dopt__escape). */
int cli_errorf(const char *cmd, const char *fmt, ...) {
  char msg[1024], line[4 * sizeof msg];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  dopt__escape(msg, strlen(msg), line, sizeof line);
  fprintf(stderr, "distopt%s%s: %s\n", *cmd ? " " : "", cmd, line);
  return CLI_USAGE;
}

int cli_check_outputs(const char *cmd, const cli_path *outs, int nout) {
  for (int k = 0; k < nout; k++) {
    if (!outs[k].path) continue;
    dopt_status s = DOPT_OK;
    for (int j = 0; s == DOPT_OK && j < k; j++)
      if (outs[j].path) s = dopt__check_distinct(outs[j].opt, outs[j].path, outs[k].opt, outs[k].path);
    for (int j = 0; s == DOPT_OK && j < nout; j++) /* every folder output of ours is a checkpoint folder */
      if (outs[j].path && outs[j].dir && !outs[k].dir)
        s = dopt__check_ckpt_names(outs[k].opt, outs[k].path, outs[j].opt, outs[j].path);
    if (s != DOPT_OK) return cli_error(cmd, s);
  }
  return CLI_OK;
}

int cli_check_paths(const char *cmd, const cli_path *outs, int nout, const cli_path *ins, int nin) {
  for (int k = 0; k < nout; k++) {
    if (!outs[k].path) continue;
    dopt_status s = dopt__check_output(outs[k].opt, outs[k].path, outs[k].dir ? DOPT_OUT_DIR : DOPT_OUT_FILE);
    for (int i = 0; s == DOPT_OK && i < nin; i++) s = dopt__check_apart(outs[k].opt, outs[k].path, ins[i].opt, ins[i].path);
    if (s != DOPT_OK) return cli_error(cmd, s);
  }
  return cli_check_outputs(cmd, outs, nout);
}

static void usage(FILE *f) {
  fputs("usage: distopt <command> [options]\n"
        "commands:\n"
        "  compare run an optimizer distributed on the simulator beside the reference and compare\n"
        "  run     apply a registered optimizer to parameters and gradients from safetensors files\n"
        "  list    list the registered optimizers and their hyperparameters\n"
        "  mem     exact optimizer-state memory of a LLaMA-size model for every optimizer\n"
        "  bench   time each optimizer step against the machine's memory bandwidth floor\n"
        "  verify  replay a recorded PyTorch run (distopt.record) through the reference and compare\n"
        "run 'distopt <command> --help' for the command's options\n",
        f);
}

/* Standard output is an output like any other: what a command printed must have reached it, else the result
 * was not delivered and the exit is 2 (an I/O failure), whatever the command concluded. A closed pipe
 * (`distopt ... | head`) ends the process by SIGPIPE first, as other tools do; with SIGPIPE ignored, the EPIPE
 * lands here: 2. */
static int delivered(const char *cmd, int rc) {
  errno = 0;
  const int flushed = fflush(stdout) == 0;
  if (flushed && !ferror(stdout)) return rc;
  const int e = !flushed && errno ? errno : EIO;
  cli_errorf(cmd, "standard output: %s (what was printed is incomplete)", strerror(e));
  return CLI_USAGE;
}

int main(int argc, char **argv) {
  /* Not a terminal: standard output fully buffered, 1 MiB, so that a command's output (list, mem, help, a run's
   * table) reaches the device in the final flush, where delivered() reads the device's own error (ENOSPC,
   * EPIPE); a buffer that filled earlier fails while printing, and stdio keeps only its error flag (EIO then). */
  static char outbuf[(size_t)1 << 20]; /* glibc sizes a buffer it allocates by the device, whatever size says */
  if (!isatty(STDOUT_FILENO)) setvbuf(stdout, outbuf, _IOFBF, sizeof outbuf);
  if (argc < 2) {
    usage(stderr);
    return CLI_USAGE;
  }
  static const struct {
    const char *name;
    int (*fn)(int, char **);
  } cmds[] = {{"run", cmd_run},         {"list", cmd_list}, {"bench", cmd_bench},
              {"compare", cmd_compare}, {"mem", cmd_mem},   {"verify", cmd_verify}};
  const char *c = argv[1];
  for (size_t k = 0; k < sizeof cmds / sizeof cmds[0]; k++) {
    if (strcmp(c, cmds[k].name) != 0) continue;
    /* the environment every command's steps read, checked before any work: a bad value is bad input */
    int threads;
    dopt_status s = dopt__default_threads(&threads);
    if (s != DOPT_OK) return cli_error(c, s);
    return delivered(c, cmds[k].fn(argc - 1, argv + 1));
  }
  if (strcmp(c, "--help") == 0 || strcmp(c, "-h") == 0 || strcmp(c, "help") == 0) {
    usage(stdout);
    return delivered("", CLI_OK);
  }
  cli_errorf("", "unknown command '%s' (see distopt --help)", c);
  return CLI_USAGE;
}

/* distopt — command-line entry point. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli.h"

int cli_error(const char *cmd, dopt_status s) {
  const char *msg = dopt_last_error();
  fprintf(stderr, "distopt %s: %s\n", cmd, *msg ? msg : dopt_status_str(s));
  return CLI_USAGE;
}

/* One line on stderr: control characters of the message (echoed input) are written as \xNN. */
int cli_errorf(const char *cmd, const char *fmt, ...) {
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  fprintf(stderr, "distopt %s: ", cmd);
  for (const char *p = msg; *p; p++) {
    unsigned char c = (unsigned char)*p;
    if (c < 0x20 || c == 0x7f) fprintf(stderr, "\\x%02x", c);
    else fputc(c, stderr);
  }
  fputc('\n', stderr);
  return CLI_USAGE;
}

int cli_check_out_folder(const char *cmd, const char *opt, const char *path) {
  char folder[4096];
  const char *slash = strrchr(path, '/');
  size_t fl = slash ? (size_t)(slash - path) : 0;
  if (fl >= sizeof folder) return cli_errorf(cmd, "%s '%.64s...': path too long", opt, path);
  if (slash && fl == 0) strcpy(folder, "/");
  else if (slash) {
    memcpy(folder, path, fl);
    folder[fl] = '\0';
  } else strcpy(folder, ".");
  struct stat st;
  if (stat(folder, &st) != 0 || !S_ISDIR(st.st_mode) || access(folder, W_OK) != 0)
    return cli_errorf(cmd, "%s '%s': the folder '%s' does not exist or is not writable", opt, path, folder);
  return CLI_OK;
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

int main(int argc, char **argv) {
  if (argc < 2) {
    usage(stderr);
    return CLI_USAGE;
  }
  const char *c = argv[1];
  if (strcmp(c, "run") == 0) return cmd_run(argc - 1, argv + 1);
  if (strcmp(c, "list") == 0) return cmd_list(argc - 1, argv + 1);
  if (strcmp(c, "bench") == 0) return cmd_bench(argc - 1, argv + 1);
  if (strcmp(c, "compare") == 0) return cmd_compare(argc - 1, argv + 1);
  if (strcmp(c, "mem") == 0) return cmd_mem(argc - 1, argv + 1);
  if (strcmp(c, "verify") == 0) return cmd_verify(argc - 1, argv + 1);
  if (strcmp(c, "--help") == 0 || strcmp(c, "-h") == 0 || strcmp(c, "help") == 0) {
    usage(stdout);
    return CLI_OK;
  }
  fprintf(stderr, "distopt: unknown command '%s'\n", c);
  usage(stderr);
  return CLI_USAGE;
}

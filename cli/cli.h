/* The `distopt` command-line tool: shared helpers of the subcommands. */
#ifndef DOPT_CLI_H
#define DOPT_CLI_H

#include <stdio.h>

#include "distopt/distopt.h"
#include "distopt/safetensors.h"

/* Exit codes, one rule for every command and backend (docs/cli.md "Exit codes"): 0 success or equivalent;
 * 1 only a measured divergence (commands that compare nothing never exit 1); 2 usage, input, I/O (standard
 * output included) or a runtime failure (out of memory, a transport's timeout, a rank that failed). */
enum { CLI_OK = 0, CLI_FAIL = 1, CLI_USAGE = 2 };

/* Prints "distopt <cmd>: <detail of the last error>" and returns CLI_USAGE. */
int cli_error(const char *cmd, dopt_status s);
/* printf-style one-line error, returns CLI_USAGE. */
int cli_errorf(const char *cmd, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

/* s as a text report shows what it echoes from a file (a trace's or a recording's names and strings): escaped by
 * the one rule (dopt__escape: C0/C1 controls, bidi and zero-width characters, invalid UTF-8) into buf; 4 ×
 * strlen(s) + 1 bytes always suffice. The JSON and SVG reports keep the text in their own escaping. */
void cli_escaped(const char *s, char *buf, size_t cap);

/* The progress line of a long run (compare, verify): on standard error, only where that is a terminal and once
 * the run has lasted CLI_PROGRESS_AFTER_S seconds (DOPT_PROGRESS_AFTER from the environment: another delay, in
 * [0, 86400]), at most every 0.25 s: "\r<what>: step 12/100  0.84 s/step  ETA 1m14s  <extra>"; s/step from the
 * steps after the first (setup excluded). cli_progress_end clears it. */
#define CLI_PROGRESS_AFTER_S 3.0
typedef struct cli_progress {
  double t0, t1, last, after; /* the start, the first step's end, the last line; the delay */
  int on, shown;       /* a terminal and not --quiet; a line is on the screen */
  const char *unit;    /* what is counted: "step" (cli_progress_init), "layout" (compare --sweep) */
} cli_progress;
void cli_progress_init(cli_progress *p, int quiet);
void cli_progress_step(cli_progress *p, const char *what, long done, long total, const char *extra);
void cli_progress_end(cli_progress *p);

/* A path a command reads or writes, named by its option ("--out", "TRACE"); dir: a folder. */
typedef struct cli_path {
  const char *opt, *path;
  int dir;
} cli_path;

/* The one rule for files (docs/files.md), checked before a command's work so
 * that a bad path fails at once with one line and nothing written: every
 * output (path NULL: not given) is a new or regular file in a writable folder
 * or a character device (dir: a folder), never a FIFO, socket or folder
 * where a file belongs; no output is, lies inside, or holds an input; and no
 * two outputs are the same file (a character device excepted).
 * CLI_OK or CLI_USAGE (after the message). */
int cli_check_paths(const char *cmd, const cli_path *outs, int nout, const cli_path *ins, int nin);
/* cli_check_paths' last part alone, for outputs checked against different inputs (run's --out and
 * --save): no two outputs are the same file, no file output takes a name a checkpoint-folder
 * output writes (latest, step-<N>, .tmp-step-<N>). */
int cli_check_outputs(const char *cmd, const cli_path *outs, int nout);

/* Writes s escaped for XML text and attributes (the SVG plots of compare and verify; cli/report.c); at most
 * maxw code points (0: all), "…" appended when cut; control characters
 * become '?'. */
void cmp_xml_text(FILE *f, const char *s, int maxw);

/* Upstream's defaults ("") when they make a valid optimizer, else the
 * optimizer's registry example (CAME has no default lr): what bench and mem
 * run when nobody chose hyperparameters. */
const char *cli_default_hparams(const char *name);

int cmd_run(int argc, char **argv);
int cmd_list(int argc, char **argv);
int cmd_bench(int argc, char **argv);
int cmd_compare(int argc, char **argv);
int cmd_mem(int argc, char **argv);
int cmd_verify(int argc, char **argv); /* cmd_verify.c over verify/: a recorded PyTorch run against the reference */

#endif

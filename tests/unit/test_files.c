/* Files (core/files.c, docs/files.md): nothing outside a command's named
 * outputs is touched, no input is overwritten, readers never block, and one
 * rule holds for every output. First the module itself, then the commands end
 * to end: every command case runs in a sandbox folder that is snapshot before
 * and after (every entry, never following a link: kind, mode, SHA-256 of a
 * file's bytes, a link's target), and only the named outputs may differ.
 * Symbolic links, FIFOs, sockets and character devices are made in the
 * sandbox (mkfifo/mknod), never in /dev.
 *   argv[1] = the distopt binary; argv[2] = "chardev": only the cases that
 *   need mknod (exit 77 where this process may not make device nodes). */
#define _GNU_SOURCE /* mknod, makedev */
#include "testutil.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/un.h>
#include <unistd.h>

#include "distopt/distopt.h"
#include "distopt/safetensors.h"
#include "files.h"
#include "fstree.h"

static const char *bin;
static char root[256], errfile[600], outfile[600], inputs[512], trace[512];

static int setup(void **st) {
  (void)st;
  int rc = dt_make_tmpdir(root, sizeof root, "dopt_files");
  snprintf(errfile, sizeof errfile, "%s/stderr.txt", root);
  snprintf(outfile, sizeof outfile, "%s/stdout.txt", root);
  snprintf(inputs, sizeof inputs, "%s/datasets/golden/inputs.safetensors", dt_source_dir());
  snprintf(trace, sizeof trace, "%s/datasets/trace/digits_mlp.safetensors", dt_source_dir());
  return rc;
}

static int teardown(void **st) {
  (void)st;
  return dt_remove_tmpdir(root);
}

/* ---- helpers ------------------------------------------------------------------------ */

/* A fresh sandbox root/<name>; its path into out. */
static void box(const char *name, char *out, size_t cap) {
  snprintf(out, cap, "%s/%s", root, name);
  char cmd[1000];
  snprintf(cmd, sizeof cmd, "rm -rf '%s' && mkdir -p '%s'", out, out);
  assert_int_equal(system(cmd), 0);
}

/* path = dir/name (a static buffer per slot: up to 8 at once). */
static const char *at(const char *dir, const char *name) {
  static char buf[8][700];
  static int k;
  char *p = buf[k++ % 8];
  snprintf(p, 700, "%s/%s", dir, name);
  return p;
}

static void put(const char *path, const char *text) {
  FILE *f = fopen(path, "w");
  assert_non_null(f);
  fputs(text, f);
  fclose(f);
}

static void copy(const char *from, const char *to) {
  char cmd[1500];
  snprintf(cmd, sizeof cmd, "cp '%s' '%s'", from, to);
  assert_int_equal(system(cmd), 0);
}

/* A UNIX socket bound at path (kept open by the caller: returns its fd). */
static int make_socket(const char *path) {
  int fd = socket(AF_UNIX, SOCK_STREAM, 0);
  assert_true(fd >= 0);
  struct sockaddr_un a;
  memset(&a, 0, sizeof a);
  a.sun_family = AF_UNIX;
  assert_true(strlen(path) < sizeof a.sun_path);
  strcpy(a.sun_path, path);
  assert_int_equal(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
  return fd;
}

static char *slurp(const char *path) {
  FILE *f = fopen(path, "r");
  char *buf = calloc(1, 65536);
  assert_non_null(buf);
  if (f) {
    size_t n = fread(buf, 1, 65535, f);
    buf[n] = '\0';
    fclose(f);
  }
  return buf;
}

/* Runs distopt with args in sandbox b (alarm: 30 s, so a reader that blocks fails the case instead of hanging):
 * the exit code must be want; with a needle, stderr must be exactly one line holding it; and nothing in b may
 * differ afterwards but the entries named in outputs (relative to b; NULL-terminated; NULL: none). */
static void expect(const char *b, const char *const *args, int want, const char *needle, const char *const *outputs,
                   const dt_run_opts *opts) {
  dt_tree *before = dt_tree_snap(b);
  dt_run_opts o = opts ? *opts : (dt_run_opts){0, 0, NULL, 0};
  if (!o.timeout_s) o.timeout_s = 30;
  int rc = dt_run_with(bin, args, outfile, errfile, &o);
  dt_tree *after = dt_tree_snap(b);
  char diff[800];
  int changed = dt_tree_diff(before, after, outputs, diff, sizeof diff);
  dt_tree_free(before);
  dt_tree_free(after);
  char *err = slurp(errfile);
  int lines = 0;
  for (char *p = err; *p; p++) lines += *p == '\n';
  char argl[600] = "";
  for (int i = 0; args[i] && strlen(argl) < 500; i++) snprintf(argl + strlen(argl), sizeof argl - strlen(argl), " %s", args[i]);
  if (rc != want) fail_msg("distopt%s: exit %d, want %d (stderr: %s)", argl, rc, want, err);
  if (needle && (lines != 1 || !strstr(err, needle)))
    fail_msg("distopt%s: stderr has %d lines, want one naming '%s': %s", argl, lines, needle, err);
  if (changed) fail_msg("distopt%s: %s (outside the named outputs)", argl, diff);
  free(err);
}

static int kind_of(const char *path) {
  struct stat st;
  return lstat(path, &st) == 0 ? (int)(st.st_mode & S_IFMT) : 0;
}

/* A checkpoint of the golden inputs after `steps` adamw steps in folder k. */
static void make_ckpt(const char *k, const char *steps) {
  const char *args[] = {"run", "--params", inputs, "--optimizer", "adamw", "--steps", steps, "--save", k, "--quiet", NULL};
  assert_int_equal(dt_run(bin, args, NULL, errfile), 0);
}

/* ---- the module ---------------------------------------------------------------------- */

static void test_check_output(void **st) {
  (void)st;
  char b[400];
  box("check_output", b, sizeof b);
  put(at(b, "file"), "x");
  assert_int_equal(mkfifo(at(b, "fifo"), 0644), 0);
  assert_int_equal(mkdir(at(b, "dir"), 0755), 0);
  int sock = make_socket(at(b, "sock"));
  assert_int_equal(symlink("file", at(b, "to_file")), 0);
  assert_int_equal(symlink("fifo", at(b, "to_fifo")), 0);
  assert_int_equal(symlink("dir", at(b, "to_dir")), 0);
  assert_int_equal(symlink("to_file", at(b, "to_to_file")), 0);
  assert_int_equal(symlink("new", at(b, "dangling")), 0);
  assert_int_equal(symlink("loop", at(b, "loop")), 0);
  struct {
    const char *name;
    int kind;
    dopt_status want;
    const char *needle;
  } C[] = {
      {"new", DOPT_OUT_FILE, DOPT_OK, NULL},
      {"file", DOPT_OUT_FILE, DOPT_OK, NULL},
      {"to_file", DOPT_OUT_FILE, DOPT_OK, NULL},
      {"to_to_file", DOPT_OUT_FILE, DOPT_OK, NULL},
      {"dangling", DOPT_OUT_FILE, DOPT_OK, NULL},
      {"fifo", DOPT_OUT_FILE, DOPT_ERR_INVALID_ARG, "is a FIFO (named pipe)"},
      {"to_fifo", DOPT_OUT_FILE, DOPT_ERR_INVALID_ARG, "is a FIFO (named pipe)"},
      {"sock", DOPT_OUT_FILE, DOPT_ERR_INVALID_ARG, "is a socket"},
      {"dir", DOPT_OUT_FILE, DOPT_ERR_INVALID_ARG, "is a folder"},
      {"to_dir", DOPT_OUT_FILE, DOPT_ERR_INVALID_ARG, "is a folder"},
      {"no/such/new", DOPT_OUT_FILE, DOPT_ERR_INVALID_ARG, "does not exist or is not writable"},
      {"file/new", DOPT_OUT_FILE, DOPT_ERR_INVALID_ARG, "does not exist or is not writable"},
      {"loop", DOPT_OUT_FILE, DOPT_ERR_INVALID_ARG, "symbolic links"},
      {"dir", DOPT_OUT_DIR, DOPT_OK, NULL},
      {"to_dir", DOPT_OUT_DIR, DOPT_OK, NULL},
      {"new", DOPT_OUT_DIR, DOPT_OK, NULL},
      {"new/deeper", DOPT_OUT_DIR, DOPT_OK, NULL},
      {"file", DOPT_OUT_DIR, DOPT_ERR_INVALID_ARG, "is a regular file; a folder is needed"},
      {"fifo", DOPT_OUT_DIR, DOPT_ERR_INVALID_ARG, "is a FIFO (named pipe); a folder is needed"},
      {"file/new", DOPT_OUT_DIR, DOPT_ERR_INVALID_ARG, "is a regular file"},
  };
  dt_tree *before = dt_tree_snap(b);
  for (size_t k = 0; k < sizeof C / sizeof C[0]; k++) {
    dopt_status s = dopt__check_output("--x", at(b, C[k].name), C[k].kind);
    if (s != C[k].want || (C[k].needle && !strstr(dopt_last_error(), C[k].needle)))
      fail_msg("%s (kind %d): %s '%s', want %s '%s'", C[k].name, C[k].kind, dopt_status_name(s), dopt_last_error(),
               dopt_status_name(C[k].want), C[k].needle ? C[k].needle : "");
    if (s != DOPT_OK && !strstr(dopt_last_error(), "--x '")) fail_msg("%s: the option is not named: %s", C[k].name, dopt_last_error());
  }
  assert_status(dopt__check_output("--x", "", DOPT_OUT_FILE), DOPT_ERR_INVALID_ARG, "--x '': empty path");
  dt_tree *after = dt_tree_snap(b);
  char diff[800];
  if (dt_tree_diff(before, after, NULL, diff, sizeof diff)) fail_msg("the check changed the folder: %s", diff);
  dt_tree_free(before);
  dt_tree_free(after);
  close(sock);
}

static void test_check_apart(void **st) {
  (void)st;
  char b[400], dotted[800];
  box("check_apart", b, sizeof b);
  assert_int_equal(mkdir(at(b, "in"), 0755), 0);
  assert_int_equal(mkdir(at(b, "in/sub"), 0755), 0);
  put(at(b, "in/sub/f"), "x");
  put(at(b, "p"), "x");
  assert_int_equal(link(at(b, "p"), at(b, "p_hard")), 0);
  assert_int_equal(symlink("p", at(b, "p_link")), 0);
  assert_int_equal(symlink("in", at(b, "in_link")), 0);
  assert_int_equal(mkdir(at(b, "out"), 0755), 0);
  snprintf(dotted, sizeof dotted, "%s/./in/../p", b);
  struct {
    const char *out, *in;
    const char *needle; /* NULL: apart */
  } C[] = {
      {"p", "p", "is the input"},
      {"p_hard", "p", "is the input"},
      {"p_link", "p", "is the input"},
      {"in/sub/f", "in", "is inside the input"},
      {"in/new", "in", "is inside the input"},
      {"in/sub/new/deeper", "in", "is inside the input"},
      {"in_link/sub/f", "in", "is inside the input"},
      {"in/sub/f", "in_link", "is inside the input"},
      {"in", "in/sub/f", "holds the input"},
      {".", "in/sub/f", "holds the input"},
      {"in", "in", "is the input"},
      {"out/x", "in", NULL},
      {"out", "in/sub/f", NULL},
      {"p2", "p", NULL},
      {"in/sub/f", "nonexistent", NULL},
      {"in", "p", NULL},
  };
  for (size_t k = 0; k < sizeof C / sizeof C[0]; k++) {
    dopt_status s = dopt__check_apart("--out", at(b, C[k].out), "--in", at(b, C[k].in));
    if (C[k].needle ? s != DOPT_ERR_INVALID_ARG || !strstr(dopt_last_error(), C[k].needle) : s != DOPT_OK)
      fail_msg("out %s, in %s: %s '%s', want '%s'", C[k].out, C[k].in, dopt_status_name(s), dopt_last_error(),
               C[k].needle ? C[k].needle : "apart");
  }
  assert_status(dopt__check_apart("--out", dotted, "--in", at(b, "p")), DOPT_ERR_INVALID_ARG, "is the input");
}

/* Two outputs of one command never land in the same file: by node when it exists, by folder and name
 * when not yet made; spellings, links and hard links seen through. */
static void test_check_distinct(void **st) {
  (void)st;
  char b[400], dotted[800];
  box("distinct", b, sizeof b);
  assert_int_equal(mkdir(at(b, "d"), 0755), 0);
  put(at(b, "f"), "x");
  assert_int_equal(link(at(b, "f"), at(b, "f_hard")), 0);
  assert_int_equal(symlink("f", at(b, "f_link")), 0);
  assert_int_equal(symlink("new", at(b, "dangling")), 0); /* names the file to be made */
  assert_int_equal(symlink("d", at(b, "d_link")), 0);
  snprintf(dotted, sizeof dotted, "%s/d/../new", b);
  struct {
    const char *a, *b;
    int same;
  } C[] = {
      {"f", "f", 1},          {"f", "f_hard", 1}, {"f_link", "f", 1},      {"new", "new", 1},
      {"dangling", "new", 1}, {"d_link/x", "d/x", 1}, {"d", "d", 1},       {"f", "new", 0},
      {"d/x", "d/y", 0},      {"new", "d/new", 0},    {"nodir/x", "nodir/x", 0}, /* its folder not made yet: not told */
  };
  for (size_t k = 0; k < sizeof C / sizeof C[0]; k++) {
    dopt_status s = dopt__check_distinct("--json", at(b, C[k].a), "--plot", at(b, C[k].b));
    if (C[k].same ? s != DOPT_ERR_INVALID_ARG || !strstr(dopt_last_error(), "are the same file") : s != DOPT_OK)
      fail_msg("%s vs %s: %s '%s', want %s", C[k].a, C[k].b, dopt_status_name(s), dopt_last_error(),
               C[k].same ? "the same file" : "distinct");
  }
  assert_status(dopt__check_distinct("--json", dotted, "--plot", at(b, "new")), DOPT_ERR_INVALID_ARG,
                "are the same file");
  /* the commands: one line, exit 2, nothing written */
  const char *c1[] = {"compare", "--steps", "2", "--json", at(b, "o"), "--plot", at(b, "o"), "--quiet", NULL};
  expect(b, c1, 2, "are the same file", NULL, NULL);
  const char *c2[] = {"compare", "--steps", "2", "--json", at(b, "f"), "--plot", at(b, "f_link"), "--quiet", NULL};
  expect(b, c2, 2, "are the same file", NULL, NULL);
  const char *r1[] = {"run", "--params", inputs, "--optimizer", "adamw", "--steps", "1", "--out", at(b, "o"), "--save",
                      at(b, "o"), "--quiet", NULL};
  expect(b, r1, 2, "are the same file", NULL, NULL);
  const char *v1[] = {"compare", "--steps", "2", "--checkpoint-at", "1", "--checkpoint-dir", at(b, "d"), "--json",
                      at(b, "d_link"), "--quiet", NULL};
  expect(b, v1, 2, "is a folder", NULL, NULL); /* a folder as --json: the output rule's */
  /* a file output on a name the checkpoint folder output writes */
  assert_int_equal(mkdir(at(b, "K"), 0755), 0);
  const char *k1[] = {"run", "--params", inputs, "--optimizer", "adamw", "--steps", "1", "--out", at(b, "K/latest"),
                      "--save", at(b, "K"), "--quiet", NULL};
  expect(b, k1, 2, "is a name the checkpoint folder --save", NULL, NULL);
  const char *k2[] = {"compare", "--steps", "2", "--checkpoint-at", "1", "--checkpoint-dir", at(b, "K"), "--json",
                      at(b, "K/step-000000001"), "--quiet", NULL};
  expect(b, k2, 2, "is a name the checkpoint folder --checkpoint-dir", NULL, NULL);
  const char *k3[] = {"run", "--params", inputs, "--optimizer", "adamw", "--steps", "1", "--out", at(b, "K/final.st"),
                      "--save", at(b, "K"), "--quiet", NULL};
  const char *const made[] = {"K", NULL};
  expect(b, k3, 0, NULL, made, NULL); /* any other name in it is fine */
}

static void test_remove_flat_dir(void **st) {
  (void)st;
  char b[400];
  box("remove", b, sizeof b);
  assert_int_equal(mkdir(at(b, "victim"), 0755), 0);
  put(at(b, "victim/a"), "a");
  put(at(b, "victim/b"), "b");
  put(at(b, "outside"), "o");
  /* a link where the folder is: the link goes, its target stays whole */
  assert_int_equal(symlink("victim", at(b, "tmp_link")), 0);
  dt_tree *before = dt_tree_snap(b);
  assert_ok(dopt__remove_flat_dir(at(b, "tmp_link")));
  assert_int_equal(kind_of(at(b, "tmp_link")), 0);
  dt_tree *after = dt_tree_snap(b);
  const char *skip[] = {"tmp_link", NULL};
  char diff[800];
  if (dt_tree_diff(before, after, skip, diff, sizeof diff)) fail_msg("removing a link changed: %s", diff);
  dt_tree_free(before);
  dt_tree_free(after);
  /* a folder of files and links: emptied and removed; the links' targets stay */
  assert_int_equal(mkdir(at(b, "gen"), 0755), 0);
  put(at(b, "gen/rank.json"), "{}");
  assert_int_equal(symlink("../outside", at(b, "gen/file_link")), 0);
  assert_int_equal(symlink("../victim", at(b, "gen/dir_link")), 0);
  assert_int_equal(mkfifo(at(b, "gen/fifo"), 0644), 0);
  assert_ok(dopt__remove_flat_dir(at(b, "gen")));
  assert_int_equal(kind_of(at(b, "gen")), 0);
  assert_int_equal(kind_of(at(b, "outside")), S_IFREG);
  assert_int_equal(kind_of(at(b, "victim/a")), S_IFREG);
  /* a folder inside: not distopt's; nothing removed */
  assert_int_equal(mkdir(at(b, "gen2"), 0755), 0);
  put(at(b, "gen2/f"), "f");
  assert_int_equal(mkdir(at(b, "gen2/sub"), 0755), 0);
  assert_status(dopt__remove_flat_dir(at(b, "gen2")), DOPT_ERR_IO, "holds a folder 'sub'");
  assert_int_equal(kind_of(at(b, "gen2/f")), S_IFREG);
  /* a regular file where the folder should be: an error naming it, untouched */
  put(at(b, "plain"), "p");
  assert_status(dopt__remove_flat_dir(at(b, "plain")), DOPT_ERR_IO, "is a regular file where distopt's own folder");
  assert_int_equal(kind_of(at(b, "plain")), S_IFREG);
  assert_ok(dopt__remove_flat_dir(at(b, "absent")));
}

static void test_atomic_write(void **st) {
  (void)st;
  char b[400], name[700];
  box("write", b, sizeof b);
  /* an existing file keeps its permissions; no temporary is left */
  put(at(b, "out"), "old");
  assert_int_equal(chmod(at(b, "out"), 0600), 0);
  assert_ok(dopt__write_file(at(b, "out"), DOPT_W_OUTPUT, "new!", 4));
  struct stat s0;
  assert_int_equal(stat(at(b, "out"), &s0), 0);
  assert_int_equal(s0.st_mode & 07777, 0600);
  assert_int_equal(s0.st_size, 4);
  /* an output through a link: the target is replaced in its own folder, the link stays a link */
  assert_int_equal(mkdir(at(b, "real"), 0755), 0);
  put(at(b, "real/target"), "t");
  assert_int_equal(symlink("real/target", at(b, "lnk")), 0);
  assert_ok(dopt__write_file(at(b, "lnk"), DOPT_W_OUTPUT, "via link", 8));
  assert_int_equal(kind_of(at(b, "lnk")), S_IFLNK);
  char *t = slurp(at(b, "real/target"));
  assert_string_equal(t, "via link");
  free(t);
  /* an internal file is never followed: the link itself is replaced */
  put(at(b, "victim"), "victim");
  assert_int_equal(symlink("victim", at(b, "latest")), 0);
  assert_ok(dopt__write_file(at(b, "latest"), DOPT_W_INTERNAL, "step\n", 5));
  assert_int_equal(kind_of(at(b, "latest")), S_IFREG);
  t = slurp(at(b, "victim"));
  assert_string_equal(t, "victim");
  free(t);
  /* links planted at every temporary name it could pick: it never writes through one (the write is refused) */
  for (int k = 0; k < 1000; k++) {
    snprintf(name, sizeof name, "%s/target2.tmp-%ld-%d", b, (long)getpid(), k);
    assert_int_equal(symlink("victim", name), 0);
  }
  assert_status(dopt__write_file(at(b, "target2"), DOPT_W_OUTPUT, "x", 1), DOPT_ERR_IO, "temporary file");
  t = slurp(at(b, "victim"));
  assert_string_equal(t, "victim");
  free(t);
  assert_int_equal(kind_of(at(b, "target2")), 0);
  /* an aborted write leaves the target as it was and no temporary */
  dopt_wfile *w;
  assert_ok(dopt__wfile_open(at(b, "out"), DOPT_W_OUTPUT, &w));
  fputs("partial", dopt__wfile_stream(w));
  dopt__wfile_abort(w);
  t = slurp(at(b, "out"));
  assert_string_equal(t, "new!");
  free(t);
  /* a FIFO at an output is refused at open, and the write never blocks on it */
  assert_int_equal(mkfifo(at(b, "fifo"), 0644), 0);
  assert_status(dopt__write_file(at(b, "fifo"), DOPT_W_OUTPUT, "x", 1), DOPT_ERR_IO, "is a FIFO");
  assert_int_equal(kind_of(at(b, "fifo")), S_IFIFO);
}

static void test_open_read(void **st) {
  (void)st;
  char b[400];
  box("read", b, sizeof b);
  assert_int_equal(mkfifo(at(b, "fifo"), 0644), 0);
  assert_int_equal(mkdir(at(b, "dir"), 0755), 0);
  int sock = make_socket(at(b, "sock"));
  char *text;
  assert_status(dopt__read_all(at(b, "fifo"), 100, &text, NULL), DOPT_ERR_IO, "a FIFO (named pipe), not a regular file");
  assert_status(dopt__read_all(at(b, "dir"), 100, &text, NULL), DOPT_ERR_IO, "a folder, not a regular file");
  assert_status(dopt__read_all(at(b, "sock"), 100, &text, NULL), DOPT_ERR_IO, "a socket, not a regular file");
  assert_status(dopt__read_all(at(b, "absent"), 100, &text, NULL), DOPT_ERR_NOT_FOUND, "cannot open");
  put(at(b, "big"), "0123456789");
  assert_status(dopt__read_all(at(b, "big"), 9, &text, NULL), DOPT_ERR_FORMAT, "exceed the limit of 9");
  size_t n;
  assert_ok(dopt__read_all(at(b, "big"), 10, &text, &n));
  assert_int_equal(n, 10);
  free(text);
  dopt_st_file *f;
  assert_status(dopt_st_load(at(b, "fifo"), &f), DOPT_ERR_IO, "a FIFO");
  close(sock);
}

/* ---- commands: cleanup never follows a link --------------------------------------------- */

static void test_save_never_follows_links(void **st) {
  (void)st;
  char b[400];
  box("save_links", b, sizeof b);
  assert_int_equal(mkdir(at(b, "d"), 0755), 0);
  put(at(b, "d/a"), "a");
  put(at(b, "d/b"), "b");
  /* a stale temporary generation that is a link into d: removed as a link */
  assert_int_equal(mkdir(at(b, "D"), 0755), 0);
  assert_int_equal(symlink("../d", at(b, "D/.tmp-step-000000002")), 0);
  char ost[700]; /* at()'s buffers are reused below: --out keeps its own */
  snprintf(ost, sizeof ost, "%s", at(b, "o.st"));
  const char *s1[] = {"run", "--params", inputs, "--optimizer", "adamw", "--steps", "2", "--save", at(b, "D"),
                      "--out", ost, "--quiet", NULL};
  const char *o1[] = {"D", "o.st", NULL};
  expect(b, s1, 0, NULL, o1, NULL);
  assert_int_equal(kind_of(at(b, "D/step-000000002")), S_IFDIR);
  assert_int_equal(kind_of(at(b, "D/.tmp-step-000000002")), 0);
  /* an existing generation that is a link into d, no `latest`: the folder cannot say whose it is (refused,
   * nothing touched); --start-over removes the link as a link and saves */
  assert_int_equal(mkdir(at(b, "D2"), 0755), 0);
  assert_int_equal(symlink("../d", at(b, "D2/step-000000002")), 0);
  s1[8] = at(b, "D2");
  expect(b, s1, 2, "holds generation 'step-000000002' but no 'latest'", NULL, NULL);
  const char *s2[] = {"run", "--params", inputs, "--optimizer", "adamw", "--steps", "2", "--save", at(b, "D2"),
                      "--start-over", "--out", ost, "--quiet", NULL};
  const char *o2[] = {"D2", "o.st", NULL};
  expect(b, s2, 0, NULL, o2, NULL);
  assert_int_equal(kind_of(at(b, "D2/step-000000002")), S_IFDIR);
  /* a regular file where the generation belongs: exit 2 before any step, naming it, nothing written */
  assert_int_equal(mkdir(at(b, "D3"), 0755), 0);
  put(at(b, "D3/step-000000002"), "not a generation");
  s1[8] = at(b, "D3");
  expect(b, s1, 2, "D3/step-000000002 is a regular file where a checkpoint generation's folder belongs", NULL, NULL);
  /* a folder where `latest` belongs: likewise */
  assert_int_equal(mkdir(at(b, "D4"), 0755), 0);
  assert_int_equal(mkdir(at(b, "D4/latest"), 0755), 0);
  s1[8] = at(b, "D4");
  expect(b, s1, 2, "D4/latest is a folder where the checkpoint's file 'latest' belongs", NULL, NULL);
  /* compare --checkpoint-dir: the distributed save, the same rules */
  assert_int_equal(mkdir(at(b, "C"), 0755), 0);
  assert_int_equal(symlink("../d", at(b, "C/.tmp-step-000000003")), 0);
  assert_int_equal(symlink("../d", at(b, "C/step-000000003")), 0);
  const char *c1[] = {"compare", "--steps", "6", "--checkpoint-at", "3", "--checkpoint-dir", at(b, "C"), "--quiet", NULL};
  expect(b, c1, 2, "holds generation 'step-000000003' but no 'latest'", NULL, NULL);
  const char *c2[] = {"compare", "--steps", "6", "--checkpoint-at", "3", "--checkpoint-dir", at(b, "C"), "--start-over",
                      "--quiet", NULL};
  const char *oc[] = {"C", NULL};
  expect(b, c2, 0, NULL, oc, NULL);
  assert_int_equal(kind_of(at(b, "C/step-000000003")), S_IFDIR);
}

/* ---- commands: one rule for every output ---------------------------------------------------- */

static void test_outputs_one_rule(void **st) {
  (void)st;
  char b[400];
  box("outputs", b, sizeof b);
  assert_int_equal(mkfifo(at(b, "fifo"), 0644), 0);
  assert_int_equal(mkdir(at(b, "dir"), 0755), 0);
  int sock = make_socket(at(b, "sock"));
  assert_int_equal(symlink("fifo", at(b, "to_fifo")), 0);
  put(at(b, "file"), "plain");
  struct {
    const char *opt, *name, *needle;
  } bad[] = {
      {"--out", "fifo", "--out '"},   {"--out", "sock", "is a socket"},        {"--out", "dir", "is a folder"},
      {"--out", "to_fifo", "is a FIFO"}, {"--save", "fifo", "--save '"},     {"--save", "file", "is a regular file"},
      {"--json", "fifo", "--json '"}, {"--plot", "dir", "--plot '"},           {"--json", "sock", "is a socket"},
      {"--checkpoint-dir", "file", "--checkpoint-dir '"},
  };
  for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
    const char *path = at(b, bad[k].name);
    if (strcmp(bad[k].opt, "--out") == 0 || strcmp(bad[k].opt, "--save") == 0) {
      const char *a[] = {"run", "--params", inputs, "--optimizer", "adamw", "--steps", "1", bad[k].opt, path, "--quiet", NULL};
      expect(b, a, 2, bad[k].needle, NULL, NULL);
    } else {
      const char *a[] = {"compare", "--steps", "2", "--checkpoint-at", "1", bad[k].opt, path, "--quiet", NULL};
      expect(b, a, 2, bad[k].needle, NULL, NULL);
    }
  }
  /* a symbolic link: its target is replaced in the target's folder, the link stays */
  assert_int_equal(mkdir(at(b, "real"), 0755), 0);
  put(at(b, "real/out.st"), "old");
  assert_int_equal(symlink("real/out.st", at(b, "lnk.st")), 0);
  const char *a[] = {"run", "--params", inputs, "--optimizer", "adamw", "--steps", "1", "--out", at(b, "lnk.st"), "--quiet", NULL};
  const char *o[] = {"real/out.st", NULL};
  expect(b, a, 0, NULL, o, NULL);
  assert_int_equal(kind_of(at(b, "lnk.st")), S_IFLNK);
  dopt_st_file *f;
  assert_ok(dopt_st_load(at(b, "real/out.st"), &f));
  assert_non_null(dopt_st_meta(f, "optimizer"));
  dopt_st_free(f);
  /* empty paths: refused before any work */
  const char *e1[] = {"run", "--params", inputs, "--optimizer", "adamw", "--out", "", NULL};
  expect(b, e1, 2, "--out '': empty path", NULL, NULL);
  const char *e2[] = {"run", "--params", inputs, "--optimizer", "adamw", "--save", "", NULL};
  expect(b, e2, 2, "--save '': empty path", NULL, NULL);
  const char *e3[] = {"compare", "--json", "", NULL};
  expect(b, e3, 2, "--json: empty path", NULL, NULL);
  close(sock);
}

/* A character device given as an output is written through: it stays the device (made with mknod here). */
static void test_outputs_char_device(void **st) {
  (void)st;
  char b[400];
  box("chardev", b, sizeof b);
  assert_int_equal(mknod(at(b, "null"), S_IFCHR | 0666, makedev(1, 3)), 0);
  const char *a[] = {"run", "--params", inputs, "--optimizer", "adamw", "--steps", "1", "--out", at(b, "null"), "--quiet", NULL};
  expect(b, a, 0, NULL, NULL, NULL); /* nothing in the folder changes: the node is still /dev/null's */
  const char *c[] = {"compare", "--steps", "2", "--json", at(b, "null"), "--plot", at(b, "null"), "--quiet", NULL};
  expect(b, c, 0, NULL, NULL, NULL);
  assert_ok(dopt__write_file(at(b, "null"), DOPT_W_OUTPUT, "x", 1));
  assert_int_equal(kind_of(at(b, "null")), S_IFCHR);
  /* a link to it, too */
  assert_int_equal(symlink("null", at(b, "to_null")), 0);
  a[8] = at(b, "to_null");
  expect(b, a, 0, NULL, NULL, NULL);
}

/* ---- commands: no output is, holds or lies inside an input ------------------------------------ */

static void test_outputs_never_inputs(void **st) {
  (void)st;
  char b[400];
  box("inputs", b, sizeof b);
  copy(trace, at(b, "t.st"));
  assert_int_equal(link(at(b, "t.st"), at(b, "t_hard.st")), 0);
  put(at(b, "c.yaml"), "optimizer:\n  type: adamw\nsteps: 2\n");
  copy(inputs, at(b, "p.st"));
  assert_int_equal(symlink("p.st", at(b, "p_link.st")), 0);
  const char *c1[] = {"compare", "--trace", at(b, "t.st"), "--steps", "2", "--json", at(b, "t.st"), NULL};
  expect(b, c1, 2, "--json '", NULL, NULL);
  const char *c2[] = {"compare", "--trace", at(b, "t.st"), "--steps", "2", "--plot", at(b, "t_hard.st"), NULL};
  expect(b, c2, 2, "is the input --trace", NULL, NULL);
  const char *c3[] = {"compare", "--config", at(b, "c.yaml"), "--plot", at(b, "c.yaml"), NULL};
  expect(b, c3, 2, "is the input --config", NULL, NULL);
  const char *r1[] = {"run", "--params", at(b, "p.st"), "--optimizer", "adamw", "--steps", "1", "--out", at(b, "p_link.st"), NULL};
  expect(b, r1, 2, "is the input --params", NULL, NULL);
  const char *r2[] = {"run", "--params", at(b, "p.st"), "--optimizer", "adamw", "--steps", "1", "--save", b, NULL};
  expect(b, r2, 2, "holds the input --params", NULL, NULL);
  /* a checkpoint being resumed: nothing inside it is an output */
  make_ckpt(at(b, "K"), "2");
  const char *gen = "K/step-000000002", *rank = "K/step-000000002/rank-00000-of-00001.safetensors";
  const char *r3[] = {"run", "--params", at(b, "p.st"), "--optimizer", "adamw", "--steps", "3", "--resume", at(b, gen),
                      "--out", at(b, rank), NULL};
  expect(b, r3, 2, "is inside the input --resume", NULL, NULL);
  const char *r4[] = {"run", "--params", at(b, "p.st"), "--optimizer", "adamw", "--steps", "3", "--resume", at(b, "K"),
                      "--out", at(b, "K/latest"), NULL};
  expect(b, r4, 2, "is inside the input --resume", NULL, NULL);
  const char *r5[] = {"run", "--params", at(b, "p.st"), "--optimizer", "adamw", "--steps", "3", "--resume", at(b, gen),
                      "--out", at(b, "K/latest"), NULL};
  expect(b, r5, 2, "is inside the input --resume (its checkpoint folder)", NULL, NULL);
  const char *r6[] = {"run", "--params", at(b, "p.st"), "--optimizer", "adamw", "--steps", "3", "--resume", at(b, "K"),
                      "--save", at(b, gen), NULL};
  expect(b, r6, 2, "--save '", NULL, NULL);
}

/* The one exception: --save K with --resume K (or K/step-N) adds generations, never rewrites the one being
 * read, and never moves `latest` before the new generation is committed. */
static void test_save_into_resumed(void **st) {
  (void)st;
  char b[400];
  box("resumed", b, sizeof b);
  make_ckpt(at(b, "K"), "2");
  const char *a[] = {"run", "--params", inputs, "--optimizer", "adamw", "--steps", "4", "--resume", at(b, "K"),
                     "--save", at(b, "K"), "--quiet", NULL};
  const char *o[] = {"K/step-000000004", "K/latest", NULL};
  expect(b, a, 0, NULL, o, NULL);
  char *l = slurp(at(b, "K/latest"));
  assert_string_equal(l, "step-000000004\n");
  free(l);
  /* the same step again: it would rewrite the generation being read */
  a[6] = "4";
  expect(b, a, 2, "would rewrite the generation being read", NULL, NULL);
  a[8] = at(b, "K/step-000000002"); /* from step 2 to 4 would replace step 4, a generation it did not write */
  expect(b, a, 2, "its latest generation is step 4 of this run; a save after step 4 would replace it", NULL, NULL);
  a[6] = "3"; /* and a save after step 3 would move `latest` back */
  expect(b, a, 2, "a save after step 3 would move 'latest' back", NULL, NULL);
  /* a full disk during the save: exit 2 (an I/O failure), latest and every generation as they were, no temporary
   * left */
  a[6] = "6";
  a[8] = at(b, "K");
  dt_run_opts full = {30, 4096, NULL, 0};
  expect(b, a, 2, "step-000000006", NULL, &full);
}

/* A checkpoint folder knows what wrote it: a run or a compare of another model or optimizer is refused before
 * any step, the folder untouched (run's data was lost to compare --checkpoint-dir before); the same run again
 * would replace its generations: refused; --start-over removes them first, other files stay. */
static void test_whose_folder(void **st) {
  (void)st;
  char b[400];
  box("whose", b, sizeof b);
  make_ckpt(at(b, "K"), "4");
  put(at(b, "K/notes.txt"), "mine");
  char k[700];
  snprintf(k, sizeof k, "%s", at(b, "K"));
  const char *other[] = {"run", "--params", inputs, "--optimizer", "lamb", "--steps", "6", "--save", k, "--quiet", NULL};
  expect(b, other, 2, "holds another run's generations: ", NULL, NULL);
  const char *hp[] = {"run", "--params", inputs, "--optimizer", "adamw", "--hparams", "lr=0.002", "--steps", "6",
                      "--save", k, "--quiet", NULL};
  expect(b, hp, 2, "hyperparameter lr", NULL, NULL);
  const char *cmp[] = {"compare", "--steps", "6", "--checkpoint-at", "3", "--checkpoint-dir", k, "--quiet", NULL};
  expect(b, cmp, 2, "holds another run's generations: ", NULL, NULL);
  const char *again[] = {"run", "--params", inputs, "--optimizer", "adamw", "--steps", "4", "--save", k, "--quiet", NULL};
  expect(b, again, 2, "a save after step 4 would replace it", NULL, NULL);
  /* the same run, later steps: added after latest */
  const char *later[] = {"run", "--params", inputs, "--optimizer", "adamw", "--steps", "6", "--save", k, "--quiet", NULL};
  const char *ol[] = {"K/step-000000006", "K/latest", NULL};
  expect(b, later, 0, NULL, ol, NULL);
  /* --start-over: every generation and latest removed, this run's saved; notes.txt stays */
  const char *over[] = {"run", "--params", inputs, "--optimizer", "lamb", "--steps", "3", "--save", k, "--start-over",
                        "--quiet", NULL};
  const char *oo[] = {"K/step-000000004", "K/step-000000006", "K/step-000000003", "K/latest", NULL};
  expect(b, over, 0, NULL, oo, NULL);
  assert_int_equal(kind_of(at(b, "K/step-000000004")), 0);
  assert_int_equal(kind_of(at(b, "K/step-000000006")), 0);
  assert_int_equal(kind_of(at(b, "K/step-000000003")), S_IFDIR);
  assert_int_equal(kind_of(at(b, "K/notes.txt")), S_IFREG);
  char *l = slurp(at(b, "K/latest"));
  assert_string_equal(l, "step-000000003\n");
  free(l);
  const char *alone[] = {"run", "--params", inputs, "--optimizer", "adamw", "--start-over", "--out", at(b, "o.st"), NULL};
  expect(b, alone, 2, "--start-over needs --save", NULL, NULL);
}

/* What a command echoes is escaped by the one rule: a path holding a bidi override, a C1 control and a byte
 * that is not UTF-8 comes back as \u202e, \u0085 and \xff on one line (they reached the terminal raw). */
static void test_echo_escaped(void **st) {
  (void)st;
  char b[400];
  box("echo", b, sizeof b);
  char bad[700];
  snprintf(bad, sizeof bad, "%s/p\xe2\x80\xae\xc2\x85\xff.st", b);
  const char *a[] = {"run", "--params", bad, "--optimizer", "adamw", "--out", at(b, "o.st"), NULL};
  expect(b, a, 2, "/p\\u202e\\u0085\\xff.st", NULL, NULL);
  char *err = slurp(errfile);
  if (strstr(err, "\xe2\x80\xae") || strstr(err, "\xc2\x85") || strchr(err, '\xff')) fail_msg("raw bytes echoed: %s", err);
  free(err);
  const char *v[] = {"verify", bad, NULL};
  expect(b, v, 2, "p\\u202e\\u0085\\xff.st", NULL, NULL);
}

/* ---- commands: readers never block -------------------------------------------------------------- */

static void test_readers_never_block(void **st) {
  (void)st;
  char b[400];
  box("fifos", b, sizeof b);
  const char *ks[] = {"K1", "K2", "K3"};
  for (int k = 0; k < 3; k++) make_ckpt(at(b, ks[k]), "2");
  unlink(at(b, "K1/latest"));
  assert_int_equal(mkfifo(at(b, "K1/latest"), 0644), 0);
  unlink(at(b, "K2/step-000000002/rank-00000-of-00001.safetensors"));
  assert_int_equal(mkfifo(at(b, "K2/step-000000002/rank-00000-of-00001.safetensors"), 0644), 0);
  unlink(at(b, "K3/step-000000002/index.json"));
  assert_int_equal(mkfifo(at(b, "K3/step-000000002/index.json"), 0644), 0);
  const char *names[] = {"K1/latest", "K2/step-000000002/rank-00000-of-00001.safetensors", "K3/step-000000002/index.json"};
  for (int k = 0; k < 3; k++) {
    const char *a[] = {"run", "--params", inputs, "--optimizer", "adamw", "--steps", "3", "--resume", at(b, ks[k]),
                       "--out", at(b, "o.st"), NULL};
    char needle[200];
    snprintf(needle, sizeof needle, "%s: a FIFO (named pipe), not a regular file", names[k]);
    expect(b, a, 2, needle, NULL, NULL);
  }
  assert_int_equal(mkfifo(at(b, "f.st"), 0644), 0);
  assert_int_equal(mkfifo(at(b, "f.yaml"), 0644), 0);
  assert_int_equal(mkdir(at(b, "rec"), 0755), 0);
  assert_int_equal(mkfifo(at(b, "rec/index.json"), 0644), 0);
  const char *r1[] = {"run", "--params", at(b, "f.st"), "--optimizer", "adamw", "--out", at(b, "o.st"), NULL};
  expect(b, r1, 2, "f.st: a FIFO", NULL, NULL);
  const char *r2[] = {"run", "--params", inputs, "--grads", at(b, "f.st"), "--optimizer", "adamw", "--out", at(b, "o.st"), NULL};
  expect(b, r2, 2, "f.st: a FIFO", NULL, NULL);
  const char *c1[] = {"compare", "--config", at(b, "f.yaml"), NULL};
  expect(b, c1, 2, "f.yaml: a FIFO", NULL, NULL);
  const char *c2[] = {"compare", "--trace", at(b, "f.st"), NULL};
  expect(b, c2, 2, "f.st: a FIFO", NULL, NULL);
  const char *c3[] = {"compare", "--trace", at(b, "rec"), "--dp", "1", NULL};
  expect(b, c3, 2, "rec/index.json: a FIFO", NULL, NULL);
  const char *v1[] = {"verify", at(b, "rec"), NULL};
  expect(b, v1, 2, "rec/index.json: a FIFO", NULL, NULL);
  /* a rank file that is a folder says so */
  make_ckpt(at(b, "K4"), "2");
  const char *rf = "K4/step-000000002/rank-00000-of-00001.safetensors";
  unlink(at(b, rf));
  assert_int_equal(mkdir(at(b, rf), 0755), 0);
  const char *a[] = {"run", "--params", inputs, "--optimizer", "adamw", "--steps", "3", "--resume", at(b, "K4"), "--out", at(b, "o.st"), NULL};
  expect(b, a, 2, "rank-00000-of-00001.safetensors: a folder, not a regular file", NULL, NULL);
}

/* ---- commands: exit codes ---------------------------------------------------------------------- */

static void test_exit_codes(void **st) {
  (void)st;
  char b[400];
  box("exits", b, sizeof b);
  /* a bad DOPT_NUM_THREADS: exit 2 before any work, in every command */
  const char *const bad_env[][2] = {{"DOPT_NUM_THREADS=x", "'x'"}, {"DOPT_NUM_THREADS=0", "'0'"}, {"DOPT_NUM_THREADS=999", "'999'"}};
  for (int e = 0; e < 3; e++) {
    const char *env[] = {bad_env[e][0], NULL};
    dt_run_opts o = {30, 0, env, 0};
    const char *r[] = {"run", "--params", inputs, "--optimizer", "adamw", "--steps", "1", "--out", at(b, "o.st"), NULL};
    const char *c[] = {"compare", "--steps", "2", "--json", at(b, "o.json"), NULL};
    const char *bn[] = {"bench", "--size", "8x8", "--iters", "1", NULL};
    const char *m[] = {"mem", NULL};
    const char *l[] = {"list", NULL};
    const char *v[] = {"verify", b, NULL};
    const char *const *all[] = {r, c, bn, m, l, v};
    for (int k = 0; k < 6; k++) expect(b, all[k], 2, bad_env[e][1], NULL, &o);
  }
  const char *t[] = {"bench", "--size", "8x8", "--iters", "1", "--torch", "/nonexistent", NULL};
  expect(b, t, 2, "--torch '/nonexistent': no such executable", NULL, NULL);
  /* a full disk while compare writes its checkpoint: exit 2 (1 is only a measured divergence), its temporary
   * generation removed */
  dt_run_opts full = {60, 4096, NULL, 0};
  const char *c[] = {"compare", "--steps", "4", "--checkpoint-at", "2", "--checkpoint-dir", at(b, "C"), "--quiet", NULL};
  assert_int_equal(mkdir(at(b, "C"), 0755), 0);
  expect(b, c, 2, "C/.tmp-step-000000002", NULL, &full);
  /* --json and --plot on a full device after an equivalent run: 2, the result was not delivered */
  const char *cj[] = {"compare", "--steps", "2", "--quiet", "--json", "/dev/full", NULL};
  expect(b, cj, 2, "/dev/full", NULL, NULL);
  const char *cp[] = {"compare", "--steps", "2", "--quiet", "--plot", "/dev/full", NULL};
  expect(b, cp, 2, "/dev/full", NULL, NULL);
  /* standard output on a full device: 2 in one line, for every command that prints (it printed 0 before) */
  const char *r[] = {"run", "--params", inputs, "--optimizer", "adamw", "--steps", "1", "--out", at(b, "o.st"), NULL};
  const char *cs[] = {"compare", "--steps", "2", NULL};
  const char *m[] = {"mem", "--model", "llama-60m", NULL};
  const char *l[] = {"list", NULL};
  const char *h[] = {"--help", NULL};
  const char *const *prints[] = {r, cs, m, l, h};
  for (int k = 0; k < 5; k++) {
    dt_run_opts o = {60, 0, NULL, 0};
    const int rc = dt_run_with(bin, prints[k], "/dev/full", errfile, &o);
    char *err = slurp(errfile);
    if (rc != 2 || !strstr(err, "standard output: No space left on device") || strchr(err, '\n') != strrchr(err, '\n'))
      fail_msg("distopt %s > /dev/full: exit %d, want 2 and one line naming standard output: %s", prints[k][0], rc, err);
    free(err);
  }
  unlink(at(b, "o.st"));
}

int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: %s DISTOPT [chardev]\n", argv[0]);
    return 2;
  }
  bin = argv[1];
  if (argc > 2 && strcmp(argv[2], "chardev") == 0) {
    char probe[64];
    snprintf(probe, sizeof probe, "/tmp/dopt_mknod_%ld", (long)getpid());
    if (mknod(probe, S_IFCHR | 0666, makedev(1, 3)) != 0) {
      printf("skipped: this process may not make device nodes (mknod: %s)\n", strerror(errno));
      return 77;
    }
    unlink(probe);
    const struct CMUnitTest dev[] = {cmocka_unit_test(test_outputs_char_device)};
    return cmocka_run_group_tests(dev, setup, teardown);
  }
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_check_output),       cmocka_unit_test(test_check_apart),
      cmocka_unit_test(test_check_distinct),
      cmocka_unit_test(test_remove_flat_dir),    cmocka_unit_test(test_atomic_write),
      cmocka_unit_test(test_open_read),          cmocka_unit_test(test_save_never_follows_links),
      cmocka_unit_test(test_outputs_one_rule),   cmocka_unit_test(test_outputs_never_inputs),
      cmocka_unit_test(test_save_into_resumed), cmocka_unit_test(test_whose_folder), cmocka_unit_test(test_echo_escaped),
      cmocka_unit_test(test_readers_never_block),
      cmocka_unit_test(test_exit_codes),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}

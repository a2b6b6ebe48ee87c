/* A file tree's snapshot, to prove that a command changed nothing outside its
 * named outputs: every entry below a root (never following a link) by path,
 * kind, mode and content (SHA-256 of a file's bytes through the library's
 * digest, a link's target). Main thread only. */
#ifndef DOPT_FSTREE_H
#define DOPT_FSTREE_H

#include <stddef.h>

typedef struct dt_tree dt_tree;

/* Snapshot of root (every entry below it, recursively). */
dt_tree *dt_tree_snap(const char *root);
void dt_tree_free(dt_tree *t);

/* Compares two snapshots of the same root. An entry whose path relative to
 * the root equals one of skip[] (NULL-terminated; NULL: none) or lies below
 * it is not compared: a named output. Returns 0 when equal, else 1 with the
 * first difference in msg ("a/b: content changed", "c: removed", ...). */
int dt_tree_diff(const dt_tree *before, const dt_tree *after, const char *const *skip, char *msg, size_t cap);

#endif

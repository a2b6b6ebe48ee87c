/* Fuzz target: the index of a recorded run (vr_index_parse, verify/verify_index.c; `distopt verify`,
 * docs/verify.md). Beyond "no crash, no leak, no UB": a rejected index leaves the result empty and one
 * NUL-terminated line of message; an accepted one keeps every promise the replay relies on — names within
 * their limits and found again by name, pieces inside their parameters, each parameter's source pieces
 * tiling it exactly, each rank's files contiguous from step start_step + 1 to `steps`, changes in step order
 * and inside the window, schema 1 without schema 2's fields (start_step, record.grads, record.projectors, a null
 * optimizer.name), schema 1 and 2 without schema 3's (record.grad_agree). */
#include <stdlib.h>
#include <string.h>

#include "fuzzcommon.h"
#include "verify.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  vr_index ix;
  char err[1024];
  int rc = vr_index_parse((const char *)data, size, "index.json", &ix, err, sizeof err);
  if (rc != 0) {
    if (ix.nparams || ix.params || ix.ranks || ix.by_name || !err[0] || strchr(err, '\n')) abort();
    return 0;
  }
  if (err[0] || ix.schema_version < VR_SCHEMA_OLDEST || ix.schema_version > VR_SCHEMA_VERSION || ix.world_size < 1 ||
      ix.nparams < 1 || ix.ngroups < 1)
    abort();
  /* schema 1 has none of schema 2's fields; a window ends at or after its start */
  if (ix.schema_version == 1 && (ix.start_step || ix.grads != VR_GRADS_F32 || ix.projectors || !ix.optimizer[0]))
    abort();
  if (ix.schema_version < 3 && ix.grad_agree) abort();
  if (ix.start_step < 0 || ix.steps < ix.start_step || (ix.grads != VR_GRADS_F32 && ix.grads != VR_GRADS_BF16)) abort();
  for (int p = 0; p < ix.nparams; p++) {
    const vr_param *vp = &ix.params[p];
    if (!vp->name[0] || strlen(vp->name) > VR_MAX_NAME || vp->numel < 1 || vp->group < 0 || vp->group >= ix.ngroups)
      abort();
    if (vr_index_find_param(&ix, vp->name) != p) abort();
    int64_t covered = 0;
    for (int r = 0; r < ix.world_size; r++)
      for (int i = 0; i < ix.ranks[r].npieces; i++) {
        const vr_piece *pc = &ix.ranks[r].pieces[i];
        if (pc->param < 0 || pc->param >= ix.nparams) abort();
        if (pc->param != p) continue;
        if (pc->lp.lo < 0 || pc->lp.len < 1 || pc->lp.lo + pc->lp.len > vp->numel) abort();
        if (pc->source) covered += pc->lp.len;
      }
    if (covered != vp->numel) abort(); /* sources are disjoint and cover: their lengths sum to numel */
  }
  for (int r = 0; r < ix.world_size; r++) {
    long next = ix.start_step + 1;
    for (int k = 0; k < ix.ranks[r].nfiles; k++) {
      const vr_file *f = &ix.ranks[r].files[k];
      if (f->first != next || f->last < f->first || !f->path[0] || f->path[0] == '/') abort();
      next = f->last + 1;
    }
    if (next - 1 != ix.steps) abort();
  }
  for (long i = 0; i < ix.nchanges; i++)
    if ((i && ix.changes[i].step < ix.changes[i - 1].step) || ix.changes[i].step <= ix.start_step) abort();
  vr_index_free(&ix);
  return 0;
}

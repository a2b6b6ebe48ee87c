/* Planted bugs for the counters' tests (docs/api.md "Counters"): optimizer implementations that do a wrong
 * amount of work, for the distributed side of a comparison (dt_dist_impl, cmp_options.dist_impl) while the
 * reference keeps the registry's. */
#ifndef DOPT_PLANTED_H
#define DOPT_PLANTED_H

enum {
  DT_PLANT_REFRESH_TWICE,   /* galore_adamw: a due refresh's SVD computed twice (the same projector, the same bits) */
  DT_PLANT_REFRESH_SKIPPED, /* galore_adamw: no refresh after the first (a gap read as infinite) */
  DT_PLANT_PLAIN_PATH,      /* galore_adamw: matrices seen flattened (ZeRO-3 init), stepped unprojected */
  DT_PLANT_Q8_SHARD,        /* adamw8bit: min_8bit_size compared with numel / 2 (the shard's at dp 2) */
  DT_PLANT_Q8_TAIL_TWICE,   /* adamw8bit: the piece holding the last element runs its step twice, once on copies
                               (wasted work on one rank, the same bits) */
  DT_PLANT_COUNT
};

struct dopt_optim_impl;
/* The planted implementation `which`, and what it plants in words. */
const struct dopt_optim_impl *dt_planted(int which);
const char *dt_planted_what(int which);

#endif

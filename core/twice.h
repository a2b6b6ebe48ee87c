/* One elementwise loop compiled twice, for the baseline ISA and for AVX2
 * (picked at run time with __builtin_cpu_supports: libgcc's data, read-only
 * after its constructor, so safe from any thread), from one body: NAME_body,
 * a static always-inline function. The bits are the same either way: each
 * element is the same IEEE +, −, ×, ÷, √ in vector lanes or alone (no
 * contraction: -ffp-contract=off; AVX2 brings no FMA by itself).
 *   DOPT_TWICE(storage, return type, name, (parameters), (arguments))
 *   DOPT_TWICE_VOID(storage, name, (parameters), (arguments)) */
#ifndef DISTOPT_TWICE_H
#define DISTOPT_TWICE_H

#define DOPT_BODY static inline __attribute__((always_inline))

#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
#define DOPT_TWICE(storage, ret, name, params, args)                                                                 \
  __attribute__((target("avx2"))) static ret name##_avx2 params { return name##_body args; }                       \
  storage ret name params { return __builtin_cpu_supports("avx2") ? name##_avx2 args : name##_body args; }
#define DOPT_TWICE_VOID(storage, name, params, args)                                                                 \
  __attribute__((target("avx2"))) static void name##_avx2 params { name##_body args; }                             \
  storage void name params {                                                                                         \
    if (__builtin_cpu_supports("avx2")) name##_avx2 args;                                                            \
    else name##_body args;                                                                                           \
  }
#else
#define DOPT_TWICE(storage, ret, name, params, args)                                                                 \
  storage ret name params { return name##_body args; }
#define DOPT_TWICE_VOID(storage, name, params, args)                                                                 \
  storage void name params { name##_body args; }
#endif

#endif

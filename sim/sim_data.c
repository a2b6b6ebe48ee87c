/* Data movement of the simulator: copies, fixed-order reductions and fault
 * bit flips. Everything that touches buffer contents lives here. */
#include "sim_internal.h"

#include <string.h>

void dopt__sim_copy(const dopt_sim_memops *mem, void *dst, const void *src, size_t bytes) {
  if (mem) {
    if (bytes != 0 && dst != src)
      mem->copy(mem->ctx, dst, src, bytes);
    return;
  }
  if (bytes != 0 && dst != src)
    memcpy(dst, src, bytes);
}

static float bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

/* Round to nearest, ties to even; NaN stays a (quiet) NaN. */
static uint16_t f32_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u)
    return (uint16_t)((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

/* Elements reduced per block: the accumulator stays in L1 and makes in-place
 * reductions safe (a block's sources are all read before it is written). */
#define SIM_BLOCK 1024

/* Reducer for element type T with accumulator type A. LD/ST convert between
 * them, ADD/MUL combine two accumulators, DIV divides by n (AVG). Integer sums
 * and products wrap (computed in unsigned arithmetic). */
#define SIM_DEFINE_REDUCER(NAME, T, A, LD, ST, ADD, MUL, DIV)                                \
  static void NAME(dopt_redop op, void *out, const void *const *srcs, int n, int start,     \
                   size_t off, size_t count) {                                               \
    A acc[SIM_BLOCK];                                                                        \
    for (size_t b = 0; b < count; b += SIM_BLOCK) {                                          \
      size_t m = count - b < SIM_BLOCK ? count - b : SIM_BLOCK;                              \
      const T *s = (const T *)srcs[start] + off + b;                                         \
      for (size_t k = 0; k < m; k++)                                                         \
        acc[k] = LD(s[k]);                                                                   \
      for (int j = 1; j < n; j++) {                                                          \
        s = (const T *)srcs[(start + j) % n] + off + b;                                      \
        switch (op) {                                                                        \
        case DOPT_PROD:                                                                  \
          for (size_t k = 0; k < m; k++)                                                     \
            acc[k] = MUL(acc[k], LD(s[k]));                                                  \
          break;                                                                             \
        case DOPT_MAX:                                                                   \
          for (size_t k = 0; k < m; k++)                                                     \
            acc[k] = LD(s[k]) > acc[k] ? LD(s[k]) : acc[k];                                  \
          break;                                                                             \
        case DOPT_MIN:                                                                   \
          for (size_t k = 0; k < m; k++)                                                     \
            acc[k] = LD(s[k]) < acc[k] ? LD(s[k]) : acc[k];                                  \
          break;                                                                             \
        default: /* SUM, AVG */                                                              \
          for (size_t k = 0; k < m; k++)                                                     \
            acc[k] = ADD(acc[k], LD(s[k]));                                                  \
          break;                                                                             \
        }                                                                                    \
      }                                                                                      \
      T *o = (T *)out + b;                                                                   \
      if (op == DOPT_AVG)                                                                \
        for (size_t k = 0; k < m; k++)                                                       \
          o[k] = ST(DIV(acc[k], n));                                                         \
      else                                                                                   \
        for (size_t k = 0; k < m; k++)                                                       \
          o[k] = ST(acc[k]);                                                                 \
    }                                                                                        \
  }

#define SIM_ID(x) (x)
#define SIM_FADD(a, b) ((a) + (b))
#define SIM_FMUL(a, b) ((a) * (b))
#define SIM_FDIV32(a, n) ((a) / (float)(n))
#define SIM_FDIV64(a, n) ((a) / (double)(n))
#define SIM_I32ADD(a, b) (int32_t)((uint32_t)(a) + (uint32_t)(b))
#define SIM_I32MUL(a, b) (int32_t)((uint32_t)(a) * (uint32_t)(b))
#define SIM_I64ADD(a, b) (int64_t)((uint64_t)(a) + (uint64_t)(b))
#define SIM_I64MUL(a, b) (int64_t)((uint64_t)(a) * (uint64_t)(b))
#define SIM_U8ADD(a, b) (uint8_t)((unsigned)(a) + (unsigned)(b))
#define SIM_U8MUL(a, b) (uint8_t)((unsigned)(a) * (unsigned)(b))
#define SIM_I32DIV(a, n) (int32_t)((a) / (int32_t)(n))
#define SIM_I64DIV(a, n) (int64_t)((a) / (int64_t)(n))
#define SIM_U8DIV(a, n) (uint8_t)((unsigned)(a) / (unsigned)(n))

SIM_DEFINE_REDUCER(reduce_f32, float, float, SIM_ID, SIM_ID, SIM_FADD, SIM_FMUL, SIM_FDIV32)
SIM_DEFINE_REDUCER(reduce_f64, double, double, SIM_ID, SIM_ID, SIM_FADD, SIM_FMUL, SIM_FDIV64)
SIM_DEFINE_REDUCER(reduce_bf16, uint16_t, float, bf16_to_f32, f32_to_bf16, SIM_FADD, SIM_FMUL,
                   SIM_FDIV32)
SIM_DEFINE_REDUCER(reduce_i32, int32_t, int32_t, SIM_ID, SIM_ID, SIM_I32ADD, SIM_I32MUL, SIM_I32DIV)
SIM_DEFINE_REDUCER(reduce_i64, int64_t, int64_t, SIM_ID, SIM_ID, SIM_I64ADD, SIM_I64MUL, SIM_I64DIV)
SIM_DEFINE_REDUCER(reduce_u8, uint8_t, uint8_t, SIM_ID, SIM_ID, SIM_U8ADD, SIM_U8MUL, SIM_U8DIV)

void dopt__sim_reduce(const dopt_sim_memops *mem, dopt_dtype dt, dopt_redop op, void *out,
                      const void *const *srcs, int n, int start, size_t off, size_t count) {
  if (mem) {
    if (count != 0)
      mem->reduce(mem->ctx, dt, op, out, srcs, n, start, off, count);
    return;
  }
  switch (dt) {
  case DOPT_F32: reduce_f32(op, out, srcs, n, start, off, count); break;
  case DOPT_F64: reduce_f64(op, out, srcs, n, start, off, count); break;
  case DOPT_BF16: reduce_bf16(op, out, srcs, n, start, off, count); break;
  case DOPT_I32: reduce_i32(op, out, srcs, n, start, off, count); break;
  case DOPT_I64: reduce_i64(op, out, srcs, n, start, off, count); break;
  case DOPT_U8: reduce_u8(op, out, srcs, n, start, off, count); break;
  default: break; /* validated by the caller */
  }
}

void dopt__sim_flip_bit(const dopt_sim_memops *mem, void *buf, size_t count, dopt_dtype dt,
                        uint64_t elem, uint32_t bit) {
  if (mem) {
    if (count != 0)
      mem->flip_bit(mem->ctx, buf, count, dt, elem, bit);
    return;
  }
  size_t esz = dopt_dtype_size(dt);
  if (count == 0 || esz == 0)
    return;
  size_t b = (size_t)(bit % (uint32_t)(esz * 8u));
  size_t byte = (size_t)(elem % count) * esz + b / 8u;
  unsigned char *p = (unsigned char *)buf + byte;
  *p = (unsigned char)(*p ^ (1u << (b % 8u)));
}

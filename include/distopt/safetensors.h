/* distopt — safetensors files (https://github.com/huggingface/safetensors format):
 * 8-byte little-endian header length N, N bytes of JSON header
 * {"name": {"dtype": "F32", "shape": [..], "data_offsets": [b, e]}, "__metadata__": {..}},
 * then the data buffer. Reading validates everything (offsets inside the
 * buffer, sizes matching dtype x shape, no overlaps); writing is atomic
 * (a temporary file renamed into place), so a failed write leaves no file. */
#ifndef DISTOPT_SAFETENSORS_H
#define DISTOPT_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "distopt/optim.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct dopt_st_file dopt_st_file;

typedef struct dopt_st_tensor {
  const char *name;
  dopt_dtype dtype;
  int ndim;
  int64_t shape[DOPT_MAX_DIMS];
  size_t numel;
  const void *data; /* inside the file buffer; may be unaligned: copy with memcpy (NULL: dopt_st_open) */
  size_t bytes;
} dopt_st_tensor;

DOPT_API dopt_status dopt_st_load(const char *path, dopt_st_file **out);
/* As dopt_st_load, but only the header is read (and validated the same way): the data stay in the file,
 * the tensors' data pointers are NULL, and dopt_st_read_f32 reads a tensor's bytes from the file when
 * asked (from any thread), so a file larger than memory can be read tensor by tensor. The file stays open
 * until dopt_st_free; a file that shrinks meanwhile is DOPT_ERR_IO at the read. */
DOPT_API dopt_status dopt_st_open(const char *path, dopt_st_file **out);
DOPT_API void dopt_st_free(dopt_st_file *f);
DOPT_API int dopt_st_count(const dopt_st_file *f);
DOPT_API dopt_status dopt_st_get(const dopt_st_file *f, int index, dopt_st_tensor *out);
/* DOPT_ERR_NOT_FOUND (message names the tensor and file) if absent. */
DOPT_API dopt_status dopt_st_find(const dopt_st_file *f, const char *name, dopt_st_tensor *out);
/* Metadata value, or NULL. */
DOPT_API const char *dopt_st_meta(const dopt_st_file *f, const char *key);
/* Copies an F32 tensor of exactly n elements into dst (errors name the tensor). */
DOPT_API dopt_status dopt_st_read_f32(const dopt_st_file *f, const char *name, float *dst, size_t n);
/* Of an F32 tensor of b·h·w elements seen as [b, h, w] (row-major), the rows [h0, h0 + hl) x columns
 * [w0, w0 + wl) of every leading index into dst [b, hl, wl]: a tensor-parallel block, read alone from a
 * streamed file (one read per leading index for whole rows, else one per row). */
DOPT_API dopt_status dopt_st_read_f32_block(const dopt_st_file *f, const char *name, size_t b, size_t h, size_t w,
                                            size_t h0, size_t hl, size_t w0, size_t wl, float *dst);

typedef struct dopt_st_writer dopt_st_writer;

DOPT_API dopt_status dopt_st_writer_create(dopt_st_writer **out);
DOPT_API void dopt_st_writer_free(dopt_st_writer *w);
/* Copies the data. Names must be unique and not "__metadata__". */
DOPT_API dopt_status dopt_st_writer_add(dopt_st_writer *w, const char *name, dopt_dtype dtype, int ndim,
                                        const int64_t *shape, const void *data);
DOPT_API dopt_status dopt_st_writer_meta(dopt_st_writer *w, const char *key, const char *value);
DOPT_API dopt_status dopt_st_writer_save(dopt_st_writer *w, const char *path);

#ifdef __cplusplus
}
#endif
#endif

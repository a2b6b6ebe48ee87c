/* Symbol visibility: the library is built with hidden visibility; only
 * DOPT_API symbols are exported. */
#ifndef DISTOPT_EXPORT_H
#define DISTOPT_EXPORT_H
#if defined(_WIN32)
#define DOPT_API
#elif defined(__GNUC__) && defined(DOPT_BUILDING_LIBRARY)
#define DOPT_API __attribute__((visibility("default")))
#else
#define DOPT_API
#endif
#endif

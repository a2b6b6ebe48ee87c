# FindUnistring: GNU libunistring (Debian: libunistring-dev), which has no CMake or pkg-config file of its own.
# Defines Unistring_FOUND, Unistring_INCLUDE_DIR, Unistring_LIBRARY and the imported target Unistring::Unistring.
# distopt uses it to classify what it echoes (core/escape.c): UTF-8 decoding and Unicode general categories.
find_path(Unistring_INCLUDE_DIR NAMES unistr.h unictype.h)
find_library(Unistring_LIBRARY NAMES unistring)
include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(Unistring REQUIRED_VARS Unistring_LIBRARY Unistring_INCLUDE_DIR)
if(Unistring_FOUND AND NOT TARGET Unistring::Unistring)
  add_library(Unistring::Unistring UNKNOWN IMPORTED)
  set_target_properties(Unistring::Unistring PROPERTIES IMPORTED_LOCATION "${Unistring_LIBRARY}"
    INTERFACE_INCLUDE_DIRECTORIES "${Unistring_INCLUDE_DIR}")
endif()
mark_as_advanced(Unistring_INCLUDE_DIR Unistring_LIBRARY)

# Warning flags (probed) and the numerics policy shared by every C target.
include(CheckCCompilerFlag)
set(DOPT_WARNING_FLAGS "")
foreach(flag -Wall -Wextra -Wpedantic -Wshadow -Wconversion -Wstrict-prototypes
             -Wmissing-prototypes -Wvla -Wformat=2)
  string(MAKE_C_IDENTIFIER "HAVE${flag}" var)
  check_c_compiler_flag(${flag} ${var})
  if(${var})
    list(APPEND DOPT_WARNING_FLAGS ${flag})
  endif()
endforeach()
if(DOPT_WERROR)
  list(APPEND DOPT_WARNING_FLAGS -Werror)
endif()

# Numerics: bitwise equality between implementations is claimed, so no FMA
# contraction and never fast-math. Applied to every target, tests included.
set(DOPT_NUMERIC_FLAGS -ffp-contract=off -fno-fast-math)

function(dopt_target_defaults tgt)
  target_compile_options(${tgt} PRIVATE ${DOPT_WARNING_FLAGS} ${DOPT_NUMERIC_FLAGS})
endfunction()

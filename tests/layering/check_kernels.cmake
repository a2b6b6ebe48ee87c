# One source for element arithmetic (docs/cuda.md "One source"): every floating-point operation of the CUDA
# kernels is one of core/elem.h's (or core/grid.h's) functions, which use explicit round-to-nearest intrinsics
# on the device. Checked on the PTX: each kernel file is compiled with contraction ALLOWED (--fmad=true), where
# a plain C operator on floats compiles to an add/sub/mul/div without a rounding modifier or into an fma, and an
# intrinsic keeps its `.rn`. So every f32/f64 add, sub, mul, div, sqrt, rcp, rsqrt and fma must carry `.rn`,
# except a multiplication by an immediate power of two (exact: libdevice's frexp scales subnormals by 2^54),
# and no approximate instruction (ex2, lg2, sin, cos, tanh, `.approx`) may appear.
#   cmake -DNVCC=... -DROOT=<source dir> -DOUT=<dir for the PTX> [-DFILES="a.cu;b.cu"] [-DARCH=90] -P check_kernels.cmake
if(NOT FILES)
  file(GLOB FILES ${ROOT}/cuda/*.cu)
endif()
if(NOT ARCH)
  set(ARCH 90)
endif()
if(NOT OUT)
  message(FATAL_ERROR "check_kernels: OUT (the directory for the PTX files) is not set")
endif()
set(bad 0)
set(out_dir ${OUT})
file(MAKE_DIRECTORY ${out_dir})
foreach(f ${FILES})
  get_filename_component(name ${f} NAME_WE)
  set(ptx ${out_dir}/${name}.ptx)
  execute_process(COMMAND ${NVCC} -ptx -arch=compute_${ARCH} --fmad=true -std=c++17 -O3 -DDOPT_BUILDING_LIBRARY
                          -DDOPT_HAVE_CUDA -D_POSIX_C_SOURCE=200809L -I${ROOT}/include -I${ROOT}/core -I${ROOT}/ref -I${ROOT}/cuda
                          ${f} -o ${ptx}
                  RESULT_VARIABLE rc ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "check_kernels: nvcc -ptx ${f} failed: ${err}")
  endif()
  file(STRINGS ${ptx} lines)
  set(kernel "")
  set(n 0)
  foreach(l IN LISTS lines)
    if(l MATCHES "^\\.(visible )?\\.?(entry|func) +([A-Za-z0-9_]+)")
      set(kernel ${CMAKE_MATCH_3})
    endif()
    if(l MATCHES "^[ \t]+((add|sub|mul|div|sqrt|rcp|rsqrt|fma)(\\.[a-z0-9]+)*\\.f(32|64))[ \t]+([^;]*)")
      set(ins ${CMAKE_MATCH_1})
      set(ops ${CMAKE_MATCH_5})
      if(NOT ins MATCHES "\\.rn(\\.|$)" OR ins MATCHES "^fma")
        # an immediate power of two: an f64 with its 52 mantissa bits zero, an f32 with its 23
        if(NOT (ins MATCHES "^mul\\.f(32|64)$" AND (ops MATCHES ", 0[dD][0-9a-fA-F][0-9a-fA-F][0-9a-fA-F]0000000000000$"
                                                     OR ops MATCHES ", 0[fF][0-9a-fA-F][0-9a-fA-F][08]00000$")))
          math(EXPR n "${n} + 1")
          string(STRIP "${l}" l)
          message("${name}.cu: ${kernel}: '${l}' (a float operation outside core/elem.h: use its functions)")
        endif()
      endif()
    elseif(l MATCHES "^[ \t]+((ex2|lg2|sin|cos|tanh)[.a-z0-9]*|[a-z0-9.]*\\.approx[.a-z0-9]*)[ \t]")
      math(EXPR n "${n} + 1")
      string(STRIP "${l}" l)
      message("${name}.cu: ${kernel}: '${l}' (an approximate instruction)")
    endif()
  endforeach()
  math(EXPR bad "${bad} + ${n}")
endforeach()
list(LENGTH FILES nfiles)
if(bad GREATER 0)
  message(FATAL_ERROR "check_kernels: ${bad} float operation(s) in ${nfiles} kernel file(s) outside the shared headers")
endif()
message("check_kernels: ${nfiles} kernel file(s), every float operation explicit round-to-nearest (core/elem.h, core/grid.h)")

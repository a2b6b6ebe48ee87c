# cmake -DDUMP=<galore_dump> -DOUT=<dir> -P threads.cmake
# galore_adamw's results must not depend on the OpenBLAS thread count.
foreach(t 1 2)
  execute_process(COMMAND ${CMAKE_COMMAND} -E env OPENBLAS_NUM_THREADS=${t} ${DUMP} ${OUT}/galore_threads_${t}.bin
                  RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "galore_dump with OPENBLAS_NUM_THREADS=${t} failed: ${rc}")
  endif()
endforeach()
file(SHA256 ${OUT}/galore_threads_1.bin h1)
file(SHA256 ${OUT}/galore_threads_2.bin h2)
file(SIZE ${OUT}/galore_threads_1.bin size)
if(NOT h1 STREQUAL h2)
  message(FATAL_ERROR "galore results differ between 1 and 2 OpenBLAS threads: ${h1} vs ${h2}")
endif()
message(STATUS "1 vs 2 OpenBLAS threads: ${size} bytes identical (sha256 ${h1})")

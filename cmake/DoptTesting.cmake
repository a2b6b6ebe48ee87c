# dopt_add_test(NAME SOURCES a.c b.c LABELS unit|sim|gpu [TIMEOUT s] [ARGS ...])
# One cmocka executable per test file, linked to the library and the test
# helpers. Every test gets a CTest TIMEOUT (default 60 s) so a hang fails CI
# instead of stalling it; DOPT_TIMEOUT_SCALE stretches them (sanitizer runs).
set(DOPT_TIMEOUT_SCALE 1 CACHE STRING "Multiplier for CTest timeouts")
function(dopt_add_test name)
  cmake_parse_arguments(T "" "TIMEOUT" "SOURCES;LABELS;ARGS" ${ARGN})
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 60)
  endif()
  math(EXPR _to "${T_TIMEOUT} * ${DOPT_TIMEOUT_SCALE}")
  add_executable(${name} ${T_SOURCES})
  dopt_target_defaults(${name})
  target_link_libraries(${name} PRIVATE distopt dopt_testutil)
  # exported symbols let the checking device name the library function at a call site (dladdr)
  set_target_properties(${name} PROPERTIES ENABLE_EXPORTS ON)
  add_test(NAME ${name} COMMAND ${name} ${T_ARGS})
  set_tests_properties(${name} PROPERTIES TIMEOUT ${_to} LABELS "${T_LABELS}"
    SKIP_RETURN_CODE 77
    ENVIRONMENT "OPENBLAS_NUM_THREADS=1;DOPT_SOURCE_DIR=${PROJECT_SOURCE_DIR}")
endfunction()

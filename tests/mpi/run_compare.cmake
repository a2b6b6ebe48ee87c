# One `distopt compare --backend mpi` under mpirun (tests/mpi/CMakeLists.txt):
#   cmake -DRUN=mpirun|...|-np|N -DDISTOPT=<distopt> -DARGS=a|b|... -P run_compare.cmake
# Passes only when the job exits 0 and rank 0 printed the bitwise verdict.
string(REPLACE "|" ";" run "${RUN}")
string(REPLACE "|" ";" args "${ARGS}")
execute_process(COMMAND ${run} ${DISTOPT} compare --backend mpi --quiet ${args}
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
message("${out}${err}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "mpi compare: exit code ${rc} (want 0)")
endif()
if(NOT out MATCHES "verdict: EQUIVALENT \\(bitwise")
  message(FATAL_ERROR "mpi compare: no bitwise verdict in the output")
endif()
string(REGEX MATCHALL "verdict:" verdicts "${out}")
list(LENGTH verdicts nv)
if(NOT nv EQUAL 1)
  message(FATAL_ERROR "mpi compare: ${nv} verdicts printed (want 1: only rank 0 reports)")
endif()

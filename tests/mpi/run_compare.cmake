# One `distopt compare --backend mpi` under mpirun (tests/mpi/CMakeLists.txt):
#   cmake -DRUN=mpirun|...|-np|N -DDISTOPT=<distopt> -DARGS=a|b|... [-DSIM=1] -P run_compare.cmake
# Passes only when the job exits 0 and rank 0 printed the bitwise verdict; with SIM=1 also the same layout on
# the simulator must print the same digest line (the MPI run computed the simulator's bits).
# @DIR@ in ARGS: a fresh folder under WORK, one for the MPI run and one for the simulator's
string(REPLACE "|" ";" run "${RUN}")
string(REPLACE "|" ";" args_in "${ARGS}")
if(WORK)
  file(REMOVE_RECURSE "${WORK}")
  file(MAKE_DIRECTORY "${WORK}")
endif()
string(REPLACE "@DIR@" "${WORK}/mpi" args "${args_in}")
string(REPLACE "@DIR@" "${WORK}/sim" sim_args "${args_in}")
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
if(SIM)
  string(REGEX MATCH "digest sha256:[0-9a-f]+" mpi_digest "${out}")
  execute_process(COMMAND ${DISTOPT} compare --quiet ${sim_args} RESULT_VARIABLE src OUTPUT_VARIABLE sout
                  ERROR_VARIABLE serr)
  string(REGEX MATCH "digest sha256:[0-9a-f]+" sim_digest "${sout}")
  if(NOT src EQUAL 0 OR sim_digest STREQUAL "" OR mpi_digest STREQUAL "")
    message(FATAL_ERROR "mpi compare: the simulator run exited ${src} or a digest is missing (mpi '${mpi_digest}', "
                        "sim '${sim_digest}')\n${sout}${serr}")
  endif()
  if(NOT mpi_digest STREQUAL sim_digest)
    message(FATAL_ERROR "mpi compare: ${mpi_digest} under MPI, ${sim_digest} on the simulator")
  endif()
  message("mpi compare: the simulator's digest, ${sim_digest}")
endif()

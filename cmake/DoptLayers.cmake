# The library is built in layers, one OBJECT library per folder
# (docs/architecture.md):  core  <-  ref, distributed, sim  <-  cuda  <-  the tools (verify, compare, cli)
# Each layer sees the public headers, core/'s internal headers and its own
# folder. The `distopt` library (and `distopt_shared`) is the union of their objects. Link probes
# (dopt_link_probe) link each layer with only the layers below it into an
# executable, so the linker rejects a call upward (e.g. core/ calling an
# optimizer of ref/, or distributed/ calling the simulator).

# dopt_layer(NAME sources...)
function(dopt_layer name)
  add_library(${name} OBJECT ${ARGN})
  target_include_directories(${name} PRIVATE ${PROJECT_SOURCE_DIR}/include ${PROJECT_SOURCE_DIR}/core
    ${CMAKE_CURRENT_SOURCE_DIR} ${CJSON_INCLUDE_DIRS})
  target_compile_definitions(${name} PRIVATE DOPT_BUILDING_LIBRARY _POSIX_C_SOURCE=200809L)
  target_link_libraries(${name} PRIVATE PkgConfig::LAPACKE PkgConfig::OPENBLAS Unistring::Unistring Threads::Threads)
  dopt_target_defaults(${name})
  target_sources(distopt PRIVATE $<TARGET_OBJECTS:${name}>)
  if(TARGET distopt_shared)
    target_sources(distopt_shared PRIVATE $<TARGET_OBJECTS:${name}>)
  endif()
endfunction()

# dopt_link_probe(NAME LAYERS...): an executable of exactly these layers'
# objects and the external libraries; fails to link if any of them calls a
# layer that is not listed.
function(dopt_link_probe name)
  set(_objs "")
  foreach(l ${ARGN})
    list(APPEND _objs $<TARGET_OBJECTS:${l}>)
  endforeach()
  add_executable(dopt_link_probe_${name} ${PROJECT_SOURCE_DIR}/tests/layering/probe.c ${_objs})
  target_link_libraries(dopt_link_probe_${name} PRIVATE PkgConfig::LAPACKE PkgConfig::OPENBLAS ${CJSON_LIBRARIES}
    OpenSSL::Crypto Unistring::Unistring Threads::Threads ${MATH_LIBRARY})
  dopt_target_defaults(dopt_link_probe_${name})
endfunction()

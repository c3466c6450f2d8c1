# CuTe DSL kernels compiled ahead of time (kernels/cutedsl/build_aot.py, reference/cutedsl_aot.md).
#
# Included by the root CMakeLists.txt after CUDA is enabled and Python is found. Runs the DSL at
# build time with the build environment's Python (nvidia-cutlass-dsl is a build requirement) and
# provides, for the extension target:
#   MOONEP_CUTEDSL_OBJECTS      the exported objects (x86-64 ELF embedding sm_90a cubins) and the
#                               generated headers, to add with target_sources (the headers make
#                               every compile of the target wait for the export)
#   MOONEP_CUTEDSL_INCLUDE_DIR  where the generated <prefix>.h headers are
#   MOONEP_CUTEDSL_LINK_LIBS    the DSL's static CUDA dialect runtime (its `_cuda*` shims) plus the
#                               system libraries that static cudart needs; at run time only the
#                               driver (libcuda.so.1) is needed.

set(MOONEP_CUTEDSL_ARCH "sm_90a" CACHE STRING "GPU architecture of the CuTe DSL kernels")
set(_moonep_cutedsl_dir "${CMAKE_SOURCE_DIR}/kernels/cutedsl")
set(MOONEP_CUTEDSL_INCLUDE_DIR "${CMAKE_BINARY_DIR}/cutedsl")

execute_process(
  COMMAND "${Python_EXECUTABLE}" -m cutlass.cute.export.aot_config --libdir
  OUTPUT_VARIABLE _moonep_cutedsl_libdir OUTPUT_STRIP_TRAILING_WHITESPACE
  ERROR_VARIABLE _moonep_cutedsl_error RESULT_VARIABLE _moonep_cutedsl_result)
if(NOT _moonep_cutedsl_result EQUAL 0)
  message(FATAL_ERROR
    "moonep_jax: the CUDA build needs the CuTe DSL (pip package nvidia-cutlass-dsl[cu13]==4.8.1) "
    "importable by ${Python_EXECUTABLE} to compile the grouped GEMM ahead of time; it is not:\n"
    "${_moonep_cutedsl_error}\n"
    "Install it into the build environment, or configure with -DMOONEP_ENABLE_CUDA=OFF.")
endif()
set(_moonep_cutedsl_runtime "${_moonep_cutedsl_libdir}/libcuda_dialect_runtime_static.a")
if(NOT EXISTS "${_moonep_cutedsl_runtime}")
  message(FATAL_ERROR
    "moonep_jax: ${_moonep_cutedsl_runtime} is missing; reinstall nvidia-cutlass-dsl[cu13]==4.8.1.")
endif()
message(STATUS "moonep_jax: CuTe DSL runtime ${_moonep_cutedsl_runtime}")

# One <prefix>.{h,o} pair per exported kernel; the list matches build_aot.py's EXPORTS.
set(MOONEP_CUTEDSL_PREFIXES
    moonep_grouped_matmul moonep_grouped_matmul_dx moonep_grouped_matmul_dw)

set(MOONEP_CUTEDSL_OBJECTS "")
set(_moonep_cutedsl_outputs "")
foreach(_prefix IN LISTS MOONEP_CUTEDSL_PREFIXES)
  list(APPEND MOONEP_CUTEDSL_OBJECTS "${MOONEP_CUTEDSL_INCLUDE_DIR}/${_prefix}.o")
  list(APPEND _moonep_cutedsl_outputs
       "${MOONEP_CUTEDSL_INCLUDE_DIR}/${_prefix}.o" "${MOONEP_CUTEDSL_INCLUDE_DIR}/${_prefix}.h")
endforeach()

# A tuning variant's constants (build_aot.py --override; tools/gpu.sh build-variant), empty for
# the committed build. Their file changes with them, so the kernels are rebuilt both ways.
set(MOONEP_CUTEDSL_OVERRIDES "" CACHE STRING
    "NAME=VALUE;... integer constants of the CuTe DSL kernels to override (tuning variants only)")
set(_moonep_cutedsl_override_args "")
foreach(_override IN LISTS MOONEP_CUTEDSL_OVERRIDES)
  list(APPEND _moonep_cutedsl_override_args --override "${_override}")
endforeach()
set(_moonep_cutedsl_overrides_file "${MOONEP_CUTEDSL_INCLUDE_DIR}/overrides.txt")
file(CONFIGURE OUTPUT "${_moonep_cutedsl_overrides_file}" CONTENT "${MOONEP_CUTEDSL_OVERRIDES}\n")

file(GLOB _moonep_cutedsl_sources CONFIGURE_DEPENDS "${_moonep_cutedsl_dir}/*.py")
add_custom_command(
  OUTPUT ${_moonep_cutedsl_outputs}
  COMMAND "${Python_EXECUTABLE}" "${_moonep_cutedsl_dir}/build_aot.py"
          --out "${MOONEP_CUTEDSL_INCLUDE_DIR}" --arch "${MOONEP_CUTEDSL_ARCH}"
          ${_moonep_cutedsl_override_args}
  DEPENDS ${_moonep_cutedsl_sources} "${_moonep_cutedsl_overrides_file}"
  COMMENT "CuTe DSL: compiling ${MOONEP_CUTEDSL_PREFIXES} ahead of time for ${MOONEP_CUTEDSL_ARCH}"
  VERBATIM)
set_source_files_properties(${MOONEP_CUTEDSL_OBJECTS} PROPERTIES EXTERNAL_OBJECT TRUE GENERATED TRUE)
set(MOONEP_CUTEDSL_OBJECTS ${_moonep_cutedsl_outputs})

find_package(Threads REQUIRED)
set(MOONEP_CUTEDSL_LINK_LIBS "${_moonep_cutedsl_runtime}" CUDA::cudart_static Threads::Threads
    ${CMAKE_DL_LIBS} rt)

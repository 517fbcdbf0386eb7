# Included before project(): refuses an unsupported CUDA toolkit in one line, before CMake's own
# compiler checks (which would fail later, and at length, on an old nvcc or an SM it does not know).
# The nvcc checked is the one the build then uses: it is handed to project() as CMAKE_CUDA_COMPILER.
# With ATTNMERGE_CUDA_CLANG the CUDA sources are compiled by clang instead
# (cmake/attnmerge_clang_cuda.cmake), and the toolkit checked is the one in ATTNMERGE_CUDA_ROOT.
#
# Supported: CUDA 12.0 to 13.x (the kernels use cudaLaunchKernelEx and griddepcontrol, CUDA 12's);
# an SM needs the first toolkit that knows it (below).  ATTNMERGE_CUDA_FLAVOR=cu12 or cu13 narrows
# that to one major version: what a build named attnmerge-cu12 or attnmerge-cu13 must be.

# SM -> the first CUDA release that compiles it.
set(_attnmerge_sm_min_100 "12.8")
set(_attnmerge_sm_min_101 "12.8")
set(_attnmerge_sm_min_103 "12.9")
set(_attnmerge_sm_min_110 "13.0")
set(_attnmerge_sm_min_120 "12.8")
set(_attnmerge_sm_min_121 "12.9")

set(ATTNMERGE_CUDA_FLAVOR "" CACHE STRING "cu12 or cu13: accept only a CUDA 12.x or 13.x toolkit ('': 12.0 to 13.x)")
set(ATTNMERGE_CUDA_CLANG "" CACHE FILEPATH
    "clang++ to compile the CUDA sources with instead of nvcc, against the toolkit in ATTNMERGE_CUDA_ROOT")
set(ATTNMERGE_CUDA_ROOT "" CACHE STRING
    "with ATTNMERGE_CUDA_CLANG: the CUDA toolkit's root, or several roots merged (PyPI's nvidia/cuda_nvcc, ...)")
if(NOT ATTNMERGE_CUDA_FLAVOR MATCHES "^(|cu12|cu13)$")
  message(FATAL_ERROR " attnmerge: ATTNMERGE_CUDA_FLAVOR: expected cu12, cu13 or nothing, got '${ATTNMERGE_CUDA_FLAVOR}'")
endif()

# One line (a message that starts with a space is not re-wrapped by CMake), ending in the ways out.
function(_attnmerge_refuse_toolkit what)
  message(FATAL_ERROR " attnmerge: ${what}; use another with CUDACXX=/path/to/nvcc or "
                      "-DCMAKE_CUDA_COMPILER=/path/to/nvcc, or ATTNMERGE_CUDA_FROM_PYPI=1 for CUDA 13 from PyPI "
                      "(ATTNMERGE_CUDA_FLAVOR=cu12 for CUDA 12 from PyPI, compiled by clang)")
endfunction()

# The version `release` (major.minor) of the toolkit `what`: in the range, the flavor, and new
# enough for every SM of the list.
function(_attnmerge_check_release release what)
  if(release VERSION_LESS 12.0 OR release VERSION_GREATER_EQUAL 14.0)
    _attnmerge_refuse_toolkit("CUDA ${release} (${what}) is not supported (CUDA 12.0 to 13.x are)")
  endif()
  string(REGEX MATCH "^[0-9]+" _major "${release}")
  if(ATTNMERGE_CUDA_FLAVOR AND NOT ATTNMERGE_CUDA_FLAVOR STREQUAL "cu${_major}")
    string(SUBSTRING "${ATTNMERGE_CUDA_FLAVOR}" 2 -1 _wanted)
    _attnmerge_refuse_toolkit("CUDA ${release} (${what}) is not supported by ATTNMERGE_CUDA_FLAVOR=${ATTNMERGE_CUDA_FLAVOR} \
(CUDA ${_wanted}.x is)")
  endif()
  foreach(_arch IN LISTS CMAKE_CUDA_ARCHITECTURES)
    string(REGEX REPLACE "[^0-9].*$" "" _sm "${_arch}")
    if(DEFINED _attnmerge_sm_min_${_sm} AND release VERSION_LESS _attnmerge_sm_min_${_sm})
      _attnmerge_refuse_toolkit("CUDA ${release} (${what}) cannot compile sm_${_sm} (CUDA \
${_attnmerge_sm_min_${_sm}} or newer can; ATTNMERGE_CUDA_ARCHITECTURES=... drops it)")
    endif()
  endforeach()
endfunction()

if(ATTNMERGE_CUDA_CLANG)
  include("${CMAKE_CURRENT_LIST_DIR}/attnmerge_clang_cuda.cmake")
  attnmerge_clang_cuda_check()
  return()
endif()

set(_attnmerge_nvcc "")
if(DEFINED CMAKE_CUDA_COMPILER AND NOT CMAKE_CUDA_COMPILER STREQUAL "")
  set(_attnmerge_nvcc "${CMAKE_CUDA_COMPILER}")
elseif(NOT "$ENV{CUDACXX}" STREQUAL "")
  set(_attnmerge_nvcc "$ENV{CUDACXX}")
else()
  # As CMake would search: PATH first, then the usual toolkit roots.
  find_program(_attnmerge_found_nvcc nvcc HINTS "$ENV{CUDA_HOME}/bin" "$ENV{CUDA_PATH}/bin" "/usr/local/cuda/bin"
               NO_CACHE)
  if(_attnmerge_found_nvcc)
    set(_attnmerge_nvcc "${_attnmerge_found_nvcc}")
  endif()
endif()

if(NOT _attnmerge_nvcc STREQUAL "")
  if(NOT IS_ABSOLUTE "${_attnmerge_nvcc}")
    find_program(_attnmerge_nvcc_path "${_attnmerge_nvcc}" NO_CACHE)
    if(_attnmerge_nvcc_path)
      set(_attnmerge_nvcc "${_attnmerge_nvcc_path}")
    endif()
  endif()
  execute_process(COMMAND "${_attnmerge_nvcc}" --version OUTPUT_VARIABLE _attnmerge_nvcc_out
                  ERROR_VARIABLE _attnmerge_nvcc_err RESULT_VARIABLE _attnmerge_nvcc_rc)
  if(NOT _attnmerge_nvcc_rc EQUAL 0)
    _attnmerge_refuse_toolkit("the CUDA compiler ${_attnmerge_nvcc} does not run (${_attnmerge_nvcc_rc})")
  endif()
  if(_attnmerge_nvcc_out MATCHES "Cuda compilation tools, release ([0-9]+\\.[0-9]+)")
    _attnmerge_check_release("${CMAKE_MATCH_1}" "${_attnmerge_nvcc}")
    set(CMAKE_CUDA_COMPILER "${_attnmerge_nvcc}" CACHE FILEPATH "CUDA compiler (checked by attnmerge)")
  endif()
endif()

# Included before project(): refuses an unsupported CUDA toolkit in one line, before CMake's own
# compiler checks (which would fail later, and at length, on an old nvcc or an SM it does not know).
# The nvcc checked is the one the build then uses: it is handed to project() as CMAKE_CUDA_COMPILER.
#
# Supported: CUDA 12.0 to 13.x (the kernels use cudaLaunchKernelEx and griddepcontrol, CUDA 12's);
# an SM needs the first toolkit that knows it (below).  Other CUDA compilers (clang) are not checked.

# SM -> the first CUDA release that compiles it.
set(_attnmerge_sm_min_100 "12.8")
set(_attnmerge_sm_min_101 "12.8")
set(_attnmerge_sm_min_103 "12.9")
set(_attnmerge_sm_min_110 "13.0")
set(_attnmerge_sm_min_120 "12.8")
set(_attnmerge_sm_min_121 "12.9")

# One line (a message that starts with a space is not re-wrapped by CMake), ending in the ways out.
function(_attnmerge_refuse_toolkit what)
  message(FATAL_ERROR " attnmerge: ${what}; use another with CUDACXX=/path/to/nvcc or "
                      "-DCMAKE_CUDA_COMPILER=/path/to/nvcc, or ATTNMERGE_CUDA_FROM_PYPI=1 for CUDA 13 from PyPI")
endfunction()

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
    set(_attnmerge_cuda "${CMAKE_MATCH_1}")
    if(_attnmerge_cuda VERSION_LESS 12.0 OR _attnmerge_cuda VERSION_GREATER_EQUAL 14.0)
      _attnmerge_refuse_toolkit("CUDA ${_attnmerge_cuda} (${_attnmerge_nvcc}) is not supported (CUDA 12.0 to 13.x are)")
    endif()
    foreach(_arch IN LISTS CMAKE_CUDA_ARCHITECTURES)
      string(REGEX REPLACE "[^0-9].*$" "" _sm "${_arch}")
      if(DEFINED _attnmerge_sm_min_${_sm} AND _attnmerge_cuda VERSION_LESS _attnmerge_sm_min_${_sm})
        _attnmerge_refuse_toolkit("CUDA ${_attnmerge_cuda} (${_attnmerge_nvcc}) cannot compile sm_${_sm} (CUDA \
${_attnmerge_sm_min_${_sm}} or newer can; ATTNMERGE_CUDA_ARCHITECTURES=... drops it)")
      endif()
    endforeach()
    set(CMAKE_CUDA_COMPILER "${_attnmerge_nvcc}" CACHE FILEPATH "CUDA compiler (checked by attnmerge)")
  endif()
endif()

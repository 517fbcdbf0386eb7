# The CUDA sources compiled by clang instead of nvcc (ATTNMERGE_CUDA_CLANG): the way to a CUDA 12
# build where there is no CUDA 12 nvcc, as on PyPI, which has CUDA 12's headers, ptxas, libdevice,
# libcudart_static and nvFatbin but no nvcc.  For each .cu file:
#   clang --cuda-device-only   PTX for each SM (clang's PTX; see ATTNMERGE_CLANG_PTX_MAX_SM)
#   the toolkit's ptxas        SASS for each real SM
#   the toolkit's nvFatbin     one fatbinary: the SASS images and the PTX of the virtual SM
#   clang --cuda-host-only     the host object, the fatbinary embedded and registered with cudart
# Every device-side tool is the toolkit's own, so the cubins carry that CUDA's ELF ABI, and the
# library loads on the drivers that toolkit's nvcc would have built for.
#
# ATTNMERGE_CUDA_ROOT is one toolkit root of the usual layout, or several roots merged (PyPI's
# site-packages/nvidia/{cuda_nvcc,cuda_runtime,cuda_cccl,nvfatbin}); clang sees them as one
# toolkit, a tree of links in the build folder (attnmerge-cuda-root).

# The kernels branch on nothing newer than sm_90 (PDL's griddepcontrol), so sm_90's PTX is what
# the newer SMs' SASS is assembled from; clang 19 knows no newer SM, and one rule keeps the build
# the same whatever clang compiles it.
set(ATTNMERGE_CLANG_PTX_MAX_SM 90)
set(_attnmerge_clang_min "19")  # the oldest clang this route is tested with

# The SM whose PTX the clang route compiles for `sm`: min(sm, ATTNMERGE_CLANG_PTX_MAX_SM).
function(_attnmerge_clang_ptx_sm out sm)
  if(sm GREATER ATTNMERGE_CLANG_PTX_MAX_SM)
    set(sm "${ATTNMERGE_CLANG_PTX_MAX_SM}")
  endif()
  set(${out} "${sm}" PARENT_SCOPE)
endfunction()

# The virtual SMs whose PTX the fatbinaries embed, for a list of requested ones (`archs`).
function(attnmerge_clang_ptx_archs out archs)
  set(_ptx "")
  foreach(_sm IN LISTS archs)
    _attnmerge_clang_ptx_sm(_p "${_sm}")
    list(APPEND _ptx "${_p}")
  endforeach()
  list(REMOVE_DUPLICATES _ptx)
  set(${out} "${_ptx}" PARENT_SCOPE)
endfunction()

# Links in `dst` to every entry of `src`, merging folders that several roots share.
function(_attnmerge_link_tree src dst)
  file(MAKE_DIRECTORY "${dst}")
  file(GLOB _entries RELATIVE "${src}" "${src}/*")
  foreach(_e IN LISTS _entries)
    if(_e MATCHES "^(__init__\\.py|__pycache__)$")  # the wheels' Python packaging
      continue()
    endif()
    if(IS_DIRECTORY "${src}/${_e}" AND IS_DIRECTORY "${dst}/${_e}")
      if(IS_SYMLINK "${dst}/${_e}")  # a second root has this folder too: merge the two
        file(REAL_PATH "${dst}/${_e}" _first)
        file(REMOVE "${dst}/${_e}")
        _attnmerge_link_tree("${_first}" "${dst}/${_e}")
      endif()
      _attnmerge_link_tree("${src}/${_e}" "${dst}/${_e}")
    elseif(NOT EXISTS "${dst}/${_e}")
      file(CREATE_LINK "${src}/${_e}" "${dst}/${_e}" SYMBOLIC)
    endif()
  endforeach()
endfunction()

# The first of `names` under `suffixes` of the roots, or "".
function(_attnmerge_find_in_roots out suffixes names)
  foreach(_root IN LISTS ATTNMERGE_CUDA_ROOT)
    foreach(_s IN LISTS suffixes)
      foreach(_n IN LISTS names)
        file(GLOB _hits "${_root}/${_s}/${_n}")
        if(_hits)
          list(GET _hits 0 _hit)
          set(${out} "${_hit}" PARENT_SCOPE)
          return()
        endif()
      endforeach()
    endforeach()
  endforeach()
  set(${out} "" PARENT_SCOPE)
endfunction()

# Before project(): clang, the toolkit and its version checked (attnmerge_cuda_check.cmake's
# rules), the merged toolkit laid out.  Sets ATTNMERGE_CUDA_VERSION and ATTNMERGE_CLANG_*.
function(attnmerge_clang_cuda_check)
  execute_process(COMMAND "${ATTNMERGE_CUDA_CLANG}" --version OUTPUT_VARIABLE _out ERROR_VARIABLE _err
                  RESULT_VARIABLE _rc)
  if(NOT _rc EQUAL 0 OR NOT _out MATCHES "clang version ([0-9]+)\\.([0-9]+)")
    _attnmerge_refuse_toolkit("ATTNMERGE_CUDA_CLANG=${ATTNMERGE_CUDA_CLANG} is not a clang that runs")
  endif()
  if(CMAKE_MATCH_1 LESS _attnmerge_clang_min)
    _attnmerge_refuse_toolkit("clang ${CMAKE_MATCH_1}.${CMAKE_MATCH_2} (${ATTNMERGE_CUDA_CLANG}) is too old to compile \
the CUDA sources (clang ${_attnmerge_clang_min} or newer is)")
  endif()
  if(NOT ATTNMERGE_CUDA_ROOT)
    _attnmerge_refuse_toolkit("ATTNMERGE_CUDA_CLANG needs the CUDA toolkit's root in ATTNMERGE_CUDA_ROOT")
  endif()

  _attnmerge_find_in_roots(_cuda_h "include" "cuda.h")
  _attnmerge_find_in_roots(_ptxas "bin" "ptxas")
  _attnmerge_find_in_roots(_libdevice "nvvm/libdevice" "libdevice.10.bc")
  _attnmerge_find_in_roots(_cudart "lib64;lib" "libcudart_static.a")
  _attnmerge_find_in_roots(_nvfatbin "lib64;lib" "libnvfatbin.so;libnvfatbin.so.[0-9]*")
  foreach(_need IN ITEMS "_cuda_h:include/cuda.h" "_ptxas:bin/ptxas" "_libdevice:nvvm/libdevice/libdevice.10.bc"
                         "_cudart:lib/libcudart_static.a" "_nvfatbin:lib/libnvfatbin.so")
    string(REPLACE ":" ";" _need "${_need}")
    list(GET _need 0 _var)
    list(GET _need 1 _what)
    if(NOT ${_var})
      _attnmerge_refuse_toolkit("ATTNMERGE_CUDA_ROOT (${ATTNMERGE_CUDA_ROOT}) has no ${_what}")
    endif()
  endforeach()

  # The headers' CUDA (cuda.h's CUDA_VERSION, 12090 for 12.9) is the build's; ptxas must be of the
  # same major version, or its cubins would carry another ABI than the runtime expects.
  file(STRINGS "${_cuda_h}" _line REGEX "^#define[ \t]+CUDA_VERSION[ \t]+[0-9]+")
  string(REGEX MATCH "[0-9]+$" _v "${_line}")
  math(EXPR _major "${_v} / 1000")
  math(EXPR _minor "${_v} % 1000 / 10")
  set(_release "${_major}.${_minor}")
  execute_process(COMMAND "${_ptxas}" --version OUTPUT_VARIABLE _out RESULT_VARIABLE _rc)
  if(NOT _rc EQUAL 0 OR NOT _out MATCHES "release ([0-9]+)\\.([0-9]+)")
    _attnmerge_refuse_toolkit("the toolkit's ptxas (${_ptxas}) does not run")
  endif()
  set(_ptxas_major "${CMAKE_MATCH_1}")
  set(_ptxas_release "${CMAKE_MATCH_1}.${CMAKE_MATCH_2}")
  _attnmerge_check_release("${_release}" "${_cuda_h}")
  _attnmerge_check_release("${_ptxas_release}" "${_ptxas}")
  if(NOT _ptxas_major EQUAL _major)
    _attnmerge_refuse_toolkit("ptxas of CUDA ${_ptxas_release} (${_ptxas}) and headers of CUDA ${_release} \
(${_cuda_h}) are not of one CUDA")
  endif()

  # clang's view of the toolkit: one root, with a stand-in for the one cuRAND header that clang's
  # CUDA wrapper includes (the library uses no cuRAND).
  set(_farm "${CMAKE_BINARY_DIR}/attnmerge-cuda-root")
  file(REMOVE_RECURSE "${_farm}")
  foreach(_root IN LISTS ATTNMERGE_CUDA_ROOT)
    foreach(_sub IN ITEMS include bin nvvm)
      if(IS_DIRECTORY "${_root}/${_sub}")
        _attnmerge_link_tree("${_root}/${_sub}" "${_farm}/${_sub}")
      endif()
    endforeach()
  endforeach()
  if(NOT EXISTS "${_farm}/include/curand_mtgp32_kernel.h")
    file(WRITE "${_farm}/include/curand_mtgp32_kernel.h"
         "/* attnmerge: a stand-in; clang's CUDA wrapper includes this cuRAND header, and attnmerge uses no cuRAND */\n")
  endif()

  set(ATTNMERGE_CUDA_VERSION "${_release}" PARENT_SCOPE)
  set(ATTNMERGE_CLANG_CUDA_ROOT "${_farm}" PARENT_SCOPE)
  set(ATTNMERGE_CLANG_PTXAS "${_ptxas}" PARENT_SCOPE)
  set(ATTNMERGE_CLANG_CUDART_STATIC "${_cudart}" PARENT_SCOPE)
  set(ATTNMERGE_CLANG_NVFATBIN "${_nvfatbin}" PARENT_SCOPE)
  message(STATUS "attnmerge: CUDA sources compiled by ${ATTNMERGE_CUDA_CLANG} against CUDA ${_release} "
                 "(ptxas ${_ptxas_release}: ${_ptxas})")
endfunction()

# After project(): cudart_static as a target, and what the fatbinary step runs on.
function(attnmerge_clang_cuda_toolkit)
  add_library(attnmerge_cudart_static STATIC IMPORTED GLOBAL)
  set_target_properties(attnmerge_cudart_static PROPERTIES
    IMPORTED_LOCATION "${ATTNMERGE_CLANG_CUDART_STATIC}"
    INTERFACE_LINK_LIBRARIES "Threads::Threads;${CMAKE_DL_LIBS};rt")
  find_package(Python3 REQUIRED COMPONENTS Interpreter)
  set(ATTNMERGE_CLANG_PYTHON "${Python3_EXECUTABLE}" PARENT_SCOPE)
endfunction()

# The host objects of the CUDA `SOURCES` (relative to the current source folder), compiled with
# `INCLUDE_DIRS` and `DEFINES`, into `out` (a list of .o files to add to a target's sources).
function(attnmerge_clang_cuda_objects out)
  cmake_parse_arguments(PARSE_ARGV 1 _a "" "" "SOURCES;INCLUDE_DIRS;DEFINES")
  set(_common -x cuda "--cuda-path=${ATTNMERGE_CLANG_CUDA_ROOT}" -std=c++17 -O3 -Wno-unknown-cuda-version)
  foreach(_dir IN LISTS _a_INCLUDE_DIRS)
    list(APPEND _common "-I${_dir}")
  endforeach()
  foreach(_def IN LISTS _a_DEFINES)
    list(APPEND _common "-D${_def}")
  endforeach()

  # Each SM's SASS comes from the PTX of min(SM, ATTNMERGE_CLANG_PTX_MAX_SM); the virtual SMs (the
  # entries without -real) also ship that PTX, for the driver to JIT on GPUs newer than the list.
  set(_real "${ATTNMERGE_CUDA_SASS_ARCHS}")
  set(_virtual "${ATTNMERGE_CUDA_PTX_ARCHS}")

  set(_objects "")
  foreach(_src IN LISTS _a_SOURCES)
    get_filename_component(_name "${_src}" NAME_WE)
    get_filename_component(_abs "${_src}" ABSOLUTE)
    set(_dir "${CMAKE_CURRENT_BINARY_DIR}/clang-cuda")
    file(MAKE_DIRECTORY "${_dir}")
    set(_images "")
    set(_image_files "")
    set(_ptx_done "")
    foreach(_sm IN LISTS _real _virtual)
      _attnmerge_clang_ptx_sm(_p "${_sm}")
      set(_ptx "${_dir}/${_name}.sm_${_p}.ptx")
      if(NOT _p IN_LIST _ptx_done)
        list(APPEND _ptx_done "${_p}")
        add_custom_command(OUTPUT "${_ptx}"
          COMMAND "${ATTNMERGE_CUDA_CLANG}" ${_common} --cuda-device-only "--cuda-gpu-arch=sm_${_p}" -S
                  -MD -MF "${_ptx}.d" -o "${_ptx}" "${_abs}"
          DEPENDS "${_abs}" DEPFILE "${_ptx}.d"
          COMMENT "clang: ${_src} -> PTX for sm_${_p}" VERBATIM)
      endif()
    endforeach()
    foreach(_sm IN LISTS _real)
      _attnmerge_clang_ptx_sm(_p "${_sm}")
      set(_cubin "${_dir}/${_name}.sm_${_sm}.cubin")
      add_custom_command(OUTPUT "${_cubin}"
        COMMAND "${ATTNMERGE_CLANG_PTXAS}" -O3 "-arch=sm_${_sm}" -o "${_cubin}" "${_dir}/${_name}.sm_${_p}.ptx"
        DEPENDS "${_dir}/${_name}.sm_${_p}.ptx"
        COMMENT "ptxas: ${_src} -> SASS for sm_${_sm}" VERBATIM)
      list(APPEND _images "sm_${_sm}=${_cubin}")
      list(APPEND _image_files "${_cubin}")
    endforeach()
    set(_ptx_added "")
    foreach(_sm IN LISTS _virtual)
      _attnmerge_clang_ptx_sm(_p "${_sm}")
      if(NOT _p IN_LIST _ptx_added)
        list(APPEND _ptx_added "${_p}")
        list(APPEND _images "compute_${_p}=${_dir}/${_name}.sm_${_p}.ptx")
        list(APPEND _image_files "${_dir}/${_name}.sm_${_p}.ptx")
      endif()
    endforeach()

    # -compress-all in the default mode, which every driver of CUDA 12 (R525 on) decompresses.
    set(_fatbin "${_dir}/${_name}.fatbin")
    add_custom_command(OUTPUT "${_fatbin}"
      COMMAND "${ATTNMERGE_CLANG_PYTHON}" "${PROJECT_SOURCE_DIR}/cmake/attnmerge_fatbin.py"
              --nvfatbin "${ATTNMERGE_CLANG_NVFATBIN}" -o "${_fatbin}" --option=-compress-all ${_images}
      DEPENDS ${_image_files} "${PROJECT_SOURCE_DIR}/cmake/attnmerge_fatbin.py"
      COMMENT "nvFatbin: ${_src} -> fatbinary" VERBATIM)

    set(_obj "${_dir}/${_name}.o")
    add_custom_command(OUTPUT "${_obj}"
      COMMAND "${ATTNMERGE_CUDA_CLANG}" ${_common} --cuda-host-only -fPIC -fvisibility=hidden
              -fvisibility-inlines-hidden -Xclang -fcuda-include-gpubinary -Xclang "${_fatbin}"
              -MD -MF "${_obj}.d" -c -o "${_obj}" "${_abs}"
      DEPENDS "${_abs}" "${_fatbin}" DEPFILE "${_obj}.d"
      COMMENT "clang: ${_src} -> host object" VERBATIM)
    list(APPEND _objects "${_obj}")
  endforeach()
  set(${out} "${_objects}" PARENT_SCOPE)
endfunction()

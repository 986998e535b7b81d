# CMake package of jcoccl's codec plugin interface, shipped inside the Python package.
#
#   cmake -S <plugin dir> -B build \
#     -Djcoccl_DIR="$(python -c 'import jcoccl; print(jcoccl.get_cmake_dir())')"
#
#   cmake_minimum_required(VERSION 3.18...4.4)
#   project(my_codec LANGUAGES CXX)
#   find_package(jcoccl 0.1 CONFIG REQUIRED)
#   jcoccl_add_codec_plugin(my_codec SOURCES my_cpu.cc CUDA_SOURCES my_cuda.cu)
#
# Provides:
#   jcoccl::codec_plugin     INTERFACE target: the include directory of <jcoccl/codec_plugin.h>
#   jcoccl_INCLUDE_DIR       that directory
#   jcoccl_add_codec_plugin(<name> SOURCES <C/C++ files> [CUDA_SOURCES <.cu files>])
#       a shared library lib<name>.so for jcoccl.compressors.load_plugin: hidden symbols but
#       the entry point, no floating-point contraction (-ffp-contract=off, nvcc --fmad=false,
#       so the kernels can match the jnp specification bit for bit), the CUDA runtime linked
#       statically when CUDA_SOURCES are given (enable the CUDA language first), and the
#       compile definition JCOCCL_PLUGIN_WITH_CUDA=1 then. Optimized: with no
#       CMAKE_BUILD_TYPE (a single-config generator's default, which compiles without -O and
#       made a plugin's encode 15x slower than jnp), the target gets Release's flags (-O3
#       -DNDEBUG) and a status line says so; an explicit CMAKE_BUILD_TYPE (Debug,
#       RelWithDebInfo, ...) is kept as given.

get_filename_component(_jcoccl_package_dir "${CMAKE_CURRENT_LIST_DIR}/../../.." ABSOLUTE)
set(jcoccl_INCLUDE_DIR "${_jcoccl_package_dir}/include")
if(NOT EXISTS "${jcoccl_INCLUDE_DIR}/jcoccl/codec_plugin.h")
  set(jcoccl_FOUND FALSE)
  set(jcoccl_NOT_FOUND_MESSAGE
      "jcoccl: ${jcoccl_INCLUDE_DIR}/jcoccl/codec_plugin.h is missing; reinstall jcoccl")
  return()
endif()

if(NOT TARGET jcoccl::codec_plugin)
  add_library(jcoccl::codec_plugin INTERFACE IMPORTED)
  set_target_properties(jcoccl::codec_plugin PROPERTIES
    INTERFACE_INCLUDE_DIRECTORIES "${jcoccl_INCLUDE_DIR}")
endif()

function(jcoccl_add_codec_plugin name)
  cmake_parse_arguments(ARG "" "" "SOURCES;CUDA_SOURCES" ${ARGN})
  if(NOT ARG_SOURCES)
    message(FATAL_ERROR "jcoccl_add_codec_plugin(${name}): give SOURCES (the CPU kernels and "
                        "the entry point)")
  endif()
  add_library(${name} SHARED ${ARG_SOURCES} ${ARG_CUDA_SOURCES})
  target_link_libraries(${name} PRIVATE jcoccl::codec_plugin)
  set_target_properties(${name} PROPERTIES
    POSITION_INDEPENDENT_CODE ON
    C_VISIBILITY_PRESET hidden
    CXX_VISIBILITY_PRESET hidden
    CUDA_VISIBILITY_PRESET hidden
    VISIBILITY_INLINES_HIDDEN ON)
  target_compile_options(${name} PRIVATE
    "$<$<COMPILE_LANGUAGE:C,CXX>:-ffp-contract=off;-fno-fast-math>"
    "$<$<COMPILE_LANGUAGE:CUDA>:--fmad=false>")
  get_property(_multi_config GLOBAL PROPERTY GENERATOR_IS_MULTI_CONFIG)
  if(NOT CMAKE_BUILD_TYPE AND NOT _multi_config)
    message(STATUS "jcoccl_add_codec_plugin(${name}): no CMAKE_BUILD_TYPE, so compiling with "
                   "Release's flags (-O3 -DNDEBUG); pass -DCMAKE_BUILD_TYPE=<type> to choose")
    foreach(_lang C CXX CUDA)
      separate_arguments(_flags UNIX_COMMAND "${CMAKE_${_lang}_FLAGS_RELEASE}")
      if(NOT _flags)
        set(_flags -O3 -DNDEBUG)
      endif()
      target_compile_options(${name} PRIVATE "$<$<COMPILE_LANGUAGE:${_lang}>:${_flags}>")
    endforeach()
  endif()
  if(ARG_CUDA_SOURCES)
    find_package(CUDAToolkit REQUIRED)
    target_link_libraries(${name} PRIVATE CUDA::cudart_static)
    target_compile_definitions(${name} PRIVATE JCOCCL_PLUGIN_WITH_CUDA=1)
  endif()
endfunction()

# Turns files (templates, rules) into a C++ table at build time, reproducibly: sorted, no timestamps.
# jf_embed(OUT <cpp> NAME <symbol> BASE <dir> FILES <abs paths...>)
function(jf_embed)
  cmake_parse_arguments(E "" "OUT;NAME;BASE" "FILES" ${ARGN})
  list(SORT E_FILES)
  add_custom_command(
    OUTPUT ${E_OUT}
    COMMAND ${CMAKE_COMMAND} -DOUT=${E_OUT} -DNAME=${E_NAME} -DBASE=${E_BASE} "-DFILES=${E_FILES}"
            -P ${PROJECT_SOURCE_DIR}/tools/cmake/EmbedRun.cmake
    DEPENDS ${E_FILES} ${PROJECT_SOURCE_DIR}/tools/cmake/EmbedRun.cmake
    COMMENT "Embedding ${E_NAME}" VERBATIM)
endfunction()

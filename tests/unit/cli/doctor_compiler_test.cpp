// `jitfuse doctor`'s C++ compiler line (tools/cli/toolchain.cpp) with fake compilers answering -print-file-name:
// a devtoolset-style linker script is named with the fix, a shared libstdc++ and a missing compiler are reported,
// and doctor succeeds whatever the compiler (the line informs; docs/deploy.md says why it matters).
#include <sys/stat.h>

#include "unit/rules/rules_test_util.hpp"

using Catch::Contains;
using jf_test::run_cli;

namespace {

// A compiler that answers `-print-file-name=libstdc++.so` with `lib`, as GCC does.
std::string fake_cxx(const jf_test::TempDir& dir, const std::string& name, const std::string& lib) {
  std::string exe = dir.write(name, "#!/bin/sh\necho '" + lib + "'\n");
  ::chmod(exe.c_str(), 0755);
  return exe;
}

}  // namespace

TEST_CASE("doctor names a C++ compiler whose libstdc++.so is a linker script adding a static part", "[cli]") {
  jf_test::TempDir dir;
  std::string script = dir.write("gcc/lib/libstdc++.so",
                                 "/* GNU ld script\n   Use the shared library, but some functions are only in\n"
                                 "   the static library, so try that secondarily.  */\nOUTPUT_FORMAT(elf64-x86-64)\n"
                                 "INPUT ( /usr/lib64/libstdc++.so.6 -lstdc++_nonshared )\n");
  std::string cxx = fake_cxx(dir, "gcc/bin/g++", script);
  auto r = run_cli("doctor", "CXX='" + cxx + "'");
  INFO(r.out);
  CHECK(r.status == 0);
  CHECK_THAT(r.out, Contains("C++       " + cxx + " ($CXX): WARNING: links part of libstdc++ statically (" + script +
                             " is a linker script adding -lstdc++_nonshared); AOTInductor packages it builds crash "
                             "when loaded: set CXX to a GCC whose libstdc++.so is the shared library, e.g. "
                             "CXX=/usr/bin/g++ (docs/deploy.md)"));
  auto j = nlohmann::json::parse(run_cli("doctor --json", "CXX='" + cxx + "'", true).out);
  CHECK(j["cxx"]["compiler"] == cxx);
  CHECK(j["cxx"]["from_env"] == true);
  CHECK(j["cxx"]["libstdcxx"] == script);
  CHECK(j["cxx"]["linker_script"] == true);
  CHECK(j["cxx"]["static_parts"] == nlohmann::json::array({"-lstdc++_nonshared"}));
  CHECK(j["cxx"]["links_libstdcxx_statically"] == true);
}

TEST_CASE("doctor finds the archive in a GROUP with AS_NEEDED, as glibc's libc.so writes it", "[cli]") {
  jf_test::TempDir dir;
  std::string script = dir.write("libstdc++.so", "/* GNU ld script */\nGROUP ( /lib/libstdc++.so.6 "
                                                 "/usr/lib/libstdc++_nonshared.a  AS_NEEDED ( /lib/ld.so.2 ) )\n");
  auto j = nlohmann::json::parse(run_cli("doctor --json", "CXX='" + fake_cxx(dir, "g++", script) + "'", true).out);
  CHECK(j["cxx"]["static_parts"] == nlohmann::json::array({"/usr/lib/libstdc++_nonshared.a"}));
}

TEST_CASE("doctor reports a compiler that links libstdc++ shared, and a missing one, and succeeds", "[cli]") {
  jf_test::TempDir dir;
  std::string so = dir.write("libstdc++.so", std::string("\x7f" "ELF\x02\x01\x01", 7) + std::string(57, '\0'));
  std::string cxx = fake_cxx(dir, "g++", so);
  auto r = run_cli("doctor", "CXX='" + cxx + "'");
  INFO(r.out);
  CHECK(r.status == 0);
  CHECK_THAT(r.out, Contains("C++       " + cxx + " ($CXX): links libstdc++ shared (" + so + ")"));
  CHECK_THAT(r.out, !Contains("WARNING"));
  r = run_cli("doctor", "CXX='" + dir.path() + "/no-such-g++'");
  INFO(r.out);
  CHECK(r.status == 0);
  CHECK_THAT(r.out, Contains("C++       " + dir.path() + "/no-such-g++ ($CXX): not found or no libstdc++.so of its own"));
  // Unset: Inductor's default, g++ (whatever this machine's g++ says; the line is there).
  r = run_cli("doctor", "-u CXX");
  CHECK(r.status == 0);
  CHECK_THAT(r.out, Contains("C++       g++ ($CXX unset: Inductor's default)"));
}

TEST_CASE("doctor asks the linker when the compiler answers -print-file-name with the bare name", "[cli]") {
  // As the GPU machine's /opt/gcc: -print-file-name=libstdc++.so says "libstdc++.so", yet linking opens a
  // devtoolset script through the compiler's own search path; ld's --verbose names it.
  jf_test::TempDir dir;
  std::string script = dir.write("gcc/lib64/libstdc++.so",
                                 "/* GNU ld script */\nINPUT ( /usr/lib64/libstdc++.so.6 -lstdc++_nonshared )\n");
  std::string exe = dir.write("gcc/bin/g++",
                              "#!/bin/sh\nfor a in \"$@\"; do\n"
                              "  [ \"$a\" = -print-file-name=libstdc++.so ] && { echo libstdc++.so; exit 0; }\n"
                              "  [ \"$a\" = -Wl,--verbose ] && { echo 'attempt to open /nowhere/libstdc++.so failed';\n"
                              "    echo 'attempt to open " + script + " succeeded'; echo 'opened script file " + script +
                              "'; exit 0; }\ndone\nexit 1\n");
  ::chmod(exe.c_str(), 0755);
  auto j = nlohmann::json::parse(run_cli("doctor --json", "CXX='" + exe + "'", true).out);
  CHECK(j["cxx"]["libstdcxx"] == script);
  CHECK(j["cxx"]["static_parts"] == nlohmann::json::array({"-lstdc++_nonshared"}));
  CHECK(j["cxx"]["links_libstdcxx_statically"] == true);
}

TEST_CASE("doctor names a compiler with no libstdc++.so whose linker takes libstdc++.a", "[cli]") {
  // The GPU machine's /opt/gcc (GCC 13.3): ld --verbose tries libstdc++.so in each directory and takes the
  // archive, so every package it links carries its own libstdc++.
  jf_test::TempDir dir;
  std::string archive = dir.write("gcc/lib/gcc/x86_64-linux-gnu/13/libstdc++.a", "!<arch>\n");
  const std::string so_dir = archive.substr(0, archive.rfind('/'));
  std::string exe = dir.write("gcc/bin/g++",
                              "#!/bin/sh\nfor a in \"$@\"; do\n"
                              "  [ \"$a\" = -print-file-name=libstdc++.so ] && { echo libstdc++.so; exit 0; }\n"
                              "  [ \"$a\" = -Wl,--verbose ] && { echo 'attempt to open " + so_dir +
                              "/libstdc++.so failed';\n    echo 'attempt to open " + archive + " succeeded'; echo '" +
                              archive + "'; exit 0; }\ndone\nexit 1\n");
  ::chmod(exe.c_str(), 0755);
  auto r = run_cli("doctor --json", "CXX='" + exe + "'", true);
  auto j = nlohmann::json::parse(r.out);
  CHECK(j["cxx"]["libstdcxx"] == archive);
  CHECK(j["cxx"]["static_parts"] == nlohmann::json::array({archive}));
  CHECK(j["cxx"]["links_libstdcxx_statically"] == true);
  auto text = run_cli("doctor", "CXX='" + exe + "'", true);
  CHECK_THAT(text.out, Contains("links libstdc++ statically (no libstdc++.so; its linker takes " + archive));
}

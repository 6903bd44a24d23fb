# Tests of tools/check_exports.py (CTest: unit:scripts): the demangled names it attributes to std::, canned nm output
# from a fake nm, and real shared objects built here with g++ that export a std:: function, or only the C ABI.
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "check_exports.py"
spec = importlib.util.spec_from_file_location("check_exports", SCRIPT)
ce = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ce)

STRING = "std::__cxx11::basic_string<char, std::char_traits<char>, std::allocator<char> >"


@pytest.mark.parametrize("name,expected", [
    ("std::__throw_length_error(char const*)", "std::__throw_length_error"),
    (f"{STRING}::_M_replace_cold(char*, unsigned long, char const*, unsigned long, unsigned long)",
     f"{STRING}::_M_replace_cold"),
    ("void std::vector<int, std::allocator<int> >::_M_realloc_insert<int const&>(__gnu_cxx::__normal_iterator<int*, "
     "std::vector<int, std::allocator<int> > >, int const&)", "std::vector<int, std::allocator<int> >::_M_realloc_insert<int const&>"),
    ("std::pair<int, int> const& std::max<std::pair<int, int> >(std::pair<int, int> const&, std::pair<int, int> const&)",
     "std::max<std::pair<int, int> >"),
    ("std::basic_ostream<char, std::char_traits<char> >& std::operator<< <std::char_traits<char> >"
     "(std::basic_ostream<char, std::char_traits<char> >&, char const*)", "std::operator@ <std::char_traits<char> >"),
    ("typeinfo for std::bad_cast", "std::bad_cast"),
    ("typeinfo name for std::bad_cast", "std::bad_cast"),
    ("vtable for std::__cxx11::basic_stringbuf<char, std::char_traits<char>, std::allocator<char> >",
     "std::__cxx11::basic_stringbuf<char, std::char_traits<char>, std::allocator<char> >"),
    ("guard variable for std::__detail::_Scanner<char>::_M_token_tbl", "std::__detail::_Scanner<char>::_M_token_tbl"),
    (f"jitfuse_torch::load_definitions({STRING} const&)", "jitfuse_torch::load_definitions"),
    ("jf_context_create", "jf_context_create"),
    ("jitfuse::Holder<std::string>::get() const", "jitfuse::Holder<std::string>::get"),
])
def test_the_entity_of_a_demangled_symbol(name, expected):
    assert ce.entity(name) == expected


NM_OUTPUT = f"""\
0000000000000000 A JITFUSE_2
0000000000012340 T jf_context_create
0000000000012400 T jitfuse_torch::load_definitions({STRING} const&)
0000000000012500 W std::vector<int, std::allocator<int> >::~vector()
0000000000012600 u std::__detail::_Scanner<char>::_M_token_tbl
0000000000012700 T std::__throw_regex_error(std::regex_constants::error_type, char const*)
0000000000012800 V typeinfo for std::bad_cast
0000000000012900 D vtable for std::__cxx11::basic_stringbuf<char, std::char_traits<char>, std::allocator<char> >
"""


def test_strong_std_symbols_are_findings_weak_and_unique_ones_only_when_strict():
    syms = ce.parse_nm(NM_OUTPUT)
    assert len(syms) == 8 and syms[0] == ("A", "JITFUSE_2")
    assert [n for _, n in ce.findings(syms, strict=False)] == [
        "std::__throw_regex_error(std::regex_constants::error_type, char const*)",
        "vtable for std::__cxx11::basic_stringbuf<char, std::char_traits<char>, std::allocator<char> >"]
    assert [t for t, _ in ce.findings(syms, strict=True)] == ["W", "u", "T", "V", "D"]


def fake_nm(tmp_path, output):
    f = tmp_path / "nm-output.txt"
    f.write_text(output)
    nm = tmp_path / "fake-nm"
    nm.write_text(f"#!/bin/sh\n[ \"$1 $2 $3\" = '-D --defined-only -C' ] || exit 9\ncat '{f}'\n")
    nm.chmod(0o755)
    return str(nm)


def run(*args):
    r = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)
    return r.returncode, r.stdout + r.stderr


def test_the_script_names_each_symbol_and_what_to_do(tmp_path):
    rc, out = run("--nm", fake_nm(tmp_path, NM_OUTPUT), "libjitfuse_torch.so")
    assert rc == 1
    assert ("libjitfuse_torch.so: exports std::__throw_regex_error(std::regex_constants::error_type, char const*) "
            "(nm type T)") in out
    assert "2 std:: symbol(s) exported" in out and "-nostdlib++ -l:libstdc++.so.6" in out and "CXX=/usr/bin/g++" in out
    rc, out = run("--nm", fake_nm(tmp_path, NM_OUTPUT), "--strict", "libjitfuse.so")
    assert rc == 1 and "5 std:: symbol(s) exported" in out and "runtime/jitfuse.map" in out


def test_a_clean_table_passes(tmp_path):
    clean = "0000000000000000 A JITFUSE_2\n0000000000012340 T jf_context_create\n"
    rc, out = run("--nm", fake_nm(tmp_path, clean), "--strict", "libjitfuse.so")
    assert rc == 0 and out.strip() == "libjitfuse.so: ok (2 exported symbols, no std:: symbol)"


def test_nm_failing_is_exit_2_not_a_pass(tmp_path):
    rc, out = run("--nm", str(tmp_path / "no-such-nm"), "libjitfuse.so")
    assert rc == 2 and "cannot run" in out
    rc, out = run(str(tmp_path / "missing.so"))
    assert rc == 2 and "failed" in out


needs_toolchain = pytest.mark.skipif(shutil.which("g++") is None or shutil.which("nm") is None,
                                     reason="needs g++ and nm to build and read a shared object")


def build_so(tmp_path, name, source, *flags):
    src = tmp_path / (name + ".cpp")
    src.write_text(source)
    so = tmp_path / f"lib{name}.so"
    subprocess.run(["g++", "-shared", "-fPIC", "-O1", *flags, "-o", str(so), str(src)], check=True)
    return str(so)


@needs_toolchain
def test_a_real_library_exporting_a_std_function_fails(tmp_path):
    # What libstdc++_nonshared.a leaves in a library: a strongly defined std:: function with default visibility.
    so = build_so(tmp_path, "leaky", 'namespace std { __attribute__((visibility("default"))) int jf_copy(int x) '
                                     '{ return x + 1; } }\nextern "C" int jf_api(int x) { return std::jf_copy(x); }\n')
    rc, out = run(so)
    assert rc == 1 and f"{so}: exports std::jf_copy(int) (nm type T)" in out
    rc, out = run("--strict", so)
    assert rc == 1


@needs_toolchain
def test_a_real_library_exporting_the_c_abi_only_passes(tmp_path):
    so = build_so(tmp_path, "clean", '#include <string>\nstatic std::string name() { return std::string(40, \'x\'); }\n'
                                     'extern "C" __attribute__((visibility("default"))) unsigned long jf_api() '
                                     '{ return name().size(); }\n', "-fvisibility=hidden", "-fvisibility-inlines-hidden")
    rc, out = run("--strict", so)
    assert rc == 0, out

# CPU tests of jitfuse/_toolchain.py without PyTorch: fake compilers (shell scripts answering -print-file-name)
# whose libstdc++.so is a devtoolset-style linker script, a real ELF shared object, or nothing; the warning.
import os
import shutil
import subprocess
import sys
import types
import warnings

import pytest

from jitfuse import _toolchain as tc

DEVTOOLSET_SCRIPT = """/* GNU ld script
   Use the shared library, but some functions are only in
   the static library, so try that secondarily.  */
OUTPUT_FORMAT(elf64-x86-64)
INPUT ( /usr/lib64/libstdc++.so.6 -lstdc++_nonshared )
"""


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    """No cached answer, no warning already given, no Inductor config and no $CXX from the test's caller."""
    tc._inspect.cache_clear()
    tc.shared_libstdcxx_compiler.cache_clear()
    monkeypatch.setattr(tc, "_warned", set())
    monkeypatch.delitem(sys.modules, "torch._inductor.config", raising=False)
    monkeypatch.delenv("CXX", raising=False)
    yield
    tc._inspect.cache_clear()
    tc.shared_libstdcxx_compiler.cache_clear()


def fake_compiler(d, answer, name="g++"):
    """A compiler that answers `-print-file-name=libstdc++.so` with `answer` and fails on anything else."""
    d.mkdir(parents=True, exist_ok=True)
    exe = d / name
    exe.write_text("#!/bin/sh\n"
                   "for a in \"$@\"; do\n"
                   f"  [ \"$a\" = -print-file-name=libstdc++.so ] && {{ echo '{answer}'; exit 0; }}\n"
                   "done\n"
                   "echo \"fake compiler: unexpected arguments $*\" >&2; exit 1\n")
    exe.chmod(0o755)
    return exe


def linker_probed_compiler(d, verbose_lines, name="g++"):
    """A compiler that answers `-print-file-name=libstdc++.so` with the bare name and prints `verbose_lines`
    when it links with `-Wl,--verbose` (what ld says of the libraries it opens); anything else fails."""
    d.mkdir(parents=True, exist_ok=True)
    exe = d / name
    echoes = "".join(f"    echo '{line}'\n" for line in verbose_lines)
    exe.write_text("#!/bin/sh\n"
                   "for a in \"$@\"; do\n"
                   "  [ \"$a\" = -print-file-name=libstdc++.so ] && { echo libstdc++.so; exit 0; }\n"
                   "  [ \"$a\" = -Wl,--verbose ] && {\n"
                   f"{echoes}"
                   "    exit 0; }\n"
                   "done\n"
                   "exit 1\n")
    exe.chmod(0o755)
    return exe


def devtoolset_compiler(tmp_path, script=DEVTOOLSET_SCRIPT):
    lib = tmp_path / "gcc" / "lib" / "libstdc++.so"
    lib.parent.mkdir(parents=True)
    lib.write_text(script)
    return fake_compiler(tmp_path / "gcc" / "bin", lib), lib


def test_a_devtoolset_style_linker_script_is_found_with_its_static_part(tmp_path):
    cxx, lib = devtoolset_compiler(tmp_path)
    found = tc.check(str(cxx), "$CXX")
    assert found is not None
    assert (found.path, found.libstdcxx, found.static_parts) == (str(cxx), str(lib), ("-lstdc++_nonshared",))
    msg = found.message("export_definitions", fix="/usr/bin/g++")
    assert msg.startswith("jitfuse (export_definitions): the C++ compiler that Inductor builds AOTInductor packages "
                          f"with, {cxx} (from $CXX), links part of libstdc++ statically")
    assert f"its libstdc++.so, {lib}, is a linker script adding -lstdc++_nonshared" in msg
    assert "SIGSEGV in std::regex under aoti_load_package" in msg
    assert "CXX=/usr/bin/g++" in msg and "torch._inductor.config.cpp.cxx = (None, '/usr/bin/g++')" in msg
    assert "docs/deploy.md" in msg


@pytest.mark.parametrize("script,parts", [
    # glibc's own libc.so has the same shape: GROUP, an archive, AS_NEEDED nested in it.
    ("/* GNU ld script */\nGROUP ( /lib/libstdc++.so.6 /usr/lib/libstdc++_nonshared.a  AS_NEEDED ( /lib/ld.so.2 ) )\n",
     ("/usr/lib/libstdc++_nonshared.a",)),
    ("INPUT(libstdc++.so.6, -l:libstdc++_extra.a)\n", ("-l:libstdc++_extra.a",)),
    ("/* GNU ld script */\nINPUT ( /usr/lib/gcc/13/libstdc++.a )\n", ("/usr/lib/gcc/13/libstdc++.a",)),
])
def test_other_linker_scripts_with_static_parts(tmp_path, script, parts):
    cxx, _ = devtoolset_compiler(tmp_path, script)
    found = tc.check(str(cxx))
    assert found is not None and found.static_parts == parts


def test_a_linker_script_naming_only_shared_objects_is_fine(tmp_path):
    cxx, _ = devtoolset_compiler(tmp_path, "/* GNU ld script */\nINPUT ( /usr/lib64/libstdc++.so.6 )\n")
    assert tc.check(str(cxx)) is None


def test_a_real_shared_object_is_fine(tmp_path):
    gxx = shutil.which("g++") or shutil.which("c++")
    if gxx is None:
        pytest.skip("needs g++ to build a shared object")
    so = tmp_path / "libstdc++.so"
    (tmp_path / "x.cpp").write_text("int jf_probe() { return 1; }\n")
    subprocess.run([gxx, "-shared", "-fPIC", "-o", str(so), str(tmp_path / "x.cpp")], check=True)
    cxx = fake_compiler(tmp_path / "bin", so)
    assert tc.libstdcxx_of(str(cxx)) == str(so)
    assert tc.linker_script_inputs(str(so)) is None
    assert tc.check(str(cxx)) is None


@pytest.mark.parametrize("answer", ["libstdc++.so", "/nonexistent/libstdc++.so"])
def test_a_compiler_without_a_libstdcxx_so_says_nothing(tmp_path, answer):
    # GCC answers the bare name when it has no such file; then there is nothing to judge.
    assert tc.check(str(fake_compiler(tmp_path, answer))) is None


def test_a_compiler_answering_the_bare_name_is_judged_by_what_its_linker_opens(tmp_path):
    # The GPU machine's /opt/gcc answers -print-file-name=libstdc++.so with the bare name, yet its linker
    # opens a devtoolset script through its own search path: ld's --verbose names it.
    lib = tmp_path / "gcc" / "lib64" / "libstdc++.so"
    lib.parent.mkdir(parents=True)
    lib.write_text(DEVTOOLSET_SCRIPT)
    exe = linker_probed_compiler(tmp_path / "gcc" / "bin", ["attempt to open /nowhere/libstdc++.so failed",
                                                          f"attempt to open {lib} succeeded",
                                                          f"opened script file {lib}"])
    assert tc.libstdcxx_of(str(exe)) == str(lib)
    found = tc.check(str(exe))
    assert found is not None and found.libstdcxx == str(lib) and found.static_parts == ("-lstdc++_nonshared",)
    assert "links part of libstdc++ statically" in found.message()


def test_a_compiler_with_no_libstdcxx_so_links_the_archive_and_is_named(tmp_path):
    # The GPU machine's /opt/gcc (GCC 13.3, run 2 of session 36): ld tries libstdc++.so in each directory and
    # takes libstdc++.a, so each package it links carries its own libstdc++.
    lib = tmp_path / "gcc" / "lib" / "gcc" / "x86_64-linux-gnu" / "13" / "libstdc++.a"
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"!<arch>\n")
    exe = linker_probed_compiler(tmp_path / "gcc" / "bin", [f"attempt to open {lib.parent}/libstdc++.so failed",
                                                          f"attempt to open {lib} succeeded", str(lib)])
    found = tc.check(str(exe), "$CXX")
    assert found is not None and found.libstdcxx == str(lib) and found.static_parts == (str(lib),)
    msg = found.message(fix="/usr/bin/g++")
    assert f"links libstdc++ statically: it has no libstdc++.so, its linker takes {lib}" in msg
    assert "CXX=/usr/bin/g++" in msg


def test_the_linker_probe_of_a_real_compiler_finds_its_libstdcxx():
    cxx = shutil.which("g++")
    if not cxx:
        pytest.skip("no g++ here")
    p = tc.libstdcxx_linked(cxx)
    assert p is not None and os.path.basename(p) == "libstdc++.so" and os.path.isfile(p)


def test_a_missing_or_failing_compiler_never_raises(tmp_path):
    assert tc.check(str(tmp_path / "no-such-g++")) is None
    bad = tmp_path / "bad"
    bad.write_text("#!/bin/sh\nexit 3\n")
    bad.chmod(0o755)
    assert tc.check(str(bad)) is None
    assert tc.check("'unbalanced quote") is None


def test_the_compiler_inductor_would_use(tmp_path, monkeypatch):
    assert tc.inductor_compiler() == ("g++", "Inductor's default, g++")
    monkeypatch.setenv("CXX", "ccache /opt/gcc/bin/g++")
    assert tc.inductor_compiler() == ("ccache /opt/gcc/bin/g++", "$CXX")
    # An imported Inductor config wins: it read $CXX when it was imported, or was set by hand.
    cxx, _ = devtoolset_compiler(tmp_path)
    cfg = types.ModuleType("torch._inductor.config")
    cfg.cpp = types.SimpleNamespace(cxx=(None, str(cxx)))
    monkeypatch.setitem(sys.modules, "torch._inductor.config", cfg)
    assert tc.inductor_compiler() == (str(cxx), "torch._inductor.config.cpp.cxx")
    found = tc.check()
    assert found is not None and found.source == "torch._inductor.config.cpp.cxx"
    # An entry that does not run is skipped, as Inductor's search does.
    cfg.cpp.cxx = (None, str(tmp_path / "missing-g++"))
    assert tc.inductor_compiler() == ("ccache /opt/gcc/bin/g++", "$CXX")


def test_the_warning_names_the_compiler_once_per_process(tmp_path, monkeypatch):
    cxx, lib = devtoolset_compiler(tmp_path)
    monkeypatch.setenv("CXX", str(cxx))
    with pytest.warns(tc.StaticLibstdcxxWarning) as rec:
        assert tc.warn_if_static("export_definitions") is not None
    assert len(rec) == 1
    msg = str(rec[0].message)
    assert msg.startswith("jitfuse (export_definitions): ") and str(cxx) in msg and str(lib) in msg and "CXX=" in msg
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tc.warn_if_static("export_definitions")  # said once already


def test_no_warning_for_a_good_compiler(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tc.warn_if_static("export_definitions") is None


def test_the_fix_proposed_is_a_compiler_that_links_libstdcxx_shared(tmp_path, monkeypatch):
    good_so = tmp_path / "good" / "libstdc++.so"
    good_so.parent.mkdir()
    good_so.write_bytes(b"\x7fELF\x02\x01\x01" + b"\0" * 57)
    bad, _ = devtoolset_compiler(tmp_path)
    good = fake_compiler(tmp_path / "goodbin", good_so)
    monkeypatch.setattr(tc, "FIX_CANDIDATES", (str(tmp_path / "absent"), str(bad), str(good)))
    assert tc.shared_libstdcxx_compiler() == str(good)
    assert f"CXX={good} " in tc.check(str(bad)).message()
    tc.shared_libstdcxx_compiler.cache_clear()
    monkeypatch.setattr(tc, "FIX_CANDIDATES", (str(bad),))
    assert "CXX=/usr/bin/g++ " in tc.check(str(bad)).message()  # none found here: the usual system compiler


def test_the_check_needs_no_torch(tmp_path):
    # The check runs where torch is absent (jitfuse doctor's machines, a build host): a fresh interpreter whose
    # `torch` import fails still reports the compiler.
    cxx, _ = devtoolset_compiler(tmp_path)
    site = tmp_path / "site" / "torch"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text("raise ImportError('no torch here')\n")
    env = dict(os.environ, CXX=str(cxx), PYTHONPATH=os.pathsep.join([str(site.parent), os.path.dirname(
        os.path.dirname(tc.__file__))]))
    r = subprocess.run([sys.executable, "-c", "import jitfuse; print(jitfuse.check_inductor_compiler().static_parts)"],
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "('-lstdc++_nonshared',)"

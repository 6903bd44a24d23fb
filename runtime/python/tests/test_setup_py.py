# CPU tests of runtime/python/setup.py's decision to build jitfuse.torch's C++ extension during pip install: every
# reason not to build is named (no torch or too old a torch in the build interpreter, no libjitfuse.so,
# JITFUSE_TORCH_EXTENSION=0), and the CMake arguments when it builds. A stand-in torch on PYTHONPATH plays the build's.
import importlib.util
import os
import shutil
import sys

import pytest

from conftest import PY_ROOT


@pytest.fixture
def setup_py(monkeypatch):
    monkeypatch.delenv("JITFUSE_TORCH_EXTENSION", raising=False)
    monkeypatch.delenv("CXX", raising=False)
    spec = importlib.util.spec_from_file_location("_jf_setup_under_test", PY_ROOT / "setup.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # __name__ is not "__main__": defines the helpers, runs no setup()
    return mod


def _torch_on_path(tmp_path, monkeypatch, body):
    d = tmp_path / "site"
    (d / "torch").mkdir(parents=True)
    (d / "torch" / "__init__.py").write_text(body)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(d), os.environ.get("PYTHONPATH", "")]))


def test_off_when_asked(setup_py, monkeypatch):
    monkeypatch.setenv("JITFUSE_TORCH_EXTENSION", "0")
    assert setup_py.plan() == (None, "JITFUSE_TORCH_EXTENSION=0")


def test_no_torch_in_the_build_interpreter_says_no_build_isolation(setup_py, tmp_path, monkeypatch):
    _torch_on_path(tmp_path, monkeypatch, "raise ImportError('no torch in this build environment')\n")
    args, why = setup_py.plan(sys.executable)
    assert args is None
    assert "cannot import torch (ImportError: no torch in this build environment)" in why
    assert "pip install --no-build-isolation runtime/python" in why


def test_no_library_to_link_says_what_to_set(setup_py, tmp_path, monkeypatch):
    _torch_on_path(tmp_path, monkeypatch, "__version__ = '2.11.0'\n")
    monkeypatch.setenv("JITFUSE_LIBRARY", str(tmp_path / "missing" / "libjitfuse.so.0"))
    args, why = setup_py.plan(sys.executable)
    assert args is None and "set JITFUSE_LIBRARY=" in why


@pytest.mark.skipif(shutil.which("cmake") is None, reason="needs cmake on PATH")
def test_builds_against_the_named_library_with_the_build_interpreter(setup_py, tmp_path, monkeypatch):
    _torch_on_path(tmp_path, monkeypatch, "__version__ = '2.11.0'\n")
    lib = tmp_path / "libjitfuse.so.0"
    lib.write_bytes(b"")
    monkeypatch.setenv("JITFUSE_LIBRARY", str(lib))
    monkeypatch.setenv("CXX", "/usr/bin/g++")
    args, why = setup_py.plan(sys.executable)
    assert why == ""
    assert f"-DJITFUSE_LIBRARY={lib}" in args and f"-DJITFUSE_TORCH_PYTHON={sys.executable}" in args
    assert "-DJITFUSE_TORCH_EXTENSION=ON" in args and "-DCMAKE_CXX_COMPILER=/usr/bin/g++" in args


def test_a_torch_older_than_jitfuse_torch_supports_is_not_built_for(setup_py, tmp_path, monkeypatch):
    _torch_on_path(tmp_path, monkeypatch, "__version__ = '1.13.1'\n")  # Debian 12's python3-torch
    args, why = setup_py.plan(sys.executable)
    assert args is None
    assert "imports torch 1.13.1, older than 2.4, the oldest jitfuse.torch supports" in why
    assert "pip install 'torch>=2.4'" in why

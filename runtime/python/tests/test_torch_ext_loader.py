# CPU tests of the C++ extension's loader (jitfuse/torch/_ext.py) without PyTorch: the environment variable's
# values, the version check before anything is loaded, and where it looks. Loaded by path (importing
# jitfuse.torch would import torch).
import importlib.util
import json

import pytest

from conftest import PY_ROOT


@pytest.fixture
def ext(monkeypatch):
    monkeypatch.setenv("JITFUSE_TORCH_EXTENSION", "0")  # module import: load() returns None, imports nothing
    spec = importlib.util.spec_from_file_location("_jf_ext_under_test", PY_ROOT / "jitfuse" / "torch" / "_ext.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.EXT is None and not mod.active()
    return mod


@pytest.mark.parametrize("value,mode", [("0", "0"), ("off", "0"), ("1", "1"), ("ON", "1"), ("auto", "auto"),
                                        ("", "auto")])
def test_mode_from_the_environment(ext, monkeypatch, value, mode):
    monkeypatch.setenv("JITFUSE_TORCH_EXTENSION", value)
    assert ext.mode() == mode


def test_a_build_for_another_torch_is_refused_with_what_to_do(ext, tmp_path, monkeypatch):
    d = tmp_path / "ext"
    d.mkdir()
    (d / ext.LIB_NAME).write_bytes(b"")
    (d / ext.BUILD_INFO).write_text(json.dumps({"format": "jitfuse.torch_build/1", "torch": "2.11.0+cu130"}))
    monkeypatch.setattr(ext, "candidate_dirs", lambda: [d])
    found, why = ext.find("2.10.1+cu128")
    assert found is None
    assert "built for torch 2.11.0+cu130" in why and "runs torch 2.10.1+cu128" in why
    assert "JITFUSE_TORCH_EXTENSION=0" in why and "rebuild" in why
    found, why = ext.find("2.11.0+cu130")
    assert found == d and why == ""


def test_no_build_says_where_it_looked(ext, tmp_path, monkeypatch):
    monkeypatch.setattr(ext, "candidate_dirs", lambda: [tmp_path / "nowhere"])
    found, why = ext.find("2.11.0")
    assert found is None and "no build of it was found" in why and "nowhere" in why


def test_an_unreadable_build_record_is_reported(ext, tmp_path, monkeypatch):
    (tmp_path / ext.LIB_NAME).write_bytes(b"")
    (tmp_path / ext.BUILD_INFO).write_text("{not json")
    monkeypatch.setattr(ext, "candidate_dirs", lambda: [tmp_path])
    found, why = ext.find("2.11.0")
    assert found is None and "unreadable" in why


def test_candidates_include_the_checkouts_build_trees(ext, monkeypatch):
    monkeypatch.setenv("JITFUSE_TORCH_EXTENSION_DIR", "/opt/somewhere")
    dirs = [str(p) for p in ext.candidate_dirs()]
    assert dirs[0] == "/opt/somewhere"
    assert any(p.endswith("build-torch") for p in dirs)

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


def _build_for(d, torch_version):
    d.mkdir()
    (d / "libjitfuse_torch.so").write_bytes(b"")
    (d / "jitfuse_torch_build.json").write_text(json.dumps({"format": "jitfuse.torch_build/1", "torch": torch_version,
                                                            "cxx11_abi": 1, "jitfuse_abi": 2}))
    return d


@pytest.fixture
def running_torch(monkeypatch):
    """A stand-in `torch` module of a given version (load() reads torch.__version__ only, before loading)."""
    import sys
    import types

    def set_version(v):
        fake = types.ModuleType("torch")
        fake.__version__ = v
        monkeypatch.setitem(sys.modules, "torch", fake)
    return set_version


def test_load_falls_back_with_both_versions_when_the_build_serves_another_torch(ext, tmp_path, monkeypatch,
                                                                               running_torch):
    d = _build_for(tmp_path / "ext", "2.11.0+cu130")
    monkeypatch.setattr(ext, "candidate_dirs", lambda: [d])
    monkeypatch.setattr(ext, "_load", lambda d: pytest.fail(f"loaded {d} built for another torch"))
    running_torch("2.10.1+cu128")
    monkeypatch.setenv("JITFUSE_TORCH_EXTENSION", "auto")
    with pytest.warns(RuntimeWarning) as rec:
        assert ext.load() is None  # the pure-Python ops
    msg = str(rec[0].message)
    assert "built for torch 2.11.0+cu130" in msg and "this process runs torch 2.10.1+cu128" in msg
    assert str(d) in msg and "rebuild it against this torch" in msg and "using the pure-Python ops" in msg


def test_load_refuses_another_torchs_build_when_required(ext, tmp_path, monkeypatch, running_torch):
    d = _build_for(tmp_path / "ext", "2.11.0+cu130")
    monkeypatch.setattr(ext, "candidate_dirs", lambda: [d])
    monkeypatch.setattr(ext, "_load", lambda d: pytest.fail(f"loaded {d} built for another torch"))
    running_torch("2.12.0")
    monkeypatch.setenv("JITFUSE_TORCH_EXTENSION", "1")
    with pytest.raises(ext.ExtensionError, match=r"JITFUSE_TORCH_EXTENSION=1 but .* built for torch 2\.11\.0\+cu130, "
                       r"but this process runs torch 2\.12\.0"):
        ext.load()


def test_load_takes_the_build_for_this_torch_after_one_for_another(ext, tmp_path, monkeypatch, running_torch):
    old = _build_for(tmp_path / "old", "2.10.1+cu128")
    new = _build_for(tmp_path / "new", "2.11.0+cu130")
    monkeypatch.setattr(ext, "candidate_dirs", lambda: [old, new])
    monkeypatch.setattr(ext, "_load", lambda d: ("loaded", d))
    running_torch("2.11.0+cu130")
    monkeypatch.setenv("JITFUSE_TORCH_EXTENSION", "auto")
    assert ext.load() == ("loaded", new)

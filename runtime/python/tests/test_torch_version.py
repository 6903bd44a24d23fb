# CPU tests of the torch versions jitfuse.torch accepts (jitfuse/_torch_support.py), without PyTorch: an old
# torch (a stand-in package claiming 1.13.1, Debian 12's) is refused at import with what to do, and the torch tests skip.
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import PY_ROOT

import jitfuse
from jitfuse import _torch_support as ts

TESTS = Path(__file__).resolve().parent


@pytest.mark.parametrize("version,parsed", [("1.13.1", (1, 13)), ("2.3.1+cu121", (2, 3)), ("2.4.0", (2, 4)),
                                            ("2.6.0a0+git1234abc", (2, 6)), ("2.7.0.dev20250301+cu128", (2, 7)),
                                            ("2.11.0+cu130", (2, 11)), ("10.0", (10, 0)), ("unknown", None),
                                            ("", None)])
def test_versions_parse_as_major_minor(version, parsed):
    assert ts.parse(version) == parsed


@pytest.mark.parametrize("version", ["2.4.0", "2.4.1+cu124", "2.5.0a0+git", "2.11.0+cu130", "3.0.0", "custom-build"])
def test_supported_or_unreadable_versions_pass(version):
    ts.check(version)


# 1.13.0a0: what Debian 12's python3-torch 1.13.1 reports as torch.__version__.
@pytest.mark.parametrize("version", ["1.13.1", "1.13.0a0", "2.0.1", "2.3.1+cu121", "2.3.0a0+git"])
def test_older_versions_are_refused_naming_both_versions_and_what_to_do(version):
    with pytest.raises(jitfuse.UnsupportedTorchError) as e:
        ts.check(version, "/usr/lib/python3/dist-packages/torch/__init__.py")
    msg = str(e.value)
    assert f"torch {version} (from /usr/lib/python3/dist-packages/torch/__init__.py)" in msg
    assert "needs PyTorch 2.4 or newer" in msg and f"tested up to {ts.TESTED_TORCH}" in msg
    assert "pip install 'torch>=2.4'" in msg
    assert e.value.found == version
    assert isinstance(e.value, ImportError)  # `except ImportError` guards and pytest's skips see "not available"


def _old_torch(tmp_path, version="1.13.1"):
    """A stand-in `torch` package of `version` that fails on any attribute but its version: what jitfuse.torch
    touches before refusing it would show as 'touched torch.<name>'."""
    site = tmp_path / "site"
    (site / "torch").mkdir(parents=True)
    (site / "torch" / "__init__.py").write_text(
        f"__version__ = {version!r}\n"
        "def __getattr__(name):\n"
        "    raise AttributeError(f'stand-in torch: jitfuse touched torch.{name}')\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(PY_ROOT), env.get("PYTHONPATH", "")])
    return site, env


def test_import_refuses_an_old_torch_before_touching_it(tmp_path):
    site, env = _old_torch(tmp_path)
    r = subprocess.run([sys.executable, "-c", "import jitfuse.torch"], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("jitfuse._torch_support.UnsupportedTorchError: jitfuse.torch needs PyTorch 2.4 or newer")
    assert f"imported torch 1.13.1 (from {site / 'torch' / '__init__.py'})" in last
    assert "pip install 'torch>=2.4'" in last
    assert "touched torch." not in r.stderr and "with_keyset" not in r.stderr


def test_an_optional_import_sees_an_import_error(tmp_path):
    _, env = _old_torch(tmp_path)
    code = ("try:\n    import jitfuse.torch\nexcept ImportError as e:\n"
            "    print(type(e).__name__, e.found)\n")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "UnsupportedTorchError 1.13.1"


def test_a_supported_version_gets_past_the_check(tmp_path):
    # The stand-in is no real torch: the import fails later, on the first attribute, but not on the version.
    _, env = _old_torch(tmp_path, "2.4.0")
    r = subprocess.run([sys.executable, "-c", "import jitfuse.torch"], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0 and "UnsupportedTorchError" not in r.stderr
    assert "touched torch." in r.stderr or "cannot import name" in r.stderr, r.stderr


def _torch_test_modules():
    """The test modules that need jitfuse.torch: those skipping through conftest.need_torch()."""
    return sorted(p.name for p in TESTS.glob("test_*.py")
                  if re.search(r"^torch = need_torch\(\)", p.read_text(encoding="utf-8"), re.M))


def test_every_torch_test_module_skips_under_an_old_torch_with_the_reason(tmp_path):
    mods = _torch_test_modules()
    assert "test_torch_channels.py" in mods and "test_torch_gpu.py" in mods and len(mods) >= 9
    for p in TESTS.glob("test_*.py"):  # none imports jitfuse.torch or torch past the one skip
        text = p.read_text(encoding="utf-8")
        if p.name not in mods:
            assert not re.search(r"^(import torch|from torch|import jitfuse\.torch|from jitfuse\.torch)", text, re.M), \
                f"{p.name} imports torch or jitfuse.torch at module level: skip it with conftest.need_torch() first"
    _, env = _old_torch(tmp_path)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *mods], cwd=TESTS,
                       env=env, capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert "error" not in out.lower().replace("unsupportedtorcherror", ""), out
    assert re.search(rf"\b{len(mods)} skipped\b", out), out
    reasons = [ln for ln in out.splitlines() if ln.startswith("SKIPPED")]  # "SKIPPED [n] file:line: reason"
    assert sum(int(re.match(r"SKIPPED \[(\d+)\]", ln).group(1)) for ln in reasons) == len(mods), out
    for ln in reasons:
        assert "jitfuse.torch needs PyTorch 2.4 or newer" in ln and "imported torch 1.13.1" in ln, ln
    assert r.returncode == 5, out  # pytest's "no tests collected": every module skipped, none failed to collect


def test_the_floor_is_the_same_in_the_package_metadata_and_the_extensions_cmake(repo):
    floor = ts.floor_text()
    assert f'torch = ["torch>={floor}"]' in (repo / "runtime" / "python" / "pyproject.toml").read_text()
    cmake = (repo / "runtime" / "torch" / "CMakeLists.txt").read_text()
    assert re.search(rf"^set\(JF_TORCH_MIN_VERSION {re.escape(floor)}\)$", cmake, re.M)

# pytest set-up for the jitfuse Python package: import path, the `gpu` marker, shared fixtures, and need_torch()
# (the one skip of the PyTorch tests). CPU tests run against the library JITFUSE_LIBRARY names (or the build tree).
import importlib
import os
import sys
from pathlib import Path

import pytest

PY_ROOT = Path(__file__).resolve().parents[1]
REPO = PY_ROOT.parents[1]
sys.path.insert(0, str(PY_ROOT))

import jitfuse  # noqa: E402
import jitfuse._abi  # noqa: E402

# While main's build is still ABI 1 (the ABI 2 work in progress), JITFUSE_TEST_EXPECT_ABI=1 lets the tests that
# exist in both ABIs run against it. Never set in CI.
if os.environ.get("JITFUSE_TEST_EXPECT_ABI"):
    jitfuse._abi.EXPECTED_ABI_VERSION = int(os.environ["JITFUSE_TEST_EXPECT_ABI"])
    _declare = jitfuse._abi.declare
    jitfuse._abi.declare = lambda lib: (_declare(lib), [])[1]


def need_torch():
    """``torch`` for a test module that needs PyTorch and jitfuse.torch, or a skip of the whole module with the
    reason: no torch (as pytest.importorskip), or a torch that jitfuse.torch refuses (too old: its
    UnsupportedTorchError's message, naming the version found and the versions supported). Call it at module
    level, before importing jitfuse.torch: ``torch = need_torch()``."""
    torch = pytest.importorskip("torch")
    try:
        importlib.import_module("jitfuse.torch")
    except jitfuse.UnsupportedTorchError as e:
        pytest.skip(str(e), allow_module_level=True)
    return torch


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs PyTorch with CUDA and a GPU (python3 -m pytest -m gpu)")


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def ctx():
    c = jitfuse.Context()
    yield c
    c.close()

# Finding and loading jitfuse.torch's C++ extension (runtime/torch: libjitfuse_torch.so and _jitfuse_torch_C),
# or deciding not to: JITFUSE_TORCH_EXTENSION=0 / 1 / unset, and the torch version the build serves.
"""The C++ extension of :mod:`jitfuse.torch`, when there is one.

``JITFUSE_TORCH_EXTENSION``:

- unset (or ``auto``): load the extension when one is found for this torch; otherwise (none built, or built
  for another torch version) use the pure-Python ops, saying why at ``logging.INFO`` (a version mismatch
  warns);
- ``1``: require it (an error saying what is missing or mismatched);
- ``0``: never load it (the pure-Python ops: ctypes over libjitfuse.so).

Where it is looked for, in order: ``$JITFUSE_TORCH_EXTENSION_DIR``, beside this package (``cmake --install``
puts it there), the checkout's build trees (``build*/runtime/torch``, ``build-torch``). A directory holds
``libjitfuse_torch.so``, ``_jitfuse_torch_C<EXT_SUFFIX>`` and ``jitfuse_torch_build.json`` (the torch version
it was built for, compared with the running torch before anything is loaded: C++ autograd needs libtorch's
full headers, so a build serves one torch version).
"""

import json
import logging
import os
from pathlib import Path
from typing import Any, List, Optional, Tuple

log = logging.getLogger("jitfuse")

ENV = "JITFUSE_TORCH_EXTENSION"
LIB_NAME = "libjitfuse_torch.so"
MODULE_NAME = "_jitfuse_torch_C"
BUILD_INFO = "jitfuse_torch_build.json"


class ExtensionError(ImportError):
    """The C++ extension was required (JITFUSE_TORCH_EXTENSION=1) and cannot be used."""


def mode() -> str:
    """'0' (off), '1' (required) or 'auto', from the environment."""
    v = os.environ.get(ENV, "auto").strip().lower()
    if v in ("0", "off", "false", "no"):
        return "0"
    if v in ("1", "on", "true", "yes"):
        return "1"
    return "auto"


def candidate_dirs() -> List[Path]:
    out: List[Path] = []
    env = os.environ.get("JITFUSE_TORCH_EXTENSION_DIR")
    if env:
        out.append(Path(env))
    here = Path(__file__).resolve().parent
    out.append(here)
    root = here.parents[3] if len(here.parents) > 3 else None
    if root is not None and (root / "runtime" / "torch" / "ops.cpp").is_file():
        builds = [p for p in sorted(root.glob("build*")) if p.is_dir()]
        out += [b / "runtime" / "torch" for b in builds if b.name != "build-torch"]
        out.append(root / "build-torch")
    return out


def version_mismatch(built_for: str, running: str, where: str) -> Optional[str]:
    """The message for an extension built for another torch than the running one, or None."""
    if built_for == running:
        return None
    return (f"jitfuse.torch's C++ extension at {where} was built for torch {built_for}, but this process runs torch "
            f"{running}: rebuild it against this torch (cmake --build <build dir> --target jitfuse_torch "
            f"jitfuse_torch_python, or cmake -S runtime/torch -B build-torch -DJITFUSE_LIBRARY=...), or set "
            f"{ENV}=0 to use the pure-Python ops")


def find(running_torch: str) -> Tuple[Optional[Path], str]:
    """(directory of a usable build, '') or (None, why not)."""
    reasons = []
    for d in candidate_dirs():
        info_path = d / BUILD_INFO
        if not (d / LIB_NAME).is_file() or not info_path.is_file():
            continue
        try:
            info = json.loads(info_path.read_text())
        except (OSError, ValueError) as e:
            reasons.append(f"{info_path}: unreadable ({e})")
            continue
        msg = version_mismatch(str(info.get("torch")), running_torch, str(d))
        if msg:
            reasons.append(msg)
            continue
        return d, ""
    if reasons:
        return None, "; ".join(reasons)
    return None, (f"no build of it was found (looked in {', '.join(str(d) for d in candidate_dirs())}); build it "
                  f"with cmake (JITFUSE_TORCH_EXTENSION=ON, see docs/python.md)")


def _load(d: Path) -> Any:
    import importlib.machinery
    import importlib.util

    import torch

    from .. import lib as _lib

    _lib.library()  # libjitfuse.so first: the extension links it by SONAME and shares this copy
    torch.ops.load_library(str(d / LIB_NAME))
    _load.registered = True  # the ops are C++ now: no way back to the Python ones in this process
    mod_path = next((p for p in d.glob(MODULE_NAME + "*.so")), None)
    if mod_path is None:
        raise ImportError(f"{d}: {LIB_NAME} is there but not {MODULE_NAME}*.so")
    loader = importlib.machinery.ExtensionFileLoader(MODULE_NAME, str(mod_path))
    spec = importlib.util.spec_from_file_location(MODULE_NAME, str(mod_path), loader=loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    mod.path = str(d)
    return mod


def load() -> Any:
    """The extension module, or None (the pure-Python ops). Called once, when jitfuse.torch is imported."""
    m = mode()
    if m == "0":
        log.info("jitfuse.torch: %s=0: the pure-Python ops", ENV)
        return None
    import torch

    d, why = find(torch.__version__)
    if d is None:
        if m == "1":
            raise ExtensionError(f"{ENV}=1 but jitfuse.torch's C++ extension cannot be used: {why}")
        if "built for torch" in why:
            import warnings
            warnings.warn(f"{why} (using the pure-Python ops)", RuntimeWarning, stacklevel=3)
        else:
            log.info("jitfuse.torch: the pure-Python ops: %s", why)
        return None
    try:
        return _load(d)
    except Exception as e:
        if m == "1" or getattr(_load, "registered", False):
            raise ExtensionError(f"{ENV}=1 but loading jitfuse.torch's C++ extension from {d} failed: {e}") from e
        import warnings
        warnings.warn(f"jitfuse.torch: loading the C++ extension from {d} failed ({e}); using the pure-Python ops",
                      RuntimeWarning, stacklevel=3)
        return None


EXT: Any = load()


def active() -> bool:
    """True when the C++ ops (and Sequential's C++ eager entry) serve this process."""
    return EXT is not None

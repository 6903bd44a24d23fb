# pip install runtime/python: the Python package (metadata in pyproject.toml), plus jitfuse.torch's C++ extension
# (runtime/torch, built with CMake against the torch of the interpreter that builds) when that interpreter imports torch.
"""Build hook of the jitfuse package.

``pip install runtime/python`` installs the pure-Python package. Its ``build_py`` step also builds the C++
extension of :mod:`jitfuse.torch` (``libjitfuse_torch.so``, ``_jitfuse_torch_C``, ``jitfuse_torch_build.json``)
into ``jitfuse/torch/`` when all of these hold, and says which one failed otherwise:

- ``JITFUSE_TORCH_EXTENSION`` is not ``0`` (``1``: any reason not to build is an error);
- the interpreter running the build imports a torch that jitfuse.torch supports (``jitfuse/_torch_support.py``).
  pip builds in an isolated environment without torch unless told not to: ``pip install --no-build-isolation
  runtime/python``;
- ``runtime/torch`` is beside ``runtime/python`` (an install from the checkout, not from a copied tree);
- a ``libjitfuse.so`` to link: ``$JITFUSE_LIBRARY``, one copied into ``runtime/python/jitfuse/``, or the
  checkout's ``build*/runtime/libjitfuse.so.0``;
- ``cmake`` is on ``PATH`` (and a C++17 compiler; ``$CXX`` picks it).
"""

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, List, Optional, Tuple

HERE = Path(__file__).resolve().parent
TORCH_SRC = HERE.parent / "torch"
OUTPUTS = ("libjitfuse_torch.so", "_jitfuse_torch_C*.so", "jitfuse_torch_build.json")


def mode() -> str:
    v = os.environ.get("JITFUSE_TORCH_EXTENSION", "auto").strip().lower()
    return "0" if v in ("0", "off", "false", "no") else "1" if v in ("1", "on", "true", "yes") else "auto"


def find_libjitfuse() -> Optional[Path]:
    env = os.environ.get("JITFUSE_LIBRARY")
    if env:
        return Path(env) if Path(env).is_file() else None
    for name in ("libjitfuse.so.0", "libjitfuse.so"):
        if (HERE / "jitfuse" / name).is_file():
            return HERE / "jitfuse" / name
    root = HERE.parents[1]
    for b in sorted(root.glob("build*")):
        if (b / "runtime" / "libjitfuse.so.0").is_file():
            return b / "runtime" / "libjitfuse.so.0"
    return None


def _torch_support() -> Any:
    """jitfuse/_torch_support.py (the supported torch versions), loaded by path: the package is not installed yet."""
    spec = importlib.util.spec_from_file_location("_jf_torch_support", HERE / "jitfuse" / "_torch_support.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def plan(python: str = sys.executable) -> Tuple[Optional[List[str]], str]:
    """(the CMake configure arguments, '') when the extension can be built, else (None, why not)."""
    if mode() == "0":
        return None, "JITFUSE_TORCH_EXTENSION=0"
    r = subprocess.run([python, "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True)
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["?"])[-1]
        return None, (f"{python} cannot import torch ({last}); pip builds in an isolated environment without "
                      "torch: pip install --no-build-isolation runtime/python")
    version = (r.stdout.strip().splitlines() or [""])[-1]
    support = _torch_support()
    if support.parse(version) is not None and support.parse(version) < support.MIN_TORCH:
        return None, (f"{python} imports torch {version}, older than {support.floor_text()}, the oldest "
                      f"jitfuse.torch supports: pip install 'torch>={support.floor_text()}' first")
    if not (TORCH_SRC / "CMakeLists.txt").is_file():
        return None, f"the extension's sources are not at {TORCH_SRC} (install from the jitfuse checkout)"
    lib = find_libjitfuse()
    if lib is None:
        return None, ("no libjitfuse.so to link: set JITFUSE_LIBRARY=/path/to/libjitfuse.so.0 (or build the "
                      "project first: cmake --build build)")
    if shutil.which("cmake") is None:
        return None, "cmake is not on PATH"
    args = [f"-DJITFUSE_LIBRARY={lib}", f"-DJITFUSE_TORCH_PYTHON={python}", "-DJITFUSE_TORCH_EXTENSION=ON",
            "-DCMAKE_BUILD_TYPE=Release"]
    if os.environ.get("CXX"):
        args.append(f"-DCMAKE_CXX_COMPILER={os.environ['CXX']}")
    if shutil.which("ninja"):
        args += ["-G", "Ninja"]
    return args, ""


def build_extension(build_temp: Path, dest: Path) -> str:
    """Builds the extension into ``dest`` (jitfuse/torch of the build tree); returns '' or why it did not."""
    args, why = plan()
    if args is None:
        return why
    b = build_temp / "jitfuse_torch"
    try:
        subprocess.run(["cmake", "-S", str(TORCH_SRC), "-B", str(b), *args], check=True)
        subprocess.run(["cmake", "--build", str(b), "--parallel", str(os.cpu_count() or 2)], check=True)
    except subprocess.CalledProcessError as e:
        return f"building it failed ({' '.join(e.cmd[:2])}... exited with {e.returncode}; its output is above)"
    dest.mkdir(parents=True, exist_ok=True)
    for pattern in OUTPUTS:
        found = list(b.glob(pattern))
        if not found:
            return f"the build left no {pattern} in {b}"
        for f in found:
            shutil.copy2(f, dest / f.name)
    return ""


if __name__ == "__main__":
    from setuptools import Distribution, setup
    from setuptools.command.build_py import build_py

    _planned: List[Tuple[Optional[List[str]], str]] = []

    class MaybeBinary(Distribution):
        """A wheel with the extension holds libraries for one platform, torch and Python: tagged so (not
        py3-none-any) when the extension is to be built."""

        def has_ext_modules(self) -> bool:
            if not _planned:
                _planned.append(plan())
            return _planned[0][0] is not None

    class BuildPy(build_py):
        def run(self) -> None:
            super().run()
            why = build_extension(Path(self.get_finalized_command("build").build_temp).resolve(),
                                  Path(self.build_lib) / "jitfuse" / "torch")
            if not why:
                print("jitfuse: built jitfuse.torch's C++ extension", file=sys.stderr)
            elif mode() == "1":
                raise SystemExit(f"jitfuse: JITFUSE_TORCH_EXTENSION=1 but the C++ extension was not built: {why}")
            else:
                print(f"jitfuse: installing without jitfuse.torch's C++ extension (the pure-Python ops serve): {why}",
                      file=sys.stderr)

    setup(cmdclass={"build_py": BuildPy}, distclass=MaybeBinary)

# Whether the C++ compiler that Inductor builds AOTInductor packages with links part of libstdc++ statically,
# which makes an in-process aoti_load_package crash. Needs no torch: `jitfuse doctor` makes the same check in C++.
"""The compiler check behind jitfuse.torch's export warning (docs/deploy.md, "The compiler for AOTInductor").

A devtoolset-style GCC (Red Hat's devtoolset / gcc-toolset, the GPU machine's ``/opt/gcc``) ships a
``libstdc++.so`` that is not the shared library but a GNU ld script::

    /* GNU ld script ... */
    INPUT ( /usr/lib64/libstdc++.so.6 -lstdc++_nonshared )

so everything it links gets the std:: functions of the newer GCC that the system's libstdc++.so.6 lacks
copied in from ``libstdc++_nonshared.a``. A ``*.wrapper.so`` that Inductor compiles with it, loaded into a
Python or C++ process that already has the shared libstdc++, mixes those private copies with the shared
one's state: the load segfaults in ``std::regex`` (under ``torch::aot_inductor::parse_device_str``). The
extension's CMake (runtime/torch/CMakeLists.txt) links its own libraries with ``-nostdlib++`` against this;
a package built by Inductor can only be fixed by choosing another compiler, so this module finds the one
Inductor would use and says so before the crash.
"""

import functools
import os
import re
import shlex
import shutil
import subprocess
import sys
import warnings
from dataclasses import dataclass
from typing import List, Optional, Tuple

# A compiler answering -print-file-name takes milliseconds; this bounds a wrapper script that hangs.
TIMEOUT_S = 10
# Compilers tried, in this order, for the fix the message proposes (the first whose libstdc++.so is shared).
FIX_CANDIDATES = ("/usr/bin/g++", "/usr/bin/c++", "/usr/bin/clang++")


class StaticLibstdcxxWarning(UserWarning):
    """The C++ compiler Inductor uses links part of libstdc++ statically (see :class:`StaticLibstdcxx`).
    A warning class of its own, so that a caller can make it an error
    (``warnings.simplefilter("error", StaticLibstdcxxWarning)``) or silence it."""


@dataclass(frozen=True)
class StaticLibstdcxx:
    """What was found: ``compiler`` as configured, ``path`` where it resolved, ``source`` (where the choice came
    from: $CXX, torch._inductor.config, the default), ``libstdcxx`` (its ``-print-file-name=libstdc++.so``) and
    the static parts that linker script adds (``static_parts``, e.g. ``-lstdc++_nonshared``)."""

    compiler: str
    path: str
    source: str
    libstdcxx: str
    static_parts: Tuple[str, ...]

    def message(self, when: str = "", fix: Optional[str] = None) -> str:
        """The warning: what was found, what it breaks, the fix (``fix``: default the first compiler of
        :data:`FIX_CANDIDATES` that links libstdc++ shared here); ``when``: what jitfuse was doing."""
        fix = fix if fix is not None else shared_libstdcxx_compiler() or "/usr/bin/g++"
        head = f"jitfuse ({when})" if when else "jitfuse"
        what = (f"links libstdc++ statically: it has no libstdc++.so, its linker takes {self.libstdcxx}"
                if self.libstdcxx.endswith(".a") else
                f"links part of libstdc++ statically: its libstdc++.so, {self.libstdcxx}, is a linker script adding "
                f"{', '.join(self.static_parts)}")
        return (f"{head}: the C++ compiler that Inductor builds AOTInductor packages with, {self.path} (from "
                f"{self.source}), {what}. A package it builds crashes when loaded into "
                f"a process that has the shared libstdc++ (SIGSEGV in std::regex under aoti_load_package). Build "
                f"packages with a compiler whose libstdc++.so is the shared library: CXX={fix} in the environment "
                f"before torch._inductor is imported, or torch._inductor.config.cpp.cxx = (None, {fix!r}); "
                f"see docs/deploy.md.")


def inductor_compiler() -> Tuple[str, str]:
    """(the C++ compiler command Inductor would build with, where that choice comes from). Inductor's
    ``config.cpp.cxx`` is ``(None, $CXX or "g++")``, read when ``torch._inductor.config`` is imported, and its
    ``cpp_builder`` takes the first entry that runs (None: a conda GCC, only with TORCH_INDUCTOR_INSTALL_GXX).
    That config is read only if something already imported it (this module imports no torch); otherwise
    ``$CXX``, else ``g++``, as the config would read them."""
    cfg = sys.modules.get("torch._inductor.config")
    cxx = getattr(getattr(cfg, "cpp", None), "cxx", None) if cfg is not None else None
    for entry in (cxx if isinstance(cxx, (tuple, list)) else (cxx,)):
        if isinstance(entry, str) and entry.strip() and _resolve(entry):
            return entry, "torch._inductor.config.cpp.cxx"
    env = os.environ.get("CXX", "").strip()
    if env:
        return env, "$CXX"
    return "g++", "Inductor's default, g++"


def _resolve(cmd: str) -> Optional[str]:
    try:
        argv = shlex.split(cmd)
    except ValueError:
        return None
    return shutil.which(argv[0]) if argv else None


def libstdcxx_of(cmd: str) -> Optional[str]:
    """The libstdc++.so ``cmd`` links with: what ``cmd -print-file-name=libstdc++.so`` answers when it names an
    existing file; else the one its linker opens linking an empty shared object (:func:`libstdcxx_linked`:
    a compiler whose search path comes from specs or ``-L`` defaults answers the bare name, as the GPU
    machine's /opt/gcc did); else None (no such compiler, or it failed)."""
    return _print_file_name(cmd) or libstdcxx_linked(cmd)


# ld's --verbose names each library it opens: "attempt to open /x/libstdc++.so succeeded", and for a linker
# script also "opened script file /x/libstdc++.so". A GCC with no libstdc++.so at all opens its libstdc++.a
# (the GPU machine's /opt/gcc: every C++ object it links carries its own libstdc++).
_LD_OPENED = re.compile(r"(?:attempt to open (\S*/libstdc\+\+\.(?:so|a)) succeeded|"
                        r"opened script file (\S*/libstdc\+\+\.so))")


def libstdcxx_linked(cmd: str) -> Optional[str]:
    """The libstdc++.so (or, when it has none, the libstdc++.a) the linker opens when ``cmd`` links an empty
    C++ shared object (``-Wl,--verbose``), or None. Writes only a temporary file, removed before returning."""
    import tempfile
    try:
        with tempfile.TemporaryDirectory(prefix="jitfuse-cxx-") as d:
            argv = shlex.split(cmd) + ["-shared", "-fPIC", "-x", "c++", os.devnull, "-o",
                                       os.path.join(d, "probe.so"), "-Wl,--verbose"]
            r = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S)
    except (OSError, ValueError, subprocess.SubprocessError):
        return None
    if r.returncode != 0:
        return None
    for m in _LD_OPENED.finditer(r.stdout + "\n" + r.stderr):
        p = m.group(1) or m.group(2)
        if os.path.isabs(p) and os.path.isfile(p):
            return p
    return None


def _print_file_name(cmd: str) -> Optional[str]:
    """What ``cmd -print-file-name=libstdc++.so`` answers when it names an existing file, else None (no such
    compiler, it failed, or it answered the bare name)."""
    try:
        argv = shlex.split(cmd) + ["-print-file-name=libstdc++.so"]
        r = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S)
    except (OSError, ValueError, subprocess.SubprocessError):
        return None
    lines = r.stdout.strip().splitlines()
    if r.returncode != 0 or not lines:
        return None
    p = lines[-1].strip()
    return p if os.path.isabs(p) and os.path.isfile(p) else None


def linker_script_inputs(path: str) -> Optional[List[str]]:
    """The files and ``-l`` names a GNU ld script's INPUT(...) and GROUP(...) commands list (AS_NEEDED
    entries included), or None when ``path`` is no linker script (an ELF shared object: the usual case)."""
    try:
        with open(path, "rb") as f:
            head = f.read(64 << 10)
    except OSError:
        return None
    if head.startswith(b"\x7fELF") or b"\0" in head:
        return None
    text = head.decode("utf-8", "replace")
    body = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    if not text.lstrip().startswith("/* GNU ld script") and not re.search(r"\b(?:INPUT|GROUP)\s*\(", body):
        return None
    names: List[str] = []
    for m in re.finditer(r"\b(?:INPUT|GROUP)\s*\(", body):
        depth, i = 1, m.end()
        while i < len(body) and depth:  # to the matching ')': AS_NEEDED ( ... ) nests
            depth += {"(": 1, ")": -1}.get(body[i], 0)
            i += 1
        for tok in re.split(r"[\s,()]+", body[m.end():i - 1]):
            if tok and tok != "AS_NEEDED":
                names.append(tok)
    return names


def static_parts(inputs: List[str]) -> Tuple[str, ...]:
    """The entries of a linker script that link code statically: archives (``*.a``, ``-l:*.a``) and the
    ``*nonshared*`` libraries (``-lstdc++_nonshared`` has no .so: the linker takes its .a)."""
    return tuple(n for n in inputs if n.endswith(".a") or "nonshared" in os.path.basename(n))


def static_parts_of(lib: Optional[str]) -> Tuple[str, ...]:
    """What of libstdc++ a compiler whose library is ``lib`` links statically: all of it for the archive
    (``libstdc++.a``), a linker script's static entries, nothing for the shared object."""
    if not lib:
        return ()
    if lib.endswith(".a"):
        return (lib,)
    return static_parts(linker_script_inputs(lib) or [])


@functools.lru_cache(maxsize=16)
def _inspect(cmd: str, source: str) -> Optional[StaticLibstdcxx]:
    lib = libstdcxx_of(cmd)
    parts = static_parts_of(lib)
    if not parts:
        return None
    return StaticLibstdcxx(cmd, _resolve(cmd) or cmd, source, lib, parts)


def check(cmd: Optional[str] = None, source: str = "") -> Optional[StaticLibstdcxx]:
    """The problem with ``cmd`` (default: :func:`inductor_compiler`'s), or None when its libstdc++.so is the
    shared library, or nothing could be learnt (no such compiler: Inductor would fail on its own, clearly).
    Never raises; one compiler run per command per process."""
    if cmd is None:
        cmd, source = inductor_compiler()
    return _inspect(cmd, source or "the caller")


@functools.lru_cache(maxsize=1)
def shared_libstdcxx_compiler() -> Optional[str]:
    """The first of :data:`FIX_CANDIDATES` that exists and links libstdc++ shared, for the message's fix."""
    for c in FIX_CANDIDATES:
        lib = libstdcxx_of(c) if os.access(c, os.X_OK) else None
        if lib and not static_parts_of(lib):
            return c
    return None


_warned: set = set()


def warn_if_static(when: str, stacklevel: int = 3) -> Optional[StaticLibstdcxx]:
    """Warns (:class:`StaticLibstdcxxWarning`, once per compiler and process) when Inductor's compiler links
    libstdc++ statically in part; ``when`` says what jitfuse was doing. Returns what :func:`check` found."""
    found = check()
    if found is not None and found.path not in _warned:
        _warned.add(found.path)
        warnings.warn(found.message(when), StaticLibstdcxxWarning, stacklevel=stacklevel)
    return found

# The low-level Python API over libjitfuse.so (ctypes): finding and checking the library, contexts,
# sequences, explain and program info as Python objects. Imports nothing beyond the standard library.
"""Low-level jitfuse API (no PyTorch needed).

>>> import jitfuse
>>> ctx = jitfuse.Context()
>>> seq = jitfuse.Sequence(ctx, [{"op": "linear", "in_features": 64, "out_features": 32}, {"op": "bias"}],
...                        recipe="bf16")
>>> print(seq.explain((16, 64)).forward)
"""

import ctypes
import json
import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence as Seq, Tuple, Union

from . import _abi
from ._channels import Wiring
from .errors import (AbiMismatchError, InvalidArgumentError, JitfuseError, LibraryNotFoundError, RuleError,
                     RuleLoadError, error_for_status, parse_rule_errors)

log = logging.getLogger("jitfuse")

LIBRARY_NAME = "libjitfuse.so"
SYSTEM_SONAME = "libjitfuse.so.0"  # what the system loader is asked for last
RECIPES = ("fp32", "fp16", "bf16", "fp8_delayed", "fp8_current", "fp8_block")

# ---------------------------------------------------------------------------------------------------
# Finding and loading the library


def _package_dir() -> Path:
    return Path(__file__).resolve().parent


def _source_root() -> Optional[Path]:
    """The checkout this package lives in (runtime/python/jitfuse -> the repository root), if it is one."""
    root = _package_dir().parents[2]
    return root if (root / "runtime" / "include" / "jitfuse" / "jitfuse.h").is_file() else None


def library_candidates() -> List[Tuple[str, str]]:
    """Where :func:`load_library` looks, in order, as (path, where-it-comes-from) pairs:

    1. beside the package (what ``cmake --install`` puts there),
    2. ``$JITFUSE_LIBRARY``,
    3. the build trees of the source checkout (``$JITFUSE_BUILD_DIR``, ``build/``, ``build-*/``),
    4. the system loader (``LD_LIBRARY_PATH``, ``ldconfig``) by SONAME.
    """
    out: List[Tuple[str, str]] = []
    pkg = _package_dir()
    for name in (LIBRARY_NAME, LIBRARY_NAME + ".0"):
        out.append((str(pkg / name), "beside the package"))
    env = os.environ.get("JITFUSE_LIBRARY")
    if env:
        out.append((env, "$JITFUSE_LIBRARY"))
    root = _source_root()
    if root is not None:
        builds: List[Path] = []
        bd = os.environ.get("JITFUSE_BUILD_DIR")
        if bd:
            builds.append(Path(bd) if os.path.isabs(bd) else root / bd)
        builds.append(root / "build")
        builds.extend(sorted(p for p in root.glob("build-*") if p.is_dir() and p not in builds))
        for b in builds:
            out.append((str(b / "runtime" / LIBRARY_NAME), "build tree"))
    out.append((SYSTEM_SONAME, "system loader (LD_LIBRARY_PATH, ldconfig)"))
    return out


class Library:
    """A loaded, ABI-checked libjitfuse.so: ``cdll`` is the :class:`ctypes.CDLL` with every ABI function
    declared, ``path`` where it was loaded from."""

    def __init__(self, cdll: ctypes.CDLL, path: str):
        self.cdll = cdll
        self.path = path
        self.abi_version = int(cdll.jf_abi_version())
        self.version = cdll.jf_version().decode()

    def last_error(self) -> str:
        msg = self.cdll.jf_last_error()
        return msg.decode("utf-8", "replace") if msg else ""

    def check(self, status: int, function: str) -> None:
        """Raises the exception of a failing jf_status, with jf_last_error()'s message."""
        if status != _abi.JF_OK:
            raise error_for_status(status, self.last_error(), function)

    def __repr__(self) -> str:
        return f"<jitfuse.Library {self.version} (C ABI {self.abi_version}) at {self.path}>"


_lock = threading.Lock()
_library: Optional[Library] = None


def _open(path: str, expected_abi: int) -> Library:
    cdll = ctypes.CDLL(path)
    cdll.jf_abi_version.restype = ctypes.c_int
    cdll.jf_abi_version.argtypes = []
    found = int(cdll.jf_abi_version())
    if found != expected_abi:
        raise AbiMismatchError(
            f"{path} implements jitfuse C ABI {found}, but this Python package (jitfuse "
            f"{_package_version()}) needs C ABI {expected_abi}: build the library from the same checkout as "
            f"the package (tools/dev.sh run), or point JITFUSE_LIBRARY at a matching libjitfuse.so",
            path, found, expected_abi)
    missing = _abi.declare(cdll)
    if missing:
        raise AbiMismatchError(f"{path} reports C ABI {found} but lacks {', '.join(missing)}: a broken or "
                               f"mismatched build of libjitfuse.so", path, found, expected_abi)
    return Library(cdll, path)


def _package_version() -> str:
    from . import __version__
    return __version__


def load_library(path: Optional[str] = None, expected_abi: Optional[int] = None) -> Library:
    """Loads libjitfuse.so (``path``, or the first of :func:`library_candidates` that loads) and checks its
    C ABI version. Raises :class:`LibraryNotFoundError` listing every path tried, or
    :class:`AbiMismatchError`. Does not cache: see :func:`library`."""
    expected = _abi.EXPECTED_ABI_VERSION if expected_abi is None else expected_abi
    candidates = [(path, "argument")] if path else library_candidates()
    tried: List[str] = []
    for cand, where in candidates:
        is_file_path = os.sep in cand
        if is_file_path and not os.path.exists(cand):
            tried.append(f"{cand} ({where}): not found")
            continue
        try:
            lib = _open(cand, expected)
        except AbiMismatchError:
            raise
        except OSError as e:
            tried.append(f"{cand} ({where}): {e}")
            continue
        except AttributeError as e:  # not a jitfuse library at all
            tried.append(f"{cand} ({where}): not libjitfuse ({e})")
            continue
        log.debug("loaded %s from %s (C ABI %d)", lib.version, lib.path, lib.abi_version)
        return lib
    raise LibraryNotFoundError(
        "libjitfuse.so was not found; tried:\n" + "\n".join(f"  {t}" for t in tried) +
        "\nBuild it (tools/dev.sh run), install it beside the package (cmake --install), or set "
        "JITFUSE_LIBRARY=/path/to/libjitfuse.so", tried)


def library() -> Library:
    """The process-wide library, loaded on first use."""
    global _library
    if _library is None:
        with _lock:
            if _library is None:
                _library = load_library()
    return _library


def abi_version() -> int:
    """The C ABI version of the loaded library."""
    return library().abi_version


def version() -> str:
    """The library's version string (jf_version)."""
    return library().version


def cache_dir() -> Optional[Path]:
    """The kernel cache directory the library uses (see docs/cache.md): ``$JITFUSE_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/jitfuse`` when XDG_CACHE_HOME is absolute, else ``$HOME/.cache/jitfuse``; None
    when none is set (kernels then stay in memory). Read from the environment at call time, as
    jf_context_create does."""
    d = os.environ.get("JITFUSE_CACHE_DIR")
    if d:
        return Path(d)
    x = os.environ.get("XDG_CACHE_HOME")
    if x and x.startswith("/"):
        return Path(x) / "jitfuse"
    h = os.environ.get("HOME")
    if h:
        return Path(h) / ".cache" / "jitfuse"
    return None


def _shape_array(shape: Iterable[int]) -> Tuple[Any, int]:
    dims = [int(d) for d in shape]
    if not dims:
        raise ValueError("a shape needs at least one dim")
    return (ctypes.c_int64 * len(dims))(*dims), len(dims)


def parse_shape(text: str) -> Tuple[int, ...]:
    """'8192x4096' or '8,1024,4096' -> a tuple of ints."""
    parts = text.replace(",", "x").lower().split("x")
    try:
        dims = tuple(int(p) for p in parts)
    except ValueError:
        raise ValueError(f"bad shape {text!r}: write dims separated by 'x', e.g. 8192x4096") from None
    if not dims or any(d <= 0 for d in dims):
        raise ValueError(f"bad shape {text!r}: every dim must be a positive integer")
    return dims


# ---------------------------------------------------------------------------------------------------
# Context


class _Owned:
    """A library handle this object owns: closed (destroyed through ``_DESTROY``) explicitly, by ``with``,
    or when garbage-collected."""
    _DESTROY = ""
    _handle: Optional[int] = None
    _lib: Any

    def close(self) -> None:
        """Destroys the handle (a context's sequences must be closed first)."""
        if self._handle is not None:
            self._lib.check(getattr(self._lib.cdll, self._DESTROY)(self._handle), self._DESTROY)
            self._handle = None

    def __enter__(self):
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def nccl_version() -> int:
    """The NCCL version code jitfuse loaded (22809 for 2.28.9); raises UnsupportedError saying why if none."""
    lib = library()
    v = ctypes.c_int()
    lib.check(lib.cdll.jf_nccl_version(ctypes.byref(v)), "jf_nccl_version")
    return int(v.value)


class Communicator(_Owned):
    """An NCCL communicator for sequences with collectives (docs/parallel.md): rank ``rank`` of
    ``world_size`` ranks that share ``unique_id`` (from :meth:`unique_id` on one rank, sent to every rank),
    created on the current CUDA device; or :meth:`wrap` of a host's ``ncclComm_t``."""

    _DESTROY = "jf_comm_destroy"

    def __init__(self, unique_id: bytes, world_size: int, rank: int, lib: Optional[Library] = None,
                 _wrap: Optional[int] = None):
        self._lib = lib or library()
        h = _abi.jf_comm()
        if _wrap is not None:
            self._lib.check(self._lib.cdll.jf_comm_wrap(ctypes.c_void_p(_wrap), ctypes.byref(h)), "jf_comm_wrap")
        else:
            uid = bytes(unique_id)
            if len(uid) != _abi.COMM_ID_BYTES:
                raise InvalidArgumentError(f"jitfuse.Communicator: a unique id has {_abi.COMM_ID_BYTES} bytes, "
                                           f"got {len(uid)}")
            buf = ctypes.create_string_buffer(uid, len(uid))
            self._lib.check(self._lib.cdll.jf_comm_create(buf, len(uid), int(world_size), int(rank),
                                                          ctypes.byref(h)), "jf_comm_create")
        self._handle = h.value
        w, r, d = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
        self._lib.check(self._lib.cdll.jf_comm_info(self._handle, ctypes.byref(w), ctypes.byref(r), ctypes.byref(d)),
                        "jf_comm_info")
        self.world_size, self.rank, self.device = int(w.value), int(r.value), int(d.value)

    @staticmethod
    def unique_id(lib: Optional[Library] = None) -> bytes:
        lib = lib or library()
        buf = ctypes.create_string_buffer(_abi.COMM_ID_BYTES)
        lib.check(lib.cdll.jf_comm_unique_id(buf, _abi.COMM_ID_BYTES), "jf_comm_unique_id")
        return buf.raw

    @classmethod
    def wrap(cls, nccl_comm: int, lib: Optional[Library] = None) -> "Communicator":
        """Borrows a host's ``ncclComm_t`` (as an int); the host keeps it alive and destroys it."""
        return cls(b"", 0, 0, lib, _wrap=int(nccl_comm))

    @property
    def handle(self) -> int:
        if self._handle is None:
            raise InvalidArgumentError("jitfuse.Communicator is closed")
        return self._handle

    def __repr__(self) -> str:
        return f"<jitfuse.Communicator rank {self.rank} of {self.world_size} on cuda:{self.device}>"


class Context(_Owned):
    """A jitfuse context: rules (built-in, ``JITFUSE_RULE_PATH``, :meth:`load_rules`), the kernel cache
    and loaded kernels. Needs no GPU. Use one per device; close it (or use ``with``) after its sequences.

    ``rules``: rule files or directories to load at once (each raising :class:`RuleLoadError` on errors).
    """

    _DESTROY = "jf_context_destroy"

    def __init__(self, rules: Iterable[Union[str, os.PathLike]] = (), lib: Optional[Library] = None):
        self._lib = lib or library()
        handle = _abi.jf_context()
        self._lib.check(self._lib.cdll.jf_context_create(ctypes.byref(handle)), "jf_context_create")
        self._handle: Optional[int] = handle.value
        self.rule_paths: List[str] = []
        log.debug("context created (cache %s)", self.cache_dir)
        for p in rules:
            self.load_rules(p)

    @property
    def handle(self) -> int:
        if self._handle is None:
            raise JitfuseError("the context is closed")
        return self._handle

    @property
    def lib(self) -> Library:
        return self._lib

    @property
    def cache_dir(self) -> Optional[Path]:
        """The kernel cache directory (see :func:`cache_dir`)."""
        return cache_dir()

    def load_rules(self, path: Union[str, os.PathLike], strict: bool = True) -> List[RuleError]:
        """Loads a rules file or a directory of ``*.json`` rules files. A broken rule is skipped (the
        others load). ``strict``: raise :class:`RuleLoadError` (with file/line/col of each problem) if
        anything was skipped; otherwise log a warning per problem and return them."""
        p = os.fspath(path)
        n = ctypes.c_int(0)
        self._lib.check(self._lib.cdll.jf_context_load_rules(self.handle, p.encode(), ctypes.byref(n)),
                        "jf_context_load_rules")
        self.rule_paths.append(p)
        if n.value == 0:
            log.info("loaded rules from %s", p)
            return []
        errors = parse_rule_errors(self._lib.last_error())
        if strict:
            raise RuleLoadError(p, errors, n.value)
        for e in errors:
            log.warning("rule skipped: %s", e)
        return errors

    def sequence(self, source: Any, recipe: str = "bf16", name: Optional[str] = None) -> "Sequence":
        """Shorthand for ``Sequence(self, source, recipe, name)``."""
        return Sequence(self, source, recipe, name)

    def __repr__(self) -> str:
        state = "closed" if self._handle is None else f"cache {self.cache_dir}"
        rules = f", +rules {self.rule_paths}" if self.rule_paths else ""
        return f"<jitfuse.Context {state}{rules}>"


# ---------------------------------------------------------------------------------------------------
# Explain and program info as Python objects


@dataclass(frozen=True)
class OpShape:
    """One op of an explained sequence with its input and output shape."""
    index: int
    op: str
    input: Tuple[int, ...]
    output: Tuple[int, ...]


@dataclass(frozen=True)
class Decision:
    """A window a rule matched in a pass, and whether it was taken (``reason`` says why not)."""
    pass_: str
    rule: str
    begin: int
    end: int
    priority: int
    taken: bool
    reason: str

    def __str__(self) -> str:
        what = "taken" if self.taken else f"not taken: {self.reason}"
        return f"{self.pass_:8s} ops [{self.begin}, {self.end})  {self.rule}  priority {self.priority}  {what}"


@dataclass(frozen=True)
class Group:
    """A final group of a plan: ops [begin, end), the rule that fused them ('' when unfused) and its
    implementation."""
    begin: int
    end: int
    ops: Tuple[str, ...]
    rule: str
    priority: int
    impl: str
    joint: bool

    @property
    def fused(self) -> bool:
        return bool(self.rule)

    def __str__(self) -> str:
        how = f"{self.rule}: {self.impl}" if self.rule else "unfused"
        return f"[{self.begin}, {self.end})  {' '.join(self.ops)}  ({how})"


@dataclass(frozen=True)
class ProgramExplain:
    """The program a plan lowers to, as ``explain --program`` prints it: steps, buffers, saved set, arena
    sizes. A record of the library's ``Program`` (the C++ IR), not a handle to it. Steps and buffers stay
    dicts as the library writes them (see docs/cli.md#explain---program)."""
    arch: str
    recipe: str
    training: bool
    forward: Tuple[Dict[str, Any], ...]
    backward: Tuple[Dict[str, Any], ...]
    buffers: Tuple[Dict[str, Any], ...]
    saved: Dict[str, Any]
    arena_bytes: Dict[str, int]
    raw: Dict[str, Any] = field(repr=False, compare=False)

    @classmethod
    def from_json(cls, j: Mapping[str, Any]) -> "ProgramExplain":
        return cls(arch=str(j.get("arch", "")), recipe=str(j.get("recipe", "")), training=bool(j.get("training")),
                   forward=tuple(j.get("forward", ())), backward=tuple(j.get("backward", ())),
                   buffers=tuple(j.get("buffers", ())), saved=dict(j.get("saved", {})),
                   arena_bytes=dict(j.get("arena_bytes", {})), raw=dict(j))


@dataclass(frozen=True)
class Explanation:
    """jf_sequence_explain as objects: the ops with shapes, every decision, the forward and backward
    groups and the program. ``raw`` is the JSON document."""
    shape: Tuple[int, ...]
    training: bool
    arch: int
    ops: Tuple[OpShape, ...]
    decisions: Tuple[Decision, ...]
    forward: Tuple[Group, ...]
    backward: Tuple[Group, ...]
    program: Optional[ProgramExplain]
    raw: Dict[str, Any] = field(repr=False, compare=False)

    @classmethod
    def from_json(cls, j: Mapping[str, Any], shape: Tuple[int, ...], training: bool, arch: int) -> "Explanation":
        def groups(key: str) -> Tuple[Group, ...]:
            return tuple(Group(int(g["begin"]), int(g["end"]), tuple(g.get("ops", ())), g.get("rule") or "",
                               int(g.get("priority", 0)), g.get("impl", ""), bool(g.get("joint", False)))
                         for g in j.get(key, ()))
        ops = tuple(OpShape(int(o["index"]), o["op"], tuple(o.get("in", ())), tuple(o.get("out", ())))
                    for o in j.get("ops", ()))
        decisions = tuple(Decision(d["pass"], d["rule"], int(d["begin"]), int(d["end"]), int(d.get("priority", 0)),
                                   bool(d["taken"]), d.get("reason", "")) for d in j.get("decisions", ()))
        prog = ProgramExplain.from_json(j["program"]) if isinstance(j.get("program"), dict) else None
        return cls(tuple(shape), training, arch, ops, decisions, groups("forward"), groups("backward"), prog, dict(j))

    def fused_groups(self, direction: str = "forward") -> Tuple[Group, ...]:
        """The groups of a pass ('forward' or 'backward') that a rule fused."""
        return tuple(g for g in getattr(self, direction) if g.fused)

    def format(self) -> str:
        """A text rendering like ``jitfuse explain``'s groups section."""
        dims = "x".join(map(str, self.shape))
        lines = [f"input {dims}, {'training' if self.training else 'inference'}, sm_{self.arch}", "forward groups:"]
        lines += [f"  {g}" for g in self.forward]
        if self.training:
            lines.append("backward groups:")
            lines += [f"  {g}" for g in self.backward]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()


@dataclass(frozen=True)
class TensorInfo:
    """A tensor of a prepared program (jf_tensor_info): ``dtype`` is a name ('bfloat16', 'float32',
    'uint8', 'float8_e4m3fn', ...), ``dl_dtype`` the DLPack (code, bits, lanes)."""
    name: str
    op_index: int
    dtype: str
    dl_dtype: Tuple[int, int, int]
    shape: Tuple[int, ...]
    bytes: int
    offset: int


@dataclass(frozen=True)
class ProgramInfo:
    """What a prepared (shape, training) needs and makes (jf_program_info)."""
    shape: Tuple[int, ...]
    training: bool
    outputs: Tuple[TensorInfo, ...]
    params: Tuple[TensorInfo, ...]
    saved: Tuple[TensorInfo, ...]
    saved_bytes: int
    forward_workspace_bytes: int
    backward_workspace_bytes: int
    alignment: int
    uses_rng: bool
    rng_offset_advance: int

    @property
    def output(self) -> TensorInfo:
        return self.outputs[0]

    @property
    def extra_outputs(self) -> Tuple[TensorInfo, ...]:
        return self.outputs[1:]


def _tensor_infos(ptr: Any, n: int) -> Tuple[TensorInfo, ...]:
    out = []
    for i in range(n):
        t = ptr[i]
        d = t.dtype
        out.append(TensorInfo(name=(t.name or b"").decode(), op_index=int(t.op_index),
                              dtype=_abi.dtype_name(d.code, d.bits, d.lanes), dl_dtype=(d.code, d.bits, d.lanes),
                              shape=tuple(int(t.shape[k]) for k in range(min(int(t.ndim), _abi.JF_MAX_DIMS))),
                              bytes=int(t.bytes), offset=int(t.offset)))
    return tuple(out)


# ---------------------------------------------------------------------------------------------------
# Sequence

OpSpec = Mapping[str, Any]
Source = Union[str, os.PathLike, Seq[OpSpec], Mapping[str, Any]]


class Sequence(_Owned):
    """A sequence of ops under a recipe, created from

    - JSON text (``jitfuse.sequence/1``) or a dict of that document,
    - a file (:class:`pathlib.Path` / ``os.PathLike``, or a str that does not start with ``{``),
    - a list of op dicts ``[{"op": "linear", "in_features": 64, "out_features": 32}, {"op": "bias"}]``
      (through the builder functions; ``name`` names it).

    Errors raise :class:`ParseError` / :class:`InvalidArgumentError` with the library's message
    (``<sequence>:1:9: op 0: unknown op 'geluu'; ...``).
    """

    _DESTROY = "jf_sequence_destroy"

    def __init__(self, ctx: Context, source: Source, recipe: str = "bf16", name: Optional[str] = None):
        self._ctx = ctx
        self._lib = ctx.lib
        self.recipe = recipe
        self._handle: Optional[int] = None
        self._info_cache: Dict[Tuple[Tuple[int, ...], bool], ProgramInfo] = {}
        self._explain_lock = threading.Lock()
        self.ops: Optional[List[Dict[str, Any]]] = None
        self.name = name or "sequence"
        self.source = "<builder>"
        handle = _abi.jf_sequence()
        cdll = self._lib.cdll
        if isinstance(source, Mapping):
            source = json.dumps(source)
        if isinstance(source, (list, tuple)):
            self._build(list(source), handle)
        elif isinstance(source, os.PathLike) or (isinstance(source, str) and not source.lstrip().startswith("{")):
            path = os.fspath(source)
            self._lib.check(cdll.jf_sequence_create_from_file(ctx.handle, path.encode(), recipe.encode(),
                                                              ctypes.byref(handle)), "jf_sequence_create_from_file")
            self.source = path
            self._remember_json(Path(path).read_text(errors="replace"))
        elif isinstance(source, str):
            self._lib.check(cdll.jf_sequence_create(ctx.handle, source.encode(), recipe.encode(),
                                                    ctypes.byref(handle)), "jf_sequence_create")
            self.source = "<json>"
            self._remember_json(source)
        else:
            raise TypeError(f"jitfuse.Sequence: source must be JSON text, a path, a dict or a list of op dicts, "
                            f"not {type(source).__name__}")
        self._handle = handle.value
        log.debug("sequence %r created (%d ops, recipe %s)", self.name, self.num_ops, recipe)

    @classmethod
    def from_json(cls, ctx: Context, text: str, recipe: str = "bf16") -> "Sequence":
        return cls(ctx, text if text.lstrip().startswith("{") else json.loads(text), recipe)

    @classmethod
    def from_file(cls, ctx: Context, path: Union[str, os.PathLike], recipe: str = "bf16") -> "Sequence":
        return cls(ctx, Path(path), recipe)

    @classmethod
    def from_ops(cls, ctx: Context, ops: Seq[OpSpec], recipe: str = "bf16", name: Optional[str] = None) -> "Sequence":
        return cls(ctx, list(ops), recipe, name)

    def _remember_json(self, text: str) -> None:
        try:
            doc = json.loads(text)
            self.ops = [dict(o) for o in doc.get("ops", [])]
            self.name = doc.get("name", self.name) if self.name == "sequence" else self.name
        except (ValueError, AttributeError, TypeError):
            self.ops = None

    def _build(self, ops: List[OpSpec], handle: Any) -> None:
        cdll = self._lib.cdll
        b = _abi.jf_builder()
        self._lib.check(cdll.jf_builder_create(self.name.encode(), ctypes.byref(b)), "jf_builder_create")
        try:
            for i, spec in enumerate(ops):
                if not isinstance(spec, Mapping) or "op" not in spec:
                    raise TypeError(f"op {i}: expected a dict with an 'op' key, got {spec!r}")
                attrs = {k: v for k, v in spec.items() if k != "op"}
                self._lib.check(cdll.jf_builder_add(b, str(spec["op"]).encode(),
                                                    json.dumps(attrs).encode() if attrs else None), "jf_builder_add")
            self._lib.check(cdll.jf_builder_finish(b, self._ctx.handle, self.recipe.encode(), ctypes.byref(handle)),
                            "jf_builder_finish")
        finally:
            cdll.jf_builder_destroy(b)
        self.ops = [dict(o) for o in ops]

    @property
    def handle(self) -> int:
        if self._handle is None:
            raise JitfuseError("the sequence is closed")
        return self._handle

    @property
    def context(self) -> Context:
        return self._ctx

    @property
    def lib(self) -> Library:
        return self._lib

    @property
    def num_ops(self) -> int:
        return int(self._lib.cdll.jf_sequence_num_ops(self.handle))

    def __len__(self) -> int:
        return self.num_ops

    def wiring(self) -> Wiring:
        """The extra input and extra output slots and the channels, as the library's parser numbered them
        (``jf_sequence_wiring``; no GPU): a :class:`jitfuse._channels.Wiring`."""
        out = ctypes.c_char_p()
        self._lib.check(self._lib.cdll.jf_sequence_wiring(self.handle, ctypes.byref(out)), "jf_sequence_wiring")
        return Wiring.from_json(json.loads(out.value.decode()))

    def check_counts(self, caller: Optional[str], n_extra_inputs: int, shape: Optional[Iterable[int]] = None,
                     n_params: int = -1, n_extra_outputs: int = -1, n_grad_extra_outputs: int = -1) -> None:
        """The library's check of a call's tensor counts (``jf_sequence_check_counts``; no GPU): raises
        :class:`InvalidArgumentError` with its message ("<caller>: sequence 'mlp' takes 1 extra input(s) (...);
        got 0") for a wrong count. ``n_params`` >= 0 counts the parameters of the ops inferred for ``shape``;
        ``n_extra_outputs`` >= 0 checks a backward's extra outputs and their gradients too."""
        dims = (ctypes.c_int64 * 0)()
        nd = 0
        if shape is not None:
            dims_l = [int(d) for d in shape]
            dims, nd = (ctypes.c_int64 * len(dims_l))(*dims_l), len(dims_l)
        self._lib.check(self._lib.cdll.jf_sequence_check_counts(
            self.handle, caller.encode() if caller is not None else None, dims, nd, int(n_extra_inputs),
            int(n_params), int(n_extra_outputs), int(n_grad_extra_outputs)), "jf_sequence_check_counts")

    def explain(self, shape: Iterable[int], training: bool = True, arch: int = 90,
                world_size: Optional[int] = None, rank: int = 0) -> Explanation:
        """The fusion decisions and the program for an input shape, without compiling or running anything
        (no GPU needed). ``arch``: SM version as a number (90 for sm_90, 80 for sm_80). ``world_size``,
        ``rank``: plan one rank of a tensor-parallel group (docs/parallel.md; default: the sequence's
        communicator's, or one rank)."""
        dims, nd = _shape_array(shape)
        out = ctypes.c_char_p()
        cdll = self._lib.cdll
        with self._explain_lock:  # the JSON buffer belongs to the sequence until the next explain
            if world_size is None:
                self._lib.check(cdll.jf_sequence_explain(self.handle, dims, nd, int(bool(training)), int(arch),
                                                         ctypes.byref(out)), "jf_sequence_explain")
            else:
                self._lib.check(cdll.jf_sequence_explain_parallel(self.handle, dims, nd, int(bool(training)),
                                                                  int(arch), int(world_size), int(rank),
                                                                  ctypes.byref(out)),
                                "jf_sequence_explain_parallel")
            doc = json.loads(out.value.decode())
        return Explanation.from_json(doc, tuple(dims), bool(training), int(arch))

    def prepare(self, shape: Iterable[int], training: bool = True, stream: Optional[int] = None) -> None:
        """Plans, compiles (or loads from the cache) and loads everything a (shape, training) needs, so that
        later calls can be captured in a CUDA graph. Needs a GPU. ``stream``: a CUstream as an int."""
        dims, nd = _shape_array(shape)
        self._lib.check(self._lib.cdll.jf_sequence_prepare(self.handle, dims, nd, int(bool(training)), stream),
                        "jf_sequence_prepare")

    def info(self, shape: Iterable[int], training: bool = True) -> ProgramInfo:
        """Output shapes/dtypes, parameters, saved-buffer layout and workspace sizes of a (shape, training),
        preparing it first if needed (needs a GPU). Cached per (shape, training) in Python."""
        key = (tuple(int(d) for d in shape), bool(training))
        hit = self._info_cache.get(key)
        if hit is not None:
            return hit
        dims, nd = _shape_array(key[0])
        pi = _abi.jf_program_info()
        self._lib.check(self._lib.cdll.jf_sequence_info(self.handle, dims, nd, int(key[1]), ctypes.byref(pi)),
                        "jf_sequence_info")
        info = ProgramInfo(
            shape=key[0], training=key[1], outputs=_tensor_infos(pi.outputs, pi.n_outputs),
            params=_tensor_infos(pi.params, pi.n_params), saved=_tensor_infos(pi.saved, pi.n_saved),
            saved_bytes=int(pi.saved_bytes), forward_workspace_bytes=int(pi.forward_workspace_bytes),
            backward_workspace_bytes=int(pi.backward_workspace_bytes), alignment=int(pi.alignment),
            uses_rng=bool(pi.uses_rng), rng_offset_advance=int(pi.rng_offset_advance))
        self._info_cache[key] = info
        log.debug("sequence %r prepared for %s (%s): saved %d B, workspaces %d/%d B", self.name, key[0],
                  "training" if key[1] else "inference", info.saved_bytes, info.forward_workspace_bytes,
                  info.backward_workspace_bytes)
        return info

    def cached_info(self, shape: Tuple[int, ...], training: bool) -> Optional[ProgramInfo]:
        """The ProgramInfo of an already prepared (shape, training), or None (never calls the library)."""
        return self._info_cache.get((shape, training))

    def open(self, shape: Iterable[int], training: bool = True,
             stream: Optional[int] = None) -> "PreparedProgram":
        """The prepared program of (shape, training) as a :class:`PreparedProgram` handle (jf_program_open;
        prepares it first if needed): calls on it skip the sequence's lookup."""
        return PreparedProgram(self, shape, training, stream)

    def forward(self, args: _abi.jf_forward_args, stream: Optional[int] = None) -> Optional[int]:
        """jf_forward with a filled :class:`jitfuse._abi.jf_forward_args`; returns the jf_saved handle the
        library allocated (training without a host saved block), else None."""
        saved_handle = _abi.jf_saved()
        self._lib.check(self._lib.cdll.jf_forward(self.handle, ctypes.byref(args), ctypes.byref(saved_handle),
                                                  stream), "jf_forward")
        return saved_handle.value

    def backward(self, args: _abi.jf_backward_args, stream: Optional[int] = None) -> None:
        """jf_backward with a filled :class:`jitfuse._abi.jf_backward_args`."""
        self._lib.check(self._lib.cdll.jf_backward(self.handle, ctypes.byref(args), stream), "jf_backward")

    def set_comm(self, comm: "Communicator", group: str = "tp") -> None:
        """Binds the communicator of the sequence's tensor-parallel group (docs/parallel.md); before the first
        prepare, info or call. The sequence keeps the communicator alive."""
        self._lib.check(self._lib.cdll.jf_sequence_set_comm(self.handle, group.encode(), comm.handle),
                        "jf_sequence_set_comm")
        self._comm = comm

    def fp8_state(self, op_index: int) -> _abi.jf_fp8_state:
        """Device pointers of a quantize op's FP8 recipe state (scale, scale_inv, amax_history)."""
        st = _abi.jf_fp8_state()
        self._lib.check(self._lib.cdll.jf_sequence_fp8_state(self.handle, int(op_index), ctypes.byref(st)),
                        "jf_sequence_fp8_state")
        return st

    def fp8_operand_state(self, op_index: int, tensor: str) -> _abi.jf_fp8_state:
        """Device pointers of a linear op's FP8 operand state (``tensor``: "input", "weight" or "grad_output")."""
        st = _abi.jf_fp8_state()
        self._lib.check(self._lib.cdll.jf_sequence_fp8_operand_state(self.handle, int(op_index), tensor.encode(),
                                                                      ctypes.byref(st)),
                        "jf_sequence_fp8_operand_state")
        return st

    def __repr__(self) -> str:
        if self._handle is None:
            return f"<jitfuse.Sequence {self.name!r} (closed)>"
        kinds = " ".join(o.get("op", "?") for o in self.ops) if self.ops is not None else f"{self.num_ops} ops"
        return f"<jitfuse.Sequence {self.name!r} {self.recipe}: {kinds}>"


class PreparedProgram(_Owned):
    """One prepared (shape, training) of a :class:`Sequence` (a ``jf_program``): what the sequence's
    ``forward``/``backward`` look up per call, resolved once, so a call is the call and nothing else (no
    lookup, lock, environment read or driver query in the library). Keeps its sequence alive in the library;
    closed explicitly, by ``with``, or when garbage-collected."""

    _DESTROY = "jf_program_close"

    def __init__(self, seq: Sequence, shape: Iterable[int], training: bool = True, stream: Optional[int] = None):
        self._lib = seq.lib
        self._handle: Optional[int] = None
        # The library's program keeps its sequence alive but not the context: holding the Python sequence
        # (which holds its Context) closes this handle before the context is destroyed, whatever order the
        # garbage collector or interpreter shutdown frees them in.
        self._seq = seq
        self.shape = tuple(int(d) for d in shape)
        self.training = bool(training)
        dims, nd = _shape_array(self.shape)
        handle = _abi.jf_program()
        self._lib.check(self._lib.cdll.jf_program_open(seq.handle, dims, nd, int(self.training), stream,
                                                       ctypes.byref(handle)), "jf_program_open")
        self._handle = handle.value

    @property
    def handle(self) -> int:
        if self._handle is None:
            raise ValueError("jitfuse.PreparedProgram: the program is closed")
        return self._handle

    def forward(self, args: _abi.jf_forward_args, stream: Optional[int] = None) -> Optional[int]:
        """jf_program_forward; as :meth:`Sequence.forward`."""
        saved_handle = _abi.jf_saved()
        self._lib.check(self._lib.cdll.jf_program_forward(self.handle, ctypes.byref(args), ctypes.byref(saved_handle),
                                                          stream), "jf_program_forward")
        return saved_handle.value

    def grad_aliases(self) -> List[Tuple[int, str, int, int]]:
        """jf_program_grad_aliases: (op index, name, byte offset in the saved buffer, bytes) of each gradient
        the backward may write in place over the saved buffer (op index -1: ``"grad_input"``)."""
        arr = ctypes.POINTER(_abi.jf_grad_alias)()
        n = ctypes.c_int(0)
        self._lib.check(self._lib.cdll.jf_program_grad_aliases(self.handle, ctypes.byref(arr), ctypes.byref(n)),
                        "jf_program_grad_aliases")
        return [(arr[i].op_index, arr[i].name.decode(), int(arr[i].saved_offset), int(arr[i].bytes))
                for i in range(n.value)]

    def backward(self, args: _abi.jf_backward_args, stream: Optional[int] = None) -> None:
        """jf_program_backward; as :meth:`Sequence.backward`."""
        self._lib.check(self._lib.cdll.jf_program_backward(self.handle, ctypes.byref(args), stream),
                        "jf_program_backward")

    def __repr__(self) -> str:
        state = "closed" if self._handle is None else ("training" if self.training else "inference")
        return f"<jitfuse.PreparedProgram {list(self.shape)} ({state})>"


def __getattr__(name: str) -> Any:
    # ``Program`` was this module's name of ProgramExplain until the three Programs got distinct names
    # (issue 31): kept, with a warning, for code that imported it.
    if name == "Program":
        import warnings
        warnings.warn("jitfuse.lib.Program is deprecated: use jitfuse.ProgramExplain", DeprecationWarning, 2)
        return ProgramExplain
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

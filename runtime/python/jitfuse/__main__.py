# `python -m jitfuse ...`: explain, rules validate, cache dir/ls through the library (jitfuse.lib); what the
# C ABI has no function for (rules list, cache show/stats/verify/prune/clear) is delegated to the `jitfuse` CLI.
"""python -m jitfuse version | explain | rules | cache"""

import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

from . import __version__
from .errors import JitfuseError
from .lib import Context, Sequence, cache_dir, library, parse_shape


def _arch(text: Optional[str]) -> int:
    if not text:
        return 90
    t = text.lower().replace("sm_", "").replace("compute_", "").rstrip("a")
    try:
        return int(t)
    except ValueError:
        raise SystemExit(f"python -m jitfuse: bad --arch {text!r}; write e.g. sm_90 or 90") from None


def _cli_binary() -> Optional[str]:
    """The `jitfuse` CLI: $JITFUSE_CLI, beside the library (build tree tools/ or install bin/), or PATH."""
    env = os.environ.get("JITFUSE_CLI")
    if env:
        return env
    try:
        lib_dir = Path(library().path).resolve().parent
        for cand in (lib_dir.parent / "tools" / "jitfuse", lib_dir.parent / "bin" / "jitfuse",
                     lib_dir.parent.parent / "bin" / "jitfuse"):
            if cand.is_file() and os.access(cand, os.X_OK):
                return str(cand)
    except JitfuseError:
        pass
    return shutil.which("jitfuse")


def _delegate(args: List[str]) -> int:
    exe = _cli_binary()
    if exe is None:
        print("python -m jitfuse: this command needs the `jitfuse` command line (the C ABI has no function for "
              "it); put it on PATH or set JITFUSE_CLI", file=sys.stderr)
        return 2
    return subprocess.call([exe, *args])


def cmd_version(a: argparse.Namespace) -> int:
    lib = library()
    print(f"jitfuse {lib.version} (C ABI {lib.abi_version}), Python package {__version__}, library {lib.path}")
    return 0


def cmd_explain(a: argparse.Namespace) -> int:
    with Context() as ctx:
        for r in a.rules:
            for e in ctx.load_rules(r, strict=False):
                print(f"python -m jitfuse: rule skipped: {e}", file=sys.stderr)
        seq = Sequence(ctx, Path(a.sequence), a.recipe)
        try:
            e = seq.explain(parse_shape(a.shape), training=not a.inference, arch=_arch(a.arch))
        finally:
            seq.close()
    if a.json:
        doc = dict(e.raw)
        if not a.program:
            doc.pop("program", None)
        print(json.dumps({"sequence": seq.name, "file": a.sequence, "shape": list(e.shape), "recipe": a.recipe,
                          "arch": e.arch, "training": e.training, **doc}, indent=2))
        return 0
    print(f"sequence {seq.name!r} ({a.sequence}): {len(e.ops)} ops, input {'x'.join(map(str, e.shape))}")
    print(f"recipe {a.recipe}, arch sm_{e.arch}, {'training (forward + backward)' if e.training else 'inference'}")
    print("\nops:")
    for o in e.ops:
        print(f"  {o.index:3d}  {o.op:18s} {'x'.join(map(str, o.input))} -> {'x'.join(map(str, o.output))}")
    for p in ("joint", "forward", "backward"):
        ds = [d for d in e.decisions if d.pass_ == p]
        if ds:
            print(f"\n{p} pass:")
            for d in ds:
                what = "taken" if d.taken else f"not taken: {d.reason}"
                print(f"  ops [{d.begin}, {d.end})  {d.rule:28s} priority {d.priority:<4d} {what}")
    for title, groups in (("forward groups", e.forward), ("backward groups", e.backward if e.training else ())):
        if groups or title == "forward groups":
            print(f"\n{title}:")
            for g in groups:
                how = f"{g.rule}: {g.impl}" if g.rule else "unfused"
                print(f"  [{g.begin}, {g.end})  {' '.join(g.ops):34s} {how}")
    if a.program and e.program is not None:
        print("\nprogram:")
        print(json.dumps(e.program.raw, indent=2))
    return 0


def cmd_rules(a: argparse.Namespace) -> int:
    if a.rules_cmd == "list":
        return _delegate(["rules", "list", *a.rest])
    bad = 0
    with Context() as ctx:
        for p in a.paths:
            errors = ctx.load_rules(p, strict=False)
            if errors:
                bad += 1
                for e in errors:
                    print(e)
                print(f"{p}: {len(errors)} error(s)")
            else:
                print(f"{p}: ok")
    return 1 if bad else 0


_MAGIC = b"JFKENTRY"


def _read_entry_meta(path: Path) -> Dict[str, Any]:
    """Reads the key and metadata of a cache entry (docs/cache.md "Entry format") without the CUBIN."""
    with path.open("rb") as f:
        head = f.read(12)
        if len(head) != 12 or head[:8] != _MAGIC:
            raise ValueError("not a jitfuse cache entry")
        (n,) = struct.unpack("<Q", f.read(8))
        key = f.read(n).decode()
        (n,) = struct.unpack("<Q", f.read(8))
        if n > 16 << 20:
            raise ValueError("metadata too large")
        meta = json.loads(f.read(n))
    meta["key"] = key
    meta["size"] = path.stat().st_size
    use = path.with_suffix(".use")
    if use.exists():
        meta["hits"] = use.stat().st_size
    return meta


def _entries(root: Path) -> Iterator[Dict[str, Any]]:
    for p in sorted(root.glob("v*/??/*.jfk")):
        try:
            yield _read_entry_meta(p)
        except (OSError, ValueError) as e:
            yield {"key": p.stem, "error": str(e), "size": p.stat().st_size if p.exists() else 0}


def cmd_cache(a: argparse.Namespace) -> int:
    d = cache_dir()
    if a.cache_cmd == "dir":
        print(d if d is not None else "(none: kernels are kept in memory only)")
        return 0
    if a.cache_cmd == "ls":
        entries = list(_entries(d)) if d is not None and d.is_dir() else []
        if a.json:
            print(json.dumps({"dir": str(d) if d else None, "entries": entries}, indent=2))
            return 0
        print(f"{'KEY':13s} {'RULE':24s} {'OPS':28s} {'RECIPE':7s} {'ARCH':7s} {'SIZE':>10s}")
        for m in entries:
            ops = m.get("ops", "")
            ops = " ".join(ops) if isinstance(ops, list) else str(ops)
            print(f"{m['key'][:12]:13s} {str(m.get('rule') or '(unfused)'):24s} {ops[:28]:28s} "
                  f"{str(m.get('recipe', '?')):7s} {str(m.get('arch', '?')):7s} {m['size']:>10d}")
        print(f"{len(entries)} entries in {d}")
        return 0
    return _delegate(["cache", a.cache_cmd, *a.rest])


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jitfuse", description="jitfuse from Python (over libjitfuse.so)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("version", help="library, ABI and package versions").set_defaults(fn=cmd_version)
    ex = sub.add_parser("explain", help="every fusion decision for a sequence (no GPU needed)")
    ex.add_argument("sequence")
    ex.add_argument("--recipe", required=True)
    ex.add_argument("--shape", required=True)
    ex.add_argument("--arch")
    ex.add_argument("--rules", action="append", default=[])
    ex.add_argument("--inference", action="store_true")
    ex.add_argument("--json", action="store_true")
    ex.add_argument("--program", action="store_true")
    ex.set_defaults(fn=cmd_explain)
    ru = sub.add_parser("rules", help="rules validate PATH... (library) | rules list (the jitfuse CLI)")
    rsub = ru.add_subparsers(dest="rules_cmd", required=True)
    rv = rsub.add_parser("validate")
    rv.add_argument("paths", nargs="+")
    rl = rsub.add_parser("list")
    rl.add_argument("rest", nargs=argparse.REMAINDER)
    ru.set_defaults(fn=cmd_rules)
    ca = sub.add_parser("cache", help="cache dir | ls [--json] (here); show|stats|verify|prune|clear (the jitfuse CLI)")
    csub = ca.add_subparsers(dest="cache_cmd", required=True)
    csub.add_parser("dir")
    cl = csub.add_parser("ls")
    cl.add_argument("--json", action="store_true")
    for c in ("show", "stats", "verify", "prune", "clear"):
        csub.add_parser(c).add_argument("rest", nargs=argparse.REMAINDER)
    ca.set_defaults(fn=cmd_cache)
    a = ap.parse_args(argv)
    try:
        return a.fn(a)
    except JitfuseError as e:
        print(f"python -m jitfuse {a.cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

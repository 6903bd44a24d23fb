#!/usr/bin/env python3
# Fails when one of our shared libraries exports std:: symbols (CTest: unit:exports, unit:exports_torch): a copy of
# libstdc++'s code exported beside the process's shared libstdc++ crashes it (issue 41; docs/deploy.md).
"""Checks the dynamic symbol table of shared libraries for exported ``std::`` (and ``__gnu_cxx::``) symbols.

    check_exports.py [--nm NM] [--strict LIB]... [LIB]...

For every library, ``nm -D --defined-only -C LIB``; each defined symbol whose entity (after "typeinfo for",
"vtable for", a template's return type...) is in namespace ``std`` or ``__gnu_cxx`` is a finding:

- ``--strict LIB``: any such symbol. For libjitfuse.so, whose version script (runtime/jitfuse.map) exports the
  C ABI (``jf_*``) and nothing else, so any C++ symbol at all is a regression.
- ``LIB``: strongly bound ones only (nm types T, D, B, R, G, S, i). What a toolchain that links part of
  libstdc++ statically leaves behind (a devtoolset-style GCC's libstdc++_nonshared.a: hundreds of ``T std::``
  functions) has this binding. Weak and unique symbols (W, V, u) are the template instantiations every C++
  library using the standard headers exports (libjitfuse_torch.so through libtorch's headers); the dynamic
  linker folds them with the process's own copy, so they are allowed.

Exits 0 when nothing is found, 1 naming each symbol (library, nm type, name) and what to do, 2 when nm fails.
"""
import argparse
import re
import subprocess
import sys
from typing import Iterable, List, Optional, Tuple

NAMESPACES = ("std::", "__gnu_cxx::")
STRONG_TYPES = set("TDBRGSi")
# nm -C's prefixes for the data that belong to an entity ("typeinfo for std::exception").
_PREFIXES = re.compile(r"^(?:(?:typeinfo name|typeinfo|vtable|VTT|construction vtable|guard variable|"
                       r"(?:non-virtual |virtual |covariant return )?thunk to|TLS init function|TLS wrapper function|"
                       r"reference temporary #\d+) for |(?:non-virtual |virtual |covariant return )?thunk to )+")


def entity(name: str) -> str:
    """The qualified name of what a demangled symbol defines: "void std::vector<int>::push_back(int const&)"
    -> "std::vector<int>::push_back"; "typeinfo for std::bad_cast" -> "std::bad_cast"."""
    name = _PREFIXES.sub("", name.strip())
    # Operator names hold the characters counted below: "std::operator<<(...)", "std::less<int>::operator()(...)".
    name = re.sub(r"operator\s*(?:<<=|>>=|<=>|<<|>>|<=|>=|->\*?|<|>|\(\)|\[\])", "operator@", name)
    depth, head = 0, []
    for c in name:  # up to the parameter list, outside template arguments
        if c == "(" and depth == 0:
            break
        depth += {"<": 1, ">": -1}.get(c, 0)
        head.append(c)
    text = "".join(head).strip()
    # A function template's demangled name starts with its return type: the entity is the last word at depth 0.
    depth, start = 0, 0
    for i, c in enumerate(text):
        depth += {"<": 1, ">": -1}.get(c, 0)
        if c == " " and depth == 0 and not text[i + 1:].startswith(("const", "volatile", "&", "*", "<")):
            start = i + 1
    return text[start:]


def parse_nm(text: str) -> List[Tuple[str, str]]:
    """(type, demangled name) of each defined symbol in ``nm -D --defined-only -C`` output."""
    out = []
    for line in text.splitlines():
        m = re.match(r"^\s*(?:[0-9a-fA-F]+\s+)?([A-Za-z])\s+(.+)$", line)
        if m:
            out.append((m.group(1), m.group(2)))
    return out


def findings(symbols: Iterable[Tuple[str, str]], strict: bool) -> List[Tuple[str, str]]:
    return [(t, n) for t, n in symbols
            if entity(n).startswith(NAMESPACES) and (strict or t in STRONG_TYPES)]


def run_nm(nm: str, lib: str) -> Optional[str]:
    try:
        r = subprocess.run([nm, "-D", "--defined-only", "-C", lib], capture_output=True, text=True)
    except OSError as e:
        print(f"check_exports: cannot run {nm}: {e}", file=sys.stderr)
        return None
    if r.returncode != 0:
        print(f"check_exports: {nm} -D --defined-only -C {lib} failed: {r.stderr.strip()}", file=sys.stderr)
        return None
    return r.stdout


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nm", default="nm", help="the nm to run (binutils' or llvm-nm; default: nm on PATH)")
    ap.add_argument("--strict", action="append", default=[], metavar="LIB",
                    help="a library that must export no std:: symbol at all, weak ones included")
    ap.add_argument("libs", nargs="*", metavar="LIB", help="a library that must export no strong std:: symbol")
    a = ap.parse_args(argv)
    if not a.libs and not a.strict:
        ap.error("name at least one library")
    bad, failed = 0, False
    for lib, strict in [(x, True) for x in a.strict] + [(x, False) for x in a.libs]:
        text = run_nm(a.nm, lib)
        if text is None:
            failed = True
            continue
        found = findings(parse_nm(text), strict)
        symbols = len(parse_nm(text))
        if not found:
            print(f"{lib}: ok ({symbols} exported symbols, no {'' if strict else 'strong '}std:: symbol)")
            continue
        bad += 1
        for t, n in found:
            print(f"{lib}: exports {n} (nm type {t})")
        why = ("its version script should export the C ABI only (runtime/jitfuse.map)" if strict else
               "the toolchain linked part of libstdc++ into it statically (e.g. a devtoolset-style GCC whose "
               "libstdc++.so is a linker script adding libstdc++_nonshared.a): link with -nostdlib++ "
               "-l:libstdc++.so.6, as runtime/torch/CMakeLists.txt does, or build with a GCC that links libstdc++ "
               "shared (CXX=/usr/bin/g++)")
        print(f"{lib}: {len(found)} std:: symbol(s) exported; a process that also has the shared libstdc++ may "
              f"crash on them (docs/deploy.md): {why}")
    if failed:
        return 2
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

# docs/environment.md against the tree (CTest: unit:scripts): every JITFUSE_* environment variable that code reads
# (C++ getenv / env::get / env::flag, Python os.environ / os.getenv, shell ${...}, CMake $ENV{...}) is a row of its one
# table, every row is read somewhere, and the library's are listed in runtime/common/env.hpp.
import os
import re
from collections import defaultdict
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "environment.md"
SOURCE_DIRS = ("runtime", "codegen", "tools", "tests", "templates", "cmake")
SUFFIXES = {".cpp", ".hpp", ".h", ".c", ".cu", ".cuh", ".py", ".sh", ".cmake"}
NAME = r"(JITFUSE_[A-Z0-9_]+)"
READS = {
    "c": [rf'getenv\(\s*"{NAME}"', rf'env::(?:get|flag)\(\s*"{NAME}"'],
    "py": [rf"""os\.environ\.get\(\s*["']{NAME}["']""", rf"""os\.getenv\(\s*["']{NAME}["']""",
           rf"""os\.environ\[\s*["']{NAME}["']\s*\](?!\s*=[^=])"""],
    "sh": [rf"\$\{{?{NAME}"],
    "cmake": [rf"\$ENV\{{{NAME}\}}"],
}
KIND = {".cpp": "c", ".hpp": "c", ".h": "c", ".c": "c", ".cu": "c", ".cuh": "c", ".py": "py", ".sh": "sh",
        ".cmake": "cmake"}


def source_files():
    for d in SOURCE_DIRS:
        for base, dirs, files in os.walk(ROOT / d):
            dirs[:] = [x for x in dirs if not x.startswith(("build", ".")) and x != "__pycache__"]
            for f in files:
                p = Path(base) / f
                if p.suffix in SUFFIXES or f == "CMakeLists.txt":
                    yield p
    yield ROOT / "CMakeLists.txt"


def reads() -> Dict[str, List[str]]:
    """{variable: ["file:line", ...]} of every read found. Python's `os.environ.get(ENV)` with a module constant
    `ENV = "JITFUSE_..."` counts too (jitfuse/torch/_ext.py reads its variable so)."""
    found: Dict[str, List[str]] = defaultdict(list)
    for p in source_files():
        if p == Path(__file__).resolve():
            continue
        kind = "cmake" if p.name == "CMakeLists.txt" else KIND[p.suffix]
        text = p.read_text(encoding="utf-8", errors="replace")
        at = lambda m: f"{p.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}"  # noqa: E731
        for pat in READS[kind]:
            for m in re.finditer(pat, text):
                found[m.group(1)].append(at(m))
        if kind == "py":
            for const, var in re.findall(rf"""^(\w+)\s*=\s*["']{NAME}["']\s*$""", text, re.M):
                for m in re.finditer(rf"os\.environ\.get\(\s*{re.escape(const)}\b", text):
                    found[var].append(at(m))
    return found


def documented() -> Dict[str, str]:
    """{variable: row} of the first table in docs/environment.md, and the names in any later table's first column."""
    text = DOC.read_text(encoding="utf-8")
    tables, cur = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            cur.append(line)
        elif cur:
            tables.append(cur)
            cur = []
    assert tables, "docs/environment.md has no table"
    rows = {}
    for line in tables[0][2:]:
        m = re.match(r"^\|\s*`([A-Z][A-Z0-9_]*)`\s*\|", line)
        assert m, f"docs/environment.md: a row of the table does not start with a `VARIABLE` cell: {line[:80]}"
        rows[m.group(1)] = line
    for t in tables[1:]:
        for line in t:
            assert not re.match(r"^\|\s*`JITFUSE_", line), \
                f"docs/environment.md: every variable belongs in the one table at the top, not in a later one: {line[:80]}"
    return rows


def test_the_scanner_sees_reads_of_every_kind():
    # If these stop being found, the patterns above have rotted, and the checks below would pass vacuously.
    r = reads()
    for var, where in [("JITFUSE_CACHE_DIR", "runtime/cache/kernel_cache.cpp"),   # env::get
                       ("JITFUSE_TORCH_SEQUENCES", "runtime/torch/registry.cpp"),  # getenv
                       ("JITFUSE_CLI", "runtime/python/jitfuse/__main__.py"),      # os.environ.get
                       ("JITFUSE_TORCH_EXTENSION", "runtime/python/jitfuse/torch/_ext.py"),  # via ENV = "..."
                       ("JITFUSE_BUILD_TYPE", "tools/dev.sh")]:                     # ${...}
        assert any(w.startswith(where + ":") for w in r.get(var, [])), (var, r.get(var))
    # A write is not a read: tools/torch_baselines/fp8_quantize_output.py sets JITFUSE_RULE_PATH.
    assert not any(w.startswith("tools/torch_baselines/") for w in r["JITFUSE_RULE_PATH"])


def test_every_variable_read_is_in_the_table():
    rows = documented()
    missing = {v: w for v, w in reads().items() if v not in rows}
    assert not missing, "read but not in docs/environment.md's table (add a row: default, meaning, who reads it):\n" + \
        "\n".join(f"  {v}: {', '.join(w[:3])}" for v, w in sorted(missing.items()))


def test_every_row_is_read_somewhere_and_complete():
    r = reads()
    for var, row in documented().items():
        cells = [c.strip() for c in row.strip().strip("|").split(" | ")]
        assert len(cells) == 4 and all(cells), f"docs/environment.md: the row of {var} needs 4 filled cells: {row[:100]}"
        if var.startswith("JITFUSE_"):
            assert var in r, f"docs/environment.md documents {var}, which nothing in the tree reads: remove the row"


def test_the_librarys_variables_are_listed_in_env_hpp():
    header = (ROOT / "runtime" / "common" / "env.hpp").read_text(encoding="utf-8")
    lib = {v for v, w in reads().items()
           if any(x.startswith(("runtime/common/", "runtime/api/", "runtime/cache/", "runtime/exec/", "runtime/cuda/",
                                "tools/cli/")) for x in w)}
    assert lib >= {"JITFUSE_CACHE_DIR", "JITFUSE_NCCL_LIBRARY", "JITFUSE_GEMM_TUNING"}
    unlisted = sorted(v for v in lib if not re.search(rf"^// {v}\s", header, re.M))
    assert not unlisted, f"runtime/common/env.hpp's list lacks {unlisted}"

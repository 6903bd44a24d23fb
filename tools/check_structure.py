#!/usr/bin/env python3
"""Structural checks of the back half (issue "Stages"), run by CTest (unit:structure):

1. Stages include downwards only: within runtime/exec, no header includes one of a later stage
   (program < layout < prepare < executor; compile and the builder sit on program), and the include
   graph of exec's headers has no cycle.
2. No function longer than MAX_LINES in runtime/exec, runtime/api and tools/cli.

Exits 1 naming every violation as file:line."""
import os
import re
import sys

MAX_LINES = 80
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The stage of each exec header that takes part in the order (others: any stage, but no cycle).
STAGE = {"exec/fp8/names.hpp": 0, "exec/program.hpp": 1, "exec/compile.hpp": 2, "exec/builder.hpp": 2,
         "exec/lowering.hpp": 2, "exec/layout.hpp": 2, "exec/fp8/recipe_state.hpp": 2, "exec/prepare.hpp": 3,
         "exec/executor.hpp": 4}


def sources(*dirs):
    for d in dirs:
        for base, _, files in os.walk(os.path.join(ROOT, d)):
            for f in sorted(files):
                if f.endswith((".cpp", ".hpp")):
                    yield os.path.join(base, f)


def rel_to_runtime(path):
    return os.path.relpath(path, os.path.join(ROOT, "runtime"))


def check_includes(problems):
    graph = {}
    for path in sources("runtime/exec"):
        if not path.endswith(".hpp"):
            continue
        me = rel_to_runtime(path)
        deps = []
        for n, line in enumerate(open(path, encoding="utf-8"), 1):
            m = re.match(r'\s*#include "(exec/[^"]+)"', line)
            if not m:
                continue
            dep = m.group(1)
            deps.append(dep)
            if me in STAGE and dep in STAGE and STAGE[dep] > STAGE[me]:
                problems.append(f"runtime/{me}:{n}: includes {dep}, a later stage (stages include downwards only)")
        graph[me] = deps
    state = {}

    def visit(node, stack):
        state[node] = 1
        for dep in graph.get(node, []):
            if state.get(dep) == 1:
                problems.append(f"runtime/{node}: include cycle {' -> '.join(stack + [node, dep])}")
            elif dep not in state:
                visit(dep, stack + [node])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])


def strip(text):
    """The text with comments, string and character literals blanked (newlines kept)."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif text.startswith('R"', i):
            m = re.match(r'R"([^(\s]*)\(', text[i:])
            end = text.find(")" + m.group(1) + '"', i) if m else -1
            j = n if end < 0 else end + len(m.group(1)) + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            out.append(" " * (min(j, n - 1) + 1 - i))
            i = j + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def check_lengths(problems):
    for path in sources("runtime/exec", "runtime/api", "tools/cli"):
        text = strip(open(path, encoding="utf-8").read())
        lines = text.split("\n")
        depth, start, name = 0, None, None
        # A function body: a `{` at depth 0 of a namespace/extern block whose line (or the one before) holds
        # a `)` — a definition's parameter list — and that is not a class, struct, enum or namespace.
        scope = []  # kinds of open braces: "ns" (namespace, extern, class bodies) or "fn"
        for ln, line in enumerate(lines, 1):
            for col, c in enumerate(line):
                if c == "{":
                    head = (lines[ln - 2] if ln > 1 else "") + " " + line[:col]
                    in_fn = "fn" in scope
                    is_scope = re.search(r"\b(namespace|struct|class|enum|union)\b[^;()]*$", head) or \
                        re.search(r'extern\s*$', head) or re.search(r"=\s*$", head)
                    if not in_fn and not is_scope and ")" in head:
                        scope.append("fn")
                        start = ln
                        name = head.strip().split("(")[0].split()[-1] if "(" in head else "?"
                    else:
                        scope.append("fn-inner" if in_fn else "ns")
                elif c == "}" and scope:
                    kind = scope.pop()
                    if kind == "fn" and ln - start + 1 > MAX_LINES:
                        problems.append(f"{os.path.relpath(path, ROOT)}:{start}: {name} is {ln - start + 1} lines "
                                        f"(at most {MAX_LINES})")


def main():
    problems = []
    check_includes(problems)
    check_lengths(problems)
    for p in problems:
        print(p)
    if problems:
        print(f"check_structure: {len(problems)} problem(s)")
        return 1
    print("check_structure: stages include downwards only; no function over", MAX_LINES, "lines")
    return 0


if __name__ == "__main__":
    sys.exit(main())

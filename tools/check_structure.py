#!/usr/bin/env python3
"""Structural checks of the tree (issues "Stages" and 41), run by CTest (unit:structure):

1. Stages include downwards only: runtime/exec is split by stage into folders, ir/ (the Program: what
   runs) < lower/ (Sequence -> Plan -> Program: the builder, implementations, layout) < run/ (Program ->
   Prepared -> call: kernels, prepare, executor, verify); every file of runtime/exec is in one of them and
   includes no header of a later folder. Within them, no file includes a header of a later stage
   (program < layout < prepare < executor < verify; compile and the builder sit on program). A .cpp takes
   the stage of its own header (executor.cpp is executor.hpp's stage); a file with no stage takes part only
   in the cycle check and the folder order. A header and its .cpp are one module, and exec's modules
   include each other without a cycle (verify.cpp including executor.hpp while executor.hpp includes verify.hpp is one).
2. No function longer than MAX_LINES in the C++ of runtime/, codegen/, tools/cli and tools/harness (the
   C-ABI check harness, moved out of runtime/reference): counted from the first line of its declaration
   (template line included) to its closing brace; lambdas, blocks and local classes count toward the
   function they are in.

Exits 1 naming every violation as file:line. `--root DIR` checks another tree (the checker's own test)."""
import argparse
import bisect
import os
import re
import sys

MAX_LINES = 80
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LENGTH_DIRS = ("runtime", "codegen", "tools/cli", "tools/harness")
CPP_EXT = (".cpp", ".hpp", ".h", ".cc")
# The stage of each exec header that takes part in the order (others: any stage, but no cycle).
STAGE = {"exec/ir/fp8/names.hpp": 0, "exec/ir/program.hpp": 1, "exec/lower/compile.hpp": 2,
         "exec/lower/builder.hpp": 2, "exec/lower/lowering.hpp": 2, "exec/lower/layout.hpp": 2,
         "exec/run/fp8/recipe_state.hpp": 2, "exec/run/prepare.hpp": 3, "exec/run/executor.hpp": 4,
         "exec/run/verify.hpp": 5}
# The stage folders of runtime/exec, in order: a file includes headers of its own folder or earlier ones.
FOLDERS = ("ir", "lower", "run")

# Known violations that are being fixed elsewhere, each named exactly, so that the check guards everything
# else today and the list only shrinks. An entry that no longer occurs is itself reported (remove it).
# Keys: ("include", file, included header) for an upward include; ("cycle", sorted modules) for an include
# cycle among modules.
ALLOWED = {}  # none: keep it so


def sources(root, *dirs):
    for d in dirs:
        for base, subdirs, files in os.walk(os.path.join(root, d)):
            subdirs.sort()
            for f in sorted(files):
                if f.endswith(CPP_EXT):
                    yield os.path.join(base, f)


# ---- 1. includes -----------------------------------------------------------------------------------------

def module_of(rel):
    """exec/run/verify.cpp and exec/run/verify.hpp are both the module exec/run/verify."""
    return os.path.splitext(rel)[0]


def exec_includes(root):
    """(file, line, included header) for every `#include "exec/..."` of runtime/exec, file relative to runtime/."""
    out = []
    for path in sources(root, "runtime/exec"):
        me = os.path.relpath(path, os.path.join(root, "runtime"))
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                m = re.match(r'\s*#\s*include\s*"(exec/[^"]+)"', line)
                if m:
                    out.append((me, n, m.group(1)))
    return out


def folder_of(rel):
    """The stage folder of exec/<folder>/..., or None for a file outside them."""
    parts = rel.split("/")
    return parts[1] if len(parts) > 2 and parts[0] == "exec" and parts[1] in FOLDERS else None


def loose_files(root):
    """Files of runtime/exec outside the stage folders."""
    found = []
    for path in sources(root, "runtime/exec"):
        me = os.path.relpath(path, os.path.join(root, "runtime"))
        if folder_of(me) is None:
            found.append((("loose", me), f"runtime/{me}: not in a stage folder of runtime/exec "
                          f"({', '.join(FOLDERS)}): move it to the stage it belongs to"))
    return found


def upward_includes(includes):
    """An include of a later stage folder's header, or of a later stage's header by a header or by a .cpp
    in its header's stage."""
    found = []
    for me, n, dep in includes:
        mine, theirs = folder_of(me), folder_of(dep)
        if mine and theirs and FOLDERS.index(theirs) > FOLDERS.index(mine):
            found.append((("include", me, dep), f"runtime/{me}:{n}: includes {dep}, a later stage folder "
                          f"({' < '.join(FOLDERS)}; stages include downwards only)"))
            continue
        stage = STAGE.get(module_of(me) + ".hpp")
        if stage is not None and dep in STAGE and STAGE[dep] > stage:
            found.append((("include", me, dep),
                          f"runtime/{me}:{n}: includes {dep}, a later stage (stages include downwards only)"))
    return found


def strongly_connected(graph):
    """Tarjan's components of `graph` (node -> {dep: evidence}), each as a sorted tuple, in node order."""
    index, low, on_stack, stack, comps = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, {})):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            comps.append(tuple(sorted(comp)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return comps


def include_cycles(includes):
    """One finding per include cycle among modules: the shortest cycle through its first module, each edge
    named by the file:line that makes it."""
    graph = {}
    for me, n, dep in includes:
        a, b = module_of(me), module_of(dep)
        if a != b:
            graph.setdefault(a, {}).setdefault(b, f"runtime/{me}:{n}")
    found = []
    for comp in strongly_connected(graph):
        if len(comp) < 2:
            continue
        start, members = comp[0], set(comp)
        paths, seen, queue = {start: [start]}, {start}, [start]
        cycle = None
        while queue and cycle is None:  # breadth first: the shortest way back to `start`
            v = queue.pop(0)
            for w in sorted(graph[v]):
                if w == start:
                    cycle = paths[v] + [start]
                    break
                if w in members and w not in seen:
                    seen.add(w)
                    paths[w] = paths[v] + [w]
                    queue.append(w)
        edges = ", ".join(f"{graph[a][b]} ({a} -> {b})" for a, b in zip(cycle, cycle[1:]))
        found.append((("cycle", comp), f"{graph[cycle[0]][cycle[1]]}: include cycle among modules "
                      f"{', '.join(comp)} (a header and its .cpp are one module): {edges}"))
    return found


def check_includes(root, problems, allowed):
    includes = exec_includes(root)
    used = set()
    for key, text in loose_files(root) + upward_includes(includes) + include_cycles(includes):
        if key in allowed:
            used.add(key)
        else:
            problems.append(text)
    for key in sorted(set(allowed) - used, key=str):
        problems.append(f"tools/check_structure.py: allow-list entry {key} no longer occurs: remove it")


# ---- 2. function lengths ---------------------------------------------------------------------------------

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


def code_only(text):
    """strip(), then preprocessor lines (with their continuations) blanked: a macro's braces are no scope."""
    lines, cont = strip(text).split("\n"), False
    for k, line in enumerate(lines):
        if cont or line.lstrip().startswith("#"):
            cont = line.rstrip().endswith("\\")
            lines[k] = " " * len(line)
    return "\n".join(lines)


def collapse(head):
    """Every balanced (...) and {...} of a declaration reduced to () and {}: what the patterns below read."""
    out, depth = [], 0
    for c in head:
        if c in "({":
            if depth == 0:
                out.append(c)
            depth += 1
        elif c in ")}":
            depth = max(depth - 1, 0)
            if depth == 0:
                out.append(c)
        elif depth == 0:
            out.append(c)
    return "".join(out)


# After the parameter list: qualifiers, a trailing return type, a requires-clause.
SPECIFIERS = r"(?:(?:const|volatile|noexcept(?:\s*\(\))?|override|final|mutable|constexpr|&&?|throw\s*\(\))\s*)*" \
             r"(?:->\s*[^;{}=]+?\s*)?(?:requires\b[^;{}]*)?"
FUNCTION = re.compile(r"\(\)\s*" + SPECIFIERS + r"$")
# A constructor's member initialisers: `) : a_(x), b_{y}`.
MEMBER = r"[\w:]+(?:<[^;{}]*?>)?\s*(?:\(\)|\{\})"
CONSTRUCTOR = re.compile(r"\(\)\s*(?:noexcept(?:\s*\(\))?\s*)?:\s*(?:" + MEMBER + r"\s*,\s*)*" + MEMBER + r"\s*$")
LAMBDA = re.compile(r"\]\s*(?:\(\))?\s*" + SPECIFIERS + r"$")
CLASS = re.compile(r"\b(?:class|struct|union|enum)\b[^()]*$")
NAME = re.compile(r"((?:[A-Za-z_]\w*::)*(?:operator\s*(?:\(\)|\[\]|[^\s\w(]+)|~?[A-Za-z_]\w*))\s*"
                   r"(?:<[^(){};]*>)?\s*\(\)")
NOT_NAMES = {"decltype", "alignas", "noexcept", "requires", "sizeof", "alignof", "__attribute__", "throw"}


def classify(head):
    """What a `{` opens outside any function, from the declaration before it: ("fn", name), ("scope", class
    name or None) for a namespace, class or enum body, or ("init", None) for a braced initialiser."""
    h = re.sub(r"\[\[.*?\]\]", "", collapse(head)).strip()
    h = re.sub(r"^(?:(?:public|private|protected)\s*:\s*)+", "", h)
    if h.endswith("=") or re.search(r"\breturn$", h):
        return "init", None
    if re.search(r"\bnamespace\b", h) or re.fullmatch(r"extern", h):
        return "scope", None
    if CLASS.search(h):
        m = re.search(r"\b(?:class|struct|union)\s+([A-Za-z_]\w*(?:::[A-Za-z_]\w*)*)\s*(?:final\s*)?(?::[^:]|$)", h)
        return "scope", m.group(1) if m else None
    if LAMBDA.search(h):
        return "fn", "lambda"
    if FUNCTION.search(h) or CONSTRUCTOR.search(h):
        names = [m.group(1) for m in NAME.finditer(h) if m.group(1) not in NOT_NAMES]
        return "fn", (names[0] if names else "?")
    return "init", None


def functions(text):
    """(name, first line, brace line, last line) of every function defined outside another function: free
    and member functions (in-class or not), lambdas at namespace scope. A brace inside a function (a block,
    a lambda, a local class) belongs to that function."""
    t = code_only(text)
    newlines = [i for i, c in enumerate(t) if c == "\n"]

    def line(i):
        return bisect.bisect_left(newlines, i) + 1

    found, stack, head, in_fn = [], [], 0, 0
    for i, c in enumerate(t):
        if in_fn:
            if c == "{":
                in_fn += 1
            elif c == "}":
                in_fn -= 1
                if in_fn == 0:
                    name, first, brace = stack.pop()[1:]
                    found.append((name, first, brace, line(i)))
                    head = i + 1
            continue
        if c == ";":
            head = i + 1
        elif c == "{":
            kind, name = classify(t[head:i])
            if kind == "fn":
                decl = re.sub(r"^(?:\s|(?:public|private|protected)\s*:)*", "", t[head:i])
                first = line(i - len(decl))
                outer = [s[1] for s in stack if s[0] == "scope" and s[1]]
                if "::" not in name and name != "lambda" and outer:
                    name = "::".join(outer) + "::" + name
                stack.append(("fn", name, first, line(i)))
                in_fn = 1
            else:
                stack.append((kind, name, head))
            head = i + 1
        elif c == "}" and stack:
            kind, _, saved = stack.pop()
            # After a braced initialiser the declaration goes on (`a_{x}, b_(y) {` of a constructor).
            head = saved if kind == "init" else i + 1
    return found


def check_lengths(root, problems):
    for path in sources(root, *LENGTH_DIRS):
        with open(path, encoding="utf-8") as f:
            text = f.read()
        for name, first, brace, last in functions(text):
            if last - first + 1 > MAX_LINES:
                problems.append(f"{os.path.relpath(path, root)}:{first}: {name} is {last - first + 1} lines "
                                f"(at most {MAX_LINES}, from its first line to its closing brace): split it "
                                f"into named steps")


def check(root, allowed):
    problems = []
    check_includes(root, problems, allowed)
    check_lengths(root, problems)
    return problems


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", default=ROOT, help="the tree to check (default: this checkout)")
    args = parser.parse_args(argv)
    problems = check(os.path.abspath(args.root), ALLOWED)
    for p in problems:
        print(p)
    if problems:
        print(f"check_structure: {len(problems)} problem(s)")
        return 1
    print(f"check_structure: stages include downwards only ({len(ALLOWED)} allowed exceptions); "
          f"no function over {MAX_LINES} lines in {', '.join(LENGTH_DIRS)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

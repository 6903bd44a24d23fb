#!/usr/bin/env python3
# The structural checker (tools/check_structure.py) on a small fake tree: it must name, as file:line, an
# 81-line function and a .cpp including a later stage, and stay quiet about what the rules allow.
import os
import subprocess
import sys
import tempfile
import textwrap
import unittest

TOOLS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "tools")
sys.path.insert(0, TOOLS)
import check_structure  # noqa: E402


def body(n):
    """n statement lines: with the signature and the closing brace, a function of n + 2 lines."""
    return "".join(f"  x += {k};\n" for k in range(n))


FILES = {
    "runtime/exec/ir/program.hpp": "// fake\n// fake\n#pragma once\n",
    "runtime/exec/run/executor.hpp": '// fake\n// fake\n#pragma once\n#include "exec/ir/program.hpp"\n',
    # The IR (folder ir/, stage 1) including the running stage (folder run/, stage 4): line 3.
    "runtime/exec/ir/program.cpp": '// fake\n#include "exec/ir/program.hpp"\n#include "exec/run/executor.hpp"\n',
    # No stage of its own, in the last folder: may include any stage.
    "runtime/exec/run/explain.cpp": '#include "exec/run/executor.hpp"\n#include "exec/ir/program.hpp"\n',
    # No stage of its own, but a lowering file including the running folder: line 1.
    "runtime/exec/lower/plan.cpp": '#include "exec/run/executor.hpp"\n',
    # Outside the stage folders.
    "runtime/exec/loose.cpp": "// fake\n",
    # A module cycle that only .cpp files close: a.cpp -> b.hpp, b.cpp -> a.hpp (line 2).
    "runtime/exec/lower/a.hpp": "#pragma once\n",
    "runtime/exec/lower/a.cpp": '#include "exec/lower/a.hpp"\n#include "exec/lower/b.hpp"\n',
    "runtime/exec/lower/b.hpp": "#pragma once\n",
    "runtime/exec/lower/b.cpp": '#include "exec/lower/b.hpp"\n#include "exec/lower/a.hpp"\n',
    # Line 4: 81 lines (a two-line signature, 78 statements, the brace); then an 80-line one at line 85.
    "codegen/src/long.cpp": "// fake\n// fake\nnamespace jitfuse::codegen {\n"
                            "int too_long(int a,\n             int b) {\n  int x = 0;\n" + body(77) + "}\n"
                            "int just_fits(int a) {\n  int x = 0;\n" + body(76) + "  return x;\n}\n"
                            "}  // namespace jitfuse::codegen\n",
}

# A member function defined in its class (line 5), whose lambda and local struct count toward it, with
# braces in strings and comments that must not; 81 lines in all.
CLASS_FILE = textwrap.dedent("""\
    // fake
    // fake
    namespace jitfuse {
    class Rownorm {
      int forward_row(int y) const {
        int x = 0;  // {{{ not a brace
        const char* s = "}}}";
        auto add = [&](int v) {
          x += v;
        };
        struct Local {
          int f() { return 1; }
        };
    """) + body(69) + "    add(1);\n    return x + s[0] + Local{}.f();\n  }\n};\n}  // namespace jitfuse\n"


def make_tree(root, files):
    for rel, text in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)


class CheckStructureTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.root = self.tmp.name
        make_tree(self.root, dict(FILES, **{"runtime/torch/ops.cpp": CLASS_FILE}))

    def tearDown(self):
        self.tmp.cleanup()

    def run_checker(self):
        r = subprocess.run([sys.executable, os.path.join(TOOLS, "check_structure.py"), "--root", self.root],
                           capture_output=True, text=True)
        return r.returncode, r.stdout

    def test_reports_upward_cpp_include_and_long_functions(self):
        rc, out = self.run_checker()
        self.assertEqual(rc, 1, out)
        self.assertIn("runtime/exec/ir/program.cpp:3: includes exec/run/executor.hpp, a later stage folder", out)
        self.assertIn("runtime/exec/lower/plan.cpp:1: includes exec/run/executor.hpp, a later stage folder", out)
        self.assertIn("runtime/exec/loose.cpp: not in a stage folder of runtime/exec (ir, lower, run)", out)
        self.assertIn("codegen/src/long.cpp:4: too_long is 81 lines", out)
        self.assertIn("runtime/torch/ops.cpp:5: Rownorm::forward_row is 81 lines", out)
        self.assertNotIn("just_fits", out)
        self.assertNotIn("explain.cpp", out)

    def test_reports_module_cycle_closed_by_cpp_files(self):
        _, out = self.run_checker()
        self.assertIn("include cycle among modules exec/lower/a, exec/lower/b", out)
        self.assertIn("runtime/exec/lower/b.cpp:2 (exec/lower/b -> exec/lower/a)", out)

    def test_allow_list_silences_named_violations_and_reports_stale_ones(self):
        allowed = {("include", "exec/ir/program.cpp", "exec/run/executor.hpp"): "test",
                   ("include", "exec/lower/plan.cpp", "exec/run/executor.hpp"): "test",
                   ("loose", "exec/loose.cpp"): "test",
                   ("cycle", ("exec/lower/a", "exec/lower/b")): "test",
                   ("cycle", ("exec/ir/program", "exec/run/executor")): "test",  # the upward include closes one
                   ("include", "exec/gone.cpp", "exec/run/executor.hpp"): "test"}
        problems = check_structure.check(self.root, allowed)
        text = "\n".join(problems)
        self.assertNotIn("a later stage", text)
        self.assertNotIn("include cycle", text)
        self.assertNotIn("not in a stage folder", text)
        self.assertIn("allow-list entry ('include', 'exec/gone.cpp', 'exec/run/executor.hpp') no longer occurs", text)

    def test_declarations_classified(self):
        cases = {
            "void operator()(int x) const ": ("fn", "operator()"),
            "Foo::Foo(int a) : a_(a), b_{} ": ("fn", "Foo::Foo"),  # after its braced initialiser
            "Foo::Foo(int a) : a_": ("init", None),                 # the braced initialiser itself
            "auto f(int x) -> std::pair<int, int> ": ("fn", "f"),
            "static const auto kTable = [] ": ("fn", "lambda"),
            "const std::map<int, int> kM = ": ("init", None),
            "struct X : Base<int> ": ("scope", "X"),
            "namespace a::b ": ("scope", None),
        }
        for head, want in cases.items():
            self.assertEqual(check_structure.classify(head), want, head)

    def test_lengths_of_functions_found(self):
        found = {name: last - first + 1 for name, first, _, last in check_structure.functions(CLASS_FILE)}
        self.assertEqual(found, {"Rownorm::forward_row": 81})


if __name__ == "__main__":
    unittest.main()

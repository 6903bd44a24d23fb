# CPU tests of jitfuse.lib against the built libjitfuse.so: context, sequences, explain, info, rules,
# cache directory, library discovery and the ABI check. No GPU, no PyTorch.
import ctypes
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import jitfuse
import jitfuse.lib as jl
from jitfuse import _abi
from jitfuse.errors import RuleError, parse_rule_errors

MLP_OPS = [
    {"op": "layernorm", "eps": 1e-5},
    {"op": "linear", "in_features": 4096, "out_features": 16384},
    {"op": "bias"},
    {"op": "gelu", "approximate": "tanh"},
    {"op": "linear", "in_features": 16384, "out_features": 4096},
    {"op": "bias"},
    {"op": "add_extra_input"},
]


def test_library_loads_with_expected_abi():
    lib = jitfuse.library()
    assert lib.abi_version == _abi.EXPECTED_ABI_VERSION
    assert jitfuse.version() == lib.version and lib.version.count(".") == 2
    assert "C ABI" in repr(lib) and lib.path in repr(lib)


def test_context_repr_and_close():
    c = jitfuse.Context()
    assert "cache" in repr(c)
    c.close()
    c.close()  # idempotent
    assert "closed" in repr(c)
    with pytest.raises(jitfuse.JitfuseError, match="closed"):
        c.handle


def test_sequence_from_json_text(ctx, repo):
    text = (repo / "tools/examples/mlp.json").read_text()
    s = jitfuse.Sequence(ctx, text, "bf16")
    assert s.num_ops == len(s) == 7
    assert s.name == "mlp" and s.ops[0]["op"] == "layernorm"
    assert repr(s) == "<jitfuse.Sequence 'mlp' bf16: layernorm linear bias gelu linear bias add_extra_input>"
    s.close()
    assert "closed" in repr(s)


def test_sequence_from_file_dict_and_list(ctx, repo):
    path = repo / "tools/examples/transformer_layer.json"
    a = jitfuse.Sequence.from_file(ctx, path, "fp16")
    b = jitfuse.Sequence(ctx, str(path), "fp16")
    c = jitfuse.Sequence(ctx, json.loads(path.read_text()), "fp16")
    d = jitfuse.Sequence.from_ops(ctx, json.loads(path.read_text())["ops"], "fp16", name="tl")
    assert a.num_ops == b.num_ops == c.num_ops == d.num_ops == 15
    assert a.source == str(path) and d.name == "tl"
    ea, ed = a.explain((128, 1024)), d.explain((128, 1024))
    assert ea.forward == ed.forward and ea.backward == ed.backward


def test_sequence_errors_map_to_exceptions(ctx):
    with pytest.raises(jitfuse.InvalidArgumentError, match=r"<sequence>:1:9: op 0: unknown op 'geluu'") as e:
        jitfuse.Sequence(ctx, '{"ops":[{"op":"geluu"}]}')
    assert e.value.status == _abi.JF_ERR_INVALID_ARGUMENT and e.value.function == "jf_sequence_create"
    assert isinstance(e.value, ValueError)
    with pytest.raises(jitfuse.ParseError, match=r"<sequence>:1:22"):
        jitfuse.Sequence(ctx, '{"ops":[{"op":"gelu"}')
    with pytest.raises(jitfuse.InvalidArgumentError, match="unknown recipe 'fp64'"):
        jitfuse.Sequence(ctx, [{"op": "gelu"}], recipe="fp64")
    with pytest.raises(jitfuse.InvalidArgumentError, match=r"<builder b>:.*unknown op 'gelux'"):
        jitfuse.Sequence(ctx, [{"op": "gelux"}], name="b")
    with pytest.raises(TypeError, match="op 1: expected a dict"):
        jitfuse.Sequence(ctx, [{"op": "gelu"}, "relu"])
    with pytest.raises(jitfuse.JitfuseIOError):
        jitfuse.Sequence(ctx, Path("/nonexistent/seq.json"))


def test_explain_returns_objects(ctx):
    s = jitfuse.Sequence(ctx, MLP_OPS, "bf16", name="mlp")
    e = s.explain((8192, 4096), training=True, arch=90)
    assert isinstance(e, jitfuse.Explanation)
    assert e.ops[1] == jitfuse.OpShape(1, "linear", (8192, 4096), (8192, 16384))
    fwd = {(g.begin, g.end): g for g in e.forward}
    assert fwd[(1, 4)].rule == "linear_bias_gelu" and fwd[(1, 4)].ops == ("linear", "bias", "gelu")
    assert fwd[(4, 7)].rule == "linear_bias_residual"
    assert not fwd[(0, 1)].fused and "unfused" in str(fwd[(0, 1)])
    assert [g.rule for g in e.fused_groups("backward")] == ["linear_bias_bwd", "linear_bias_bwd"]
    taken = [d for d in e.decisions if d.taken and d.pass_ == "forward"]
    assert {d.rule for d in taken} == {"linear_bias_gelu", "linear_bias_residual"}
    loser = next(d for d in e.decisions if d.rule == "linear_bias" and d.pass_ == "forward")
    assert not loser.taken and "higher-priority" in loser.reason
    assert isinstance(e.program, jitfuse.ProgramExplain) and e.program.training
    with pytest.warns(DeprecationWarning):  # the old name, kept as a deprecated alias
        assert jitfuse.Program is jitfuse.ProgramExplain
    kinds = [st["kind"] for st in e.program.forward]
    assert "gemm" in kinds and "kernel" in kinds
    assert any(b["name"] == "input" for b in e.program.buffers)
    assert "backward" in e.program.arena_bytes
    text = str(e)
    assert "forward groups:" in text and "linear_bias_gelu" in text
    inf = s.explain((8192, 4096), training=False)
    assert not inf.training and all(g.rule != "linear_bias_gelu" or "GELU" in g.impl for g in inf.forward)


def test_explain_shape_error_names_the_op(ctx):
    s = jitfuse.Sequence(ctx, [{"op": "linear", "in_features": 64, "out_features": 32}, {"op": "bias"}])
    with pytest.raises(jitfuse.InvalidArgumentError, match=r"op 0 \(linear\).*in_features = 64"):
        s.explain((16, 63))
    with pytest.raises(ValueError):
        s.explain(())


def test_info_and_prepare_without_gpu_or_with(ctx):
    """Without a GPU jf_sequence_info/prepare fail with NoDeviceError; with one they describe the program."""
    s = jitfuse.Sequence(ctx, [{"op": "linear", "in_features": 64, "out_features": 32}, {"op": "bias"},
                               {"op": "gelu"}], "bf16")
    try:
        info = s.info((16, 64), training=True)
    except jitfuse.NoDeviceError as e:
        assert e.status == _abi.JF_ERR_NO_DEVICE and e.message
        with pytest.raises(jitfuse.NoDeviceError):
            s.prepare((16, 64))
        return
    assert info.output.shape == (16, 32) and info.output.dtype == "bfloat16"
    assert {(p.op_index, p.name, p.shape) for p in info.params} == {(0, "weight", (32, 64)), (1, "bias", (32,))}
    assert info.saved_bytes > 0 and info.alignment >= 16 and not info.uses_rng
    assert s.info((16, 64), training=True) is info  # cached
    s.prepare((16, 64), training=False)


def test_parse_rule_errors():
    errs = parse_rule_errors("a/b.json:3:7: rule 'x': bad\n/missing: no such file or directory\n"
                             "c.json:1:1: op 'y': does not compile:\n  log line 1\n")
    assert errs[0] == RuleError("a/b.json", 3, 7, "rule 'x': bad")
    assert errs[1] == RuleError("/missing", None, None, "no such file or directory")
    assert errs[2].file == "c.json" and errs[2].message.endswith("log line 1")
    assert str(errs[0]) == "a/b.json:3:7: rule 'x': bad"


def test_rule_load_errors_carry_file_line_col(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "jitfuse.rules/1", "rules": [\n  {"name": "x", "pass": "forwrd"}\n]}\n')
    c = jitfuse.Context()
    with pytest.raises(jitfuse.RuleLoadError) as e:
        c.load_rules(bad)
    err = e.value
    assert err.file == str(bad) and err.line is not None and err.col is not None
    assert err.n_errors >= 1 and err.errors[0].file == str(bad)
    assert f"{bad}:{err.line}:{err.col}:" in str(err)
    broken = tmp_path / "broken.json"
    broken.write_text('{"rules": [\n  {"name": "x"\n')
    errs = c.load_rules(broken, strict=False)  # logged, returned, not raised
    assert errs and errs[0].file == str(broken) and errs[0].line == 3
    missing = c.load_rules(tmp_path / "nope.json", strict=False)
    assert missing[0].line is None and "no such file" in missing[0].message
    c.close()


def test_user_rules_load_and_fuse(repo):
    c = jitfuse.Context(rules=[repo / "docs/examples/softplus"])
    assert c.rule_paths
    s = jitfuse.Sequence(c, repo / "docs/examples/bias_softplus.json", "bf16")
    e = s.explain((64, 256))
    assert e.forward[0].rule == "bias_softplus"
    s.close()
    c.close()


def test_cache_dir_follows_the_library_rules(monkeypatch, tmp_path):
    monkeypatch.setenv("JITFUSE_CACHE_DIR", str(tmp_path / "c"))
    assert jitfuse.cache_dir() == tmp_path / "c"
    monkeypatch.delenv("JITFUSE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert jitfuse.cache_dir() == tmp_path / "xdg" / "jitfuse"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert jitfuse.cache_dir() == tmp_path / "home" / ".cache" / "jitfuse"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.delenv("HOME")
    assert jitfuse.cache_dir() is None
    monkeypatch.setenv("JITFUSE_CACHE_DIR", str(tmp_path / "d"))
    assert jitfuse.Context().cache_dir == tmp_path / "d"


def test_abi_mismatch_message():
    path = jitfuse.library().path
    with pytest.raises(jitfuse.AbiMismatchError) as e:
        jl.load_library(path, expected_abi=99)
    err = e.value
    assert err.found == _abi.EXPECTED_ABI_VERSION and err.expected == 99 and err.path == path
    assert f"implements jitfuse C ABI {err.found}, but this Python package" in str(err)
    assert "needs C ABI 99" in str(err) and "JITFUSE_LIBRARY" in str(err)
    assert isinstance(err, ImportError)


def test_abi_mismatch_from_a_fake_library(tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build a fake libjitfuse.so")
    src = tmp_path / "fake.c"
    src.write_text("int jf_abi_version(void) { return 999; }\n")
    so = tmp_path / "libjitfuse.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(so), str(src)], check=True)
    with pytest.raises(jitfuse.AbiMismatchError, match=r"implements jitfuse C ABI 999, but .* needs C ABI "):
        jl.load_library(str(so))


def test_library_not_found_lists_every_path(monkeypatch, tmp_path):
    monkeypatch.setattr(jl, "_package_dir", lambda: tmp_path / "pkg")
    monkeypatch.setattr(jl, "_source_root", lambda: tmp_path / "checkout")
    (tmp_path / "checkout" / "build-asan").mkdir(parents=True)
    monkeypatch.setenv("JITFUSE_LIBRARY", str(tmp_path / "nope" / "libjitfuse.so"))
    monkeypatch.delenv("JITFUSE_BUILD_DIR", raising=False)
    monkeypatch.setattr(jl, "SYSTEM_SONAME", "libjitfuse-test-absent.so.0")
    with pytest.raises(jitfuse.LibraryNotFoundError) as e:
        jl.load_library()
    msg = str(e.value)
    for p in (tmp_path / "pkg" / "libjitfuse.so", tmp_path / "nope" / "libjitfuse.so",
              tmp_path / "checkout" / "build" / "runtime" / "libjitfuse.so",
              tmp_path / "checkout" / "build-asan" / "runtime" / "libjitfuse.so"):
        assert str(p) in msg
    assert "($JITFUSE_LIBRARY): not found" in msg and "beside the package" in msg
    assert "system loader" in msg and len(e.value.tried) == 6
    assert isinstance(e.value, OSError)


def test_not_a_jitfuse_library_is_reported(monkeypatch, tmp_path):
    import ctypes.util
    libm = ctypes.util.find_library("m")
    if libm is None:
        pytest.skip("no libm")
    monkeypatch.setattr(jl, "library_candidates", lambda: [(libm, "test")])
    with pytest.raises(jitfuse.LibraryNotFoundError, match="not libjitfuse"):
        jl.load_library()


# Struct layouts against the header, compiled with the machine's C compiler (skipped without one).
def test_struct_layouts_match_the_header(tmp_path, repo):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    structs = [_abi.DLTensor, _abi.jf_tensor_info, _abi.jf_program_info, _abi.jf_param, _abi.jf_forward_args,
               _abi.jf_backward_args, _abi.jf_fp8_state, _abi.jf_allocator, _abi.jf_grad_alias]
    lines = ["#include <stdio.h>", "#include <stddef.h>", "#include <jitfuse/jitfuse.h>", "int main(void) {"]
    expect = []
    for s in structs:
        lines.append(f'printf("%zu\\n", sizeof({s.__name__}));')
        expect.append(ctypes.sizeof(s))
        for f in s._fields_:
            lines.append(f'printf("%zu\\n", offsetof({s.__name__}, {f[0]}));')
            expect.append(getattr(s, f[0]).offset)
    lines.append("return 0; }")
    src = tmp_path / "layout.c"
    src.write_text("\n".join(lines))
    exe = tmp_path / "layout"
    subprocess.run([cc, "-I", str(repo / "runtime/include"), "-o", str(exe), str(src)], check=True)
    got = [int(x) for x in subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split()]
    assert got == expect


def test_every_header_function_is_declared(repo):
    import re
    header = (repo / "runtime/include/jitfuse/jitfuse.h").read_text()
    names = set(re.findall(r"JF_API [^;(]*?\b(jf_\w+)\s*\(", header))
    assert names == {f[0] for f in _abi.FUNCTIONS}
    assert f"#define JF_ABI_VERSION {_abi.EXPECTED_ABI_VERSION}" in header


# python -m jitfuse
def _cli(*args, env=None):
    e = dict(os.environ, **(env or {}))
    e["PYTHONPATH"] = str(Path(jitfuse.__file__).resolve().parents[1]) + os.pathsep + e.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "jitfuse", *args]
    if os.environ.get("JITFUSE_TEST_EXPECT_ABI"):  # the interim ABI 1 library (see conftest.py)
        cmd = [sys.executable, "-c", "import sys, runpy, jitfuse._abi as a; a.EXPECTED_ABI_VERSION = "
               f"{int(os.environ['JITFUSE_TEST_EXPECT_ABI'])}; d = a.declare; a.declare = lambda l: (d(l), [])[1]; "
               "sys.argv[0] = 'jitfuse'; runpy.run_module('jitfuse', run_name='__main__')", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=e)


def test_cli_explain(repo):
    r = _cli("explain", str(repo / "tools/examples/mlp.json"), "--recipe", "bf16", "--shape", "8192x4096")
    assert r.returncode == 0, r.stderr
    assert "linear_bias_gelu" in r.stdout and "forward groups:" in r.stdout and "backward groups:" in r.stdout
    r = _cli("explain", str(repo / "tools/examples/mlp.json"), "--recipe", "bf16", "--shape", "8192x4096", "--json")
    doc = json.loads(r.stdout)
    assert doc["shape"] == [8192, 4096] and doc["forward"][1]["rule"] == "linear_bias_gelu" and "program" not in doc
    r = _cli("explain", str(repo / "tools/examples/mlp.json"), "--recipe", "bf16", "--shape", "8192x4095")
    assert r.returncode == 2 and "error:" in r.stderr


def test_cli_rules_validate(tmp_path, repo):
    bad = tmp_path / "bad.json"
    bad.write_text('{"rules": [\n  {"name": "x"\n')
    r = _cli("rules", "validate", str(bad))
    assert r.returncode == 1 and f"{bad}:3:" in r.stdout
    r = _cli("rules", "validate", str(repo / "docs/examples/softplus"))
    assert r.returncode == 0 and "ok" in r.stdout


def test_cli_cache_dir_and_ls(tmp_path, repo):
    golden = repo / "tests/golden/cache/entry_v1.jfk"
    d = tmp_path / "cache"
    r = _cli("cache", "dir", env={"JITFUSE_CACHE_DIR": str(d)})
    assert r.stdout.strip() == str(d)
    r = _cli("cache", "ls", "--json", env={"JITFUSE_CACHE_DIR": str(d)})
    assert json.loads(r.stdout)["entries"] == []
    if golden.exists():
        key = golden.read_bytes()[20:84].decode()
        (d / "v1" / key[:2]).mkdir(parents=True)
        shutil.copy(golden, d / "v1" / key[:2] / f"{key}.jfk")
        r = _cli("cache", "ls", "--json", env={"JITFUSE_CACHE_DIR": str(d)})
        entries = json.loads(r.stdout)["entries"]
        assert len(entries) == 1 and entries[0]["key"] == key and "error" not in entries[0]
        r = _cli("cache", "ls", env={"JITFUSE_CACHE_DIR": str(d)})
        assert key[:12] in r.stdout and "1 entries" in r.stdout


def test_cli_version():
    r = _cli("version")
    assert r.returncode == 0 and f"C ABI {_abi.EXPECTED_ABI_VERSION}" in r.stdout


def _dl(storage, shape, dtype=(_abi.kDLBfloat, 16), strides=None):
    """A DLTensor over host bytes that are never read (every call below is refused before any device work)."""
    d = _abi.DLTensor()
    d.data = ctypes.cast(storage, ctypes.c_void_p)
    d.device = _abi.DLDevice(_abi.kDLCUDA, 0)
    d.ndim = len(shape)
    d.dtype = _abi.DLDataType(dtype[0], dtype[1], 1)
    d._dims = (ctypes.c_int64 * len(shape))(*shape)
    d.shape = ctypes.cast(d._dims, ctypes.POINTER(ctypes.c_int64))
    if strides is not None:
        d._strides = (ctypes.c_int64 * len(shape))(*strides)
        d.strides = ctypes.cast(d._strides, ctypes.POINTER(ctypes.c_int64))
    return d


@pytest.mark.parametrize("bad, message", [
    ({"bias": ((16,),)}, "tensor 'params op 0 (bias) 'bias'': expected shape 8, got 16"),
    ({"bias": ((8,), (_abi.kDLFloat, 16))}, "tensor 'params op 0 (bias) 'bias'': expected dtype bf16 for this recipe, "
                                            "got float16"),
    ({"input": ((4, 8), (_abi.kDLBfloat, 16), (1, 4))},
     "tensor 'input' is not contiguous row-major: strides (1,4) for shape 4x8"),
    ({"extra": ((4, 4),)}, "tensor 'extra input 0 (op 1)': expected shape 4x8, got 4x4"),
])
def test_the_library_names_a_tensor_of_the_wrong_shape_dtype_or_layout(ctx, bad, message):
    """The per-call checks both jitfuse.torch paths hand every tensor to as it is (its own shape, strides and
    dtype): their messages are these, word for word (the C++ extension and ForwardArgs.call_as_they_are
    format none of their own). Refused before any device work, so no GPU is needed."""
    seq = jitfuse.Sequence(ctx, '{"name": "blk", "ops": [{"op": "bias"}, {"op": "add_extra_input"}]}', "bf16")
    storage = (ctypes.c_char * 4096)()
    t = {"input": ((4, 8),), "extra": ((4, 8),), "output": ((4, 8),), "bias": ((8,),), **bad}
    x, e, out, b = (_dl(storage, *t[k]) for k in ("input", "extra", "output", "bias"))
    a = _abi.jf_forward_args()
    a.input, a.output = ctypes.pointer(x), ctypes.pointer(out)
    extras = (ctypes.POINTER(_abi.DLTensor) * 1)(ctypes.pointer(e))
    a.extra_inputs, a.n_extra_inputs = ctypes.cast(extras, ctypes.POINTER(ctypes.POINTER(_abi.DLTensor))), 1
    p = (_abi.jf_param * 1)()
    p[0].op_index, p[0].name, p[0].tensor = 0, b"bias", ctypes.pointer(b)
    a.params, a.n_params = ctypes.cast(p, ctypes.POINTER(_abi.jf_param)), 1
    assert seq.lib.cdll.jf_forward(seq.handle, ctypes.byref(a), None, None) == _abi.JF_ERR_INVALID_ARGUMENT
    assert seq.lib.last_error() == message
    seq.close()


def test_weights_as_the_model_stores_them(ctx):
    """weight_layout "in_out" (GPT-2's Conv1D) and split_weight (gate and up as two weights): the parameters the
    library asks for, and the GEMMs explain shows (no GPU needed)."""
    conv = jitfuse.Sequence(ctx, [{"op": "linear", "in_features": 64, "out_features": 256, "weight_layout": "in_out"},
                                  {"op": "bias"}, {"op": "gelu", "approximate": "tanh"}], "bf16")
    e = conv.explain((32, 64))
    gemms = [st for st in e.program.forward + e.program.backward if st["kind"] == "gemm"]
    assert gemms and all("W[k,n]" in st["formula"] for st in gemms), gemms
    assert [st["layout"] for st in gemms][:1] == ["NN"]
    split = jitfuse.Sequence(ctx, [{"op": "linear", "in_features": 64, "out_features": 96, "split_weight": True},
                                   {"op": "swiglu"}], "bf16")
    e = split.explain((32, 64))
    fwd = [st for st in e.program.forward if st["kind"] == "gemm"]
    assert [(st["n"], st.get("ldy"), st.get("element_offsets", {}).get("d", 0)) for st in fwd] == [(48, 96, 0), (48, 96, 48)]
    with pytest.raises(jitfuse.JitfuseError, match="split_weight has no FP8 form"):
        jitfuse.Sequence(ctx, [{"op": "linear", "in_features": 128, "out_features": 128, "split_weight": True}],
                         "fp8_current").explain((128, 128))

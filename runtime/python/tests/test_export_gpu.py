# Export round trip (issue 28): torch.export of a model with jitfuse Sequentials, AOTInductor package, run in
# this process, in a Python process that never imports jitfuse, and from the C++ host runtime/torch/examples/
# aoti_run.cpp (libtorch + libjitfuse_torch + libjitfuse); outputs compared with eager. Needs the C++ extension, and a
# compiler that links libstdc++ dynamically for AOTInductor's wrapper (CXX; see docs/deploy.md).
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import need_torch

torch = need_torch()  # or a skip of this module: no torch, or one jitfuse.torch refuses
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

import jitfuse.torch as jt  # noqa: E402
from jitfuse.torch import _ext  # noqa: E402
from test_torch_gpu import check, randomize  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _ext.active(), reason="export needs the C++ extension")]
H, ROWS, BF16 = 128, 16, torch.bfloat16


class Model(torch.nn.Module):
    """Three Sequentials: one without extra inputs (`extra_inputs=[]`, what AOTInductor's proxy executor passes as
    None), one without parameters either, one with an extra input; a PyTorch op between them that Inductor
    compiles."""

    def __init__(self):
        super().__init__()
        kw = {"device": "cuda", "dtype": BF16}
        self.a = jt.Sequential(jt.LayerNorm(H), jt.Linear(H, H), jt.Bias(H), jt.GELU(), name="up", **kw)
        self.s = jt.Sequential(jt.Scale(0.5), jt.SiLU(), name="no_params", **kw)
        self.b = jt.Sequential(jt.Linear(H, H), jt.Bias(H), jt.GELU(), jt.AddExtraInput(), name="down", **kw)

    def forward(self, x):
        h = self.s(self.a(x))
        return self.b(torch.tanh(h), x)


NO_JITFUSE_SCRIPT = textwrap.dedent("""
    import os, sys, torch
    torch.ops.load_library(os.environ["JF_TORCH_LIB"])   # the C++ ops; no jitfuse Python code
    runner = torch._inductor.aoti_load_package(sys.argv[1])
    x = torch.load(sys.argv[2]).cuda()
    y = runner(x)
    y = y[0] if isinstance(y, (list, tuple)) else y
    assert not [m for m in sys.modules if m.split(".")[0] == "jitfuse"], "jitfuse was imported"
    torch.save(y.cpu(), sys.argv[3])
""")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The model, its input, its eager output, the AOTInductor package and the definitions file."""
    tmp = tmp_path_factory.mktemp("export")
    torch.manual_seed(0)
    model = Model().eval()
    randomize(model)
    x = torch.randn(ROWS, H, device="cuda", dtype=BF16)
    with torch.no_grad():
        ref = model(x)
        ep = torch.export.export(model, (x,))
    calls = [n for n in ep.graph.nodes if n.op == "call_function" and "jitfuse" in str(n.target)]
    assert len(calls) == 3, ep.graph
    pkg = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp / "model.pt2"))
    seqs = tmp / "model.jfseq"
    assert jt.export_definitions(model, seqs) >= 3
    defined = {int(line.split("\t")[0]) for line in seqs.read_text().splitlines()[1:]}
    assert {int(n.args[0]) for n in calls} <= defined
    return {"model": model, "x": x, "ref": ref, "pkg": pkg, "seqs": seqs, "tmp": tmp}


def _no_pythonpath_env(seqs):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["JITFUSE_TORCH_SEQUENCES"] = str(seqs)
    return env


def _in_process(exported):
    runner = torch._inductor.aoti_load_package(exported["pkg"])
    with torch.no_grad():
        y = runner(exported["x"])
    return y[0] if isinstance(y, (list, tuple)) else y


def test_export_aoti_package_in_process(exported):
    y = _in_process(exported)
    check("AOTI in-process vs eager", y, exported["ref"], BF16, gemm=True, chain=3)


def test_export_aoti_package_in_a_cuda_graph(exported):
    """The package captured in a CUDA graph (the single-threaded runner: the default one queries CUDA events,
    which a capture forbids) replays the package's output; the replay writes its output anew (poisoned first)."""
    runner = torch._inductor.aoti_load_package(exported["pkg"], run_single_threaded=True)
    x = exported["x"]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(s):
        for _ in range(3):
            runner(x)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(g):
        out = runner(x)
    out = out[0] if isinstance(out, (list, tuple)) else out
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, _in_process(exported))


def test_export_aoti_package_runs_without_python_jitfuse(exported):
    """A Python process that loads libjitfuse_torch.so (which finds libjitfuse.so itself) and the package, and
    never imports jitfuse's Python code."""
    tmp, x = exported["tmp"], exported["x"]
    torch.save(x.cpu(), tmp / "x.pt")
    env = _no_pythonpath_env(exported["seqs"])
    env.pop("JITFUSE_LIBRARY", None)
    env["JF_TORCH_LIB"] = str(Path(_ext.EXT.path) / _ext.LIB_NAME)
    r = subprocess.run([sys.executable, "-c", NO_JITFUSE_SCRIPT, exported["pkg"], str(tmp / "x.pt"),
                        str(tmp / "y.pt")], env=env, capture_output=True, text=True, timeout=300, cwd=tmp)
    assert r.returncode == 0, r.stdout + r.stderr
    y = torch.load(tmp / "y.pt")
    check("AOTI from Python without jitfuse vs eager", y, exported["ref"].cpu(), BF16, gemm=True, chain=3)
    assert torch.equal(y, _in_process(exported).cpu())


def test_export_aoti_package_runs_in_a_cpp_host(exported):
    """runtime/torch/examples/aoti_run.cpp: libtorch + libjitfuse_torch + libjitfuse, no Python."""
    exe = Path(_ext.EXT.path) / "jitfuse_aoti_run"
    if not exe.exists():
        pytest.skip(f"{exe} not built (cmake -DJITFUSE_TORCH_AOTI_EXAMPLE=ON)")
    tmp, x = exported["tmp"], exported["x"]
    (tmp / "x.bin").write_bytes(x.cpu().view(torch.int16).numpy().tobytes())
    env = _no_pythonpath_env(exported["seqs"])
    env.pop("JITFUSE_LIBRARY", None)
    r = subprocess.run([str(exe), exported["pkg"], str(exported["seqs"]), str(tmp / "x.bin"), str(ROWS), str(H),
                        str(tmp / "y.bin"), "200"], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    print(r.stdout)
    yc = torch.frombuffer(bytearray((tmp / "y.bin").read_bytes()), dtype=torch.int16).view(BF16).view(ROWS, H)
    check("AOTI from C++ vs eager", yc, exported["ref"].cpu(), BF16, gemm=True, chain=3)
    assert torch.equal(yc, _in_process(exported).cpu())
    assert "CUDA graph replay output identical: 1" in r.stdout  # the package captured in a CUDA graph


def test_definitions_file_is_refused_when_malformed(tmp_path):
    bad = tmp_path / "bad.jfseq"
    bad.write_text("jitfuse.torch_sequences/1\n12\tbf16\t0\n")
    with pytest.raises(Exception, match=r"bad.jfseq:2: expected 8 tab-separated fields"):
        _ext.EXT.load_definitions(str(bad))
    (tmp_path / "other.txt").write_text("hello\n")
    with pytest.raises(Exception, match="not a jitfuse.torch_sequences/1 file"):
        _ext.EXT.load_definitions(str(tmp_path / "other.txt"))


@pytest.mark.parametrize("ops", ["linear_bias_gelu", "scale_gelu"])
def test_export_sequence_without_extra_inputs(tmp_path, ops):
    """A lone Sequential without extra inputs (and, for scale_gelu, without parameters): its empty lists reach
    the op as None through AOTInductor's proxy executor (`Tensor[]?`)."""
    mods = [jt.Linear(H, H), jt.Bias(H), jt.GELU()] if ops == "linear_bias_gelu" else [jt.Scale(0.25), jt.GELU()]
    model = jt.Sequential(*mods, device="cuda", dtype=BF16).eval()
    randomize(model)
    x = torch.randn(ROWS, H, device="cuda", dtype=BF16)
    with torch.no_grad():
        ref = model(x)
        ep = torch.export.export(model, (x,))
    pkg = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "m.pt2"))
    runner = torch._inductor.aoti_load_package(pkg)
    with torch.no_grad():
        torch.full_like(ref, float("nan"))  # freed: the package's output takes this block, NaN unless written
        y = runner(x)
    y = y[0] if isinstance(y, (list, tuple)) else y
    assert torch.equal(y, ref)

# Tensor parallelism on several GPUs (docs/parallel.md): tools/multigpu/tp.py's checks through torchrun, one
# process per GPU, on 2 and (where the machine has them) 4 GPUs: the TP and TP+SP MLP blocks against one GPU
# (`check`; the SP blocks' forward also as CUDA-graph replays; again with JITFUSE_PEER_COPY=0), an HF Llama with TP+SP
# MLPs trained 100 AdamW steps against one GPU (`train --sp`), and the all-reduce + residual + RMSNorm group — the one-shot kernel over peer-mapped buffers, its
# NCCL path and NCCL's all-reduce followed by our norm — against float64, eager and captured in CUDA graphs
# (`arnorm`); tools/multigpu/ep.py's expert parallelism: the expert block with MoEDispatch / MoECombine against
# float64 on every rank (`check`), a small MoE language model's 60 AdamW steps against one GPU (`train`, also
# under activation checkpointing and torch.compile), and
# Hugging Face's Mixtral with hf.apply(expert_parallel="ep") against the unmodified model (`hf`).
# Skipped with fewer GPUs.
import os
import subprocess
import sys

import pytest

from conftest import need_torch

torch = need_torch()
if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
    pytest.skip("needs 2 GPUs", allow_module_level=True)

pytestmark = pytest.mark.gpu
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
TP = os.path.join(ROOT, "tools", "multigpu", "tp.py")
EP = os.path.join(ROOT, "tools", "multigpu", "ep.py")


def torchrun(world, mode, port, timeout=300, script=TP, args=(), env_extra=None):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", JF_TP_WATCHDOG=str(timeout - 20), **(env_extra or {}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--master-port", str(port),
           script, mode, *args]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{' '.join(cmd)} exited {r.returncode}:\n{(r.stdout + r.stderr)[-6000:]}"
    return r.stdout


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_blocks_match_one_gpu(world):
    out = torchrun(world, "check", 29531 + world)
    assert "MISMATCH" not in out and " ok" in out


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_blocks_match_one_gpu_on_nccls_reduce_scatter(world):
    # JITFUSE_PEER_COPY=0: the SP linears' NCCL way instead of the copy-engine collectives.
    out = torchrun(world, "check", 29581 + world, env_extra={"JITFUSE_PEER_COPY": "0"})
    assert "MISMATCH" not in out and "graph replay 2" in out


@pytest.mark.parametrize("world", [2, 4])
def test_hf_llama_with_tp_sp_mlps_tracks_one_gpu(world):
    out = torchrun(world, "train", 29591 + world, args=["--sp"])
    assert "MISMATCH" not in out and f"TP={world}+SP, 100 AdamW steps" in out and "apart ok" in out


@pytest.mark.parametrize("world", [2, 4])
def test_allreduce_residual_norm_matches_float64(world):
    out = torchrun(world, "arnorm", 29541 + world)
    assert "MISMATCH" not in out and "## all-reduce + residual + RMSNorm" in out


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_block_matches_float64(world):
    out = torchrun(world, "check", 29551 + world, script=EP)
    assert "MISMATCH" not in out and "dW2 (this rank's experts)" in out and "max_rows too small -> ok" in out


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_training_tracks_one_gpu(world):
    out = torchrun(world, "train", 29561 + world, script=EP)
    assert "MISMATCH" not in out and "apart ok" in out


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_training_under_checkpointing_and_compile(world):
    # Each EP layer under torch.utils.checkpoint (the backward recomputes its dispatch and combine) and the model
    # under torch.compile: the loss curve still tracks one GPU's eager model.
    out = torchrun(world, "train", 29611 + world, script=EP, args=["--checkpoint", "--compile"])
    assert "MISMATCH" not in out and "checkpoint, compile, 60 AdamW steps" in out and "apart ok" in out


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_hf_mixtral_matches_the_unmodified_model(world):
    out = torchrun(world, "hf", 29571 + world, script=EP)
    assert "MISMATCH" not in out and "generate() of 8 tokens equal" in out and "apart ok" in out


def test_expert_parallel_hf_mixtral_trains_under_gradient_checkpointing():
    out = torchrun(2, "hf", 29621, script=EP, args=["--checkpoint"])
    assert "MISMATCH" not in out and "EP=2, gradient checkpointing, 20 AdamW steps" in out and "apart ok" in out

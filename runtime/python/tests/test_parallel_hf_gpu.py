# Tensor parallelism inside a user's model (docs/parallel.md): a Hugging Face Llama (from a config, random
# init) whose MLPs are swapped for column-/row-parallel jitfuse Sequentials, with and without sequence
# parallelism, on a one-rank torch.distributed group, trained with AdamW and gradient checkpointing: the
# loss curve equals the plainly swapped model's (one rank: the collectives copy), and the loss falls.
import pytest

from conftest import need_torch

torch = need_torch()  # or a skip of this module: no torch, or one jitfuse.torch refuses
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
transformers = pytest.importorskip("transformers")

from torch import nn  # noqa: E402

import jitfuse.torch as jt  # noqa: E402
from test_parallel_gpu import one_rank_group  # noqa: E402,F401  (the one-rank group, autouse)

pytestmark = pytest.mark.gpu
DEV = "cuda"


class TpLlamaMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) as column-parallel [gate; up] -> SwiGLU -> row-parallel down (one rank:
    the shards are the whole weights); ``tp=None``: the plain jitfuse swap."""

    def __init__(self, mlp, tp, sp):
        super().__init__()
        f, h = mlp.gate_proj.weight.shape
        kw = (lambda m: dict(tensor_parallel=m, sequence_parallel=sp)) if tp else (lambda m: {})
        self.seq = jt.Sequential(jt.Linear(h, 2 * f, **kw("column")), jt.SwiGLU(), jt.Linear(f, h, **kw("row")),
                                 device=DEV, dtype=mlp.gate_proj.weight.dtype, name="tp_llama_mlp")
        with torch.no_grad():
            self.seq[0].weight.copy_(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
            self.seq[2].weight.copy_(mlp.down_proj.weight)

    def forward(self, hs):
        return self.seq(hs.reshape(-1, hs.shape[-1])).reshape(hs.shape)


def llama(tp, sp):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=704, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=4, vocab_size=512,
                                   max_position_embeddings=128)
    m = transformers.LlamaForCausalLM(cfg).to(DEV, torch.bfloat16)
    for layer in m.model.layers:
        layer.mlp = TpLlamaMLP(layer.mlp, tp, sp)
    return m


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_hf_llama_with_parallel_mlps_trains_like_the_plain_swap(sp):
    ids = torch.randint(0, 512, (4, 64), device=DEV, generator=torch.Generator(device=DEV).manual_seed(3))
    curves = {}
    for tp in (False, True):
        model = llama(tp, sp)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        curve = []
        for _ in range(8):
            opt.zero_grad(set_to_none=True)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            curve.append(loss.item())
        curves[tp] = curve
    diff = max(abs(a - b) for a, b in zip(curves[True], curves[False]))
    assert diff < 2e-2, (diff, curves)  # SP pipelines the GEMMs in row chunks: rounding may differ
    assert curves[True][-1] < curves[True][0] - 0.3, curves

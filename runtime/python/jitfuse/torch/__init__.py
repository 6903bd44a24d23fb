# jitfuse for PyTorch: nn.Module ops and Sequential over the jitfuse::forward / jitfuse::backward custom ops.
# Importing it imports torch and registers the two custom ops; the library loads on the first sequence.
"""PyTorch modules running jitfuse sequences (see docs/python.md).

>>> import torch, jitfuse.torch as jt
>>> mlp = jt.Sequential(jt.Linear(1024, 4096), jt.Bias(4096), jt.GELU(), jt.Linear(4096, 1024), jt.Bias(1024),
...                     device="cuda", dtype=torch.bfloat16)
>>> y = mlp(torch.randn(8, 1024, device="cuda", dtype=torch.bfloat16))
"""

from ._calls import fp8_weights_unchanged
from ._ext import active as extension_active
from ._ops import backward_op, forward_op
from .float8 import Float8Tensor
from .._channels import ChannelError, Wiring
from . import distributed
from .modules import (GEGLU, GELU, QGELU, AddChannel, AddExtraInput, AllGather, AllReduce, BasicOp, Bias, CrossEntropy, Dropout,
                      Fork, Fp8Sequential, ReduceScatter, Identity, LayerNorm, Linear, MakeExtraOutput, Op, Quantize, ReGLU, ReLU, Reshape, RMSNorm, Scale,
                      Sequential, SiLU, SReLU, SwiGLU, export_definitions)

__all__ = [
    "Sequential", "BasicOp", "Op", "Linear", "Bias", "GELU", "ReLU", "SiLU", "QGELU", "SReLU", "SwiGLU", "GEGLU",
    "ReGLU", "LayerNorm", "RMSNorm", "Dropout", "Scale", "Identity", "Reshape", "Quantize", "AddExtraInput",
    "MakeExtraOutput", "Fork", "AddChannel", "ChannelError", "Wiring", "forward_op", "backward_op", "Fp8Sequential",
    "Float8Tensor", "fp8_weights_unchanged", "extension_active", "export_definitions", "AllGather", "ReduceScatter",
    "AllReduce", "distributed", "CrossEntropy",
]

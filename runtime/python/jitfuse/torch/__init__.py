# jitfuse for PyTorch: nn.Module ops and Sequential over the jitfuse::forward / jitfuse::backward custom ops.
# Importing it imports torch and registers the two custom ops; the library loads on the first sequence.
"""PyTorch modules running jitfuse sequences (see docs/python.md).

>>> import torch, jitfuse.torch as jt
>>> mlp = jt.Sequential(jt.Linear(1024, 4096), jt.Bias(4096), jt.GELU(), jt.Linear(4096, 1024), jt.Bias(1024),
...                     device="cuda", dtype=torch.bfloat16)
>>> y = mlp(torch.randn(8, 1024, device="cuda", dtype=torch.bfloat16))
"""

# The torch version first: an older torch fails inside the modules below with errors that name none of this
# (torch 1.13: "Library.impl() got an unexpected keyword argument 'with_keyset'"). See jitfuse/_torch_support.py.
import torch as _torch

from .._torch_support import UnsupportedTorchError, check as _check_torch

_check_torch(getattr(_torch, "__version__", ""), getattr(_torch, "__file__", None) or "")

from ._calls import fp8_weights_unchanged  # noqa: E402
from ._ext import active as extension_active  # noqa: E402
from ._ops import backward_op, forward_op  # noqa: E402
from .float8 import Float8Tensor  # noqa: E402
from .._channels import ChannelError, Wiring  # noqa: E402
from . import distributed  # noqa: E402
from . import hf  # noqa: E402
from . import _dynamo_backend  # noqa: E402
from ._dynamo_backend import backend, explain  # noqa: E402
from .modules import (GEGLU, GELU, QGELU, AddChannel, AddExtraInput, AllGather, AllReduce, BasicOp, Bias, CrossEntropy, Dropout,  # noqa: E402
                      Fork, Fp8Sequential, GroupedLinear, ReduceScatter, Identity, LayerNorm, Linear, MakeExtraOutput,
                      MoECombine, MoEDispatch, MoEPermute, MoEUnpermute, Op, Quantize, ReGLU, ReLU, Reshape, RMSNorm, Scale,
                      Sequential, SiLU, SReLU, SwiGLU, export_definitions)
from .. import _toolchain  # noqa: E402

if extension_active():
    # Models export through the extension's ops; an Inductor compiler that links libstdc++ statically in part
    # builds packages that crash when loaded (docs/deploy.md): say so now, once, not after the crash.
    _toolchain.warn_if_static("loading the C++ extension that exported models call", stacklevel=2)

_dynamo_backend.register()

__all__ = [
    "Sequential", "BasicOp", "Op", "Linear", "Bias", "GELU", "ReLU", "SiLU", "QGELU", "SReLU", "SwiGLU", "GEGLU",
    "ReGLU", "LayerNorm", "RMSNorm", "Dropout", "Scale", "Identity", "Reshape", "Quantize", "AddExtraInput",
    "MakeExtraOutput", "Fork", "AddChannel", "ChannelError", "Wiring", "forward_op", "backward_op", "Fp8Sequential",
    "Float8Tensor", "fp8_weights_unchanged", "extension_active", "export_definitions", "AllGather", "ReduceScatter",
    "AllReduce", "distributed", "hf", "backend", "explain", "UnsupportedTorchError", "CrossEntropy", "MoEPermute",
    "MoEUnpermute", "GroupedLinear", "MoEDispatch", "MoECombine",
]

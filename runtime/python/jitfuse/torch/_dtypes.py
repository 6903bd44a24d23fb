# dtype tables of the PyTorch side: torch dtype <-> DLPack (type code, bits), and the recipe that a
# floating input dtype runs under.
"""torch dtypes as the C ABI's DLPack dtypes, and the recipes of the package."""

from typing import Dict, Tuple

import torch

from .. import _abi
from ..errors import JitfuseError

TORCH_TO_DL: Dict[torch.dtype, Tuple[int, int]] = {
    torch.float32: (_abi.kDLFloat, 32), torch.float16: (_abi.kDLFloat, 16), torch.bfloat16: (_abi.kDLBfloat, 16),
    torch.uint8: (_abi.kDLUInt, 8), torch.int64: (_abi.kDLInt, 64), torch.int32: (_abi.kDLInt, 32),
}
# The dtypes of CrossEntropy's labels (an extra input of their own dtype, without a gradient).
LABEL_DTYPES = (torch.int64, torch.int32)
DL_TO_TORCH: Dict[Tuple[int, int], torch.dtype] = {v: k for k, v in TORCH_TO_DL.items()}
if hasattr(torch, "float8_e4m3fn"):
    DL_TO_TORCH[(_abi.kDLFloat8_e4m3fn, 8)] = torch.float8_e4m3fn
    TORCH_TO_DL[torch.float8_e4m3fn] = (_abi.kDLFloat8_e4m3fn, 8)

RECIPE_OF_DTYPE: Dict[torch.dtype, str] = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
FP8_RECIPES = ("fp8_delayed", "fp8_current", "fp8_block")


def torch_dtype(dl: Tuple[int, int, int]) -> torch.dtype:
    """The torch dtype of a DLPack (code, bits, lanes) the library reported."""
    try:
        return DL_TO_TORCH[(dl[0], dl[1])]
    except KeyError:
        raise JitfuseError(f"jitfuse reported a tensor of DLPack dtype {dl} that PyTorch cannot hold") from None

# Kept for code outside the package that imported the old single-module runtime (tools/torch_baselines):
# the names it used, re-exported from the modules the runtime is split into. New code imports those.
"""Backwards-compatible re-exports of the PyTorch runtime: :mod:`._dtypes` (dtype tables),
:mod:`._registry` (definitions, contexts, programs per device), :mod:`._calls` (routes, argument blocks,
the kernels), :mod:`._ops` (the custom ops, the eager call, the autograd node)."""

from ._calls import WORKSPACE_CACHE_MAX_BYTES, direct_call_ok, fp8_weights_unchanged
from ._dtypes import FP8_RECIPES, RECIPE_OF_DTYPE, torch_dtype
from ._ops import backward_op, forward_op
from ._registry import (Definition, DeviceProgram, context, define, device_program, existing_programs,
                        forget)

program = device_program  # the old name of device_program

__all__ = ["WORKSPACE_CACHE_MAX_BYTES", "direct_call_ok", "fp8_weights_unchanged", "FP8_RECIPES", "RECIPE_OF_DTYPE",
           "torch_dtype", "backward_op", "forward_op", "Definition", "DeviceProgram", "context", "define",
           "device_program", "existing_programs", "forget", "program"]

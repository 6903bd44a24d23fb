# Float8Tensor: the E4M3 output of a trailing Quantize, with the scale that decodes it, behaving as a
# tensor of its nominal dtype for autograd (so the gradient reaching it is never rounded to E4M3).
"""The FP8 output of a :class:`jitfuse.torch.Sequential` ending in :class:`jitfuse.torch.Quantize`.

A ``Float8Tensor`` holds the E4M3 codes jitfuse wrote (:attr:`fp8_data`, ``torch.float8_e4m3fn``) and the
per-tensor ``scale_inv`` (:attr:`scale_inv`, float32 ``[1]``) that decodes them: ``x ~ codes * scale_inv``.
Its ``dtype`` is the nominal (high-precision) dtype, bfloat16, as TransformerEngine's ``Float8Tensor``:

- autograd sees a bfloat16 output, so the gradient flowing back into it arrives as bfloat16 and the
  Quantize's backward is straight through (no rounding of the gradient to E4M3);
- any PyTorch op applied to it runs on the dequantized values (``codes * scale_inv`` in float32, rounded to
  the nominal dtype), so ``y.float()``, ``y + 1`` or a loss on it are correct numbers;
- :meth:`dequantize` decodes explicitly; :attr:`fp8_data` / :attr:`scale_inv` hand the codes and their
  scale to an FP8 consumer (e.g. ``torch._scaled_mm``).
"""

from typing import Any, Dict, Optional, Tuple

import torch
from torch import Tensor
from torch.utils._pytree import tree_map

_aten = torch.ops.aten


class Float8Tensor(Tensor):
    """E4M3 codes + their float32 scale_inv, a tensor of dtype ``nominal`` for everything else."""

    _data: Tensor
    _scale_inv: Tensor

    @staticmethod
    def __new__(cls, data: Tensor, scale_inv: Tensor, nominal: torch.dtype = torch.bfloat16,
                requires_grad: bool = False) -> "Float8Tensor":
        t = Tensor._make_wrapper_subclass(cls, data.shape, dtype=nominal, device=data.device,
                                          requires_grad=requires_grad)
        t._data = data
        t._scale_inv = scale_inv
        return t

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # everything happened in __new__
        pass

    @property
    def fp8_data(self) -> Tensor:
        """The E4M3 codes (``torch.float8_e4m3fn``, contiguous, the tensor's shape)."""
        return self._data

    @property
    def scale_inv(self) -> Tensor:
        """float32 ``[1]``: decodes the codes, ``x ~ fp8_data * scale_inv``."""
        return self._scale_inv

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> Tensor:
        """The decoded values as a plain tensor of ``dtype`` (default: the nominal dtype)."""
        return (self._data.float() * self._scale_inv).to(dtype or self.dtype)

    def __repr__(self) -> str:  # type: ignore[override]
        return f"Float8Tensor(nominal={self.dtype}, shape={tuple(self.shape)}, values={self.dequantize()})"

    def __tensor_flatten__(self) -> Tuple[list, Dict[str, Any]]:
        return ["_data", "_scale_inv"], {"nominal": self.dtype}

    @staticmethod
    def __tensor_unflatten__(inner: Dict[str, Tensor], meta: Dict[str, Any], outer_size: Any,
                             outer_stride: Any) -> "Float8Tensor":
        return Float8Tensor(inner["_data"], inner["_scale_inv"], meta["nominal"])

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Tuple = (), kwargs: Optional[Dict] = None) -> Any:
        kwargs = kwargs or {}
        if func in (_aten.detach.default, _aten.alias.default):
            (t,) = args
            return Float8Tensor(func(t._data), t._scale_inv, t.dtype)
        # Everything else runs on the decoded values and returns plain tensors.
        unwrap = lambda a: a.dequantize() if isinstance(a, Float8Tensor) else a  # noqa: E731
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))

    __torch_function__ = torch._C._disabled_torch_function_impl

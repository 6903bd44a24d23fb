# jitfuse for Python: ctypes over libjitfuse.so (jitfuse.lib) and PyTorch modules (jitfuse.torch, lazy).
# Importing this package loads nothing; the library is loaded on first use.
"""jitfuse: fused deep-learning op sequences (JSON fusion rules, NVRTC-compiled kernels, cuBLASLt GEMMs).

- :mod:`jitfuse.lib`: the C ABI from Python (no PyTorch): :class:`Context`, :class:`Sequence`,
  ``explain``, ``info``, rule loading, the cache directory.
- :mod:`jitfuse.torch`: ``nn.Module`` ops and :class:`jitfuse.torch.Sequential`, as ``torch.library``
  custom ops that ``torch.compile`` traces and CUDA graphs capture.
- ``python -m jitfuse explain|rules|cache|version``.
"""

__version__ = "0.1.0"

from ._abi import EXPECTED_ABI_VERSION
from .errors import (AbiMismatchError, CompileError, CudaError, InternalError, InvalidArgumentError,
                     JitfuseError, JitfuseIOError, JitfuseMemoryError, LibraryNotFoundError, NoDeviceError,
                     NotPreparedError, ParseError, RuleError, RuleLoadError, UnsupportedError)
from ._toolchain import StaticLibstdcxx, StaticLibstdcxxWarning, check as check_inductor_compiler
from ._torch_support import UnsupportedTorchError
from .lib import (Communicator, Context, Decision, Explanation, Group, Library, OpShape, PreparedProgram,
                  ProgramExplain, ProgramInfo, Sequence, TensorInfo, abi_version, cache_dir, library,
                  library_candidates, load_library, nccl_version,
                  parse_shape, version)

__all__ = [
    "__version__", "EXPECTED_ABI_VERSION", "Communicator", "nccl_version", "Context", "Sequence", "Explanation", "Decision", "Group", "OpShape",
    "PreparedProgram", "ProgramExplain", "ProgramInfo", "TensorInfo", "Library", "library", "load_library", "library_candidates",
    "abi_version", "version", "cache_dir", "parse_shape", "JitfuseError", "InvalidArgumentError", "ParseError",
    "UnsupportedError", "CompileError", "CudaError", "JitfuseIOError", "JitfuseMemoryError", "NoDeviceError",
    "InternalError", "NotPreparedError", "LibraryNotFoundError", "AbiMismatchError", "RuleError", "RuleLoadError",
    "UnsupportedTorchError", "StaticLibstdcxx", "StaticLibstdcxxWarning", "check_inductor_compiler",
]


def __getattr__(name: str):
    if name == "Program":  # deprecated: the old name of ProgramExplain (see jitfuse.lib)
        from . import lib
        return lib.Program
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

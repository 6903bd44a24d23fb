# The PyTorch versions jitfuse.torch supports, and the refusal of any other at import, with what to do.
# Imports no torch: jitfuse.torch runs it before touching torch's internals; setup.py and the tests load it alone.
"""Which torch :mod:`jitfuse.torch` runs on.

The floor is the oldest torch that has every API the package calls without a fallback:

- ``torch.library.register_fake`` (2.4; before it ``impl_abstract``): the fake kernels of the two ops,
  what ``torch.compile`` and ``torch.export`` trace through;
- ``Library.impl(..., with_keyset=True)`` (2.2): the ``Autograd`` kernel of ``jitfuse::forward``;
- ``torch.compiler.is_compiling`` (2.3), ``torch.float8_e4m3fn`` and wrapper subclasses with
  ``__tensor_flatten__`` (2.1: ``Float8Tensor``).

Older torch fails inside the package with an error that names none of this (torch 1.13.1, Debian 12's
``python3-torch``: ``TypeError: Library.impl() got an unexpected keyword argument 'with_keyset'``), so
:func:`check` refuses it first. Newer torch is not refused: releases are tested as they come (see
``TESTED_TORCH``), and a C++ extension built for another torch is refused by its own loader (``_ext.py``).
"""

import re
from typing import Optional, Tuple

# Raise it when the package starts calling an API a supported torch lacks (and say which, above).
MIN_TORCH: Tuple[int, int] = (2, 4)
# The newest torch the package's GPU tests ran on (docs/python.md, "Supported PyTorch versions").
TESTED_TORCH = "2.11"


class UnsupportedTorchError(ImportError):
    """``import jitfuse.torch`` under a torch older than :data:`MIN_TORCH`. An ImportError, so that code
    guarding an optional import (``try: import jitfuse.torch except ImportError``) and pytest's skips treat it
    as "not available here"; ``found`` is the torch version that was refused."""

    def __init__(self, message: str, found: str):
        super().__init__(message)
        self.found = found


def parse(version: str) -> Optional[Tuple[int, int]]:
    """(major, minor) of a torch version string ("2.5.1+cu124", "2.6.0a0+git1234", "1.13.1"), or None when
    it does not start with two numbers."""
    m = re.match(r"\s*(\d+)\.(\d+)", str(version))
    return (int(m.group(1)), int(m.group(2))) if m else None


def floor_text() -> str:
    return f"{MIN_TORCH[0]}.{MIN_TORCH[1]}"


def message(found: str, where: str = "") -> str:
    """The refusal: the torch found (and where), the versions supported, what to do."""
    at = f" (from {where})" if where else ""
    return (f"jitfuse.torch needs PyTorch {floor_text()} or newer (tested up to {TESTED_TORCH}); this Python "
            f"imported torch {found}{at}. Install a supported torch in this environment, e.g. "
            f"pip install 'torch>={floor_text()}' (pick the CUDA build for your driver at "
            f"https://pytorch.org/get-started/locally/), or put it first on sys.path. Without jitfuse.torch, "
            f"`import jitfuse` (the library from Python) and the jitfuse CLI still work.")


def check(version: str, where: str = "") -> None:
    """Raises :class:`UnsupportedTorchError` when ``version`` is older than :data:`MIN_TORCH`. A version that
    does not parse is let through: it cannot be judged, and refusing it would block a custom build."""
    v = parse(version)
    if v is not None and v < MIN_TORCH:
        raise UnsupportedTorchError(message(str(version), where), str(version))

# Python exceptions for jitfuse's status codes and for rule-loading errors (file:line:col).
# One class per jf_status, so callers can catch what they can handle; all derive from JitfuseError.
"""Exceptions raised by the jitfuse package."""

import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Type

from . import _abi


class JitfuseError(Exception):
    """A jitfuse call failed. ``status`` is the jf_status code (0 when not from a C call), ``function``
    the C function, ``message`` the library's message (jf_last_error)."""

    def __init__(self, message: str, status: int = 0, function: str = ""):
        self.message = message
        self.status = status
        self.function = function
        prefix = f"{function}: " if function else ""
        super().__init__(f"{prefix}{message}" if message else f"{prefix}{_abi.STATUS_NAMES.get(status, status)}")

    @property
    def status_name(self) -> str:
        return _abi.STATUS_NAMES.get(self.status, str(self.status))


class InvalidArgumentError(JitfuseError, ValueError):
    """JF_ERR_INVALID_ARGUMENT: a bad tensor, shape, attribute, op index or handle."""


class ParseError(JitfuseError, ValueError):
    """JF_ERR_PARSE: malformed JSON; the message has file:line:col."""


class UnsupportedError(JitfuseError, NotImplementedError):
    """JF_ERR_UNSUPPORTED: a valid request this build cannot do."""


class CompileError(JitfuseError):
    """JF_ERR_COMPILE: NVRTC rejected a generated kernel; the message holds the log."""


class CudaError(JitfuseError):
    """JF_ERR_CUDA: a driver or cuBLASLt call failed."""


class JitfuseIOError(JitfuseError, OSError):
    """JF_ERR_IO: a file could not be read or written."""


class JitfuseMemoryError(JitfuseError, MemoryError):
    """JF_ERR_OUT_OF_MEMORY."""


class NoDeviceError(JitfuseError):
    """JF_ERR_NO_DEVICE: no usable GPU or driver."""


class InternalError(JitfuseError):
    """JF_ERR_INTERNAL: a jitfuse bug; please report it with the message."""


class NotPreparedError(JitfuseError):
    """JF_ERR_NOT_PREPARED: a forward/backward of an unprepared shape inside a CUDA-graph capture.
    Call ``prepare`` (or run the shape once) before capturing."""


class LibraryNotFoundError(JitfuseError, OSError):
    """libjitfuse.so was not found or could not be loaded; ``tried`` lists every candidate and why."""

    def __init__(self, message: str, tried: List[str]):
        super().__init__(message)
        self.tried = tried


class AbiMismatchError(JitfuseError, ImportError):
    """The loaded libjitfuse.so implements another C ABI version than this package."""

    def __init__(self, message: str, path: str, found: int, expected: int):
        super().__init__(message)
        self.path = path  # after the base __init__: ImportError resets .path
        self.found = found
        self.expected = expected


_BY_STATUS: Dict[int, Type[JitfuseError]] = {
    _abi.JF_ERR_INVALID_ARGUMENT: InvalidArgumentError,
    _abi.JF_ERR_PARSE: ParseError,
    _abi.JF_ERR_UNSUPPORTED: UnsupportedError,
    _abi.JF_ERR_COMPILE: CompileError,
    _abi.JF_ERR_CUDA: CudaError,
    _abi.JF_ERR_IO: JitfuseIOError,
    _abi.JF_ERR_OUT_OF_MEMORY: JitfuseMemoryError,
    _abi.JF_ERR_NO_DEVICE: NoDeviceError,
    _abi.JF_ERR_INTERNAL: InternalError,
    _abi.JF_ERR_NOT_PREPARED: NotPreparedError,
}


def error_for_status(status: int, message: str, function: str = "") -> JitfuseError:
    """The exception instance for a jf_status (JitfuseError for codes this package does not know)."""
    return _BY_STATUS.get(status, JitfuseError)(message, status, function)


@dataclass(frozen=True)
class RuleError:
    """One problem reported by jf_context_load_rules: where (file, line, col; line/col None when the
    message has no position, e.g. a missing path) and what."""

    file: str
    line: Optional[int]
    col: Optional[int]
    message: str

    def __str__(self) -> str:
        where = self.file if self.line is None else f"{self.file}:{self.line}:{self.col}"
        return f"{where}: {self.message}"


_POSITIONED = re.compile(r"^(?P<file>.+?):(?P<line>\d+):(?P<col>\d+): (?P<msg>.*)$")
_FILE_ONLY = re.compile(r"^(?P<file>[^:]+?): (?P<msg>.*)$")


def parse_rule_errors(text: str) -> List[RuleError]:
    """Splits jf_last_error() of jf_context_load_rules into RuleErrors (one per line; a line without a
    location continues the previous message, e.g. a compiler log)."""
    errors: List[RuleError] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        m = _POSITIONED.match(line)
        if m:
            errors.append(RuleError(m["file"], int(m["line"]), int(m["col"]), m["msg"]))
            continue
        m = _FILE_ONLY.match(line)
        if m and (not errors or not line[:1].isspace()):
            errors.append(RuleError(m["file"], None, None, m["msg"]))
        elif errors:
            last = errors[-1]
            errors[-1] = RuleError(last.file, last.line, last.col, last.message + "\n" + line)
        else:
            errors.append(RuleError("", None, None, line))
    return errors


class RuleLoadError(JitfuseError):
    """jf_context_load_rules skipped rules (the others stay loaded). ``errors`` holds each problem with
    its file, line and col; ``path`` is what was loaded."""

    def __init__(self, path: str, errors: List[RuleError], n_errors: int):
        self.path = path
        self.errors = errors
        self.n_errors = n_errors
        first = errors[0] if errors else None
        self.file = first.file if first else path
        self.line = first.line if first else None
        self.col = first.col if first else None
        lines = "\n".join(f"  {e}" for e in errors)
        super().__init__(f"{path}: {n_errors} error(s) loading rules (the other rules were loaded):\n{lines}",
                         _abi.JF_OK, "jf_context_load_rules")

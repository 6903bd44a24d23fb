# ctypes mirror of runtime/include/jitfuse/jitfuse.h (C ABI 2) and the DLPack structs it uses.
# Kept field for field in header order; change this file together with the header and EXPECTED_ABI_VERSION.
"""ctypes declarations of the jitfuse C ABI (version 2) and of DLPack's DLTensor.

Nothing here loads a library: :func:`declare` attaches argument and result types to a loaded
:class:`ctypes.CDLL`. Layouts follow ``jitfuse.h`` and ``dlpack/dlpack.h`` (DLPack 0.6 to 1.x share
``DLTensor``).
"""

import ctypes
from ctypes import (POINTER, Structure, c_char_p, c_int, c_int32, c_int64, c_size_t, c_uint8, c_uint16,
                    c_uint64, c_void_p)
from typing import Dict, List, Tuple

EXPECTED_ABI_VERSION = 2

# jf_status
JF_OK = 0
JF_ERR_INVALID_ARGUMENT = 1
JF_ERR_PARSE = 2
JF_ERR_UNSUPPORTED = 3
JF_ERR_COMPILE = 4
JF_ERR_CUDA = 5
JF_ERR_IO = 6
JF_ERR_OUT_OF_MEMORY = 7
JF_ERR_NO_DEVICE = 8
JF_ERR_INTERNAL = 9
JF_ERR_NOT_PREPARED = 10

STATUS_NAMES: Dict[int, str] = {
    0: "JF_OK", 1: "JF_ERR_INVALID_ARGUMENT", 2: "JF_ERR_PARSE", 3: "JF_ERR_UNSUPPORTED",
    4: "JF_ERR_COMPILE", 5: "JF_ERR_CUDA", 6: "JF_ERR_IO", 7: "JF_ERR_OUT_OF_MEMORY",
    8: "JF_ERR_NO_DEVICE", 9: "JF_ERR_INTERNAL", 10: "JF_ERR_NOT_PREPARED",
}

# DLPack
kDLCPU = 1
kDLCUDA = 2
kDLCUDAManaged = 13
kDLInt = 0
kDLUInt = 1
kDLFloat = 2
kDLBfloat = 4
kDLFloat8_e4m3fn = 10  # DLPack 1.0


class DLDevice(Structure):
    _fields_ = [("device_type", c_int32), ("device_id", c_int32)]


class DLDataType(Structure):
    _fields_ = [("code", c_uint8), ("bits", c_uint8), ("lanes", c_uint16)]

    def __repr__(self) -> str:
        return f"DLDataType({dtype_name(self.code, self.bits, self.lanes)})"


class DLTensor(Structure):
    _fields_ = [
        ("data", c_void_p),
        ("device", DLDevice),
        ("ndim", c_int32),
        ("dtype", DLDataType),
        ("shape", POINTER(c_int64)),
        ("strides", POINTER(c_int64)),
        ("byte_offset", c_uint64),
    ]


_DTYPE_NAMES: Dict[Tuple[int, int], str] = {
    (kDLFloat, 32): "float32", (kDLFloat, 16): "float16", (kDLBfloat, 16): "bfloat16",
    (kDLFloat, 64): "float64", (kDLUInt, 8): "uint8", (kDLInt, 8): "int8", (kDLInt, 32): "int32",
    (kDLInt, 64): "int64", (kDLUInt, 64): "uint64", (kDLFloat8_e4m3fn, 8): "float8_e4m3fn",
}


def dtype_name(code: int, bits: int, lanes: int = 1) -> str:
    """'bfloat16', 'float32', ... for a DLDataType (lanes > 1 appended as 'xN')."""
    name = _DTYPE_NAMES.get((code, bits), f"dl(code={code},bits={bits})")
    return name if lanes == 1 else f"{name}x{lanes}"


# Opaque handles are plain pointers.
jf_context = c_void_p
jf_sequence = c_void_p
jf_saved = c_void_p
jf_program = c_void_p
jf_comm = c_void_p
jf_builder = c_void_p
jf_stream = c_void_p

ALLOC_FN = ctypes.CFUNCTYPE(c_void_p, c_size_t, c_void_p, c_void_p)
FREE_FN = ctypes.CFUNCTYPE(None, c_void_p, c_size_t, c_void_p, c_void_p)


class jf_allocator(Structure):
    _fields_ = [("alloc", ALLOC_FN), ("free", FREE_FN), ("user", c_void_p)]


JF_MAX_DIMS = 16  # the header's JF_MAX_DIMS


class jf_tensor_info(Structure):
    _fields_ = [
        ("name", c_char_p),
        ("op_index", c_int),
        ("dtype", DLDataType),
        ("ndim", c_int),
        ("shape", c_int64 * JF_MAX_DIMS),
        ("bytes", c_size_t),
        ("offset", c_size_t),
    ]


class jf_grad_alias(Structure):
    _fields_ = [
        ("op_index", c_int),
        ("name", c_char_p),
        ("saved_offset", c_size_t),
        ("bytes", c_size_t),
    ]


class jf_program_info(Structure):
    _fields_ = [
        ("n_outputs", c_int),
        ("outputs", POINTER(jf_tensor_info)),
        ("n_params", c_int),
        ("params", POINTER(jf_tensor_info)),
        ("n_saved", c_int),
        ("saved", POINTER(jf_tensor_info)),
        ("saved_bytes", c_size_t),
        ("forward_workspace_bytes", c_size_t),
        ("backward_workspace_bytes", c_size_t),
        ("alignment", c_size_t),
        ("uses_rng", c_int),
        ("rng_offset_advance", c_uint64),
    ]


class jf_param(Structure):
    _fields_ = [("op_index", c_int), ("name", c_char_p), ("tensor", POINTER(DLTensor))]


# void* where the header has typed pointers to memory the host fills per call (rng_state: const
# uint64_t*): same ABI, and assigning a Python int (a torch data_ptr) to a c_void_p field is cheap.
class jf_forward_args(Structure):
    _fields_ = [
        ("input", POINTER(DLTensor)),
        ("extra_inputs", POINTER(POINTER(DLTensor))),
        ("n_extra_inputs", c_int),
        ("output", POINTER(DLTensor)),
        ("extra_outputs", POINTER(POINTER(DLTensor))),
        ("n_extra_outputs", c_int),
        ("params", POINTER(jf_param)),
        ("n_params", c_int),
        ("training", c_int),
        ("rng_state", c_void_p),
        ("rng_seed", c_uint64),
        ("rng_offset", c_uint64),
        ("saved", c_void_p),
        ("saved_bytes", c_size_t),
        ("workspace", c_void_p),
        ("workspace_bytes", c_size_t),
        ("fp8_weights_unchanged", c_int),
    ]


class jf_backward_args(Structure):
    _fields_ = [
        ("input", POINTER(DLTensor)),
        ("extra_inputs", POINTER(POINTER(DLTensor))),
        ("n_extra_inputs", c_int),
        ("output", POINTER(DLTensor)),
        ("extra_outputs", POINTER(POINTER(DLTensor))),
        ("n_extra_outputs", c_int),
        ("params", POINTER(jf_param)),
        ("n_params", c_int),
        ("saved", c_void_p),
        ("saved_bytes", c_size_t),
        ("grad_output", POINTER(DLTensor)),
        ("grad_extra_outputs", POINTER(POINTER(DLTensor))),
        ("n_grad_extra_outputs", c_int),
        ("grad_input", POINTER(DLTensor)),
        ("grad_extra_inputs", POINTER(POINTER(DLTensor))),
        ("n_grad_extra_inputs", c_int),
        ("grads", POINTER(jf_param)),
        ("n_grads", c_int),
        ("workspace", c_void_p),
        ("workspace_bytes", c_size_t),
    ]


class jf_fp8_state(Structure):
    _fields_ = [
        ("scale", c_void_p),
        ("scale_inv", c_void_p),
        ("amax_history", c_void_p),
        ("history_len", c_int64),
    ]


_st = c_int  # jf_status
# (name, restype, argtypes). Every function of jitfuse.h, ABI 2.
FUNCTIONS: List[Tuple[str, object, list]] = [
    ("jf_abi_version", c_int, []),
    ("jf_version", c_char_p, []),
    ("jf_last_error", c_char_p, []),
    ("jf_context_create", _st, [POINTER(jf_context)]),
    ("jf_context_destroy", _st, [jf_context]),
    ("jf_context_load_rules", _st, [jf_context, c_char_p, POINTER(c_int)]),
    ("jf_context_set_allocator", _st, [jf_context, POINTER(jf_allocator)]),
    ("jf_sequence_create", _st, [jf_context, c_char_p, c_char_p, POINTER(jf_sequence)]),
    ("jf_sequence_create_from_file", _st, [jf_context, c_char_p, c_char_p, POINTER(jf_sequence)]),
    ("jf_sequence_destroy", _st, [jf_sequence]),
    ("jf_sequence_num_ops", c_int, [jf_sequence]),
    ("jf_sequence_wiring", _st, [jf_sequence, POINTER(c_char_p)]),
    ("jf_sequence_check_counts", _st, [jf_sequence, c_char_p, POINTER(c_int64), c_int, c_int, c_int, c_int, c_int]),
    ("jf_builder_create", _st, [c_char_p, POINTER(jf_builder)]),
    ("jf_builder_add", _st, [jf_builder, c_char_p, c_char_p]),
    ("jf_builder_finish", _st, [jf_builder, jf_context, c_char_p, POINTER(jf_sequence)]),
    ("jf_builder_destroy", _st, [jf_builder]),
    ("jf_sequence_prepare", _st, [jf_sequence, POINTER(c_int64), c_int, c_int, jf_stream]),
    ("jf_sequence_info", _st, [jf_sequence, POINTER(c_int64), c_int, c_int, POINTER(jf_program_info)]),
    ("jf_forward", _st, [jf_sequence, POINTER(jf_forward_args), POINTER(jf_saved), jf_stream]),
    ("jf_backward", _st, [jf_sequence, POINTER(jf_backward_args), jf_stream]),
    ("jf_program_open", _st, [jf_sequence, POINTER(c_int64), c_int, c_int, jf_stream, POINTER(jf_program)]),
    ("jf_program_get_info", _st, [jf_program, POINTER(jf_program_info)]),
    ("jf_program_grad_aliases", _st, [jf_program, POINTER(POINTER(jf_grad_alias)), POINTER(c_int)]),
    ("jf_program_forward", _st, [jf_program, POINTER(jf_forward_args), POINTER(jf_saved), jf_stream]),
    ("jf_program_backward", _st, [jf_program, POINTER(jf_backward_args), jf_stream]),
    ("jf_program_close", _st, [jf_program]),
    ("jf_saved_buffer", _st, [jf_saved, POINTER(c_void_p), POINTER(c_size_t)]),
    ("jf_sequence_fp8_state", _st, [jf_sequence, c_int, POINTER(jf_fp8_state)]),
    ("jf_sequence_fp8_operand_state", _st, [jf_sequence, c_int, c_char_p, POINTER(jf_fp8_state)]),
    ("jf_saved_release", _st, [jf_saved, jf_stream]),
    ("jf_sequence_explain", _st, [jf_sequence, POINTER(c_int64), c_int, c_int, c_int, POINTER(c_char_p)]),
    # Tensor parallelism (docs/parallel.md)
    ("jf_nccl_version", _st, [POINTER(c_int)]),
    ("jf_comm_unique_id", _st, [c_void_p, c_size_t]),
    ("jf_comm_create", _st, [c_void_p, c_size_t, c_int, c_int, POINTER(jf_comm)]),
    ("jf_comm_wrap", _st, [c_void_p, POINTER(jf_comm)]),
    ("jf_comm_info", _st, [jf_comm, POINTER(c_int), POINTER(c_int), POINTER(c_int)]),
    ("jf_comm_destroy", _st, [jf_comm]),
    ("jf_sequence_set_comm", _st, [jf_sequence, c_char_p, jf_comm]),
    ("jf_sequence_explain_parallel", _st,
     [jf_sequence, POINTER(c_int64), c_int, c_int, c_int, c_int, c_int, POINTER(c_char_p)]),
]
COMM_ID_BYTES = 128  # JF_COMM_ID_BYTES


def declare(lib: ctypes.CDLL) -> List[str]:
    """Sets restype/argtypes of every ABI function found in ``lib``; returns the names it lacks."""
    missing = []
    for name, restype, argtypes in FUNCTIONS:
        try:
            fn = getattr(lib, name)
        except AttributeError:
            missing.append(name)
            continue
        fn.restype = restype
        fn.argtypes = argtypes
    return missing

"""Tensor and sequence parallelism with ``torch.distributed`` (docs/parallel.md).

A process group (NCCL backend) is registered under the group name its ops use (default ``"tp"``)::

    import torch.distributed as dist, jitfuse.torch as jt
    dist.init_process_group("nccl")
    jt.distributed.set_process_group(dist.new_group(ranks), name="tp")
    mlp = jt.Sequential(jt.RMSNorm(h), jt.Linear(h, 2 * f, tensor_parallel="column", sequence_parallel=True),
                        jt.SwiGLU(), jt.Linear(f, h, tensor_parallel="row", sequence_parallel=True), ...)

Each rank's jitfuse communicator is made once per (group, device): rank 0 of the group draws an NCCL
unique id, ``broadcast_object_list`` sends it through the group, every rank joins. Parallel linears size
their weight shards by the registered group's world size.
"""
import threading
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch

from ..lib import Communicator, Sequence

_lock = threading.RLock()
_groups: Dict[str, Any] = {}
_comms: Dict[Tuple[str, int], Communicator] = {}


def set_process_group(group: Any = None, name: str = "tp") -> None:
    """Registers ``group`` (a ``torch.distributed`` process group with the NCCL backend; None: the default
    group) as the communicator group ``name``. Register before building modules that use it."""
    import torch.distributed as dist
    if not dist.is_initialized():
        raise RuntimeError("jitfuse.torch.distributed: torch.distributed is not initialized "
                           "(call torch.distributed.init_process_group first)")
    group = group if group is not None else dist.group.WORLD  # None and WORLD are one group
    with _lock:
        old = _groups.get(name)
        if old is not None and old is not group and any(k[0] == name for k in _comms):
            raise RuntimeError(f"jitfuse.torch.distributed: group {name!r} already runs sequences on another "
                               f"process group; use another name")
        _groups[name] = group


def process_group(name: str = "tp") -> Any:
    return _groups.get(name)


def world_size(name: str = "tp") -> int:
    """The registered group's size (1 when none is registered: one rank)."""
    g = _groups.get(name)
    if g is None:
        return 1
    import torch.distributed as dist
    return int(dist.get_world_size(g))


def rank(name: str = "tp") -> int:
    """This process's rank in the registered group (0 when none is registered)."""
    g = _groups.get(name)
    if g is None:
        return 0
    import torch.distributed as dist
    return int(dist.get_rank(g))


def communicator(name: str = "tp", device_index: Optional[int] = None) -> Communicator:
    """This rank's jitfuse communicator of group ``name`` on ``device_index`` (default: the current CUDA
    device), made on first use — a collective call: every rank of the group must make it."""
    import torch.distributed as dist
    dev = torch.cuda.current_device() if device_index is None else int(device_index)
    with _lock:
        c = _comms.get((name, dev))
        if c is not None:
            return c
        g = _groups.get(name)
        if g is None:
            raise RuntimeError(f"jitfuse.torch.distributed: no process group registered as {name!r}: call "
                               f"jitfuse.torch.distributed.set_process_group(group, name={name!r}) first")
        rank, size = dist.get_rank(g), dist.get_world_size(g)
        with torch.cuda.device(dev):
            box: List[Any] = [Communicator.unique_id() if rank == 0 else None]
            dist.broadcast_object_list(box, src=dist.get_global_rank(g, 0), group=g)
            c = _comms[(name, dev)] = Communicator(box[0], size, rank)
        return c


def needs_comm(ops: Iterable[Dict[str, Any]]) -> Optional[str]:
    """The group a sequence's ops run collectives on, or None."""
    for o in ops:
        if o.get("op") in ("all_gather", "reduce_scatter", "all_reduce", "moe_dispatch", "moe_combine"):
            return str(o.get("group", "tp"))
        if o.get("op") == "linear" and o.get("tensor_parallel", "none") != "none":
            return str(o.get("group", "tp"))
    return None


def bind(sequence: Sequence, ops: Iterable[Dict[str, Any]], device_index: int) -> None:
    """Hands ``sequence`` its group's communicator when its ops run collectives (before its first prepare)."""
    name = needs_comm(ops)
    if name is not None and device_index >= 0:
        sequence.set_comm(communicator(name, device_index), name)


def sequence_parallel_params(module: torch.nn.Module) -> List[torch.nn.Parameter]:
    """The parameters of ``module``'s jitfuse Sequentials that see only this rank's tokens (norm weights and
    biases on sequence shards, a bias after a reduce-scatter): their gradients are this rank's part, and
    the host all-reduces them over the group before the optimizer step (as Megatron does)."""
    from .modules import Bias, Linear, Sequential, _Norm
    out: List[torch.nn.Parameter] = []
    for seq in (m for m in module.modules() if isinstance(m, Sequential)):
        sharded = False  # on sequence shards: before the first all_gather, after a reduce_scatter
        for op in seq._ops:
            if isinstance(op, Linear) and op.tensor_parallel != "none":
                sharded = op.sequence_parallel and op.tensor_parallel == "row"
                continue
            if getattr(op, "op", "") in ("all_gather",):
                sharded = False
            if getattr(op, "op", "") in ("reduce_scatter",):
                sharded = True
            if isinstance(op, (_Norm, Bias)) and (sharded or _before_gather(seq, op)):
                out.extend(p for _, p in op.jf_params())
    return out


def _before_gather(seq: Any, op: Any) -> bool:
    from .modules import Linear
    for o in seq._ops:
        if o is op:
            return any((isinstance(x, Linear) and x.tensor_parallel == "column" and x.sequence_parallel)
                       or getattr(x, "op", "") == "all_gather" for x in seq._ops[seq._ops.index(op) + 1:])
    return False


def allreduce_sequence_parallel_grads(module: torch.nn.Module, name: str = "tp") -> None:
    """Sums the gradients of :func:`sequence_parallel_params` over group ``name`` (after backward)."""
    import torch.distributed as dist
    g = _groups.get(name)
    if g is None or dist.get_world_size(g) == 1:
        return
    for p in sequence_parallel_params(module):
        if p.grad is not None:
            dist.all_reduce(p.grad, group=g)

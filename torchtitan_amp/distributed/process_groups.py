"""Device and process-group set-up: CUDA + nccl when a GPU is there, CPU + gloo otherwise."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from torchtitan_amp.config import ConfigError, JobConfig

if TYPE_CHECKING:
    from torchtitan_amp.distributed.parallel_dims import ParallelDims


@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def choose_device(requested: str, local_rank: int) -> torch.device:
    if requested == "cuda" and not torch.cuda.is_available():
        raise ConfigError("'training.device' = 'cuda' but no CUDA GPU is available; use 'cpu' or 'auto'")
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", local_rank % max(torch.cuda.device_count(), 1))
    return torch.device("cpu")


def choose_backend(requested: str, device: torch.device) -> str:
    if requested == "nccl" and device.type != "cuda":
        raise ConfigError("'parallelism.backend' = 'nccl' needs CUDA; use 'gloo' or 'auto' on CPU")
    if requested == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    return requested


def resolve(config: JobConfig) -> DistInfo:
    """Decide device and backend from config and torchrun's environment; starts nothing."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = choose_device(config.training.device, local_rank)
    backend = choose_backend(config.parallelism.backend, device)
    return DistInfo(int(os.environ.get("RANK", "0")), local_rank, world_size_from_env(), device, backend)


def set_device(info: DistInfo) -> None:
    """Make this rank's GPU the current one; call before anything allocates on CUDA."""
    if info.device.type == "cuda":
        torch.cuda.set_device(info.device)


# cuBLAS's deterministic workspace setting (torch's reproducibility notes); ":16:8" also works.
CUBLAS_DETERMINISTIC_WORKSPACE = ":4096:8"


def set_determinism(deterministic: bool) -> None:
    """training.deterministic: deterministic kernels everywhere, CUDA included.

    cuBLAS reads CUBLAS_WORKSPACE_CONFIG once, at its first matmul, and without it
    `use_deterministic_algorithms` makes every CUDA matmul raise; cuDNN's autotuner picks
    algorithms by timing, so it is turned off. A value the user set is kept."""
    if not deterministic:
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_DETERMINISTIC_WORKSPACE)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def init(info: DistInfo, timeout_s: float = 300.0) -> None:
    """Start the process group when launched by torchrun (even with one process)."""
    set_device(info)
    if "MASTER_ADDR" in os.environ and not dist.is_initialized():
        timeout = timedelta(seconds=timeout_s)
        store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
        # torchrun keeps one store across `--max-restarts` attempts; without a per-attempt prefix
        # a restarted rank can read a dead peer's address and fail to connect.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.PrefixStore(f"torchtitan_amp/attempt_{attempt}", store)
        dist.init_process_group(
            info.backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timeout,
            device_id=info.device if info.device.type == "cuda" else None,
        )


def values_by_rank(
    name: str, value: str, store: dist.Store | None = None, rank: int | None = None, world_size: int | None = None
) -> list[str]:
    """Every rank's `value` for `name`, in rank order, through the default group's store (the
    torchrun rendezvous): a start-up fact the ranks must agree on, exchanged without a collective,
    so no traffic counter or predicted collective count sees it.

    Args:
        name: the fact's key in the store; unique per exchange.
        value: this rank's value.
        store: the store to exchange through (None: the default group's; one process or no group:
            just `value`).
        rank: this rank's index (None: the default group's); needed with `store`.
        world_size: how many ranks write (None: the default group's); needed with `store`.
    """
    if store is None:
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return [value]
        store, rank, world_size = dist.distributed_c10d._get_default_store(), dist.get_rank(), dist.get_world_size()
    assert rank is not None and world_size is not None
    keys = [f"torchtitan_amp/{name}/{r}" for r in range(world_size)]
    store.set(keys[rank], value)
    store.wait(keys)
    return [store.get(k).decode() for k in keys]


def set_timeouts(timeout_s: float, dims: ParallelDims) -> None:
    """Give every process group the steady-state timeout: a collective that a dead or hung rank
    never joins then fails after `timeout_s` instead of blocking the job forever."""
    if not dist.is_initialized():
        return
    timeout = timedelta(seconds=timeout_s)
    groups: list[dist.ProcessGroup | None] = [None]
    if dims.world_size > 1:
        mesh = dims.mesh
        assert mesh.mesh_dim_names is not None  # build_mesh names every dim
        groups += [mesh.get_group(name) for name in mesh.mesh_dim_names]
        groups += [dims.get_mesh("dp").get_group(), dims.get_mesh("loss").get_group()]
        fsdp = dims.get_mesh("fsdp")
        groups += [fsdp.get_group(i) for i in range(fsdp.ndim)]
    for group in groups:
        dist.distributed_c10d._set_pg_timeout(timeout, group)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def control_group(timeout_s: float) -> dist.ProcessGroup | None:
    """A gloo group for host-side agreement (the per-step stop poll); None = the default group,
    already gloo (or no process group / one rank: nothing to agree with). Collective when it
    creates one: call at the same point on every rank.

    Why: on nccl a collective on a CUDA tensor whose result the host reads (`.tolist()`) is a
    device sync that drains the GPU's queue; on gloo with a CPU tensor it never touches the GPU.
    `timeout_s` is the steady-state collective timeout (comm.timeout_seconds), which set_timeouts
    gives the other groups: a rank that stops answering fails the poll then, not after gloo's
    30-minute default. Not the async checkpoint upload's group: two threads must not share one."""
    if not dist.is_initialized() or dist.get_world_size() == 1 or dist.get_backend() == "gloo":
        return None
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


def mean_across(value: torch.Tensor, group: dist.ProcessGroup | None) -> float:
    """Mean of a scalar over a group, summed in fp32 (gloo has no AVG reduce op)."""
    if group is None or not dist.is_initialized():
        return float(value)
    total = value.detach().float().clone()
    dist.all_reduce(total, group=group)
    return float(total) / dist.get_world_size(group)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (a plain tensor is its own)."""
    return t.to_local() if isinstance(t, DTensor) else t


# Tokens activation checkpointing's and torch.compile's wrappers insert into module names.
_WRAPPER_TOKENS = ("_checkpoint_wrapped_module.", "_orig_mod.")


def unwrapped_name(name: str) -> str:
    """A module's name as the model spells it, whatever wrappers parallelize applied."""
    for token in _WRAPPER_TOKENS:
        name = name.replace(token, "")
    return name

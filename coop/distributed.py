"""One run across processes: torchrun's ranks, PyTorch's own process group, nothing home-made.

    torchrun --nproc-per-node 4 tools/train.py data.name=dtd data.root=$DATA     # 4 GPUs, NCCL
    torchrun --nproc-per-node 2 tools/train.py device=cpu ...                    # 2 CPU ranks, gloo

Without torchrun's environment variables (`WORLD_SIZE` unset or 1) every function here is the
identity of the one-process run: no process group, no communication, nothing rescaled.

What the engine asks of this module (docs/distributed.md):

- `world()`: this process's rank, the world size and the local rank, read from the environment,
  so that the run folder's lock and log files are chosen before any process group exists;
- `init(device, backend)`: the process group (NCCL on CUDA, gloo otherwise, or `train.dist_backend`)
  and this rank's device (`cuda:LOCAL_RANK`);
- `share(n)`: this rank's contiguous share of n items (a global batch, or a list of
  evaluation batches): the first n mod N ranks take one item more;
- `average_gradients(params, n_local)`: the gradients of the global batch's mean loss from each
  rank's mean over its own share, weighted by share size, in one flat all-reduce;
- `gather(obj)` / `broadcast(obj)` / `broadcast_tensors(tensors)` / `all_sum(values)` /
  `barrier()`: the collectives.

Why an explicit all-reduce and not DistributedDataParallel: a method's learnable tensors are a
few plain tensors (`Method.learnable()`, MaPLe's lists of per-layer prompts included), not one
module's parameters behind a `forward`; DDP would wrap a module whose `forward` the engine does not
call (`Method.loss`), register hooks on the frozen towers' thousands of parameters, and average by
the world size, which is wrong when the shares of a batch differ in size. One flat all-reduce of the
kilobytes-to-megabytes of prompt gradients per step is all the communication a step needs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from coop.config.checks import ConfigError

BACKENDS = ("auto", "gloo", "nccl")


@dataclass(frozen=True)
class World:
    """Where this process sits among the ranks of one run (rank 0 alone writes the run folder)."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def log_name(self) -> str:
        """Rank 0 writes `log.txt`; rank k writes its warnings to `log.rank<k>.txt`."""
        return "log.txt" if self.is_main else f"log.rank{self.rank}.txt"


def world() -> World:
    """This process's place, from torchrun's `RANK`, `WORLD_SIZE` and `LOCAL_RANK` (one process
    without them)."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return World()
    return World(int(os.environ.get("RANK", "0")), size, int(os.environ.get("LOCAL_RANK", "0")))


def is_main() -> bool:
    return world().is_main


def active() -> bool:
    """Whether this run spans several processes (and so its collectives communicate)."""
    return world().size > 1


def init(device: torch.device, backend: str = "auto") -> torch.device:
    """Join the run's process group (once) and return this rank's device.

    Args:
        device: the device the config asks for (`engine.resolve_device`); any CUDA device becomes
            `cuda:LOCAL_RANK`, one GPU per rank.
        backend: `train.dist_backend`: auto (NCCL on CUDA, gloo on CPU), gloo or nccl.

    Raises:
        ConfigError: NCCL on a run without CUDA, or more ranks on a node than it has GPUs.
    """
    w = world()
    if w.size == 1:
        return device
    if device.type == "cuda":
        if w.local_rank >= torch.cuda.device_count():
            raise ConfigError(
                f"rank {w.rank} has local rank {w.local_rank}, and this node has "
                f"{torch.cuda.device_count()} GPUs: launch at most that many processes per node"
            )
        device = torch.device("cuda", w.local_rank)
        torch.cuda.set_device(device)
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise ConfigError(
            f"train.dist_backend=nccl needs CUDA, and this run is on {device.type}; use gloo (or auto)"
        )
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=w.rank, world_size=w.size)
    return device


def share(n: int, w: World | None = None) -> tuple[int, int]:
    """[start, end) of this rank's contiguous share of n items: sizes differ by at most one, the
    first n mod N ranks taking one more, so the shares in rank order are the n items in order."""
    w = w or world()
    base, extra = divmod(n, w.size)
    start = w.rank * base + min(w.rank, extra)
    return start, start + base + (w.rank < extra)


def batch_range(n: int, batch_size: int) -> range:
    """This rank's items when n items are encoded `batch_size` at a time and the batches are shared:
    every rank runs exactly the batches that one process runs, so their results are bit-identical."""
    start, end = share(-(-n // batch_size))
    return range(min(start * batch_size, n), min(end * batch_size, n))


def gather_lists(*parts: list) -> tuple[list, ...]:
    """Each list concatenated over the ranks in rank order: `gather_lists(feats, labels)` turns each
    rank's per-batch lists into the whole run's (the lists themselves in one process)."""
    return tuple(sum(lists, []) for lists in zip(*gather(parts), strict=True))


def require_shares(n: int, what: str) -> None:
    """ConfigError unless each rank gets at least one of the n items of a global batch."""
    size = world().size
    if n < size:
        raise ConfigError(
            f"{what} of {n} images cannot be split across {size} ranks: launch at most {n} processes"
        )


def _comm_device() -> torch.device:
    """Where a collective's tensors live: the rank's GPU under NCCL, the CPU under gloo."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def average_gradients(params: list[torch.Tensor], n_local: int) -> int:
    """Turn each rank's gradients of its mean loss over `n_local` images into the gradients of the
    mean over the whole global batch, on every rank; returns the global batch's size.

    Each rank's gradient is weighted by n_local / N, which is exact for unequal shares too (a
    loss that is a mean over its batch plus terms that do not depend on the batch, as every
    method's is). A rank whose share was all unreadable images (`data.skip_corrupt`) joins with
    zero gradients; the reduced gradient is given to every parameter.

    Args:
        params: the optimizer's tensors (those without a gradient count as zero).
        n_local: images in this rank's share of the batch.
    """
    if not active():
        return n_local
    device = _comm_device()
    pieces = []
    for p in params:
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        pieces.append((grad.float() * n_local).flatten().to(device))
    flat = torch.cat([*pieces, torch.tensor([float(n_local)], device=device)])  # (sum of numels + 1,)
    dist.all_reduce(flat)
    total = int(flat[-1].item())
    if total == 0:
        return 0
    offset = 0
    for p in params:
        g = (flat[offset : offset + p.numel()] / total).view_as(p).to(p.device, p.dtype)
        offset += p.numel()
        p.grad = g
    return total


def all_sum(values: list[float]) -> list[float]:
    """Element-wise sums of `values` over the ranks (float64)."""
    if not active():
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=_comm_device())
    dist.all_reduce(t)
    return t.tolist()


def gather(obj) -> list:
    """Every rank's `obj` (picklable: CPU tensors, lists, numbers), in rank order, on every rank."""
    if not active():
        return [obj]
    out = [None] * world().size
    dist.all_gather_object(out, obj)
    return out


def broadcast(obj):
    """Rank 0's `obj` on every rank."""
    if not active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def broadcast_tensors(tensors: dict[str, torch.Tensor]) -> None:
    """Copy rank 0's values of `tensors` into every rank's, in place (e.g. a closed-form fit)."""
    if not active():
        return
    values = broadcast({k: t.detach().cpu() for k, t in tensors.items()})
    with torch.no_grad():
        for k, t in tensors.items():
            t.copy_(values[k])


def barrier() -> None:
    if active():
        dist.barrier()


def close() -> None:
    """Leave the process group (the tools call it at exit; nothing without one)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()

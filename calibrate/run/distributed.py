"""Data-parallel calibration under torchrun: one process per GPU (or CPU process), statistics merged exactly.

torchrun (``--nproc-per-node``, ``--nnodes``) starts the processes and sets RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT; this module reads them, joins the process group (NCCL on GPUs, gloo on CPU)
and offers the few collectives a run needs. Without that environment everything here is a no-op for one
process, so the pipeline has one code path.

Failures: every rank runs each step inside ``Group.together()``, which ends in one collective where each rank
says whether it failed, so a rank that raised makes every other rank stop at the same point with its
message. A rank that dies outright (killed, out of memory) breaks the next collective, or is waited for at
most ``timeout_s`` seconds: either way the others raise ``DistributedError`` instead of hanging.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..capture.stats import Stats

_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


class DistributedError(ValueError):
    """Another rank failed, or the ranks lost contact. A ValueError so that the CLI reports it as one line."""


@dataclass(frozen=True)
class Group:
    """This process's place in the run: rank among ``world`` processes, the device it computes on."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: str = "auto"
    active: bool = False  # a process group was joined (launched by torchrun)

    @property
    def writes(self) -> bool:
        """Only rank 0 writes the checkpoint, runs the short verify and prints the summary."""
        return self.rank == 0

    @contextmanager
    def together(self, what: str) -> Iterator[None]:
        """Run one step of the pipeline on every rank; afterwards every rank knows whether any of them failed.

        A rank that raised tells the others (its exception then goes on); the others raise DistributedError
        naming it, instead of waiting in a later collective for a rank that will never come.
        """
        try:
            yield
        except Exception as e:
            if self.active:
                try:
                    self._exchange(f"{type(e).__name__}: {e}".splitlines()[0], what)
                except DistributedError:
                    pass  # the others may be gone too; this rank's own error is the one to report
            raise
        if self.active:
            failed = [(r, m) for r, m in enumerate(self._exchange(None, what)) if m is not None]
            if failed:
                rank, message = failed[0]
                raise DistributedError(f"rank {rank} of {self.world} failed during {what} ({message}); nothing was written")

    def merge(self, stats: Stats) -> None:
        """Fold every rank's statistics into each rank's ``stats``, in place, as ``Stats.merge_`` would.

        Sums (counts, histograms, float64 moments) are summed, maxima reduced by max; each tensor keeps its
        dtype, so counts and maxima are exact and float64 sums differ from one process only by rounding.
        """
        if not self.active:
            return
        try:
            for tensor, op in stats.merge_parts():
                dist.all_reduce(tensor, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
        except RuntimeError as e:  # torch.distributed.DistError and backend errors
            raise self._lost(e, "the merge of statistics") from None

    def _exchange(self, message: str | None, what: str) -> list[str | None]:
        """Every rank's message (None = this rank is fine), in rank order."""
        messages: list[str | None] = [None] * self.world
        try:
            dist.all_gather_object(messages, message)
        except RuntimeError as e:
            raise self._lost(e, what) from None
        return messages

    def _lost(self, error: Exception, what: str) -> DistributedError:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return DistributedError(
            f"rank {self.rank} of {self.world} lost contact with the other ranks during {what} ({first}); "
            "another rank died or hung (see its log); nothing was written"
        )


def launched() -> bool:
    """Whether torchrun (or anything setting its environment) started this process as one rank of several."""
    return all(name in os.environ for name in _ENV)


def _env_int(name: str) -> int:
    value = os.environ[name]
    if not value.isdigit():
        raise ValueError(f"{name}={value!r} is not a rank number; start kvcal with torchrun, or unset {name}")
    return int(value)


def rank_device(requested: str, local_rank: int) -> str:
    """The device of one rank: its own GPU, cuda:LOCAL_RANK, unless the run is on CPU."""
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return "cpu"
    if requested not in ("auto", "cuda"):
        raise ValueError(f"--device {requested}: under torchrun each rank uses cuda:LOCAL_RANK; pass --device cuda, cpu or leave it out")
    if local_rank >= torch.cuda.device_count():
        raise ValueError(
            f"rank with LOCAL_RANK {local_rank} has no GPU: {torch.cuda.device_count()} are visible; "
            "give torchrun --nproc-per-node at most the number of GPUs"
        )
    return f"cuda:{local_rank}"


@contextmanager
def _native_stderr_kept_on_success() -> Iterator[None]:
    """Hold back what C++ code writes to stderr (fd 2) inside the block; pass it on only if the block succeeds.

    A join that times out makes c10d log its error with a 40-frame C++ stack trace straight to fd 2, where
    Python cannot catch it; the caller's one-line error says the same in words.
    """
    held = tempfile.TemporaryFile()
    saved = os.dup(2)
    os.dup2(held.fileno(), 2)
    ok = False
    try:
        yield
        ok = True
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        if ok:
            held.seek(0)
            os.write(2, held.read())
        held.close()


@contextmanager
def session(device: str, timeout_s: float) -> Iterator[Group]:
    """This process's Group: joined to the others when torchrun launched it (left at the end), else a lone rank 0.

    ``timeout_s`` bounds the wait for the other ranks to arrive and every collective after, so a rank that
    died or hangs ends the run instead of blocking it.
    """
    if not launched():
        yield Group(device=device)
        return
    rank, world, local_rank = _env_int("RANK"), _env_int("WORLD_SIZE"), _env_int("LOCAL_RANK")
    device = rank_device(device, local_rank)
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(device)  # NCCL's object collectives use the current device
    # torch.distributed.nn's functions take ``group=group.WORLD`` as a default argument: imported after the join
    # (transformers imports it when it loads a tokenizer), they would hold the process group forever, so that
    # leaving could not free it and its worker threads would still run while Python shuts down (SIGABRT).
    import torch.distributed.nn as _  # noqa: F401  (bound as _: a bare `import torch...` would make torch local here)
    try:
        with _native_stderr_kept_on_success():
            dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
    except RuntimeError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DistributedError(
            f"rank {rank} could not join the other {world - 1} ranks at {os.environ['MASTER_ADDR']}:"
            f"{os.environ['MASTER_PORT']} within {timeout_s:g} s ({first}); check that every node started and "
            "--master-addr/--master-port are reachable"
        ) from None
    try:
        yield Group(rank, world, local_rank, device, active=True)
    finally:
        dist.destroy_process_group()

"""A worker whose model spans several devices: one process per tensor-parallel rank.

Rank 0 is the worker process itself: Redis I/O, scheduling, the adapter pool's every decision. It
starts the followers (ranks 1 … N-1) as spawned processes, one per GPU, which build their share of
the same model through the same residency (worker/switching/residency.py) and then run the steps
rank 0 sends them (ModelRunner.follow, worker/engine/step_channel.py). torch.distributed: the model's
collectives over NCCL on GPUs (gloo on CPU), rank 0's per-step messages over gloo, rendezvous by TCP
on a free local port.

A rank that dies takes the worker down, never a hang: rank 0 watches its followers' processes and,
when one exits, crashes the worker (its running jobs handed back, as after any engine crash), and
exits within _EXIT_BOUND_S even if its engine thread is stuck in a collective with the dead rank.
A follower watches rank 0, its parent, and exits when it goes.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from multiprocessing.connection import wait as wait_for_exit

import structlog
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _abort_process_group  # torch's only abort of every group

from kernels.lora.configs import set_plan_cache_dir
from shared.config import WorkerConfig
from shared.log import configure_logging
from worker.device_share import apply_device_share
from worker.engine.step_channel import StepChannel
from worker.metrics import WorkerMetrics
from worker.model.parallel.group import TensorParallel
from worker.switching.residency import ModelResidency

log = structlog.get_logger(__name__)

FollowerBody = Callable[[int, int, int, WorkerConfig], None]  # (rank, size, port, config)

# NVLink multicast (NVLS) off in every rank: a program using it can put a host's shared GPUs out of service
NVLS_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# a step's collectives wait this long for a rank that stopped answering (the watchdogs act sooner on one that died)
_COLLECTIVE_TIMEOUT = timedelta(minutes=5)
# a follower waits for rank 0's next step without end (a worker may idle for hours): it watches rank 0 instead
_IDLE_TIMEOUT = timedelta(days=365)
_EXIT_BOUND_S = 10.0  # from a rank's death to this worker's exit, whatever its engine thread is doing
_STOP_S = 10.0  # followers' own exit after rank 0 says stop
_LEAVE_S = 5.0  # a rank's leaving of the group; past it the rank moves on (it is ending anyway)


def rank_config(config: WorkerConfig, rank: int) -> WorkerConfig:
    """`config` as rank `rank` runs it: on CUDA its own GPU, the rank-th from the configured one."""
    device = config.engine.device
    if not device.startswith("cuda"):
        return config
    first = int(device.partition(":")[2] or 0)
    return replace(config, engine=replace(config.engine, device=f"cuda:{first + rank}"))


class Followers:
    """Rank 0's side of a tensor-parallel worker: the follower processes, and the channel to them."""

    def __init__(self, config: WorkerConfig, follow: FollowerBody | None = None) -> None:
        """Start ranks 1 … N-1 of config.engine.tensor_parallel and join the group as rank 0 (blocks
        until every rank has joined). The worker's residency then takes `channel`. `follow`: what a
        follower process runs, follow(rank, size, port, config) (default: a worker's follower, its
        model from the checkpoint; the engine benchmark's has random weights)."""
        size = config.engine.tensor_parallel
        if size < 2:
            raise ValueError("a tensor-parallel worker needs tensor_parallel >= 2")
        if len(config.models) != 1:
            raise ValueError("a tensor-parallel worker serves one model (no switching between models)")
        os.environ.update(NVLS_OFF)  # the spawned followers inherit it
        port = _free_port()
        context = mp.get_context("spawn")
        self._processes = [
            context.Process(
                target=follow or follow_checkpoint, args=(rank, size, port, config), name=f"tp-rank-{rank}", daemon=True
            )
            for rank in range(1, size)
        ]
        for process in self._processes:
            process.start()
        self._stopping = threading.Event()
        self._on_death: Callable[[BaseException], None] | None = None
        # from the start: a follower that dies before it joins would leave rank 0 waiting in the rendezvous
        threading.Thread(target=self._watch, name="tp-watchdog", daemon=True).start()
        self.channel = join_group(0, size, port, torch.device(rank_config(config, 0).engine.device))

    def watch(self, on_death: Callable[[BaseException], None]) -> None:
        """From now on, a follower's exit calls `on_death` (the worker's crash), then ends this process
        within _EXIT_BOUND_S; until this is called, it ends this process at once (nothing is served yet)."""
        self._on_death = on_death

    def stop(self, *, tell: bool) -> None:
        """End the followers: `tell` them to stop (only once rank 0's engine thread has ended: the
        message goes over the channel its steps use), wait for them, end any left, then leave the
        group (aborting, so never waiting on them: leave_group)."""
        self._stopping.set()
        if tell and all(process.is_alive() for process in self._processes):
            self.channel.send(None)
        for process in self._processes:
            process.join(_STOP_S)
            if process.is_alive():
                process.kill()
                process.join()
        leave_group(self.channel)

    def _watch(self) -> None:
        wait_for_exit([process.sentinel for process in self._processes])
        if self._stopping.is_set():
            return
        dead = {process.name: process.exitcode for process in self._processes if not process.is_alive()}
        on_death = self._on_death
        log.error("tensor_parallel_rank_died", ranks=dead, exit_within_s=_EXIT_BOUND_S if on_death else 0)
        if on_death is not None:
            on_death(RuntimeError(f"tensor-parallel rank process ended: {dead}"))
        if not self._stopping.wait(_EXIT_BOUND_S if on_death is not None else 0):
            log.error("tensor_parallel_exit_forced")
            os._exit(1)


def join_group(rank: int, size: int, port: int, device: torch.device) -> StepChannel:
    """Join the tensor-parallel group as `rank` (rendezvous on 127.0.0.1:`port`); the channel over it."""
    on_cuda = device.type == "cuda"
    if on_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if on_cuda else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=size,
        timeout=_COLLECTIVE_TIMEOUT,
    )
    control = dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT)
    tp = TensorParallel(rank, size, dist.group.WORLD)
    # the communicator is built here, by an eager collective, never first inside a graph capture
    tp.all_reduce(torch.zeros(1, device=device))
    return StepChannel(tp, control)


def leave_group(channel: StepChannel) -> None:
    """Leave the tensor-parallel group of `channel` (this process's every group) within _LEAVE_S,
    whatever the other ranks do. First what holds the group's resources lets go of them
    (channel.release: the runners' CUDA graphs, which NCCL waits for without end; issue #26's hang
    at stop). Then NCCL communicators are aborted, not shut down gracefully, so no rank waits on its
    peers (nothing runs on the group any more: nothing is lost); gloo's groups (CPU) are destroyed.
    Past _LEAVE_S the rank moves on (it is ending) with the group left to the process's exit."""
    if not dist.is_initialized():
        return
    aborts = dist.get_backend() == "nccl"

    def leave() -> None:
        try:
            channel.release()
            if aborts:
                try:
                    _abort_process_group()
                    return
                except Exception as exc:  # then the graceful way, still bounded by _LEAVE_S
                    log.warning("tensor_parallel_abort_failed", error=str(exc))
            dist.destroy_process_group()
        except Exception as exc:  # the rank is ending: a failed leave is reported, never raised past it
            log.warning("tensor_parallel_leave_failed", error=str(exc))

    leaving = threading.Thread(target=leave, name="tp-leave", daemon=True)
    leaving.start()
    leaving.join(_LEAVE_S)
    if leaving.is_alive():
        log.warning("tensor_parallel_leave_unfinished", after_s=_LEAVE_S)


def follow_checkpoint(rank: int, size: int, port: int, config: WorkerConfig) -> None:
    """A worker's follower process: its share of the model from the checkpoint, then rank 0's steps
    until it says stop."""
    config, channel = start_follower(rank, size, port, config)
    try:
        residency = ModelResidency(config, WorkerMetrics(config.engine.device), channel)
        prepared = residency.prepare(config.models[0].name)
        log.info("tensor_parallel_follower_ready", rank=rank, model=config.models[0].name)
        prepared.runner.follow(config.adapter_root)
    finally:  # a follower that failed too: its graphs would keep its exit waiting in NCCL
        leave_group(channel)


def start_follower(rank: int, size: int, port: int, config: WorkerConfig) -> tuple[WorkerConfig, StepChannel]:
    """A follower process's start, before it builds its model: (its config, its channel to rank 0)."""
    os.environ.update(NVLS_OFF)
    configure_logging(f"worker-rank{rank}")
    _exit_with_parent()
    config = rank_config(config, rank)
    apply_device_share(config.engine)
    set_plan_cache_dir(config.kernel_plans_dir)  # the LoRA plans rank 0 tuned or found, where it found them
    return config, join_group(rank, size, port, torch.device(config.engine.device))


def _exit_with_parent() -> None:
    """End this process as soon as its parent (rank 0) has ended, however it ended."""
    parent = mp.parent_process()
    if parent is None:
        return

    def watch() -> None:
        wait_for_exit([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]

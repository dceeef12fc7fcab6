"""What a tensor-parallel rank 0 tells its followers each step, so that every rank runs the same
forward: the step's inputs, the adapters rank 0 wrote into which pages since the last step (rank 0's
pool decides every load and eviction; the followers copy into the pages it names), and the tokens
rank 0 sampled (the next step's inputs may take them from the device).

Inputs and loads are small host objects and go over a gloo group (pickled, like vLLM's CPU group);
the sampled tokens stay on the device and go over the model's own group (NCCL on GPUs). A follower
waits for rank 0 between steps without a timeout (a worker may idle for hours): it watches its parent
instead (worker/tensor_parallel/), and rank 0 watches its followers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from shared.schema import AdapterRef
from worker.engine.step_inputs import StepInputs
from worker.model.parallel.group import TensorParallel


class RanksOutOfStep(BaseException):
    """A step failed on rank 0 after its followers were sent it: the ranks can no longer run in step,
    so the worker must end (a BaseException, so the engine's per-step recovery lets it through to the
    engine thread, whose crash stops the worker)."""


@dataclass(frozen=True, slots=True)
class AdapterLoad:
    ref: AdapterRef
    pages: tuple[int, ...]  # the adapter's pages in rank order; its slot is pages[0]


@dataclass(frozen=True, slots=True)
class StepMessage:
    inputs: StepInputs | None  # None: stop serving
    loads: tuple[AdapterLoad, ...] = ()  # to write before the step runs


@dataclass(slots=True)
class StepChannel:
    tp: TensorParallel
    control: dist.ProcessGroup  # gloo, over every rank of `tp`
    _loads: list[AdapterLoad] = field(default_factory=list)  # rank 0: written since the last step

    # -- rank 0 ---------------------------------------------------------------------------------

    def adapter_written(self, ref: AdapterRef, pages: tuple[int, ...]) -> None:
        """Rank 0's pool queued `ref` into `pages`: the followers write their parts before the next step."""
        self._loads.append(AdapterLoad(ref, pages))

    def send(self, inputs: StepInputs | None) -> None:
        """The next step (None: stop) to every follower, with the adapter loads queued before it."""
        message = StepMessage(inputs, tuple(self._loads))
        self._loads.clear()
        dist.broadcast_object_list([message], src=0, group=self.control)

    # -- followers ------------------------------------------------------------------------------

    def receive(self) -> StepMessage:
        box: list[object] = [None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        message = box[0]
        if not isinstance(message, StepMessage):
            raise TypeError(f"rank {self.tp.rank} received {type(message).__name__}, not a StepMessage")
        return message

    # -- every rank -----------------------------------------------------------------------------

    def smallest(self, value: int) -> int:
        """The least of every rank's `value` (each rank calls it at the same point)."""
        least = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(least, op=dist.ReduceOp.MIN, group=self.control)
        return int(least.item())

    def share_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """Rank 0's sampled tokens int64 [B] on every rank: rank 0 passes its own, a follower a buffer
        of the same shape on its device, which is filled."""
        dist.broadcast(tokens, src=0, group=self.tp.group)
        return tokens

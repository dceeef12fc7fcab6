"""What a tensor-parallel rank 0 tells its followers each step, so that every rank runs the same
forward: the step's inputs, the adapters rank 0's pool started reading (the followers read their
parts meanwhile) and wrote into which pages since the last step (rank 0's pool decides every load and
eviction; the followers copy into the pages it names), and the tokens rank 0 sampled (the next
step's inputs may take them from the device).

Inputs and loads are small host objects: msgpack (plain data, nothing a peer sends can run code as
pickle's could) in one fixed frame of a gloo group, one broadcast per step (torch's
broadcast_object_list pickles and takes two: a decode step of 64 sequences cost 1.0 ms
against 0.34 ms this way on a 2-core CPU machine); a message past the frame sends its
rest in a second. The sampled tokens stay on the device and go over the model's own group (NCCL on
GPUs). A follower waits for rank 0 between steps without a timeout (a worker may idle for hours): it
watches its parent instead (worker/tensor_parallel.py), and rank 0 watches its followers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields

import msgpack
import numpy as np
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
    reads: tuple[AdapterRef, ...] = ()  # to read ahead: rank 0 started reading them from disk


# bytes of the frame every step's message goes in (a decode step of 64 sequences takes a few KB)
FRAME_BYTES = 1 << 16
_LENGTH_BYTES = 8  # the frame starts with the message's length


@dataclass(slots=True)
class StepChannel:
    tp: TensorParallel
    control: dist.ProcessGroup  # gloo, over every rank of `tp`
    _loads: list[AdapterLoad] = field(default_factory=list)  # rank 0: written since the last step
    _reads: list[AdapterRef] = field(default_factory=list)  # rank 0: read since the last step
    _frame: torch.Tensor = field(default_factory=lambda: torch.zeros(FRAME_BYTES, dtype=torch.uint8))
    _releases: list[Callable[[], None]] = field(default_factory=list)  # run before this rank leaves the group

    # -- rank 0 ---------------------------------------------------------------------------------

    def reading(self, ref: AdapterRef) -> None:
        """Rank 0's pool started reading `ref` from disk: the followers read their parts meanwhile."""
        self._reads.append(ref)

    def written(self, ref: AdapterRef, pages: tuple[int, ...]) -> None:
        """Rank 0's pool queued `ref` into `pages`: the followers write their parts before the next step."""
        self._loads.append(AdapterLoad(ref, pages))

    def send(self, inputs: StepInputs | None) -> None:
        """The next step (None: stop) to every follower, with the adapter loads queued before it."""
        loads = [[*_values(load.ref), list(load.pages)] for load in self._loads]
        reads = [_values(ref) for ref in self._reads]
        self._loads.clear()
        self._reads.clear()
        payload = msgpack.packb([None if inputs is None else _values(inputs), loads, reads])
        room = FRAME_BYTES - _LENGTH_BYTES
        frame = self._frame.numpy()
        frame[:_LENGTH_BYTES] = np.frombuffer(len(payload).to_bytes(_LENGTH_BYTES, "little"), dtype=np.uint8)
        head = payload[:room]
        frame[_LENGTH_BYTES : _LENGTH_BYTES + len(head)] = np.frombuffer(head, dtype=np.uint8)
        dist.broadcast(self._frame, src=0, group=self.control)
        if len(payload) > room:
            rest = torch.frombuffer(bytearray(payload[room:]), dtype=torch.uint8)
            dist.broadcast(rest, src=0, group=self.control)

    # -- followers ------------------------------------------------------------------------------

    def receive(self) -> StepMessage:
        dist.broadcast(self._frame, src=0, group=self.control)
        frame = self._frame.numpy()
        length = int.from_bytes(frame[:_LENGTH_BYTES].tobytes(), "little")
        room = FRAME_BYTES - _LENGTH_BYTES
        payload = frame[_LENGTH_BYTES : _LENGTH_BYTES + min(length, room)].tobytes()
        if length > room:
            rest = torch.empty(length - room, dtype=torch.uint8)
            dist.broadcast(rest, src=0, group=self.control)
            payload += rest.numpy().tobytes()
        inputs, loads, reads = msgpack.unpackb(payload)
        return StepMessage(
            None if inputs is None else StepInputs(*inputs),
            tuple(AdapterLoad(AdapterRef(*ref), tuple(pages)) for *ref, pages in loads),
            tuple(AdapterRef(*ref) for ref in reads),
        )

    # -- every rank -----------------------------------------------------------------------------

    def before_leaving(self, release: Callable[[], None]) -> None:
        """Call `release` as this rank leaves the group, before it does (worker/tensor_parallel.py's
        leave_group): what holds the group's resources, such as graphs that captured its collectives."""
        self._releases.append(release)

    def release(self) -> None:
        """Run (once) what `before_leaving` was given, in order."""
        releases, self._releases = self._releases, []
        for release in releases:
            release()

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


def _values(item: StepInputs | AdapterRef) -> list:
    """A dataclass's field values in order, the lists themselves (dataclasses.astuple deep-copies them)."""
    return [getattr(item, f.name) for f in fields(item)]

"""Rank 0's per-step messages reach a follower whole (two CPU processes over gloo): a decode step in
one frame with the adapter reads and loads queued before it, a long prefill past the frame in two broadcasts."""

from __future__ import annotations

import multiprocessing as mp

import torch
import torch.distributed as dist

from cli.redis_server import free_port
from shared.schema import AdapterRef
from worker.engine.step_channel import FRAME_BYTES, AdapterLoad, StepMessage
from worker.engine.step_inputs import StepInputs
from worker.tensor_parallel import join_group, leave_group

REF = AdapterRef("support", 3, "acme/support", "ab" * 32)


def receive_two(port: int, received: mp.Queue) -> None:
    channel = join_group(1, 2, port, torch.device("cpu"))
    for _ in range(2):
        received.put(channel.receive())
    leave_group(channel)


def decode_step(batch: int) -> StepInputs:
    return StepInputs(
        input_ids=[-(row + 1) for row in range(batch)],
        positions=[100 + row for row in range(batch)],
        slot_mapping=list(range(batch)),
        token_slots=[row % 3 - 1 for row in range(batch)],
        query_start=list(range(batch + 1)),
        block_tables=[[row, row + batch] for row in range(batch)],
    )


def test_a_decode_step_and_a_prefill_past_the_frame_arrive_whole():
    tokens = FRAME_BYTES  # each an int of several bytes: far past one frame
    prefill = StepInputs(
        list(range(tokens)), list(range(tokens)), list(range(tokens)), [-1] * tokens, [0, tokens], [list(range(64))]
    )
    context = mp.get_context("spawn")
    received = context.Queue()
    port = free_port()
    follower = context.Process(target=receive_two, args=(port, received), daemon=True)
    follower.start()
    channel = join_group(0, 2, port, torch.device("cpu"))
    try:
        channel.reading(REF)
        channel.written(REF, (5, 9))
        channel.send(decode_step(64))
        channel.send(prefill)
        assert received.get(timeout=60) == StepMessage(decode_step(64), (AdapterLoad(REF, (5, 9)),), (REF,))
        assert received.get(timeout=60) == StepMessage(prefill, ())
    finally:
        follower.join(30)
        released = []  # what holds the group's resources (a runner's graphs) lets go while still in it
        channel.before_leaving(lambda: released.append(dist.is_initialized()))
        leave_group(channel)
    assert released == [True]
    assert not dist.is_initialized()

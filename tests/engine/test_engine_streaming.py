"""Token deltas (what the worker publishes for streaming): one per token for a streamed request, none
for a request nobody streams; either way the result carries the whole output."""

from __future__ import annotations

from dataclasses import replace

from shared.schema import JobStatus
from tests.engine.test_engine_generation import NEW_TOKENS, greedy_request, make_engine
from tests.engine.tiny_hf import TinyCheckpoint


def test_only_streamed_requests_hand_out_token_deltas(llama: TinyCheckpoint):
    engine = make_engine(llama)
    streamed = greedy_request(llama, "streamed", None)
    quiet = replace(greedy_request(llama, "quiet", "all_r8"), stream=False)
    for request in (streamed, quiet):
        assert engine.add(request) is None
    deltas, results = [], {}
    while engine.num_unfinished:
        results.update((result.job_id, result) for result in engine.step())
        deltas += engine.take_deltas()

    assert {result.status for result in results.values()} == {JobStatus.SUCCEEDED}
    assert {delta.job_id for delta in deltas} == {"streamed"}
    output = results["streamed"].output
    # every token but the last (whose text the result brings) as a delta, in order, text contiguous
    assert [delta.token_id for delta in deltas] == list(output.token_ids[: NEW_TOKENS - 1])
    assert [delta.offset for delta in deltas] == [sum(len(d.text) for d in deltas[:i]) for i in range(len(deltas))]
    assert output.text.startswith("".join(delta.text for delta in deltas))
    assert len(results["quiet"].output.token_ids) == NEW_TOKENS

"""A real worker publishes token events only for jobs submitted with `stream`: the events of a
non-streamed job are its end alone, a streamed job's tokens arrive one event each before it."""

from __future__ import annotations

import pytest

from shared import keys
from tests.fleet import MODEL, Fleet

pytestmark = pytest.mark.slow


def test_token_events_are_published_only_for_streamed_jobs(fleet: Fleet):
    fleet.start_gateway()
    fleet.start_worker("w1")
    job = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 6, "ignore_eos": True, "temperature": 0.0}
    streamed, quiet = fleet.submit([{**job, "stream": True}, job])
    records = fleet.wait_finished([streamed, quiet], timeout_s=120)
    assert records[0].output.token_ids == records[1].output.token_ids

    with fleet.redis() as client:
        streamed_events = [fields[b"type"] for _, fields in client.xrange(keys.job_events(streamed))]
        quiet_events = [fields[b"type"] for _, fields in client.xrange(keys.job_events(quiet))]
    assert streamed_events == [b"token"] * 5 + [b"end"]  # the last token's text comes with the end
    assert quiet_events == [b"end"]

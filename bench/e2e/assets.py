"""The benchmark's model and adapters on disk, in the formats the real loaders read.

The model is a Llama checkpoint in HF format (config.json, sharded safetensors with an index,
tokenizer.json) with random weights drawn on `device` (a GPU draws 8B parameters in milliseconds;
the time goes into copying them to the host and writing the files). The tokenizer is a word-level
one over the model's whole vocabulary: token i is the word `t{i}`, so any sampled id decodes to
text (a random model samples ids from the whole vocabulary; a smaller BPE vocabulary would decode
most of them to nothing, and streaming would carry empty deltas), and a prompt of n words is
exactly n tokens after the BOS.

Adapters are PEFT LoRA directories (adapter_config.json + adapter_model.safetensors), rank r on
all seven projections, each drawn from its own seed so no two share weights.
"""

from __future__ import annotations

import json
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from bench.e2e.presets import Preset
from cli.demo_model import model_config
from shared.adapter_format import CONFIG_FILE, WEIGHTS_FILE
from shared.model_info import PROJECTIONS, ModelInfo
from worker.adapter_pool.peft_adapter import peft_key

BOS, EOS = "<s>", "</s>"
INIT_STD = 0.02
LORA_B_STD = 0.01  # with A ~ N(0, 1/in): an update of a few percent of the base projection's output
SHARD_BYTES = 2 << 30
_WRITERS = 4  # files written at once (serialisation and the copy into the page cache)


def token_word(token_id: int) -> str:
    """The text of token `token_id` in the benchmark's tokenizer."""
    return f"t{token_id}"


def special_ids(vocab_size: int) -> tuple[int, int]:
    """(BOS, EOS): the last two ids of the vocabulary."""
    return vocab_size - 2, vocab_size - 1


def word_tokenizer(vocab_size: int) -> Tokenizer:
    """Whitespace-split words `t{i}` → id i; encoding prepends BOS; decoding joins words with spaces."""
    bos, eos = special_ids(vocab_size)
    vocab = {token_word(i): i for i in range(vocab_size - 2)} | {BOS: bos, EOS: eos}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=token_word(0)))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens([BOS, EOS])
    tokenizer.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, bos)])
    return tokenizer


def _base_tensors(preset: Preset) -> list[tuple[str, tuple[int, ...]]]:
    """HF Llama parameter names and shapes ([out_features, in_features] for linears)."""
    shape = preset.shape
    hidden, inter, vocab = shape.hidden_size, shape.intermediate_size, preset.vocab_size
    q_width, kv_width = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    tensors = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(shape.num_layers):
        layer = f"model.layers.{i}"
        tensors += [
            (f"{layer}.input_layernorm.weight", (hidden,)),
            (f"{layer}.self_attn.q_proj.weight", (q_width, hidden)),
            (f"{layer}.self_attn.k_proj.weight", (kv_width, hidden)),
            (f"{layer}.self_attn.v_proj.weight", (kv_width, hidden)),
            (f"{layer}.self_attn.o_proj.weight", (hidden, q_width)),
            (f"{layer}.post_attention_layernorm.weight", (hidden,)),
            (f"{layer}.mlp.gate_proj.weight", (inter, hidden)),
            (f"{layer}.mlp.up_proj.weight", (inter, hidden)),
            (f"{layer}.mlp.down_proj.weight", (hidden, inter)),
        ]
    return [*tensors, ("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]


def _shards(tensors: list[tuple[str, tuple[int, ...]]], itemsize: int) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Consecutive groups of at most SHARD_BYTES (a larger tensor gets a shard of its own)."""
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, dims in tensors:
        nbytes = itemsize * torch.Size(dims).numel()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((name, dims))
        size += nbytes
    return shards


def write_model(model_dir: Path, preset: Preset, device: torch.device) -> ModelInfo:
    """Write the checkpoint, tokenizer and configs into `model_dir` (created); returns its ModelInfo."""
    model_dir.mkdir(parents=True)
    bos, eos = special_ids(preset.vocab_size)
    config = model_config(preset.shape, preset.vocab_size, bos, eos) | {
        "torch_dtype": preset.dtype,
        "rope_theta": preset.rope_theta,
    }
    (model_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    word_tokenizer(preset.vocab_size).save(str(model_dir / "tokenizer.json"))
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS}
    (model_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")

    dtype = getattr(torch, preset.dtype)
    generator = torch.Generator(device=device).manual_seed(0)
    shards = _shards(_base_tensors(preset), dtype.itemsize)
    weight_map: dict[str, str] = {}
    total_bytes = 0
    with ThreadPoolExecutor(_WRITERS) as writers:
        pending: list[Future] = []
        for index, shard in enumerate(shards, start=1):
            file_name = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
            tensors = {}
            for name, dims in shard:
                if name.endswith("norm.weight"):
                    tensor = torch.ones(dims, dtype=dtype)
                else:
                    tensor = torch.empty(dims, dtype=dtype, device=device).normal_(0.0, INIT_STD, generator=generator)
                tensors[name] = tensor.cpu()
                weight_map[name] = file_name
                total_bytes += tensor.nbytes
            pending = [f for f in pending if not f.done()]
            if len(pending) >= _WRITERS:  # bound the host memory held by shards not yet written
                pending.pop(0).result()
            pending.append(writers.submit(save_file, tensors, str(model_dir / file_name), {"format": "pt"}))
        for future in pending:
            future.result()
    index_file = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index_file, indent=2) + "\n")
    return ModelInfo.from_pretrained(preset.name, model_dir)


@dataclass(frozen=True, slots=True)
class BenchAdapter:
    name: str
    tenant: str
    path: str  # relative to the adapter root
    popularity_rank: int  # 1 is the hottest under Zipf traffic


def adapter_specs(preset: Preset) -> list[BenchAdapter]:
    """The adapters in popularity order; tenants own them round-robin, so every tenant has hot and cold ones."""
    specs = []
    for k in range(1, preset.num_adapters + 1):
        tenant = tenant_name(k % preset.num_tenants)
        specs.append(BenchAdapter(f"zipf-{k:03d}", tenant, f"{tenant}/zipf-{k:03d}", k))
    return specs


def tenant_name(index: int) -> str:
    return f"tenant{index}"


def _lora_tensors(info: ModelInfo, rank: int, dtype: torch.dtype, seed: int, device: torch.device) -> dict:
    generator = torch.Generator(device=device).manual_seed(1000 + seed)
    tensors = {}
    for layer in range(info.num_layers):
        for projection in PROJECTIONS:
            fan_in, fan_out = info.projection_shape(projection)
            a = torch.randn(rank, fan_in, device=device, generator=generator) * fan_in**-0.5
            b = torch.randn(fan_out, rank, device=device, generator=generator) * LORA_B_STD
            tensors[peft_key(layer, projection, "A")] = a.to(dtype).cpu()
            tensors[peft_key(layer, projection, "B")] = b.to(dtype).cpu()
    return tensors


def write_adapters(
    adapter_root: Path, adapters: list[BenchAdapter], info: ModelInfo, preset: Preset, model_dir: Path,
    device: torch.device,
) -> None:  # fmt: skip
    """Write every adapter's directory under `adapter_root`."""
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(model_dir),
        "r": preset.lora_rank,
        "lora_alpha": 2 * preset.lora_rank,
        "lora_dropout": 0.0,
        "target_modules": list(PROJECTIONS),
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "inference_mode": True,
    }
    dtype = getattr(torch, preset.dtype)
    with ThreadPoolExecutor(_WRITERS) as writers:
        pending: list[Future] = []
        for adapter in adapters:
            directory = adapter_root / adapter.path
            directory.mkdir(parents=True)
            (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
            tensors = _lora_tensors(info, preset.lora_rank, dtype, adapter.popularity_rank, device)
            pending = [f for f in pending if not f.done()]
            if len(pending) >= 2 * _WRITERS:
                pending.pop(0).result()
            pending.append(writers.submit(save_file, tensors, str(directory / WEIGHTS_FILE), {"format": "pt"}))
        for future in pending:
            future.result()

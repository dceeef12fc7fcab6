"""`lorafleet tune`: a model's LoRA plans tuned by hand on this machine's GPU, and a clear refusal
on a machine without one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cli.main import main
from kernels.lora.configs import config_file, read_plans
from shared.model_info import ModelInfo
from tests.engine.tiny_hf import save_tiny_model
from worker.kernel_plans import adapted_layer, plan_keys, pool_rank


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_model("llama", directory, seed=0)
    return directory


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_without_cuda_tune_exits_2_saying_it_needs_a_gpu(tiny_checkpoint: Path, capsys, tmp_path: Path) -> None:
    assert main(["tune", "--model", f"tiny={tiny_checkpoint}", "--kernel-plans-dir", str(tmp_path / "plans")]) == 2
    assert "error: `lorafleet tune` times kernels on a CUDA GPU, and torch sees none here" in capsys.readouterr().err
    assert not (tmp_path / "plans").exists()


def test_a_checkpoint_without_a_supported_architecture_is_refused_first(tmp_path: Path, capsys) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    assert main(["tune", "--model", f"gpt2={tmp_path}"]) == 2
    assert "architecture 'GPT2LMHeadModel' is not supported" in capsys.readouterr().err


def test_the_plan_directories_exclude_each_other(tiny_checkpoint: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["tune", "--model", f"tiny={tiny_checkpoint}", "--packaged", "--kernel-plans-dir", "x"])
    assert exited.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


@pytest.mark.gpu
def test_tune_writes_every_bucket_of_the_models_shapes(tiny_checkpoint: Path, tmp_path: Path, capsys) -> None:
    plans = tmp_path / "plans"
    assert (
        main(["tune", "--model", f"tiny={tiny_checkpoint}", "--tokens", "8", "1", "--kernel-plans-dir", str(plans)])
        == 0
    )
    info = ModelInfo.from_pretrained("tiny", tiny_checkpoint)
    keys = plan_keys(adapted_layer(info, 64), pool_rank(info, 64))
    written = read_plans(config_file(torch.cuda.get_device_name(), plans))
    assert set(written) == {(key, bucket) for key in keys for bucket in (1, 8)}
    out = capsys.readouterr().out
    assert "qkv 64->64|32|32, o 64->64, gate_up 64->96|96, down 96->64" in out
    table = out[out.index("chosen") :].splitlines()[1:3]
    assert [line.split()[0] for line in table] == ["1", "8"]

"""What lorafleet needs to know about a base model, parsed from its HF `config.json` without torch.

The gateway uses it for context-length checks, the adapter validator for the shapes an adapter's
A/B matrices must have, and the worker to build the network.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from shared.bnb_quantization import LOAD_BLOCK_SIZE, checkpoint_block_size
from shared.errors import ErrorCode, LorafleetError
from shared.int4_quantization import (
    CODEBOOK_FORMATS,
    INT4_FORMATS,
    INT4_METHODS,
    check_int4_widths,
    checkpoint_group_size,
    load_group_size,
)
from shared.quantization import (
    KV_CACHE_DTYPES,
    checkpoint_quantization,
    checkpoint_scale_block,
    checkpoint_unquantized,
    served_quantization,
)

# Decoder-only families that share the Llama block (RMSNorm, RoPE, GQA attention, SwiGLU MLP).
# Qwen2 differs only by a bias on q/k/v; Mistral's sliding window is honoured as a context cap.
# The MoE families swap the MLP for a routed mixture of SwiGLU experts; Qwen3-MoE also RMS-normalises
# q and k per head before RoPE.
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM")
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", *MOE_ARCHITECTURES)

# The seven projections an adapter may target, as PEFT names them.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
# projections the worker runs as one GEMM (they share their input): one weight format for all of them
PACKED_PROJECTIONS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))

# Each MoE family's names for an expert's (gate, up, down) projections, as its checkpoints and
# per-expert PEFT adapters spell them: `mlp.experts.{e}.gate_proj` / `block_sparse_moe.experts.{e}.w1`.
EXPERT_PROJECTIONS = {
    "Qwen3MoeForCausalLM": ("gate_proj", "up_proj", "down_proj"),
    "MixtralForCausalLM": ("w1", "w3", "w2"),
}
# the checkpoint's name for the MoE block of a layer
MOE_BLOCK = {"Qwen3MoeForCausalLM": "mlp", "MixtralForCausalLM": "block_sparse_moe"}


@dataclass(frozen=True, slots=True)
class ModelInfo:
    name: str
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_context: int  # tokens (prompt + output) one sequence may hold
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str  # the checkpoint's dtype name, e.g. "bfloat16"
    # Mixture of experts (0 / empty for dense families)
    num_experts: int = 0
    num_experts_per_tok: int = 0  # top-k
    moe_intermediate_size: int = 0  # one expert's SwiGLU width
    norm_topk_prob: bool = False  # renormalise the top-k router probabilities to sum to 1
    moe_layers: tuple[int, ...] = ()  # layers whose MLP is the MoE block (others: a dense MLP)
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3)
    # how the weights are stored: in the checkpoint's files, and on the device as served ("none",
    # "fp8": shared/quantization.py; 4-bit "awq", "gptq", or "int4" as served when quantized at load:
    # shared/int4_quantization.py; bitsandbytes' "nf4" (published or quantized at load) and "fp4":
    # shared/bnb_quantization.py); the KV cache's dtype as served ("auto": the activations')
    checkpoint_quantization: str = "none"
    quantization: str = "none"
    kv_cache_dtype: str = "auto"
    # inputs per scale group (bitsandbytes: block) of 4-bit weights (quantization in INT4_FORMATS); 0 otherwise
    weight_group_size: int = 0
    # a bitsandbytes checkpoint's double quantization: each block's absmax stored in 8 bits
    weight_double_quant: bool = False
    # (outputs, inputs) of the weight blocks sharing one scale in a block-wise FP8 checkpoint, which
    # the loader turns into per-output-channel scales (shared/quantization.py); None otherwise
    weight_scale_block: tuple[int, int] | None = None
    # decoder projections an FP8 checkpoint leaves in its own dtype (its `ignore` list), by their
    # checkpoint names (decoder_projection_name): served unquantized beside the FP8 ones
    unquantized: tuple[str, ...] = ()
    # affine 4-bit weights (int4, AWQ, GPTQ) also held in the tensor cores' layout for decode steps of
    # few sequences, where a bf16 model's widths allow (kernels/quant/int4_mma.py; EngineConfig.int4_decode_copy)
    int4_decode_copy: bool = False

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def expert_projection_shape(self, projection: str) -> tuple[int, int]:
        """(in_features, out_features) of one expert's projection, by its family's name for it."""
        gate, up, down = EXPERT_PROJECTIONS[self.architecture]
        width = self.moe_intermediate_size
        return {gate: (self.hidden_size, width), up: (self.hidden_size, width), down: (width, self.hidden_size)}[
            projection
        ]

    def projection_shape(self, projection: str) -> tuple[int, int]:
        """(in_features, out_features) of one target module of a decoder layer."""
        q_width = self.num_heads * self.head_dim
        kv_width = self.num_kv_heads * self.head_dim
        return {
            "q_proj": (self.hidden_size, q_width),
            "k_proj": (self.hidden_size, kv_width),
            "v_proj": (self.hidden_size, kv_width),
            "o_proj": (q_width, self.hidden_size),
            "gate_proj": (self.hidden_size, self.intermediate_size),
            "up_proj": (self.hidden_size, self.intermediate_size),
            "down_proj": (self.intermediate_size, self.hidden_size),
        }[projection]

    def projection_quantization(self, layer: int, projection: str) -> str:
        """How decoder layer `layer`'s `projection` (a name in PROJECTIONS) is served: as the model's
        weights are, or "none" where the checkpoint left it unquantized."""
        return "none" if decoder_projection_name(layer, projection) in self.unquantized else self.quantization

    def unquantized_summary(self) -> list[str]:
        """The decoder projections served unquantized, as people read them: one left so in every layer as
        `model.layers.*.mlp.down_proj`, any other by its name; empty for a model served in one format."""
        if not self.unquantized:
            return []
        layers = range(self.num_layers)
        kept = set(self.unquantized)
        everywhere = [p for p in PROJECTIONS if all(decoder_projection_name(n, p) in kept for n in layers)]
        kept -= {decoder_projection_name(n, p) for n in layers for p in everywhere}
        patterns = [decoder_projection_name("*", p) for p in everywhere]
        return patterns + [name for name in self.unquantized if name in kept]

    def served(
        self, *, quantization: str | None, kv_cache_dtype: str, source: Path, int4_decode_copy: bool = False
    ) -> ModelInfo:
        """This model as a worker serves it with --quantization `quantization` (None: as the checkpoint
        is), --kv-cache-dtype `kv_cache_dtype` and, for affine 4-bit weights, `int4_decode_copy` (a
        CUDA worker's --int4-decode-copy); errors name `source`, the checkpoint."""
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, not {kv_cache_dtype!r}")
        weights = served_quantization(self.checkpoint_quantization, quantization, source)
        if weights not in ("none", "fp8") and self.is_moe:
            raise LorafleetError(
                ErrorCode.INVALID_REQUEST, f"{source}: {weights} weights are not supported for MoE models yet"
            )
        group_size = self.weight_group_size
        widths = {name: self.projection_shape(name)[0] for name in PROJECTIONS}
        if weights == "int4" and self.checkpoint_quantization == "none":
            group_size = load_group_size(widths, source)
        if weights == "nf4" and self.checkpoint_quantization == "none":
            group_size = LOAD_BLOCK_SIZE
        if weights in INT4_FORMATS:
            check_int4_widths(widths, group_size, source)
        decode_copy = int4_decode_copy and weights in ("int4", *INT4_METHODS)
        return replace(
            self,
            quantization=weights,
            kv_cache_dtype=kv_cache_dtype,
            weight_group_size=group_size,
            int4_decode_copy=decode_copy,
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> ModelInfo:
        data = json.loads(text)
        data["eos_token_ids"] = tuple(data["eos_token_ids"])
        data["moe_layers"] = tuple(data.get("moe_layers", ()))
        data["unquantized"] = tuple(data.get("unquantized", ()))
        if data.get("weight_scale_block") is not None:
            data["weight_scale_block"] = tuple(data["weight_scale_block"])
        return cls(**data)

    @classmethod
    def from_pretrained(cls, name: str, model_dir: Path) -> ModelInfo:
        path = Path(model_dir) / "config.json"
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise LorafleetError(ErrorCode.INVALID_REQUEST, f"cannot read {path}: {exc}") from exc
        architecture = (config.get("architectures") or [""])[0]
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise LorafleetError(
                ErrorCode.INVALID_REQUEST,
                f"{path}: architecture {architecture!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})",
            )
        num_heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // num_heads
        eos = config.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        max_context = config.get("max_position_embeddings", 4096)
        if config.get("sliding_window") and config.get("use_sliding_window", True):
            max_context = min(max_context, config["sliding_window"])
        moe = _moe_fields(architecture, config)
        weights = checkpoint_quantization(config, path)
        group_size = 0
        if weights in CODEBOOK_FORMATS:
            group_size = checkpoint_block_size(Path(model_dir), weights)
        elif weights in INT4_FORMATS:
            group_size = checkpoint_group_size(config["quantization_config"], path)
        double_quant = weights in CODEBOOK_FORMATS and bool(
            config["quantization_config"].get("bnb_4bit_use_double_quant")
        )
        rope_theta = config.get("rope_theta")
        rope_scaling = config.get("rope_scaling")
        # transformers >= 5 folds rope settings into `rope_parameters`
        rope_parameters = config.get("rope_parameters") or {}
        if rope_theta is None:
            rope_theta = rope_parameters.get("rope_theta", 10000.0)
        if rope_scaling is None and rope_parameters.get("rope_type", "default") != "default":
            rope_scaling = rope_parameters
        return cls(
            name=name,
            architecture=architecture,
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=config.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            vocab_size=config["vocab_size"],
            max_context=max_context,
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(config.get("attention_bias", architecture == "Qwen2ForCausalLM")),
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=config.get("torch_dtype") or config.get("dtype") or "float32",
            checkpoint_quantization=weights,
            quantization=weights,
            weight_group_size=group_size,
            weight_double_quant=double_quant,
            weight_scale_block=checkpoint_scale_block(config, path),
            unquantized=_unquantized(config, path, architecture, moe),
            **moe,
        )


def decoder_projection_name(layer: int | str, projection: str) -> str:
    """The checkpoint's name for decoder layer `layer`'s `projection` (a name in PROJECTIONS); layer "*":
    the pattern of every layer's."""
    block = "self_attn" if projection in ATTENTION_PROJECTIONS else "mlp"
    return f"model.layers.{layer}.{block}.{projection}"


def _unquantized(config: dict[str, Any], path: Path, architecture: str, moe: dict[str, Any]) -> tuple[str, ...]:
    """The decoder projections the checkpoint (config.json at `path`) leaves unquantized. Raises
    LorafleetError where they split a packed GEMM (q/k/v, gate/up) or include experts, which the
    worker serves in one format."""
    moe_layers = moe.get("moe_layers", ())
    names = [
        decoder_projection_name(layer, projection)
        for layer in range(config["num_hidden_layers"])
        for projection in (ATTENTION_PROJECTIONS if layer in moe_layers else PROJECTIONS)
    ]
    unquantized = checkpoint_unquantized(config, path, names)
    experts = [
        f"model.layers.{layer}.{MOE_BLOCK[architecture]}.experts.{expert}.{projection}"
        for layer in moe_layers
        for expert in range(moe["num_experts"])
        for projection in EXPERT_PROJECTIONS[architecture]
    ]
    if left := checkpoint_unquantized(config, path, experts):
        raise LorafleetError(
            ErrorCode.INVALID_REQUEST,
            f"{path}: {left[0]} is left unquantized: an FP8 model's experts are served in FP8 only",
        )
    for layer in range(config["num_hidden_layers"]):
        for pack in PACKED_PROJECTIONS:
            names = [decoder_projection_name(layer, projection) for projection in pack]
            if 0 < sum(name in unquantized for name in names) < len(names):
                raise LorafleetError(
                    ErrorCode.INVALID_REQUEST,
                    f"{path}: of {', '.join(names)} only some are left unquantized: the worker runs them "
                    "as one GEMM, in one format",
                )
    return unquantized


def _moe_fields(architecture: str, config: dict[str, Any]) -> dict[str, Any]:
    """The MoE fields of ModelInfo from an HF config, as each family's modeling code reads them."""
    if architecture not in MOE_ARCHITECTURES:
        return {}
    num_layers = config["num_hidden_layers"]
    # transformers 5 writes num_local_experts for both families; Qwen3's hub configs say num_experts
    num_experts = config.get("num_experts") or config.get("num_local_experts") or 0
    if architecture == "MixtralForCausalLM":
        return {
            "num_experts": num_experts,
            "num_experts_per_tok": config["num_experts_per_tok"],
            "moe_intermediate_size": config["intermediate_size"],
            "norm_topk_prob": True,  # Mixtral always renormalises
            "moe_layers": tuple(range(num_layers)),
        }
    step = config.get("decoder_sparse_step", 1)
    dense = set(config.get("mlp_only_layers") or ())
    return {
        "num_experts": num_experts,
        "num_experts_per_tok": config["num_experts_per_tok"],
        "moe_intermediate_size": config["moe_intermediate_size"],
        "norm_topk_prob": bool(config.get("norm_topk_prob", False)),
        "moe_layers": tuple(i for i in range(num_layers) if i not in dense and num_experts and (i + 1) % step == 0),
        "qk_norm": True,
    }

"""The Triton paged-attention kernel against the torch reference on random inputs, in fp16/fp32
(on CPU through the interpreter, which computes bf16 dots wrongly: bf16 is tested on the GPU)."""

from __future__ import annotations

import pytest
import torch

from kernels.attention import paged_attention, paged_attention_reference, paged_attention_triton, store_kv
from tests.kernels.attention_cases import make_case
from tests.kernels.lora_cases import rel_err

# compiled kernels need CUDA tensors; without a GPU the interpreter runs them on CPU tensors
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3}
# (query heads, KV heads, head_dim): power-of-two GQA, and the demo model's (SmolLM2-135M: a group of 3)
HEAD_LAYOUTS = {"llama": (32, 8, 128), "smollm2": (9, 3, 64)}

CASES = {
    "decode": [(1, 1), (1, 17), (1, 40), (1, 64)],
    "prefill": [(5, 5), (33, 33), (1, 1)],
    "chunked_prefill": [(7, 30), (16, 16), (3, 50)],
    "mixed": [(1, 23), (20, 20), (1, 9), (9, 41)],
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kind", sorted(CASES))
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"), [(8, 2, 64, 16), (2, 2, 48, 5), (9, 3, 64, 16)]
)
def test_triton_matches_the_reference(
    kind: str, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> None:
    case = make_case(
        CASES[kind],
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        device=DEVICE,
        seed=len(kind),
    )
    out = paged_attention_triton(*case.args())
    ref = paged_attention_reference(*case.args())
    assert rel_err(out, ref) < TOLERANCE[dtype]


def test_a_token_never_sees_positions_after_its_own() -> None:
    case = make_case(
        [(6, 10)], num_heads=4, num_kv_heads=1, head_dim=32, block_size=4, dtype=torch.float32, device=DEVICE
    )
    before = paged_attention_triton(*case.args())
    # overwrite the cache at the last position: only the last new token may change
    last_block = case.block_tables[0, 9 // 4]
    case.key_cache[last_block, 9 % 4] += 5.0
    case.value_cache[last_block, 9 % 4] -= 5.0
    after = paged_attention_triton(*case.args())
    assert torch.equal(after[:5], before[:5])
    assert not torch.allclose(after[5], before[5])


def test_dispatcher_takes_the_reference_on_cpu_tensors() -> None:
    case = make_case([(3, 8), (1, 5)], num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, dtype=torch.float32)
    assert torch.equal(paged_attention(*case.args()), paged_attention_reference(*case.args()))


def test_store_kv_writes_each_token_at_its_slot() -> None:
    key_cache = torch.zeros(3, 4, 2, 8)
    value_cache = torch.zeros(3, 4, 2, 8)
    key, value = torch.randn(2, 2, 8), torch.randn(2, 2, 8)
    store_kv(key, value, key_cache, value_cache, torch.tensor([9, 2]))
    assert torch.equal(key_cache[2, 1], key[0]) and torch.equal(value_cache[0, 2], value[1])
    assert int((key_cache != 0).any(-1).any(-1).sum()) == 2


def test_rejects_query_heads_that_do_not_group_over_kv_heads() -> None:
    case = make_case([(1, 4)], num_heads=3, num_kv_heads=2, head_dim=16, block_size=4, dtype=torch.float32)
    with pytest.raises(ValueError, match="multiple"):
        paged_attention_triton(*case.args())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("layout", sorted(HEAD_LAYOUTS))
@pytest.mark.parametrize("kind", sorted(CASES))
def test_bf16_on_the_gpu_matches_the_reference(kind: str, layout: str) -> None:
    lens = [(q * 7, ctx * 7) for q, ctx in CASES[kind]]
    num_heads, num_kv_heads, head_dim = HEAD_LAYOUTS[layout]
    case = make_case(
        lens,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=16,
        dtype=torch.bfloat16,
        device="cuda",
    )
    out = paged_attention(*case.args())
    ref = paged_attention_reference(*case.args())
    assert rel_err(out, ref) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_blocks_past_two_to_the_31_elements_are_addressed_correctly() -> None:
    """A small model on a large GPU gets millions of blocks: block offsets must not wrap at int32."""
    block_size, kv_heads, head_dim = 16, 1, 16
    num_blocks = (2**31) // (block_size * kv_heads * head_dim) + 64  # past 2**31 elements per cache
    shape = (num_blocks, block_size, kv_heads, head_dim)
    key_cache = torch.zeros(shape, dtype=torch.float16, device="cuda")
    value_cache = torch.zeros(shape, dtype=torch.float16, device="cuda")
    high_blocks = torch.arange(num_blocks - 4, num_blocks, device="cuda", dtype=torch.int32)  # the top of the cache
    context = 4 * block_size
    keys = torch.randn(context, kv_heads, head_dim, dtype=torch.float16, device="cuda")
    values = torch.randn(context, kv_heads, head_dim, dtype=torch.float16, device="cuda")
    key_cache[high_blocks.long()] = keys.view(4, block_size, kv_heads, head_dim)
    value_cache[high_blocks.long()] = values.view(4, block_size, kv_heads, head_dim)
    q = torch.randn(1, 2, head_dim, dtype=torch.float16, device="cuda")
    args = (
        torch.tensor([0, 1], dtype=torch.int32, device="cuda"),
        torch.tensor([context], dtype=torch.int32, device="cuda"),
        high_blocks.unsqueeze(0),
        head_dim**-0.5,
    )
    out = paged_attention_triton(q, key_cache, value_cache, *args, 1)
    expected = paged_attention_reference(q, key_cache, value_cache, *args)
    assert rel_err(out.float(), expected.float()) < 1e-2

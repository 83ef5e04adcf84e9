"""The Triton W4A16 grouped-expert kernel (workers/eagle3/target/w4a16_moe.py) against the fp32
reference path (one expert dequantized at a time) on a GPU: top-8 of 384 experts, token
counts from one to 65,536, experts that receive no token, and no host synchronisation in
the forward. Skipped without CUDA and Triton (CPU machines, CI)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from workers.eagle3.target import w4a16_moe
from workers.eagle3.target.packed_experts import PackedExperts

pytestmark = pytest.mark.skipif(not w4a16_moe.available(), reason="needs CUDA and Triton")

EXPERTS, TOP_K = 384, 8
TOLERANCE = 2e-2
"""bf16 activations and an fp32 accumulator against fp32 throughout: the error is bf16's
rounding of the input, the intermediate and the output (~2^-8 relative each)."""


def random_experts(hidden: int, inter: int, seed: int = 0) -> PackedExperts:
    """Random INT4 weights made on the GPU: random int32 words are random nibbles."""
    gen = torch.Generator("cuda").manual_seed(seed)
    module = PackedExperts(EXPERTS, hidden, inter, device="cuda")
    for buffer in module.buffers():
        if buffer.dtype == torch.int32:
            buffer.copy_(torch.randint(-2**31, 2**31 - 1, buffer.shape, generator=gen,
                                       device="cuda", dtype=torch.int32))
        else:  # scales of a weight whose inputs are ~N(0, 1): std ~ 1/sqrt(fan_in)
            fan_in = buffer.shape[-1] * module.group_size
            buffer.copy_(torch.rand(buffer.shape, generator=gen, device="cuda")
                         .mul(0.5).add(0.75).div(4 * fan_in ** 0.5))
    return module


def route(tokens: int, *, only: int | None = None, seed: int = 1
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-8 of 384 from random logits; `only`: among the first `only` experts, so the
    rest receive no token."""
    gen = torch.Generator("cuda").manual_seed(seed)
    logits = torch.randn(tokens, EXPERTS, generator=gen, device="cuda")
    if only is not None:
        logits[:, only:] = -torch.inf
    weights, index = torch.topk(logits.sigmoid(), TOP_K, dim=-1)
    return index, weights / weights.sum(-1, keepdim=True)


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.float() - expected).abs().max() / expected.abs().max()).item()


@pytest.fixture(scope="module")
def small() -> PackedExperts:
    return random_experts(1024, 256)


@pytest.mark.parametrize("tokens", [1, 7, 300, 8192, 65536])
def test_kernel_matches_the_fp32_reference(small: PackedExperts, tokens: int) -> None:
    gen = torch.Generator("cuda").manual_seed(tokens)
    x = torch.randn(tokens, small.hidden_dim, generator=gen, device="cuda")
    index, weights = route(tokens)
    expected = small.reference(x, index, weights)
    got = w4a16_moe.moe_forward(x.bfloat16(), small.gate_up_packed, small.gate_up_scale,
                                small.down_packed, small.down_scale, index, weights)
    error = relative_error(got, expected)
    print(f"tokens {tokens}: max relative error {error:.2e} (bf16 vs fp32)")
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    assert error < TOLERANCE


def test_experts_that_receive_no_token(small: PackedExperts) -> None:
    x = torch.randn(300, small.hidden_dim, device="cuda")
    index, weights = route(300, only=20)  # 364 of the 384 experts get nothing
    expected = small.reference(x, index, weights)
    got = w4a16_moe.moe_forward(x.bfloat16(), small.gate_up_packed, small.gate_up_scale,
                                small.down_packed, small.down_scale, index, weights)
    error = relative_error(got, expected)
    print(f"20 of 384 experts used: max relative error {error:.2e}")
    assert error < TOLERANCE


# torch warns that its sync debug mode is a prototype; the suite turns warnings into errors
@pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype:UserWarning")
def test_kimi_shapes_and_no_host_synchronisation() -> None:
    experts = random_experts(7168, 2048)
    x = torch.randn(300, 7168, device="cuda")
    index, weights = route(300)
    expected = experts.reference(x, index, weights)
    xb = x.bfloat16()
    got = experts(xb, index, weights)  # compiles; PackedExperts dispatches to the kernel
    error = relative_error(got, expected)
    print(f"Kimi-K2.5 shapes (7168, 384 x 2048, top-8), 300 tokens: max relative error "
          f"{error:.2e}")
    assert error < TOLERANCE
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        again = experts(xb, index, weights)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(again, got)  # and deterministic: no atomics


@pytest.fixture(scope="module")
def int4_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny INT4 DeepSeek-V3 (workers/fixtures/tiny_int4.py): built here when compressed-tensors
    is installed, else the one `JOBSUP_INT4_CHECKPOINT` names (the GPU machines lack
    the package: the checkpoint travels with the tree)."""
    named = os.environ.get("JOBSUP_INT4_CHECKPOINT")
    if named:
        return Path(named)
    pytest.importorskip("compressed_tensors")
    from workers.fixtures.tiny_int4 import build_tiny_int4_target

    return build_tiny_int4_target(tmp_path_factory.mktemp("int4") / "int4", hidden=128)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_packed_model_split_over_two_gpus(int4_checkpoint: Path) -> None:
    """The packed model on one GPU and split over two (the kernel then runs on the
    second GPU's layers too): the same hidden states, bit for bit."""
    from workers.eagle3.target.loading import load_target
    from workers.eagle3.target.packed_experts import PackedExperts

    one = load_target(int4_checkpoint, device="cuda:0", dtype=torch.bfloat16)
    split = load_target(int4_checkpoint, device=["cuda:0", "cuda:1"], dtype=torch.bfloat16)
    assert one.experts == split.experts == "packed"
    placed = {str(m.gate_up_packed.device) for m in split.model.modules()
              if isinstance(m, PackedExperts)}
    assert placed == {"cuda:0", "cuda:1"}
    ids = torch.randint(8, 384, (4, 64), generator=torch.Generator().manual_seed(3)).cuda()
    with torch.no_grad():
        a = one.model(input_ids=ids, output_hidden_states=True).hidden_states
        b = split.model(input_ids=ids, output_hidden_states=True).hidden_states
    for layer, (x, y) in enumerate(zip(a, b, strict=True)):
        assert torch.equal(x, y.to(x.device)), layer


def test_packed_model_on_a_gpu(int4_checkpoint: Path) -> None:
    """load_target's packed path on CUDA (the load plan checked, the kernel in every MoE
    layer) against the same model with the reference path in its MoE layers: the first
    MoE layer's output to bf16's rounding (later layers also see routing near-ties of a
    random router flip, so they are reported, not held to it)."""
    from workers.eagle3.target.loading import load_target
    from workers.eagle3.target.packed_experts import PackedExperts

    gpu = load_target(int4_checkpoint, device="cuda:0", dtype=torch.bfloat16)
    assert gpu.experts == "packed"
    ids = torch.randint(8, 384, (4, 64), generator=torch.Generator().manual_seed(3)).cuda()
    runs = []
    for kernel in (True, False):
        for module in gpu.model.modules():
            if isinstance(module, PackedExperts):
                module.use_kernel = kernel
        with torch.no_grad():
            runs.append(gpu.model(input_ids=ids, output_hidden_states=True).hidden_states)
    errors = [relative_error(x, y.float()) for x, y in zip(*runs, strict=True)]
    print("kernel vs reference path in one bf16 model on the GPU, per layer: "
          + " ".join(f"{e:.1e}" for e in errors))
    assert errors[0] == errors[1] == 0.0  # embedding, dense layer 0
    assert errors[2] < TOLERANCE  # the first MoE layer

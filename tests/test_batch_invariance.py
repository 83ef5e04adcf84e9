"""workers.eagle3.extraction.batch_invariance on CPU with tiny random DeepSeek-V3, Qwen3-MoE and
Llama models built from transformers' own classes: fp32 batching changes nothing beyond
rounding, bf16 differences match an independent computation, routing flips are counted
at the right layer, the fp32 router really computes in fp32, and the CLI writes its
report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from tests.helpers import make_conversations, worker_env
from workers.eagle3.extraction.batch_invariance import (
    CheckError,
    check_batch_invariance,
    find_routers,
    format_report,
    pick_samples,
    routers_in_fp32,
    routing_flips,
)
from workers.eagle3.extraction.extractor import Sample, pack_batches, pad_batch
from workers.fixtures.tiny import build_tokenizer, corpus

pytestmark = pytest.mark.usefixtures("one_thread")

REPO = Path(__file__).resolve().parent.parent
VOCAB = 384
BATCH_TOKENS = 1024


def deepseek(vocab: int = VOCAB) -> DeepseekV3ForCausalLM:
    """4 layers, the first dense (first_k_dense_replace=1), then 8 routed experts in 2
    groups, top-2 within the best group, one shared expert; small MLA dimensions."""
    config = DeepseekV3Config(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
        n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
        topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=32,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, max_position_embeddings=512,
        tie_word_embeddings=False)
    torch.manual_seed(0)
    return DeepseekV3ForCausalLM(config).eval()


def qwen3_moe() -> Qwen3MoeForCausalLM:
    """4 layers, the first dense (mlp_only_layers), then 8 experts, top 2."""
    config = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[0],
        max_position_embeddings=512, tie_word_embeddings=False)
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(config).eval()


def llama() -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def samples() -> list[Sample]:
    """24 random samples of 20-199 tokens, the second half of each on the loss mask:
    with BATCH_TOKENS they pack into batches of 5 to 11 (and one of one)."""
    generator = torch.Generator().manual_seed(1)
    out = []
    for i in range(24):
        length = int(torch.randint(20, 200, (1,), generator=generator))
        ids = torch.randint(8, VOCAB, (length,), generator=generator).tolist()
        out.append(Sample(i, f"s{i}", ids, [0] * (length // 2) + [1] * (length - length // 2)))
    return out


def report(model: Any, samples: list[Sample], n: int, **kwargs: Any) -> dict[str, Any]:
    return check_batch_invariance(model.get_decoder(), model.get_output_embeddings(), samples,
                                  n=n, batch_tokens=BATCH_TOKENS, **kwargs)


@pytest.mark.parametrize("build", [deepseek, qwen3_moe])
def test_fp32_batched_equals_alone_to_rounding(build: Any, samples: list[Sample]) -> None:
    """In fp32 a right-padded batch gives each sample its own result up to rounding:
    no routing flip, no argmax change; the MoE layers, and only they, have a routing
    figure (layer 0 is dense in both)."""
    result = report(build(), samples, n=6)
    assert result["n"] == 6 and result["dtype"] == "float32"
    assert result["moe_layers"] == [1, 2, 3]
    assert [e["layer"] for e in result["layers"]] == [0, 1, 2, 3]
    assert [e["moe"] for e in result["layers"]] == [False, True, True, True]
    assert result["layers"][0]["routing_flip_share"] is None
    for entry in result["layers"][1:]:
        assert entry["routing_flip_share"] == 0 and entry["routing_flip_share_max"] == 0
    for entry in result["layers"]:
        assert 0 <= entry["rel_diff_median"] <= entry["rel_diff_max"] < 1e-4
    assert result["final"]["rel_diff_max"] < 1e-4
    assert result["argmax_differs_share"] == 0
    assert result["router_logits_dtype"] == "float32"
    assert all(s["batch_samples"] > 1 for s in result["samples"])  # really batched
    assert result["loss_tokens"] == sum(s["loss_tokens"] for s in result["samples"])
    json.dumps(result)  # JSON-able as it is
    table = format_report(result)
    assert "routing flips" in table and "0.00 %" in table


def test_dense_model_has_no_routing_and_no_lm_head_figure(samples: list[Sample]) -> None:
    model = llama()
    result = check_batch_invariance(model.get_decoder(), None, samples, n=3,
                                    batch_tokens=BATCH_TOKENS)
    assert result["moe_layers"] == [] and result["router_logits_dtype"] is None
    assert all(e["routing_flip_share"] is None for e in result["layers"])
    assert result["argmax_differs_share"] is None
    assert all(s["argmax_differs"] is None for s in result["samples"])
    assert "argmax" not in format_report(result)


@pytest.mark.slow
def test_bf16_differences_match_an_independent_computation(samples: list[Sample]) -> None:
    """In bf16 batching changes results measurably (on some samples: most rows of a
    CPU bf16 matmul do not depend on the batch); each reported figure equals the one
    computed from `output_hidden_states` with and without the sample's batch."""
    model = qwen3_moe().to(torch.bfloat16)
    result = report(model, samples, n=12)
    batches = {s.index: batch for batch in pack_batches(samples, BATCH_TOKENS) for s in batch}
    by_index = {s.index: s for s in samples}
    independent = []
    for entry in result["samples"]:
        sample = by_index[entry["index"]]
        batch = batches[sample.index]
        row, length = batch.index(sample), len(sample.input_ids)
        with torch.no_grad():
            ids, attention = pad_batch(batch)
            batched = model(input_ids=ids, attention_mask=attention,
                            output_hidden_states=True).hidden_states
            alone = model(input_ids=torch.tensor([sample.input_ids]),
                          output_hidden_states=True).hidden_states
        # hidden_states[i + 1] is layer i's output; the last one is the normed final state
        expected = [rel_diff(batched[i + 1][row, :length], alone[i + 1][0])
                    for i in range(len(alone) - 1)]
        assert entry["layer_rel_diff"][:-1] == pytest.approx(expected[:-1], rel=1e-3, abs=1e-9)
        assert entry["final_rel_diff"] == pytest.approx(expected[-1], rel=1e-3, abs=1e-9)
        independent += expected
    assert max(independent) > 1e-4, "bf16 batching changed nothing: the test measures nothing"
    assert result["final"]["rel_diff_max"] > 1e-4
    assert result["router_logits_dtype"] == "bfloat16"


def rel_diff(batched: torch.Tensor, alone: torch.Tensor) -> float:
    return float((batched.float() - alone.float()).norm() / alone.float().norm())


def test_routing_flips_compare_expert_sets() -> None:
    batched = torch.tensor([[0, 1], [2, 3], [1, 0], [5, 7]])
    alone = torch.tensor([[1, 0], [2, 4], [0, 1], [6, 7]])
    assert routing_flips(batched, alone).tolist() == [False, True, False, True]


def test_forced_flips_are_counted_at_their_layer(samples: list[Sample]) -> None:
    """A hook makes layer 2's router pick experts {6, 7} for the first 3 tokens of each
    row when batched, {4, 5} alone, {0, 1} elsewhere: exactly 3 flips per sample there,
    none in layer 1 (fp32: nothing else differs before it)."""
    model = deepseek()
    batch = [s for s in samples if 60 <= len(s.input_ids) <= 100][:3]
    longest = max(len(s.input_ids) for s in batch)
    assert len(pack_batches(batch, BATCH_TOKENS)) == 1

    def force(_module: Any, _args: Any, output: tuple[torch.Tensor, ...]) -> tuple[Any, ...]:
        logits, weights, ids = output
        batched = len(ids) == len(batch) * longest
        position = torch.arange(len(ids)) % (longest if batched else len(ids))
        forced = torch.tensor([0, 1]).expand(len(ids), 2).clone()
        forced[position < 3] = torch.tensor([6, 7] if batched else [4, 5])
        return logits, weights, forced

    handle = model.get_decoder().layers[2].mlp.gate.register_forward_hook(force)
    try:
        result = report(model, batch, n=3)
    finally:
        handle.remove()
    assert [s["routing_flipped_tokens"]["2"] for s in result["samples"]] == [3, 3, 3]
    assert [s["routing_flipped_tokens"]["1"] for s in result["samples"]] == [0, 0, 0]
    layer = result["layers"][2]
    assert layer["routing_flip_share"] == pytest.approx(9 / sum(len(s.input_ids) for s in batch))
    assert layer["routing_flip_share_max"] == pytest.approx(3 / min(len(s.input_ids)
                                                                      for s in batch))


def test_routers_found_are_the_declared_ones() -> None:
    decoder = deepseek().get_decoder()
    routers = find_routers(decoder)
    assert sorted(routers) == [1, 2, 3]
    assert all(router is decoder.layers[i].mlp.gate for i, (router, _) in routers.items())
    assert find_routers(llama().get_decoder()) == {}


def test_routers_are_found_where_the_model_declares_none(samples: list[Sample],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers 5.17's DeepSeek-V3 declares no `router_logits` recorder: the
    routers are then found by class name, and the figures are the same."""
    model = deepseek()
    declared = report(model, samples, 4)
    decoder = model.get_decoder()
    older = {k: v for k, v in decoder._can_record_outputs.items() if k != "router_logits"}
    monkeypatch.setattr(type(decoder), "_can_record_outputs", older)
    routers = find_routers(decoder)
    assert sorted(routers) == [1, 2, 3]
    assert all(router is decoder.layers[i].mlp.gate for i, (router, _) in routers.items())
    assert report(model, samples, 4)["layers"] == declared["layers"]


def test_experts_without_a_readable_router_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    decoder = deepseek().get_decoder()
    monkeypatch.setattr(type(decoder), "_can_record_outputs", {"router_logits": "NoSuchGate"})
    with pytest.raises(CheckError, match="decoder layer 1 has experts but no router"):
        find_routers(decoder)


def test_fp32_router_computes_qwen3_logits_in_fp32() -> None:
    """Qwen3-MoE's router computes its logits in the model dtype; inside
    `routers_in_fp32` they are the fp32 product of the (exactly widened) bf16 weight and
    input, and afterwards the router is bf16 again, on its very weight storage."""
    model = qwen3_moe().to(torch.bfloat16)
    router = model.get_decoder().layers[1].mlp.gate
    weight = router.weight.data
    x = torch.randn(16, 64).to(torch.bfloat16)
    plain = router(x)[0]
    assert plain.dtype == torch.bfloat16
    with routers_in_fp32([router]):
        logits = router(x)[0]
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, x.float() @ weight.float().T, rtol=1e-6, atol=1e-6)
    assert not torch.equal(logits, plain.float())  # no longer rounded to bf16
    assert router.weight.data_ptr() == weight.data_ptr() and router.weight.dtype == torch.bfloat16
    assert router(x)[0].dtype == torch.bfloat16


def test_fp32_router_in_the_report(samples: list[Sample]) -> None:
    """Qwen3-MoE: the report says which dtype the router logits had. DeepSeek-V3: its
    router already computes in fp32, so the option changes nothing."""
    qwen = qwen3_moe().to(torch.bfloat16)
    assert report(qwen, samples, n=2)["router_logits_dtype"] == "bfloat16"
    with_fp32 = report(qwen, samples, n=2, fp32_router=True)
    assert with_fp32["router_logits_dtype"] == "float32" and with_fp32["fp32_router"]
    assert qwen.get_decoder().layers[1].mlp.gate.weight.dtype == torch.bfloat16
    ds = deepseek().to(torch.bfloat16)
    plain, fp32 = report(ds, samples, n=4), report(ds, samples, n=4, fp32_router=True)
    assert plain["router_logits_dtype"] == fp32["router_logits_dtype"] == "float32"
    assert plain["layers"] == fp32["layers"] and plain["final"] == fp32["final"]


def test_pick_samples_spreads_over_lengths_and_prefers_shared_batches() -> None:
    lengths = [10, 11, 12, 13, 14, 90]
    samples = [Sample(i, str(i), [1] * n, [1] * n) for i, n in enumerate(lengths)]
    batches = pack_batches(samples, 70)  # [10..14] together, 90 alone
    assert [len(b) for b in batches] == [5, 1]
    assert [s.index for s in pick_samples(batches, 3)] == [0, 2, 4]
    assert [s.index for s in pick_samples(batches, 1)] == [2]
    assert [s.index for s in pick_samples(batches, 6)] == [0, 1, 2, 3, 4, 5]
    assert [s.index for s in pick_samples(batches, 99)] == [0, 1, 2, 3, 4, 5]


def test_nothing_to_check() -> None:
    with pytest.raises(CheckError, match="no samples"):
        check_batch_invariance(llama().get_decoder(), None, [], n=1, batch_tokens=64)


def extract(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "workers.extract", *map(str, args)],
                          capture_output=True, text=True, timeout=300, cwd=REPO,
                          env=worker_env())


@pytest.mark.slow
def test_cli_writes_the_report_and_does_not_extract(tmp_path: Path) -> None:
    tokenizer = build_tokenizer(corpus())
    model_dir = tmp_path / "deepseek"
    deepseek(vocab=len(tokenizer)).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    data = make_conversations(tmp_path / "conv.jsonl")
    out = tmp_path / "out"
    result = extract("--model", model_dir, "--data", data, "--out", out, "--device", "cpu",
                     "--dtype", "bf16", "--batch-tokens", "2048",
                     "--check-batch-invariance", "3")
    assert result.returncode == 0, result.stderr[-3000:]
    saved = json.loads((out / "batch_invariance.json").read_text())
    assert saved["n"] == 3 and saved["dtype"] == "bfloat16" and saved["batch_tokens"] == 2048
    assert saved["moe_layers"] == [1, 2, 3] and len(saved["layers"]) == 4
    assert saved["router_logits_dtype"] == "float32"  # DeepSeek-V3's router upcasts
    assert all(s["batch_samples"] > 1 for s in saved["samples"])
    assert "routing flips" in result.stderr and "batch_invariance.json" in result.stderr
    assert not list(out.rglob("*.safetensors")) and not (out / "manifest.jsonl").exists()


@pytest.mark.slow
@pytest.mark.parametrize(("extra", "message"), [
    (["--ranks", "2"], "runs in one process"),
    (["--gpus", "2"], "runs in one process"),
    (["--check-batch-invariance", "0"], "must be >= 1"),
])
def test_cli_refuses(tmp_path: Path, extra: list[str], message: str) -> None:
    if "--check-batch-invariance" not in extra:
        extra = ["--check-batch-invariance", "2", *extra]
    result = extract("--model", tmp_path, "--data", tmp_path / "d.jsonl", "--out",
                     tmp_path / "o", *extra)
    assert result.returncode == 2 and message in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_cli_fp32_router_needs_the_check(tmp_path: Path) -> None:
    result = extract("--model", tmp_path, "--data", tmp_path / "d.jsonl", "--out", tmp_path,
                     "--check-fp32-router")
    assert result.returncode == 2 and "goes with --check-batch-invariance" in result.stderr

"""The static decoder (`workers/eagle3/generation/static_decode.py`) against transformers'
`generate`, on CPU in fp32: greedy answers token for token on the Llama, Qwen2 and Qwen3
layouts (left-padded rows of different lengths, a one-token prompt, rows that stop and
rows cut at the token budget, the prefill in chunks, the steps' windows of the cache);
seeded sampling, whose nucleus of one token is the greedy answer; the attention kernel's
output layout; the layouts it refuses; and `workers.generate --decoder` end to end, whose
two decoders write the same conversations. On a machine with CUDA (skipped elsewhere):
the graphs against `generate` in fp32, and against eager steps in bf16 at SmolLM2's
attention shape."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import PY, REPO
from workers.eagle3.generation.static_decode import (
    Sampling,
    StaticDecoder,
    unsupported_reason,
)
from workers.fixtures.tiny import build_tiny_llama, build_tiny_target

pytestmark = pytest.mark.timeout(300)

STOP = 2
SHAPES = {"vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 512, "tie_word_embeddings": False}


def random_model(layout: str) -> Any:
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    classes = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
               "qwen3": (Qwen3Config, Qwen3ForCausalLM)}
    config, model = classes[layout]
    torch.manual_seed(1)
    built = model(config(**SHAPES)).eval()
    with torch.no_grad():  # sharper attention than the init's: positions tell in the answers
        for layer in built.model.layers:
            layer.self_attn.q_proj.weight.mul_(4.0)
            layer.self_attn.k_proj.weight.mul_(4.0)
    return built


def prompt_rows(lengths: tuple[int, ...] = (5, 17, 1, 9, 30, 3, 12, 22, 7, 2, 15, 26),
                ) -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(3, SHAPES["vocab_size"], (n,), generator=generator).tolist()
            for n in lengths]


def cut(tokens: list[int], stop_ids: set[int]) -> list[int]:
    """A `generate` row as the static decoder returns it: up to its first stop token."""
    stop = next((i for i, t in enumerate(tokens) if t in stop_ids), None)
    return tokens if stop is None else tokens[:stop + 1]


def transformers_greedy(model: Any, rows: list[list[int]], max_new_tokens: int,
                        stop_ids: set[int]) -> list[list[int]]:
    width, device = max(map(len, rows)), model.device
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows], device=device)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=sorted(stop_ids), pad_token_id=0)
    return [cut(tokens, stop_ids) for tokens in out[:, width:].tolist()]


@pytest.mark.parametrize("layout", ["llama", "qwen2", "qwen3"])
def test_greedy_answers_are_generates_token_for_token(layout: str) -> None:
    model, rows = random_model(layout), prompt_rows()
    # stop on the token the rows emit most, so that some rows stop early and some do not
    first = transformers_greedy(model, rows, 40, set())
    counts = torch.bincount(torch.tensor([t for row in first for t in row]))
    stop_ids = {int(counts.argmax())}
    expected = transformers_greedy(model, rows, 40, stop_ids)
    assert any(len(row) < 40 for row in expected) and any(len(row) == 40 for row in expected)

    ours = StaticDecoder(model).generate(rows, max_new_tokens=40, stop_ids=stop_ids)
    assert ours == expected
    chunked = StaticDecoder(model, prefill_tokens=7).generate(rows, max_new_tokens=40,
                                                                stop_ids=stop_ids)
    assert chunked == expected  # one row per prefill chunk: the 30-token row's width
    windowed = StaticDecoder(model, window_tokens=3).generate(rows, max_new_tokens=40,
                                                              stop_ids=stop_ids)
    assert windowed == expected  # 13 windows: each step reads its stretch's slots
    assert StaticDecoder(model).generate(rows[:1], max_new_tokens=40, stop_ids=stop_ids) \
        == expected[:1]  # alone, without the padding of the others


def test_the_answers_do_not_depend_on_the_attention_kernels_output_layout(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA's memory-efficient kernel returns its output as a transposed view ([B, M, H,
    D] underneath), where the CPU's is contiguous: the same answers from both layouts.
    The kernel's values are the CPU's own; only the layout is CUDA's."""
    from torch.nn import functional

    model, rows = random_model("qwen3"), prompt_rows()
    expected = StaticDecoder(model).generate(rows, max_new_tokens=12, stop_ids={STOP})
    attention = functional.scaled_dot_product_attention

    def transposed_layout(*args: Any, **kwargs: Any) -> torch.Tensor:
        out = attention(*args, **kwargs)
        return out.transpose(1, 2).contiguous().transpose(1, 2)

    monkeypatch.setattr(functional, "scaled_dot_product_attention", transposed_layout)
    assert not transposed_layout(torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 4),
                                 torch.ones(1, 2, 3, 4)).is_contiguous()
    assert StaticDecoder(model).generate(rows, max_new_tokens=12, stop_ids={STOP}) == expected


def test_the_real_tokenizers_chat_prompts_answer_as_generate(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = build_tiny_llama(tmp_path / "tiny")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    questions = ["Why is the sky blue?", "Write a haiku about GPUs and the long night of "
                 "training a draft model", "2+2?"]
    rows = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=True,
                                          add_generation_prompt=True, return_dict=False)
            for q in questions]
    stop_ids = {tokenizer.eos_token_id}
    assert StaticDecoder(model).generate(rows, max_new_tokens=24, stop_ids=stop_ids) \
        == transformers_greedy(model, rows, 24, stop_ids)


def test_sampling_is_seeded_and_its_one_token_nucleus_is_greedy() -> None:
    model, rows = random_model("llama"), prompt_rows()
    decoder = StaticDecoder(model)
    greedy = decoder.generate(rows, max_new_tokens=20, stop_ids={STOP})
    hot = Sampling(temperature=1.5, top_p=0.95, seed=3)
    first = decoder.generate(rows, max_new_tokens=20, stop_ids={STOP}, sampling=hot)
    assert first == decoder.generate(rows, max_new_tokens=20, stop_ids={STOP}, sampling=hot)
    other = decoder.generate(rows, max_new_tokens=20, stop_ids={STOP},
                             sampling=Sampling(temperature=1.5, top_p=0.95, seed=4))
    assert first != other and first != greedy
    narrow = Sampling(temperature=1.5, top_p=1e-9, seed=3)  # the top token alone
    assert decoder.generate(rows, max_new_tokens=20, stop_ids={STOP}, sampling=narrow) == greedy
    one = Sampling(temperature=1.5, seed=3, top_k=1)
    assert decoder.generate(rows, max_new_tokens=20, stop_ids={STOP}, sampling=one) == greedy
    few = Sampling(temperature=1.5, top_p=0.95, seed=3, top_k=3)
    assert decoder.generate(rows, max_new_tokens=20, stop_ids={STOP}, sampling=few) != first


def test_rows_decoded_in_parts_answer_as_one_batch() -> None:
    """A batch larger than what fits (`max_rows` here; on CUDA the free memory's share,
    `rows_that_fit`) is decoded in parts one after another: the greedy answers of one
    batch."""
    model, rows = random_model("llama"), prompt_rows()
    decoder = StaticDecoder(model)
    whole = decoder.generate(rows, max_new_tokens=20, stop_ids={STOP})
    assert decoder.generate(rows, max_new_tokens=20, stop_ids={STOP}, max_rows=5) == whole
    assert decoder.rows_that_fit(100, sampled=False) is None  # a CPU: not known
    # a row's device bytes: its keys and values in every layer, then its step buffers
    per_slot = 2 * 3 * 2 * (64 // 4) * 4  # k and v, layers, kv heads, head_dim, fp32
    assert decoder.row_bytes(100, sampled=False) == 100 * per_slot + 300 * 8


def test_the_nucleus_is_drawn_from_the_top_candidates_with_whole_vocabulary_mass() -> None:
    """Top-p without a top-k ranks only the `NUCLEUS_CANDIDATES` most likely tokens
    (`topk`, no sort of the vocabulary), with their probabilities over the whole of it:
    with as many candidates as the vocabulary, the same samples as with fewer that hold
    the nucleus; a nucleus cut at one candidate is greedy."""
    from workers.eagle3.generation import static_decode

    model, rows = random_model("llama"), prompt_rows()
    decoder = StaticDecoder(model)
    hot = Sampling(temperature=0.7, top_p=0.5, seed=3)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(static_decode, "NUCLEUS_CANDIDATES", SHAPES["vocab_size"])
        everything = decoder.generate(rows, max_new_tokens=12, stop_ids={STOP},
                                      sampling=hot)
        patch.setattr(static_decode, "NUCLEUS_CANDIDATES", 1)
        assert decoder.generate(rows, max_new_tokens=12, stop_ids={STOP}, sampling=hot) \
            == decoder.generate(rows, max_new_tokens=12, stop_ids={STOP})
    assert everything != decoder.generate(rows, max_new_tokens=12, stop_ids={STOP})


def test_a_batch_whose_last_row_stops_where_a_window_starts_ends_there(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The last rows stopping between two done checks, at a window's first step: the
    batch ends, where it dropped every row and decoded on (on CUDA, a graph of no rows
    failed its check on an empty tensor)."""
    from workers.eagle3.generation import static_decode

    model, row = random_model("llama"), prompt_rows()[4]
    free = StaticDecoder(model).generate([row], max_new_tokens=24, stop_ids=())[0]
    # its answer's end: the first new token not seen before it, at a step the done check
    # (every 8 steps) does not see; the windows are made to start at that step
    made = next(i + 1 for i, t in enumerate(free) if i >= 2 and t not in free[:i]
                and (i + 1) % static_decode.DONE_CHECK_EVERY)
    steps: list[int] = []
    step = static_decode._Batch._step

    def counted(batch: Any, window: int) -> None:
        steps.append(batch.rows)
        step(batch, window)

    monkeypatch.setattr(static_decode._Batch, "_step", counted)
    decoder = StaticDecoder(model, window_tokens=made - 1)
    assert decoder.generate([row], max_new_tokens=24, stop_ids={free[made - 1]}) \
        == [free[:made]]
    assert steps == [1] * (made - 1)  # one step per token after the first, none after


def test_edge_cases() -> None:
    decoder = StaticDecoder(random_model("llama"))
    assert decoder.generate([], max_new_tokens=5, stop_ids={STOP}) == []
    assert decoder.generate([[5, 6]], max_new_tokens=0, stop_ids={STOP}) == [[]]
    one = decoder.generate([[5, 6]], max_new_tokens=1, stop_ids=())
    assert len(one) == 1 and len(one[0]) == 1
    with pytest.raises(ValueError, match="at least one prompt token"):
        decoder.generate([[5], []], max_new_tokens=3, stop_ids={STOP})
    for temperature, top_p in ((0.0, 1.0), (1.0, 0.0), (1.0, 1.5)):
        with pytest.raises(ValueError, match="temperature > 0 and a top-p in"):
            Sampling(temperature, top_p)
    with pytest.raises(ValueError, match="top-k >= 0"):
        Sampling(1.0, top_k=-1)


@pytest.mark.parametrize("layout", ["qwen3_moe", "deepseek_v3"])
def test_other_layouts_are_refused_with_the_reason(tmp_path: Path, layout: str) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(build_tiny_target(tmp_path / layout, layout))
    reason = unsupported_reason(model)
    assert reason is not None and repr(layout) in reason, reason
    with pytest.raises(ValueError, match="cannot run this model"):
        StaticDecoder(model)


def generate(model: Path, out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    prompts = REPO / "workers" / "fixtures" / "data" / "demo_prompts.jsonl"
    return subprocess.run(
        [PY, "-m", "workers.generate", "--prompts", str(prompts), "--limit", "12",
         "--backend", "transformers", "--model", str(model), "--device", "cpu",
         "--max-tokens", "32", "--batch-size", "5", "--out", str(out), *args],
        cwd=REPO, capture_output=True, text=True, timeout=240)


def answers(path: Path) -> dict[str, Any]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return {r["id"]: (r["messages"][-1]["content"], r["finish_reason"], r["usage"])
            for r in records}


def sampling_defaults(model: Path, **settings: Any) -> None:
    """The model's generation config asks for sampling, as Qwen2.5-Instruct's does."""
    path = model / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **settings}))


def test_the_worker_writes_the_same_conversations_with_either_decoder(tmp_path: Path) -> None:
    """Greedy with either, though the model's config samples with a repetition penalty:
    without --temperature the answers are the argmax's, as workers.evaluate decodes."""
    model = build_tiny_llama(tmp_path / "tiny")
    sampling_defaults(model, do_sample=True, temperature=0.7, top_k=20, top_p=0.8,
                      repetition_penalty=1.3)
    static = generate(model, tmp_path / "static.jsonl", "--decoder", "static")
    assert static.returncode == 0, static.stderr[-2000:]
    assert "decoding with a static KV cache" in static.stderr
    plain = generate(model, tmp_path / "plain.jsonl", "--decoder", "transformers")
    assert plain.returncode == 0, plain.stderr[-2000:]
    assert "decoding with transformers' generate" in plain.stderr
    ours, theirs = answers(tmp_path / "static.jsonl"), answers(tmp_path / "plain.jsonl")
    assert len(ours) == 12 and ours == theirs
    # sampled, both within the config's top-k: of one token, the greedy answers again
    sampling_defaults(model, top_k=1, top_p=1.0)
    for decoder in ("static", "transformers"):
        out = tmp_path / f"hot-{decoder}.jsonl"
        hot = generate(model, out, "--decoder", decoder, "--temperature", "1.5")
        assert hot.returncode == 0, hot.stderr[-2000:]
        assert answers(out) == ours, decoder


def test_the_worker_refuses_a_static_decoder_the_model_cannot_take(tmp_path: Path) -> None:
    model = build_tiny_target(tmp_path / "moe", "qwen3_moe")
    refused = generate(model, tmp_path / "out.jsonl", "--decoder", "static")
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert "--decoder static cannot run this model: its model type is 'qwen3_moe'" \
        in refused.stderr
    auto = generate(model, tmp_path / "auto.jsonl")  # auto: generate's, and says why
    assert auto.returncode == 0, auto.stderr[-2000:]
    assert "the static decoder cannot run this model (its model type is 'qwen3_moe'" \
        in auto.stderr


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@needs_cuda
@pytest.mark.parametrize("layout", ["llama", "qwen3"])
def test_on_cuda_the_graphs_answer_as_generate(layout: str) -> None:
    """The CUDA path: graphs captured per window (3-step windows: 13 of them), each
    checked against its eager step, answers `generate`'s in fp32 (TF32 off, torch's
    default for matrix products); no graph failed its check."""
    model, rows = random_model(layout).cuda(), prompt_rows()
    first = transformers_greedy(model, rows, 40, set())
    counts = torch.bincount(torch.tensor([t for row in first for t in row]))
    stop_ids = {int(counts.argmax())}
    expected = transformers_greedy(model, rows, 40, stop_ids)
    decoder = StaticDecoder(model, window_tokens=3)
    assert decoder.generate(rows, max_new_tokens=40, stop_ids=stop_ids) == expected
    assert not decoder.graphs_failed


@needs_cuda
def test_on_cuda_bf16_graphs_agree_with_eager_steps() -> None:
    """bf16, SmolLM2's attention shape (9 query heads on 3 key-value heads, head
    dimension 64), a batch of 256 with 100 new tokens (four 32-step windows): every
    graph's first replay passed its check against the eager step, and the greedy
    answers are those of the same decoder with graphs refused (eager steps)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(2)
    config = LlamaConfig(vocab_size=1024, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=4, num_attention_heads=9, num_key_value_heads=3,
                         max_position_embeddings=2048, tie_word_embeddings=True)
    model = LlamaForCausalLM(config).eval().to("cuda", torch.bfloat16)
    generator = torch.Generator().manual_seed(5)
    rows = [torch.randint(3, 1024, (int(n),), generator=generator).tolist()
            for n in torch.randint(1, 120, (256,), generator=generator)]
    graphed = StaticDecoder(model)
    answers = graphed.generate(rows, max_new_tokens=100, stop_ids=())
    assert not graphed.graphs_failed
    eager = StaticDecoder(model)
    eager.graphs_failed = True  # no graphs: every step eager
    same = sum(a == b for a, b in zip(answers,
                                      eager.generate(rows, max_new_tokens=100, stop_ids=()),
                                      strict=True))
    assert same == len(rows), f"{same} of {len(rows)} answers identical"


@needs_cuda
def test_on_cuda_a_batch_larger_than_the_free_memory_is_decoded_in_parts() -> None:
    """A batch whose KV cache would not fit in the device's free memory is cut into
    parts of `rows_that_fit` rows (no out-of-memory error), with the answers of a batch
    cut by hand."""
    model, rows = random_model("llama").cuda(), prompt_rows()
    decoder = StaticDecoder(model)
    expected = decoder.generate(rows, max_new_tokens=8, stop_ids=())
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    hog = torch.empty(free - (256 << 20), dtype=torch.uint8, device="cuda")  # 256 MB left
    try:
        slots = 30 + 8
        wanted = int(1.5 * (256 << 20) / decoder.row_bytes(slots, sampled=False))
        fit = decoder.rows_that_fit(slots, sampled=False)
        assert fit is not None and fit < wanted
        many = (rows * (wanted // len(rows) + 1))[:wanted]
        answers = decoder.generate(many, max_new_tokens=8, stop_ids=())
    finally:
        del hog
    assert len(answers) == wanted
    assert answers[:len(rows)] == expected


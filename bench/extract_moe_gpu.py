"""GPU benchmark of workers.extract on a DeepSeek-V3-style MoE (Kimi-K2's language model
in shape: width 7168, MLA with 64 heads, a first dense layer, sigmoid-routed top-8
experts plus a shared one, vocab 163,840), random weights, ~1,450-token samples.

`single` (one GPU), side by side in one run, medians of `--repeats`:
1. HF prefill: the same packed batches through transformers' own decoder forward, no
   hooks, nothing copied or written (the baseline the worker is held to: >= 90 %);
2. the bf16 matmul ceiling of this GPU ([16384, 7168] x [7168, 7168]) and the model's
   FLOPs per token, so both rates read as a share of what the silicon allows;
3. the disk: files of the same sizes written by the same threads in each mode;
4. the worker (the extraction loop of `workers.extract`, as the CLI runs it) with its
   default flags, then with each `--writeback` mode (fsync, range, none + final sync),
   and with `--alone` one sample per forward pass (what batch invariance would cost);
5. the batch-invariance report (`--check-batch-invariance`) of this model in bf16, with
   and without fp32 routers.

`invariance`: the batch-invariance report of the MoE and of a dense model of the same
shape (every MLP dense), side by side on the same samples.

`split` (2+ GPUs): a smaller MoE of the same shape is saved, then the real CLI runs it on
one GPU and split over all (`--gpus-per-model N`); tokens/s as the workers report them,
peak memory per device, and every file compared.

`python bench/extract_moe_gpu.py single --layers 61 --experts 32` on an H200;
`--tiny` runs a small config on the CPU to check the script.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from extract_gpu import clean, disk_ceiling, file_sizes, make_samples, sync  # noqa: E402

from workers.eagle3.extraction.batch_invariance import check_batch_invariance, format_report  # noqa: E402
from workers.eagle3.extraction.extractor import Extractor, Sample, Stats, pack_batches, pad_batch  # noqa: E402
from workers.eagle3.extraction.hidden_files import DEFAULT_WRITEBACK, WRITEBACK_MODES  # noqa: E402
from workers.eagle3.target.model import Target  # noqa: E402


def moe_config(args: argparse.Namespace) -> Any:
    from transformers import DeepseekV3Config

    if args.tiny:
        return DeepseekV3Config(
            vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
            num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=4,
            n_routed_experts=16, num_experts_per_tok=4, n_group=1, topk_group=1,
            n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16,
            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)
    return DeepseekV3Config(  # Kimi-K2's language model, fewer and smaller experts
        vocab_size=163840, hidden_size=7168, intermediate_size=18432,
        moe_intermediate_size=args.moe_intermediate, num_hidden_layers=args.layers,
        num_attention_heads=64, num_key_value_heads=64, n_routed_experts=args.experts,
        num_experts_per_tok=8, n_group=1, topk_group=1, n_shared_experts=1,
        first_k_dense_replace=1, routed_scaling_factor=2.827, q_lora_rank=1536,
        kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
        max_position_embeddings=8192, rope_theta=50000.0)


def build(config: Any, device: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config)
    torch.set_default_dtype(torch.float32)
    return model.eval()


def flops_per_token(config: Any, mean_len: float) -> float:
    """Forward FLOPs per token: 2 x the weights a token passes through (attention
    projections, the dense or shared-plus-top-k expert MLPs) + causal attention over
    half the sample on average."""
    h, heads = config.hidden_size, config.num_attention_heads
    qk = config.qk_nope_head_dim + config.qk_rope_head_dim
    attention = (h * config.q_lora_rank + config.q_lora_rank * heads * qk
                 + h * (config.kv_lora_rank + config.qk_rope_head_dim)
                 + config.kv_lora_rank * heads * (config.qk_nope_head_dim + config.v_head_dim)
                 + heads * config.v_head_dim * h)
    dense = 3 * h * config.intermediate_size
    moe = 3 * h * config.moe_intermediate_size * (config.num_experts_per_tok
                                                  + config.n_shared_experts) \
        + h * config.n_routed_experts
    layers = config.num_hidden_layers
    first = config.first_k_dense_replace
    weights = layers * attention + first * dense + (layers - first) * moe
    scores = layers * heads * (qk + config.v_head_dim) * mean_len / 2
    return 2 * (weights + scores)


def matmul_tflops(device: str) -> float:
    a = torch.randn(16384, 7168, dtype=torch.bfloat16, device=device)
    b = torch.randn(7168, 7168, dtype=torch.bfloat16, device=device)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        a @ b
    torch.cuda.synchronize()
    return 20 * 2 * 16384 * 7168 * 7168 / (time.perf_counter() - t0) / 1e12


def hf_prefill(model: torch.nn.Module, samples: list[Sample], batch_tokens: int,
               device: str) -> float:
    """Tokens/s of transformers' own decoder forward over the same packed batches."""
    decoder = model.get_decoder()
    batches = [tuple(t.to(device) for t in pad_batch(b))
               for b in pack_batches(samples, batch_tokens)]
    tokens = sum(len(s.input_ids) for s in samples)
    sync(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        for ids, mask in batches:
            decoder(input_ids=ids, attention_mask=mask, use_cache=False)
    sync(device)
    return tokens / (time.perf_counter() - t0)


def run_worker(target: Target, samples: list[Sample], out: Path, *, batch_tokens: int,
               writeback: str | None, device: str) -> tuple[float, float]:
    """(tokens/s, GB/s) of the extraction loop; `writeback` None: the worker's default.
    With `none` the final sync counts: the disk must take the data in the end."""
    out.mkdir(parents=True, exist_ok=True)
    stats = Stats(total=len(samples))
    options: dict[str, Any] = {} if writeback is None else {"writeback": writeback}
    extractor = Extractor(target, out, batch_tokens=batch_tokens, stats=stats,
                          store="dtype", **options)  # bf16: the sizes counted below
    sync(device)
    t0 = time.perf_counter()
    extractor.run(samples)
    if writeback == "none":
        os.sync()
    elapsed = time.perf_counter() - t0
    assert stats.written == len(samples), (stats.written, len(samples))
    return stats.tokens / elapsed, stats.bytes_written / elapsed / 1e9


def single(args: argparse.Namespace) -> int:
    device = "cpu" if args.tiny else "cuda"
    if args.tiny:
        args.samples, args.mean_len, args.batch_tokens = min(args.samples, 24), 200, 2048
    config = moe_config(args)
    t0 = time.perf_counter()
    model = build(config, device)
    target = Target.of(model)
    params = sum(p.numel() for p in model.parameters())
    samples = make_samples(args.samples, args.mean_len, config.vocab_size)
    tokens = sum(len(s.input_ids) for s in samples)
    sizes = file_sizes(samples, config.hidden_size)
    per_token = flops_per_token(config, tokens / len(samples))
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"{params / 1e9:.1f}B params ({config.num_hidden_layers} layers, "
          f"{config.n_routed_experts} experts top-{config.num_experts_per_tok}, hidden "
          f"{config.hidden_size}), built in {time.perf_counter() - t0:.0f} s on {name}; "
          f"{len(samples)} samples, {tokens} tokens, {sum(sizes) / 1e9:.1f} GB per pass, "
          f"{per_token / 1e9:.1f} GFLOP per token", flush=True)
    if device == "cuda":
        print(f"weights {torch.cuda.memory_allocated() / 1e9:.1f} GB", flush=True)
        hf_prefill(model, samples[:16], args.batch_tokens, device)  # warm up

    modes = [None, *WRITEBACK_MODES]
    results: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        results.setdefault("hf", []).append(hf_prefill(model, samples, args.batch_tokens, device))
        for mode in WRITEBACK_MODES:
            clean(args.out)
            results.setdefault(f"disk {mode}", []).append(
                disk_ceiling(args.out / "raw", sizes, args.writers, mode))
        for mode in modes:
            clean(args.out)
            tps, gbs = run_worker(target, samples, args.out / "w", batch_tokens=args.batch_tokens,
                                  writeback=mode, device=device)
            key = f"worker {mode or 'default (' + DEFAULT_WRITEBACK + ')'}"
            results.setdefault(key, []).append(tps)
            results.setdefault(key + " GB/s", []).append(gbs)
        if args.alone:  # the batch-invariant alternative: every sample in its own pass
            clean(args.out)
            tps, _ = run_worker(target, samples, args.out / "w", batch_tokens=1, writeback=None,
                                device=device)
            results.setdefault("worker default, one sample per pass", []).append(tps)
        print(json.dumps({k: round(v[-1], 2) for k, v in results.items()}), flush=True)
    clean(args.out)
    median = {k: statistics.median(v) for k, v in results.items()}
    ceiling = matmul_tflops(device) if device == "cuda" else float("nan")
    bytes_per_token = sum(sizes) / tokens
    print(f"\n| run | tokens/s | GB/s | vs HF prefill | TFLOP/s (share of matmul "
          f"{ceiling:.0f}) |")
    print("| --- | ---: | ---: | ---: | ---: |")
    hf = median["hf"]

    def row(label: str, tps: float) -> None:
        tflops = tps * per_token / 1e12
        print(f"| {label} | {tps:,.0f} | {tps * bytes_per_token / 1e9:.2f} | "
              f"{100 * tps / hf:.1f} % | {tflops:.0f} ({100 * tflops / ceiling:.0f} %) |")

    row("HF prefill (no hooks, no copy, no write)", hf)
    for mode in WRITEBACK_MODES:
        row(f"disk alone ({args.writers} threads, writeback {mode}, final sync counted)",
            median[f"disk {mode}"] / bytes_per_token * 1e9)
    for key in results:
        if key.startswith("worker") and not key.endswith("GB/s"):
            row(key, median[key])
    print(f"\nmedians of {args.repeats}; {bytes_per_token / 1e3:.1f} kB per token "
          f"(bf16 aux 3H + final H, ids, mask); {args.batch_tokens} tokens per batch")

    report_rows: list[dict[str, Any]] = []
    for fp32 in (False, True):
        if fp32 and report_rows[0]["router_logits_dtype"] == "float32":
            print("\n(the routers already compute in fp32: no fp32-router run)")
            break
        t0 = time.perf_counter()
        report = check_batch_invariance(target.decoder, target.lm_head, samples,
                                        n=args.invariance, batch_tokens=args.batch_tokens,
                                        fp32_router=fp32)
        print(f"\nbatch invariance, fp32 routers {'on' if fp32 else 'off'} "
              f"({time.perf_counter() - t0:.0f} s):\n{format_report(report)}", flush=True)
        report_rows.append(report)
    if args.json:
        args.json.write_text(json.dumps({"results": results, "median": median,
                                         "params": params, "tokens": tokens,
                                         "flops_per_token": per_token,
                                         "matmul_tflops": ceiling,
                                         "batch_invariance": report_rows}, indent=2))
    return 0


def invariance(args: argparse.Namespace) -> int:
    """The batch-invariance report of the MoE and of a dense model of the same shape
    (every layer's MLP dense), on the same samples."""
    device = "cpu" if args.tiny else "cuda"
    if args.tiny:
        args.samples, args.mean_len, args.batch_tokens = min(args.samples, 24), 200, 2048
    reports = {}
    for label, dense in (("MoE", False), ("dense, same shape", True)):
        config = moe_config(args)
        if dense:
            config.first_k_dense_replace = config.num_hidden_layers
        model = build(config, device)
        target = Target.of(model)
        params = sum(p.numel() for p in model.parameters())
        samples = make_samples(args.samples, args.mean_len, config.vocab_size)
        t0 = time.perf_counter()
        report = check_batch_invariance(target.decoder, target.lm_head, samples,
                                        n=args.invariance, batch_tokens=args.batch_tokens)
        print(f"\n{label}: {params / 1e9:.1f}B params, check in {time.perf_counter() - t0:.0f} s"
              f"\n{format_report(report)}", flush=True)
        reports[label] = report
        del model, target
        if device == "cuda":
            torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(reports, indent=2))
    return 0


def split(args: argparse.Namespace) -> int:
    """One GPU vs the model split over all of them, through the real CLI."""
    from extract_split_gpu import compare, print_runs, timed_run

    from workers.fixtures.tiny import build_tokenizer, corpus

    n = torch.cuda.device_count()
    if n < 2:
        raise SystemExit("split needs at least 2 GPUs")
    config = moe_config(args)
    model_dir, data = args.out / "model", args.out / "conv.jsonl"
    t0 = time.perf_counter()
    model = build(config, "cuda:0")
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(model_dir)
    build_tokenizer(corpus()).save_pretrained(model_dir)
    del model
    torch.cuda.empty_cache()
    print(f"{params / 1e9:.1f}B params saved in {time.perf_counter() - t0:.0f} s", flush=True)
    with open(data, "w") as f:
        for s in make_samples(args.samples, args.mean_len, 384):
            text = " ".join(f"w{t}" for t in s.input_ids)
            f.write(json.dumps({"id": s.id, "messages": [
                {"role": "user", "content": "Explain."},
                {"role": "assistant", "content": text}]}) + "\n")
    rows = []
    for label, options in (("1 GPU", ["--gpus", "1"]),
                           (f"split over {n}", ["--gpus-per-model", str(n)])):
        os.sync()
        rows.append(timed_run(model_dir, data, args.out, label, options))
    print_runs(rows)
    files, identical, worst = compare(args.out / "1_GPU", args.out / f"split_over_{n}")
    print(f"\nsplit vs 1 GPU: {files} files, {identical} bit-identical, max |diff| {worst:g}")
    with contextlib.suppress(OSError):
        shutil.rmtree(args.out)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=("single", "invariance", "split"))
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench-moe"))
    parser.add_argument("--layers", type=int, default=61)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--moe-intermediate", type=int, default=768)
    parser.add_argument("--samples", type=int, default=192)
    parser.add_argument("--mean-len", type=int, default=1450)
    parser.add_argument("--batch-tokens", type=int, default=16384)
    parser.add_argument("--writers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--invariance", type=int, default=16,
                        help="samples re-run alone for the batch-invariance report")
    parser.add_argument("--alone", action="store_true",
                        help="also the worker with one sample per forward pass")
    parser.add_argument("--tiny", action="store_true", help="small CPU config (a smoke run)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    return {"single": single, "invariance": invariance, "split": split}[args.mode](args)


if __name__ == "__main__":
    raise SystemExit(main())

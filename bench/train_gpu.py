"""GPU benchmark of workers.train's training step (`train_step`, not a copy), its
reference form and its fused one side by side (`--variants old,new`: `fused=False` with
its metrics read every step, as the trainer ran before the fused head, and `fused=True`
with the rows chosen on the host and metrics read every 10 steps). `--config smollm2`
takes SmolLM2-135M's shapes (`--draft-intermediate-size 6144`: the wide recipe); the
default is an 8B-class target: H=4096, intermediate 14336, 32 heads / 8 kv heads (head_dim 128),
vocab 128,256, draft vocab 32,000, Llama-3 RoPE, TTT 7, sequences of 2048 tokens packed
into `--batch-tokens` (16,384: 8 sequences). The draft, a random frozen target
lm_head/embedding and synthetic aux/hidden/ids/loss_mask all live in GPU memory (no
disk): 20% of each sequence is prompt (loss_mask 0), and the target's rows outside the
draft vocabulary are scaled down so its argmax is in the draft vocabulary, as on real
data (~95% coverage).

Model FLOPs per optimizer step, counted analytically (T = B*L tokens, N_i = valid
positions scored at TTT step i, D = head_dim, Hq/Hkv = heads):

    draft forward = 2*T*3H*H                                            (fc, once)
        + sum_i [ 2*T*(2H*(Hq + 2*Hkv)*D + Hq*D*H + 3*H*I)            (q,k,v,o, mlp)
                  + 4*Hq*D*B*(L*(L+1)/2 + i*L)    (QK^T and PV over the keys each query
                                                   sees: causal step-0 prefix + i own)
                  + 2*H*V_draft*N_i ]                                  (draft lm_head)
    step = 3 * draft forward (forward + backward ~ 2x forward)
         + 2*H*V*T                                       (target lm_head, forward only)

MFU = model FLOPs / step time / the bf16 matmul ceiling measured in the same run
(torch.matmul of 8192x8192 bf16, CUDA events), and / the H200's 989 TFLOP/s dense bf16
spec. `--tiny` runs a small config on the CPU to check the script. Prints a markdown
table; `--json FILE` also writes the numbers; `--profile` the top kernels.

Measured on an H200 before the fused step existed (the old step, torch 2.11+cu130,
defaults): 720 ms/step, 22,758 tokens/s, 267.5
model TFLOP per step = 372 TFLOP/s = 51.6% of the 721 TFLOP/s measured matmul ceiling
(37.6% of 989), peak 68.9 GiB. Matmuls are ~47% of GPU time; the rest is mostly
elementwise work (RoPE, RMSNorm, dtype casts, the fp32 loss over [N, 32000] logits).
torch.compile of the decoder layer gave 653 ms/step but cost 172 s of compilation (a
graph per TTT step, as the K/V list grows), so the worker does not use it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from workers.eagle3.draft.model import DraftConfig, Eagle3Draft  # noqa: E402
from workers.eagle3.training.fused_loss import ScoredRows  # noqa: E402
from workers.eagle3.training.train_data import Batch  # noqa: E402
from workers.train import (  # noqa: E402
    TargetHead,
    build_optimizer,
    build_scheduler,
    new_scaler,
    train_step,
)

BF16_DENSE_SPEC_TFLOPS = 989.0
"""The H100 SXM's and the H200's dense bf16 spec (the same tensor cores)."""
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}


def draft_config(tiny: bool, name: str = "8b") -> DraftConfig:
    if tiny:
        return DraftConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, vocab_size=384,
                           draft_vocab_size=64, aux_layer_ids=[2, 4, 5])
    if name == "smollm2":  # SmolLM2-135M-Instruct's shapes, the 16k default draft vocab
        return DraftConfig(hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                           num_key_value_heads=3, head_dim=64, vocab_size=49152,
                           draft_vocab_size=16384, max_position_embeddings=8192,
                           rope={"rope_type": "default", "rope_theta": 100000.0},
                           aux_layer_ids=[1, 14, 27])
    return DraftConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=128, vocab_size=128256,
                       draft_vocab_size=32000, max_position_embeddings=131072,
                       rope=dict(LLAMA3_ROPE), aux_layer_ids=[2, 16, 29])


def build(config: DraftConfig, device: torch.device, dtype: torch.dtype,
          seed: int = 0) -> tuple[Eagle3Draft, TargetHead]:
    generator = torch.Generator(device="cpu").manual_seed(seed)
    chosen = torch.randperm(config.vocab_size, generator=generator)[:config.draft_vocab_size]
    t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
    t2d[chosen] = True
    d2t = torch.nonzero(t2d).reshape(-1) - torch.arange(config.draft_vocab_size)
    torch.manual_seed(seed)
    shape = (config.vocab_size, config.hidden_size)
    embed = torch.randn(shape, device=device, dtype=dtype) * 0.02
    lm_head = torch.randn(shape, device=device, dtype=dtype) * 0.02
    lm_head[~t2d.to(device)] *= 0.5  # argmax lands in the draft vocabulary, as on real data
    model = Eagle3Draft(config, embed_weight=embed).to(device)
    model.set_vocab(d2t, t2d)
    return model, TargetHead(lm_head, t2d)


def synthetic_batch(config: DraftConfig, batch_tokens: int, seq_len: int,
                    device: torch.device, dtype: torch.dtype) -> Batch:
    rows, width = max(1, batch_tokens // seq_len), config.hidden_size
    mask = torch.ones(rows, seq_len, dtype=torch.bool, device=device)
    mask[:, :seq_len // 5] = False  # the prompt
    return Batch(aux=torch.randn(rows, seq_len, 3 * width, device=device, dtype=dtype),
                 hidden=torch.randn(rows, seq_len, width, device=device, dtype=dtype),
                 input_ids=torch.randint(0, config.vocab_size, (rows, seq_len), device=device),
                 loss_mask=mask, indices=list(range(rows)), tokens=rows * seq_len)


def model_flops(c: DraftConfig, batch: Batch, head: TargetHead, steps: int) -> dict[str, float]:
    rows, length = batch.input_ids.shape
    tokens = rows * length
    h, d, heads, kv = c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads
    with torch.autocast(batch.input_ids.device.type, dtype=torch.bfloat16,
                        enabled=batch.input_ids.is_cuda):
        _, valid = head(batch.hidden, batch.loss_mask)
    scored = [int(valid[:, 1 + i:].sum()) for i in range(steps)]
    linear = 2 * tokens * (2 * h * (heads + 2 * kv) * d + heads * d * h + 3 * h *
                           c.intermediate_size)
    attention = [4 * heads * d * rows * (length * (length + 1) / 2 + i * length)
                 for i in range(steps)]
    lm_head = [2 * h * c.draft_vocab_size * n for n in scored]
    forward = 2 * tokens * 3 * h * h + steps * linear + sum(attention) + sum(lm_head)
    target = 2 * h * c.vocab_size * tokens
    return {"total": 3 * forward + target, "draft_forward": forward, "target": target,
            "attention_share": 3 * sum(attention) / (3 * forward + target),
            "scored_share": sum(scored) / (steps * tokens)}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, iterations: int, device: torch.device) -> float:  # noqa: ANN001
    """Seconds per call: CUDA events on a GPU, the wall clock on a CPU."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iterations):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1000 / iterations
    began = time.perf_counter()
    for _ in range(iterations):
        fn()
    return (time.perf_counter() - began) / iterations


def matmul_ceiling(device: torch.device, size: int, dtype: torch.dtype) -> float:
    """FLOP/s of one size x size x size matmul, the mean of 10 after 3 warm-ups."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(3):
        torch.matmul(a, b)
    sync(device)
    return 2 * size ** 3 / timed(lambda: torch.matmul(a, b), 10, device)


def write_extraction(root: Path, config: DraftConfig, samples: int, store: str,
                     seed: int = 0) -> None:
    """`samples` files in the layout `workers.extract` writes (manifest.jsonl,
    extract_config.json, one safetensors file per sample), random features of `config`'s
    width, lengths uniform in [64, 512) (SmolLM2's conversations average ~265 tokens),
    the first fifth of each a prompt (loss_mask 0); `store` bf16 or fp8 as `--store`."""
    from safetensors.torch import save_file

    from workers.eagle3.extraction.fp8_features import encode, scale_name

    root.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    width = config.hidden_size
    with open(root / "manifest.jsonl", "w", encoding="utf-8") as manifest:
        for index in range(samples):
            length = int(torch.randint(64, 512, (1,), generator=generator))
            mask = torch.ones(length, dtype=torch.int64)
            mask[:length // 5] = 0
            tensors = {"input_ids": torch.randint(0, config.vocab_size, (length,),
                                                  generator=generator),
                       "loss_mask": mask}
            for name, layers in (("aux_hidden_states", 3), ("hidden_state", 1)):
                x = torch.randn(length, layers * width, generator=generator)
                if store == "fp8":
                    tensors[name], tensors[scale_name(name)] = encode(x, layers)
                else:
                    tensors[name] = x.to(torch.bfloat16)
            file = f"rows/{index // 1000:04d}/data_{index}.safetensors"
            (root / file).parent.mkdir(parents=True, exist_ok=True)
            save_file(tensors, str(root / file))
            manifest.write(json.dumps({"index": index, "file": file, "seq_len": length}) + "\n")
    (root / "extract_config.json").write_text(json.dumps({
        "hidden_size": width, "vocab_size": config.vocab_size, "store": store,
        "dtype": "bf16", "aux_layer_ids": config.aux_layer_ids}))


def disk_breakdown(config: DraftConfig, root: Path, batch_tokens: int, batches: int,
                   ttt_steps: int, device: torch.device) -> list[tuple[str, float]]:
    """Tokens/s of the parts of `workers.train`'s loop over an extraction on disk, each
    over the same first `batches` batches of epoch 0's plan: the reader alone (as the
    trainer calls it: pinned on a GPU, cast to the compute dtype, fp8 features kept as
    stored there and decoded on the device), the reader decoding fp8 itself (as before),
    the read-ahead reader, the host-to-device copy (and decode) of resident batches, the
    step alone on one resident batch, and the loop as `workers.train` runs it (read
    ahead, copy, decode, step), its batches read ahead on one thread and in 2 processes
    (`--read-processes`)."""
    from workers.eagle3.training.train_data import (
        ExtractedData,
        load_batch,
        prefetched,
        read_ahead,
    )
    from workers.train import compute_dtype

    data = ExtractedData(root)
    plan = data.plan_epoch(0, 0, batch_tokens)[:batches]
    dtype = compute_dtype(device)
    pin = device.type == "cuda"

    def load(samples: list) -> Batch:  # noqa: ANN001
        return load_batch(root, samples, config.hidden_size, batch_tokens, pin=pin,
                          dtype=dtype, fp8=device.type == "cuda")

    def rate(fn) -> float:  # noqa: ANN001 - tokens/s of fn(), which returns tokens
        sync(device)
        began = time.perf_counter()
        tokens = fn()
        sync(device)
        return tokens / (time.perf_counter() - began)

    rows: list[tuple[str, float]] = []
    load(plan[0])  # the page cache and the allocator warm
    rows.append(("read (load_batch, one thread)", rate(lambda: sum(load(b).tokens
                                                                 for b in plan))))
    rows.append(("read, unpinned", rate(lambda: sum(
        load_batch(root, b, config.hidden_size, batch_tokens, pin=False, dtype=dtype,
                   fp8=device.type == "cuda").tokens for b in plan))))
    rows.append(("read, fp8 decoded by the reader (before)", rate(lambda: sum(
        load_batch(root, b, config.hidden_size, batch_tokens, pin=pin, dtype=dtype).tokens
        for b in plan))))
    rows.append(("read ahead (prefetched)", rate(lambda: sum(b.tokens for b in
                                                           prefetched(load, plan)))))
    resident = [load(b) for b in plan[:min(len(plan), 8)]]
    rows.append(("copy to the device and decode (8 batches)", rate(lambda: sum(
        b.to(device).decoded().tokens for b in resident))))
    model, head = build(config, device, dtype)
    optimizer = build_optimizer(model, 1e-3)
    scheduler = build_scheduler(optimizer, 0, 10 * batches + 20)
    first = resident[0].to(device).decoded()

    def steps_resident() -> int:
        for _ in range(batches):
            train_step(model, head, first, optimizer, scheduler, ttt_steps=ttt_steps)
        return first.tokens * batches

    train_step(model, head, first, optimizer, scheduler, ttt_steps=ttt_steps)  # warm-up
    rows.append(("train_step on one resident batch", rate(steps_resident)))

    def whole_loop(processes: int) -> int:
        tokens = 0

        def unpinned(samples: list) -> Batch:  # noqa: ANN001 - pinned by the loader
            return load_batch(root, samples, config.hidden_size, batch_tokens, dtype=dtype,
                              fp8=device.type == "cuda")

        batches = read_ahead(unpinned if processes else load, plan, processes=processes,
                             pin=pin)
        for batch in batches:
            train_step(model, head, batch.to(device).decoded(), optimizer, scheduler,
                       ttt_steps=ttt_steps)
            tokens += batch.tokens
        return tokens

    for processes in (0, 2, 0, 2):  # twice each, alternating
        rows.append((f"the loop (read ahead in {processes or 'a thread, no'} processes "
                     "+ copy + step)", rate(lambda n=processes: whole_loop(n))))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a small config on the CPU")
    parser.add_argument("--config", choices=("8b", "smollm2"), default="8b",
                        help="the target's shapes: an 8B Llama (default) or SmolLM2-135M")
    parser.add_argument("--disk", type=Path, default=None, metavar="DIR",
                        help="instead: write --disk-samples random samples as an extraction "
                             "in DIR (kept if there) and print the tokens/s of each part of "
                             "workers.train's loop over them (read, copy, step, the loop)")
    parser.add_argument("--disk-samples", type=int, default=2000)
    parser.add_argument("--store", choices=("bf16", "fp8"), default="bf16",
                        help="--disk: the features' store")
    parser.add_argument("--seq-len", type=int, default=None, help="default 2048 (tiny: 128)")
    parser.add_argument("--batch-tokens", type=int, default=None,
                        help="default 16384 (tiny: 512)")
    parser.add_argument("--ttt-steps", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=None, help="default 10 (tiny: 2)")
    parser.add_argument("--steps", type=int, default=None, help="default 30 (tiny: 5)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--variants", default="old,new",
                        help="the steps to time side by side, in this order: old (the "
                             "reference step, metrics read every step), new (workers.train's "
                             "fused step); default old,new")
    parser.add_argument("--draft-intermediate-size", type=int, default=None, metavar="N",
                        help="the draft's MLP width (default: the config's; the wide "
                             "SmolLM2 recipe is 6144)")
    parser.add_argument("--profile", action="store_true",
                        help="also print the top kernels of 3 steps (torch.profiler)")
    args = parser.parse_args()
    tiny = args.tiny
    device = torch.device("cpu" if tiny else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: use --tiny to check the script on a CPU")
    seq_len = args.seq_len or (128 if tiny else 2048)
    batch_tokens = args.batch_tokens or (512 if tiny else 16384)
    warmup, steps = args.warmup or (2 if tiny else 10), args.steps or (5 if tiny else 30)
    dtype = torch.float32 if tiny else torch.bfloat16

    config = draft_config(tiny, args.config)
    if args.disk is not None:
        if not (args.disk / "manifest.jsonl").exists():
            write_extraction(args.disk, config, args.disk_samples, args.store)
        rows = disk_breakdown(config, args.disk, args.batch_tokens or (512 if tiny else 32768),
                              args.steps or (5 if tiny else 20), args.ttt_steps, device)
        print(f"| part of the loop ({args.config}, {args.store}, "
              f"{args.batch_tokens or (512 if tiny else 32768)} tokens a batch) | tokens/s |")
        print("| --- | ---: |")
        for name, value in rows:
            print(f"| {name} | {value:,.0f} |")
        return
    if args.draft_intermediate_size:
        config = dataclasses.replace(config, intermediate_size=args.draft_intermediate_size)
    batch = synthetic_batch(config, batch_tokens, seq_len, device, dtype)
    scored = ScoredRows.of(batch.loss_mask, args.ttt_steps)
    if device.type == "cuda":
        scored = scored.map(torch.Tensor.pin_memory)
    ceiling = matmul_ceiling(device, 1024 if tiny else 8192, dtype)
    results = {name: run_variant(name, config, batch, scored, args, warmup, steps, device,
                                 dtype, ceiling) for name in args.variants.split(",")}
    tokens = batch.input_ids.numel()
    first = next(iter(results.values()))
    print(f"{first['device']}, torch {first['torch']}, {first['config']}, TTT "
          f"{args.ttt_steps}, {batch.input_ids.shape[0]} x {seq_len} tokens a batch, MLP "
          f"{config.intermediate_size}, draft vocab {config.draft_vocab_size}; "
          f"{'fp32' if tiny else 'bf16'} matmul ceiling {ceiling / 1e12:.4g} TFLOP/s; "
          f"{100 * first['scored_positions_share']:.1f}% of positions scored\n")
    names = list(results)
    print("| measure | " + " | ".join(names) + " |")
    print("| --- |" + " ---: |" * len(names))
    for label, key, fmt in (("step time (ms)", "step_ms", "{:.1f}"),
                            ("tokens/s", "tokens_per_s", "{:,.0f}"),
                            ("model TFLOP/s", "model_tflops", "{:.4g}"),
                            ("MFU vs measured ceiling", "mfu_vs_ceiling", "{:.1%}"),
                            ("MFU vs 989 TFLOP/s (H100/H200 bf16 spec)", "mfu_vs_spec",
                             "{:.1%}"),
                            ("peak GPU memory (GiB)", "peak_memory_gib", "{:.2f}"),
                            ("peak GPU memory per token (KiB)", "peak_kib_per_token",
                             "{:.1f}"),
                            ("loss after the timed steps", "last_loss", "{:.4f}")):
        print(f"| {label} | " + " | ".join(fmt.format(results[n][key]) for n in names) + " |")
    if "old" in results and len(results) > 1:
        for name in names:
            if name != "old":
                print(f"\nspeed-up of {name} over old: "
                      f"{results[name]['tokens_per_s'] / results['old']['tokens_per_s']:.2f}x "
                      f"({tokens} tokens a step)")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        model, head = build(config, device, dtype)
        optimizer = build_optimizer(model, 1e-4)
        scheduler = build_scheduler(optimizer, 0, 100)
        step = variant_step(names[-1], model, head, batch, scored, optimizer, scheduler,
                            args.ttt_steps)
        for _ in range(3):
            step(1)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA]
                                               if device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            for k in range(3):
                step(k)
            sync(device)
        key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
        print(f"\nthe top kernels of 3 steps of {names[-1]}:")
        print(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=70))


LOG_EVERY = 10
"""The new step's metrics are read every this many steps (`workers.train --log-every`'s
default); the old step read them, and checked the gradient, at every step."""


def variant_step(name: str, model: Eagle3Draft, head: TargetHead, batch: Batch,
                 scored: ScoredRows, optimizer: torch.optim.Optimizer, scheduler: object,
                 ttt_steps: int):  # noqa: ANN201 - the step k -> its metrics or None
    """`old`: the reference step (`fused=False`: boolean-mask gathers, the head
    checkpointed) with its metrics read at every step, as workers.train ran before the
    fused head; `new`: workers.train's step now (`fused=True`, the rows chosen on the
    host and copied with the batch, metrics read every LOG_EVERY steps)."""
    scaler = new_scaler(batch.input_ids.device)
    if name not in ("old", "new"):
        raise SystemExit(f"--variants: unknown variant {name!r} (old, new)")

    def step(k: int) -> dict[str, float] | None:
        fused = name == "new"
        rows = scored.to(batch.input_ids.device) if fused else None
        metrics = train_step(model, head, batch, optimizer, scheduler, ttt_steps=ttt_steps,
                             rows=rows, scaler=scaler, fused=fused)
        return metrics.read() if not fused or (k + 1) % LOG_EVERY == 0 else None

    return step


def run_variant(name: str, config: DraftConfig, batch: Batch, scored: ScoredRows,
                args: argparse.Namespace, warmup: int, steps: int, device: torch.device,
                dtype: torch.dtype, ceiling: float) -> dict[str, float | str]:
    model, head = build(config, device, dtype)
    optimizer = build_optimizer(model, 1e-4)
    scheduler = build_scheduler(optimizer, 0, warmup + steps + 1)
    flops = model_flops(config, batch, head, args.ttt_steps)
    step = variant_step(name, model, head, batch, scored, optimizer, scheduler,
                        args.ttt_steps)
    for k in range(warmup):
        step(k)
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    counter = iter(range(steps))
    seconds = timed(lambda: step(next(counter)), steps, device)
    last = step(LOG_EVERY - 1) or {}
    achieved = flops["total"] / seconds
    tokens = batch.input_ids.numel()
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else float("nan")
    del model, head, optimizer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "variant": name,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "config": args.config if not args.tiny else "tiny",
        "seq_len": batch.input_ids.shape[1], "batch_tokens": tokens,
        "ttt_steps": args.ttt_steps, "intermediate_size": config.intermediate_size,
        "step_ms": seconds * 1e3, "tokens_per_s": tokens / seconds,
        "model_tflop_per_step": flops["total"] / 1e12, "model_tflops": achieved / 1e12,
        "matmul_ceiling_tflops": ceiling / 1e12, "mfu_vs_ceiling": achieved / ceiling,
        "mfu_vs_spec": achieved / (BF16_DENSE_SPEC_TFLOPS * 1e12),
        "attention_flop_share": flops["attention_share"],
        "scored_positions_share": flops["scored_share"],
        "peak_memory_gib": peak / 2**30, "peak_kib_per_token": peak / 1024 / tokens,
        "last_loss": last.get("loss", float("nan")),
    }


if __name__ == "__main__":
    main()

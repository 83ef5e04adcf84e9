"""Kimi-K2.5's MoE layers with their INT4 experts kept packed, on one GPU (H200).

Layer shapes as released: hidden 7168, 384 routed experts of intermediate 2048 in
compressed-tensors' pack-quantized INT4 (groups of 32, bf16 scales), one bf16 shared
expert of 2048, a sigmoid router, top-8, routed scaling 2.827. Random weights are made
on the GPU (random int32 words are random nibbles), nothing is read from disk.

1. GPU bytes: as many packed layers as the GPU holds (`--layers 0`: as many as leave
   `--headroom` GB free), the allocator's bytes per layer against the bytes the
   checkpoint stores for it (goal <= 1.05x), and the forward's working memory.
2. tokens/s per MoE layer of the packed path (workers/eagle3/target/w4a16_moe.py through
   `PackedExperts`) at extraction batch sizes, against the same layer with bf16
   experts — all 384, one layer fits — run (a) grouped: `torch._grouped_mm` over
   expert-sorted tokens, (b) one expert after the other as transformers' eager
   experts do.
3. MLA attention: transformers' `DeepseekV3Attention` at Kimi-K2's shapes in bf16
   (sdpa), on samples of `--sample-len` tokens, measured per layer.
4. The projection for 61 layers on 8 GPUs with the split pipelining (each GPU busy on
   its ~61/8 layers, so throughput = 8 x batch / (61 x per-layer time)), against the
   seed's ~3,600 tokens/s (goal >= 3x) and its 71 GB per GPU. The dense first layer is
   counted as a MoE layer; embeddings, the LM head and the writing of features are
   left out (they are not the MoE's).

`python bench/moe_w4a16.py` (CUDA, Triton). Prints a table; `--json PATH` writes it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from workers.eagle3.target import w4a16_moe  # noqa: E402
from workers.eagle3.target.packed_experts import PackedExperts  # noqa: E402

HIDDEN, EXPERTS, INTER, TOP_K, SHARED, SCALING = 7168, 384, 2048, 8, 2048, 2.827
LAYERS_61, GPUS, SEED_TOKENS_S, SEED_GB = 61, 8, 3600.0, 71.0
GB = 1e9


class MoELayer(nn.Module):
    """Router + packed routed experts + bf16 shared expert (Kimi-K2.5's MoE block)."""

    def __init__(self, experts: nn.Module, gen: torch.Generator) -> None:
        super().__init__()
        dev = "cuda"
        self.experts = experts
        self.router = torch.randn(EXPERTS, HIDDEN, device=dev, generator=gen).mul_(
            HIDDEN ** -0.5).bfloat16()
        self.bias = torch.zeros(EXPERTS, device=dev)
        self.shared_gate_up = torch.randn(2 * SHARED, HIDDEN, device=dev, generator=gen
                                          ).mul_(HIDDEN ** -0.5).bfloat16()
        self.shared_down = torch.randn(HIDDEN, SHARED, device=dev, generator=gen).mul_(
            SHARED ** -0.5).bfloat16()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = nn.functional.linear(x.float(), self.router.float()).sigmoid()
        _, index = torch.topk(scores + self.bias, TOP_K, dim=-1)
        weights = scores.gather(1, index)
        weights = weights / weights.sum(-1, keepdim=True) * SCALING
        routed = self.experts(x, index, weights)
        gate, up = nn.functional.linear(x, self.shared_gate_up).chunk(2, dim=-1)
        shared = nn.functional.linear(nn.functional.silu(gate) * up, self.shared_down)
        return x + routed + shared


def packed_experts(gen: torch.Generator) -> PackedExperts:
    module = PackedExperts(EXPERTS, HIDDEN, INTER, device="cuda")
    for _, buffer in module.named_buffers():
        if buffer.dtype == torch.int32:
            buffer.copy_(torch.randint(-2**31, 2**31 - 1, buffer.shape, generator=gen,
                                       device="cuda", dtype=torch.int32))
        else:
            fan_in = buffer.shape[-1] * module.group_size
            buffer.copy_(torch.rand(buffer.shape, generator=gen, device="cuda")
                         .mul(0.5).add(0.75).div(4 * fan_in ** 0.5))
    return module


class Bf16Experts(nn.Module):
    """The same experts in bf16 (transformers' fused layout), run grouped or one by one."""

    def __init__(self, gen: torch.Generator, grouped: bool) -> None:
        super().__init__()
        self.grouped = grouped
        self.gate_up = torch.randn(EXPERTS, 2 * INTER, HIDDEN, device="cuda", generator=gen,
                                   dtype=torch.bfloat16).mul_(HIDDEN ** -0.5)
        self.down = torch.randn(EXPERTS, HIDDEN, INTER, device="cuda", generator=gen,
                                dtype=torch.bfloat16).mul_(INTER ** -0.5)

    def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor
                ) -> torch.Tensor:
        return self.run_grouped(x, index, weights) if self.grouped else \
            self.run_loop(x, index, weights)

    def run_grouped(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor
                    ) -> torch.Tensor:
        flat = index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(EXPERTS, dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        offs = counts.cumsum(0, dtype=torch.int32)
        xs = x[order // TOP_K]
        gate, up = torch._grouped_mm(xs, self.gate_up.transpose(-2, -1), offs=offs).chunk(2, -1)
        y = torch._grouped_mm(nn.functional.silu(gate) * up, self.down.transpose(-2, -1),
                              offs=offs)
        out = torch.zeros(flat.numel(), HIDDEN, device=x.device, dtype=x.dtype)
        out[order] = y * weights.reshape(-1)[order, None].to(y.dtype)
        return out.view(-1, TOP_K, HIDDEN).sum(1, dtype=torch.float32).to(x.dtype)

    def run_loop(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor
                 ) -> torch.Tensor:  # transformers' eager DeepseekV3Experts.forward
        out = torch.zeros_like(x)
        mask = nn.functional.one_hot(index, num_classes=EXPERTS).permute(2, 1, 0)
        for expert in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero():
            e = int(expert[0])
            slot, token = torch.where(mask[e])
            gate, up = nn.functional.linear(x[token], self.gate_up[e]).chunk(2, dim=-1)
            y = nn.functional.linear(nn.functional.silu(gate) * up, self.down[e])
            out.index_add_(0, token, (y * weights[token, slot, None]).to(out.dtype))
        return out


class Tuned(nn.Module):
    """`PackedExperts` through the kernel with explicit tile sizes."""

    def __init__(self, experts: PackedExperts, config: dict[str, int]) -> None:
        super().__init__()
        self.experts, self.config = experts, config

    def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor
                ) -> torch.Tensor:
        e = self.experts
        return w4a16_moe.moe_forward(x, e.gate_up_packed, e.gate_up_scale, e.down_packed,
                                     e.down_scale, index, weights, **self.config)


CONFIGS = "0x64x128x4x3,64x128x128x4x3,64x128x128x8x3,128x128x128x8x3,64x64x256x4x3,"\
          "64x128x256x8x2,128x64x128x4x3,16x64x128x4x3"
"""block_m (0: by rows per expert) x block_n x block_k x warps x stages, swept first."""


def sweep(first: MoELayer, batches: list[int], configs: str, repeats: int
          ) -> dict[int, dict[str, int]]:
    """The fastest tile configuration per batch size, on one layer."""
    keys = ("block_m", "block_n", "block_k", "num_warps", "num_stages")
    packed = first.experts
    best: dict[int, dict[str, int]] = {}
    for batch in batches:
        x = torch.randn(batch, HIDDEN, device="cuda", dtype=torch.bfloat16)
        timed = []
        for spec in configs.split(","):
            config = dict(zip(keys, (int(v) for v in spec.split("x")), strict=True))
            config = {k: v for k, v in config.items() if v}
            first.experts = Tuned(packed, config)
            try:
                with torch.no_grad():
                    seconds = time_layers([first], x, repeats)
            except Exception as exc:  # noqa: BLE001 - a config the GPU cannot run
                print(f"  {spec}: {type(exc).__name__}: {str(exc)[:80]}")
                continue
            timed.append((seconds, spec, config))
            print(f"  {batch} tokens, {spec}: {seconds * 1e3:.2f} ms")
        seconds, spec, config = min(timed, key=lambda item: item[0])
        print(f"best at {batch}: {spec} ({seconds * 1e3:.2f} ms)")
        best[batch] = config
    first.experts = packed
    return best


def time_layers(layers: list[nn.Module], x: torch.Tensor, repeats: int) -> float:
    """Seconds per layer of a forward through all of `layers` (median of `repeats`)."""
    def once() -> None:
        h = x
        for layer in layers:
            h = layer(h)

    once()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        once()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2] / len(layers)


def stored_bytes(layer: MoELayer) -> int:
    tensors = [*layer.experts.buffers(), layer.router, layer.bias, layer.shared_gate_up,
               layer.shared_down]
    return sum(t.numel() * t.element_size() for t in tensors)


def attention_seconds(batch: int, sample_len: int, repeats: int) -> float | None:
    """One bf16 MLA layer (Kimi-K2's shapes, sdpa) per `batch` tokens in samples of
    `sample_len`; None when transformers' module cannot be built here."""
    try:
        from transformers import DeepseekV3Config
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
            DeepseekV3Attention,
            DeepseekV3RotaryEmbedding,
        )

        config = DeepseekV3Config(
            hidden_size=HIDDEN, num_attention_heads=64, num_key_value_heads=64,
            q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
            v_head_dim=128, max_position_embeddings=max(8192, sample_len))
        config._attn_implementation = "sdpa"
        with torch.device("cuda"):
            attn = DeepseekV3Attention(config, layer_idx=0).to(torch.bfloat16).eval()
            rotary = DeepseekV3RotaryEmbedding(config)
        samples = max(1, batch // sample_len)
        x = torch.randn(samples, sample_len, HIDDEN, device="cuda", dtype=torch.bfloat16)
        pos = torch.arange(sample_len, device="cuda")[None].expand(samples, -1)
        cos, sin = rotary(x, pos)

        class Wrap(nn.Module):
            def forward(self, h: torch.Tensor) -> torch.Tensor:
                return attn(hidden_states=h, position_embeddings=(cos, sin),
                            attention_mask=None)[0]

        with torch.no_grad():
            seconds = time_layers([Wrap()], x, repeats)
        return seconds * batch / (samples * sample_len)
    except Exception as exc:  # noqa: BLE001 - a bench reports what it could not measure
        print(f"attention not measured: {type(exc).__name__}: {exc}")
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="4096,8192,16384",
                        help="tokens per forward pass (comma-separated)")
    parser.add_argument("--layers", type=int, default=0,
                        help="packed layers to hold (0: as many as fit)")
    parser.add_argument("--headroom", type=float, default=14.0, help="GB left free")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sample-len", type=int, default=1450)
    parser.add_argument("--loop-batch", type=int, default=8192,
                        help="the one batch size the one-expert-at-a-time bf16 path runs")
    parser.add_argument("--configs", default=CONFIGS, help="tile sizes to sweep")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not w4a16_moe.available():
        sys.exit("needs CUDA and Triton")
    batches = [int(b) for b in args.batches.split(",")]
    gen = torch.Generator("cuda").manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    print(f"device: {props.name}, {props.total_memory / GB:.1f} GB; torch {torch.__version__}")
    result: dict[str, Any] = {"device": props.name, "batches": batches}

    # 1. bytes
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    first = MoELayer(packed_experts(gen), gen)
    torch.cuda.synchronize()
    per_layer = torch.cuda.memory_allocated() - base
    stored = stored_bytes(first)
    free, _ = torch.cuda.mem_get_info()
    count = args.layers or 1 + int((free - args.headroom * GB) // per_layer)
    layers = [first] + [MoELayer(packed_experts(gen), gen) for _ in range(count - 1)]
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - base
    experts_bytes = first.experts.nbytes
    bf16_experts = EXPERTS * 3 * HIDDEN * INTER * 2
    print(f"\n== GPU bytes per MoE layer: {count} layers held, {held / GB:.1f} GB")
    print(f"allocated per layer {per_layer / GB:.3f} GB; stored (checkpoint) "
          f"{stored / GB:.3f} GB; ratio {per_layer / stored:.4f} (goal <= 1.05)")
    print(f"routed experts packed {experts_bytes / GB:.3f} GB vs bf16 {bf16_experts / GB:.3f} "
          f"GB ({bf16_experts / experts_bytes:.2f}x)")
    result.update(layers_held=count, bytes_per_layer=per_layer, stored_per_layer=stored,
                  bytes_ratio=per_layer / stored, packed_experts_bytes=experts_bytes)

    # 2. packed tokens/s, with the best tiles of the sweep
    print("\n== tile sweep (one layer)")
    best = sweep(first, batches, args.configs, 3)
    result["best_configs"] = {str(b): c for b, c in best.items()}
    plain = [layer.experts for layer in layers]
    rows = []
    with torch.no_grad():
        for batch in batches:
            for layer, experts in zip(layers, plain, strict=True):
                layer.experts = Tuned(experts, best[batch])
            x = torch.randn(batch, HIDDEN, device="cuda", dtype=torch.bfloat16)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            seconds = time_layers(layers, x, args.repeats)
            work = torch.cuda.max_memory_allocated() - before
            rows.append({"batch": batch, "packed_s": seconds, "work_bytes": work})
            print(f"packed: {batch} tokens: {seconds * 1e3:.2f} ms/layer "
                  f"({batch / seconds:,.0f} tokens/s/layer) over {count} layers, working "
                  f"memory {work / GB:.2f} GB, tiles {best[batch]}")
    del layers, first, plain
    torch.cuda.empty_cache()

    # 2b. bf16 experts, grouped and one by one
    for grouped, key in ((True, "bf16_grouped_s"), (False, "bf16_loop_s")):
        try:
            bf16 = MoELayer(Bf16Experts(gen, grouped), gen)
            with torch.no_grad():
                for row in rows:
                    if not grouped and row["batch"] != args.loop_batch:
                        continue
                    x = torch.randn(row["batch"], HIDDEN, device="cuda", dtype=torch.bfloat16)
                    row[key] = time_layers([bf16], x, args.repeats)
                    print(f"bf16 {'grouped' if grouped else 'one by one'}: {row['batch']} "
                          f"tokens: {row[key] * 1e3:.2f} ms/layer")
        except Exception as exc:  # noqa: BLE001
            print(f"bf16 {'grouped' if grouped else 'loop'} not measured: "
                  f"{type(exc).__name__}: {exc}")
        bf16 = None
        torch.cuda.empty_cache()

    # 3. attention, 4. projection
    flops = 2 * TOP_K * 3 * HIDDEN * INTER + 2 * 3 * HIDDEN * SHARED
    print(f"\n== per layer, Kimi-K2.5 shapes; projection for {LAYERS_61} layers on "
          f"{GPUS} GPUs (pipelined)")
    head = (f"{'tokens':>7} {'packed ms':>10} {'TFLOP/s':>8} {'bf16 grp ms':>11} "
            f"{'bf16 loop ms':>12} {'attn ms':>8} {'layer ms':>9} {'node tok/s':>11} "
            f"{'x seed':>7}")
    print(head)
    for row in rows:
        attn = attention_seconds(row["batch"], args.sample_len, args.repeats)
        row["attention_s"] = attn
        layer = row["packed_s"] + (attn or 0.0)
        node = GPUS * row["batch"] / (LAYERS_61 * layer)
        row.update(node_tokens_s=node, vs_seed=node / SEED_TOKENS_S,
                   tflops=flops * row["batch"] / row["packed_s"] / 1e12)

        def ms(value: float | None) -> str:
            return f"{value * 1e3:.2f}" if value else "-"

        print(f"{row['batch']:>7} {ms(row['packed_s']):>10} {row['tflops']:>8.1f} "
              f"{ms(row.get('bf16_grouped_s')):>11} {ms(row.get('bf16_loop_s')):>12} "
              f"{ms(attn) if attn else 'excl.':>8} {layer * 1e3:>9.2f} {node:>11,.0f} "
              f"{node / SEED_TOKENS_S:>7.1f}")
    per_gpu = (LAYERS_61 / GPUS) * stored + 2 * 163840 * HIDDEN * 2 / GPUS
    print(f"\nweights per GPU at {LAYERS_61} layers / {GPUS}: {per_gpu / GB:.1f} GB "
          f"(MoE layers counted for all 61; embeddings and LM head spread) vs the seed's "
          f"{SEED_GB:.0f} GB; plus the working memory above")
    result.update(rows=rows, weights_per_gpu=per_gpu)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

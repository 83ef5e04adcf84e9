"""What each GPU will hold, decided from the checkpoint's headers before a byte is loaded.

The seed's experience was a 24-minute load ending in an out-of-memory error. Here the
bytes come from the safetensors headers (no tensor read) and config.json: routed experts
as stored (packed INT4 + scales) or, with `experts="dequantized"`, as transformers holds
them (bf16: 4x the packed words, no scales); every other tensor in the compute dtype;
the decoder's items (embedding, each layer, final norm and LM head) balanced over the
GPUs by bytes exactly as workers/eagle3/target/split.py balances them; plus the forward's working
memory for the batch (the MoE kernel's buffers: per token `top_k` output rows and `top_k`
intermediate rows, the padding of each expert's rows, and ~8 hidden-sized activations;
the measured working memory on an H200 at 16,384 tokens was 3.58 GB for a Kimi-K2.5
layer, this gives 3.6 GB). A GPU that cannot hold its share is refused with the
shortfall named: `python -m workers.eagle3.target.load_plan MODEL --gpus-per-model 8`.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from workers.eagle3.target.packed_experts import EXPERT_KEY, checkpoint_entries

LAYER = re.compile(r"layers\.(\d+)\.")
GB = 1e9


class LoadPlanError(Exception):
    """The model does not fit; the message names the GPU and the shortfall."""


@dataclass(frozen=True)
class LoadPlan:
    gpus: int
    weights: list[int]  # bytes of weights per GPU
    activations: int  # bytes of working memory per GPU (each runs the whole batch)
    experts_bytes: int  # all routed experts, as they will be held
    other_bytes: int  # everything else, in the compute dtype

    @property
    def per_gpu(self) -> list[int]:
        return [w + self.activations for w in self.weights]

    def check(self, capacity: int) -> None:
        """Refuse, naming the first GPU short of `capacity` bytes and by how much."""
        for gpu, need in enumerate(self.per_gpu):
            if need > capacity:
                raise LoadPlanError(
                    f"GPU {gpu} of {self.gpus} would hold {size_text(need)} "
                    f"({size_text(self.weights[gpu])} weights + "
                    f"{size_text(self.activations)} working memory) but has "
                    f"{size_text(capacity)}: short by {size_text(need - capacity)} (more "
                    "--gpus-per-model, fewer --batch-tokens, or --experts packed)")

    def table(self) -> str:
        lines = [f"{'GPU':>4} {'weights GB':>11} {'working GB':>11} {'total GB':>9}"]
        lines += [f"{gpu:>4} {w / GB:>11.2f} {self.activations / GB:>11.2f} "
                  f"{(w + self.activations) / GB:>9.2f}" for gpu, w in enumerate(self.weights)]
        lines.append(f"routed experts {self.experts_bytes / GB:.2f} GB, the rest "
                     f"{self.other_bytes / GB:.2f} GB")
        return "\n".join(lines)


def size_text(size: int | float) -> str:
    return f"{size / GB:.1f} GB" if size >= 0.1 * GB else f"{size / 1e6:.2f} MB"


def text_config(config: dict) -> dict:
    return config.get("text_config") or config


def plan_load(path: Path, *, gpus: int = 1, experts: str = "packed", dtype_bytes: int = 2,
              batch_tokens: int = 16384) -> LoadPlan:
    """The plan for the checkpoint at `path` split over `gpus` GPUs."""
    from workers.eagle3.target.split import balanced_assignment

    text = text_config(json.loads((Path(path) / "config.json").read_text()))
    layers = int(text["num_hidden_layers"])
    before = after = 0  # embedding (and anything else outside the layers); norm + head
    per_layer = [0] * layers
    experts_bytes = other_bytes = 0
    for name, entry in checkpoint_entries(Path(path)).items():
        match = EXPERT_KEY.match(name)
        if match:
            if match["part"] == "weight_shape":
                continue
            if experts == "dequantized":  # bf16 weights, no scales
                size = entry.nbytes * 4 if match["part"] == "weight_packed" else 0
            else:
                size = entry.nbytes
            experts_bytes += size
        else:
            elements = entry.nbytes // max(1, entry.dtype.itemsize)
            size = elements * (dtype_bytes if entry.dtype.is_floating_point
                               else entry.dtype.itemsize)
            other_bytes += size
        layer = LAYER.search(name)
        if layer and int(layer.group(1)) < layers:
            per_layer[int(layer.group(1))] += size
        elif "lm_head" in name or name.endswith("norm.weight"):
            after += size
        else:
            before += size
    sizes = [before, *per_layer, after]
    weights = [0] * gpus
    for size, part in zip(sizes, balanced_assignment(sizes, gpus), strict=True):
        weights[part] += size
    return LoadPlan(gpus, weights, working_bytes(text, batch_tokens, dtype_bytes),
                    experts_bytes, other_bytes)


def working_bytes(text: dict, tokens: int, dtype_bytes: int) -> int:
    if tokens <= 0:
        return 0
    hidden = int(text["hidden_size"])
    top_k = int(text.get("num_experts_per_tok") or 0)
    experts = int(text.get("n_routed_experts") or 0)
    inter = int(text.get("moe_intermediate_size") or 0)
    pairs = tokens * top_k
    moe = pairs * hidden + (pairs + experts * 128) * inter
    return (moe + 8 * tokens * hidden) * dtype_bytes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.eagle3.target.load_plan",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=Path)
    parser.add_argument("--gpus-per-model", type=int, default=1)
    parser.add_argument("--gpu-gb", type=float, default=None,
                        help="memory per GPU (default: what GPU 0 has free)")
    parser.add_argument("--experts", choices=("packed", "dequantized"), default="packed")
    parser.add_argument("--batch-tokens", type=int, default=16384)
    args = parser.parse_args(argv)
    plan = plan_load(args.model, gpus=args.gpus_per_model, experts=args.experts,
                     batch_tokens=args.batch_tokens)
    print(plan.table())
    capacity = args.gpu_gb * GB if args.gpu_gb else free_gpu_bytes()
    if capacity is None:
        print("no GPU here and no --gpu-gb: nothing to check against")
        return 0
    try:
        plan.check(int(capacity))
    except LoadPlanError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"fits: {max(plan.per_gpu) / GB:.1f} of {capacity / GB:.1f} GB on the fullest GPU")
    return 0


def free_gpu_bytes() -> int | None:
    import torch

    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.mem_get_info()[0])


if __name__ == "__main__":
    sys.exit(main())

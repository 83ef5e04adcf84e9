"""The target's own batched prefill + decode speed: the ceiling `workers.generate
--backend transformers` is measured against (docs/benchmarks.md).

    python bench/target_throughput.py --model /models/smollm2 --batch 256 --batch 1024

Random prompt ids of `--prompt-tokens`, one prefill of the whole batch, then
`--new-tokens` greedy decode steps with the KV cache (transformers' DynamicCache, eager),
no padding, no stopping: every sequence decodes every step. Timed with CUDA syncs, after
one warm-up round. Prints a table: batch, prefill tokens/s, decode tokens/s, and the
decode step's milliseconds.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoModelForCausalLM


def measure(model: torch.nn.Module, batch: int, prompt_tokens: int, new_tokens: int,
            device: torch.device) -> tuple[float, float]:
    """(prefill seconds, decode seconds) for one batch."""
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (batch, prompt_tokens), device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    with torch.inference_mode():
        sync()
        started = time.perf_counter()
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        sync()
        prefill = time.perf_counter() - started
        cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        started = time.perf_counter()
        for _ in range(new_tokens):
            out = model(input_ids=token, past_key_values=cache, use_cache=True)
            cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        sync()
        decode = time.perf_counter() - started
    return prefill, decode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch", type=int, action="append", help="repeatable")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device).eval()
    measure(model, 8, args.prompt_tokens, 8, device)  # warm-up: kernels, allocator
    print(f"\nprompt {args.prompt_tokens} tokens, {args.new_tokens} new, {dtype}, "
          f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}\n")
    print("| batch | prefill tokens/s | decode tokens/s | decode step ms |")
    print("| ---: | ---: | ---: | ---: |")
    for batch in args.batch or [256]:
        prefill, decode = measure(model, batch, args.prompt_tokens, args.new_tokens, device)
        print(f"| {batch} | {batch * args.prompt_tokens / prefill:,.0f} | "
              f"{batch * args.new_tokens / decode:,.0f} | "
              f"{1000 * decode / args.new_tokens:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

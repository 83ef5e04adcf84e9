"""Routed experts held as compressed-tensors stores them: `pack-quantized` symmetric INT4.

Kimi-K2.5 (and Kimi-K2, and DeepSeek-V3 quantized the same way) ships every routed
expert's `gate_proj`, `up_proj` and `down_proj` as three tensors:
- `weight_packed` int32 `[out, in/8]`: compressed-tensors' `pack_to_int32` along the input
  dimension — element k of a row sits in bits `4*(k % 8)` .. `4*(k % 8) + 3` of word `k // 8`
  as the unsigned nibble `q + 8`, q in [-8, 7];
- `weight_scale` `[out, in/32]` in the checkpoint's float dtype (bf16): one scale per group
  of 32 consecutive inputs; symmetric, so no zero point;
- `weight_shape` `[out, in]`.
The library dequantizes as `q.to(scale.dtype) * scale` (the product rounded to the
scale's dtype: forward_helpers._dequantize), and so does every path here, so the packed
and the dequantized models hold exactly the same weights.

`PackedExperts` replaces transformers' fused `DeepseekV3Experts` (same call:
`(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]`) and holds, per MoE
layer, `gate_up_packed` `[E, 2I, H/8]` ([gate; up] as transformers fuses them),
`gate_up_scale` `[E, 2I, H/32]`, `down_packed` `[E, H, I/8]`, `down_scale` `[E, H, I/32]`:
1/4 of the bf16 bytes plus 1/16 for the scales. On CUDA with Triton its forward is
workers/eagle3/target/w4a16_moe.py's grouped kernel; elsewhere (CPU, tests, no Triton) the
reference: tokens sorted by expert, one expert dequantized at a time in the compute
dtype, no bf16 copy of more than one expert at once.

`load_packed_model` builds the model with its parameters on the meta device, swaps the
fused experts for `PackedExperts`, and reads every tensor straight from the safetensors
shards into its final place (a plain `readinto`, no mmap: the file's pages never count
against the process), the shards in parallel, reporting bytes read.
"""

from __future__ import annotations

import json
import re
import struct
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

SUPPORTED = {"format": "pack-quantized", "num_bits": 4, "type": "int", "symmetric": True,
             "strategy": "group", "group_size": 32}
"""The one scheme `PackedExperts` runs (Kimi-K2 / K2.5's): anything else is refused."""

PACK = 8
"""INT4 values per int32 word."""

EXPERT_KEY = re.compile(
    r"^(?P<layer>.*\.layers\.\d+\.mlp)\.experts\.(?P<expert>\d+)\."
    r"(?P<proj>gate|up|down)_proj\.(?P<part>weight_packed|weight_scale|weight_shape)$")

RENAMES = (("language_model.model.", "model.language_model."),
           ("language_model.lm_head.", "lm_head."),
           ("vision_tower.", "model.vision_tower."),
           ("mm_projector.", "model.mm_projector."))
"""A released checkpoint's tensor-name prefixes -> transformers' module names (Kimi-K2.5's
wrapper); a name no rule matches is used as it is (DeepSeek-V3, Kimi-K2)."""


class UnsupportedScheme(ValueError):
    """The checkpoint's quantization is not the one the packed path runs."""


# -- the scheme ---------------------------------------------------------------------------

def quantization_config(config: dict[str, Any]) -> dict[str, Any] | None:
    """The checkpoint's `quantization_config` (top level, or inside `text_config` where
    Kimi-K2.5 keeps it), or None."""
    found = config.get("quantization_config")
    if found is None:
        found = (config.get("text_config") or {}).get("quantization_config")
    return found


def is_pack_quantized(path: Path) -> bool:
    """Whether the checkpoint's config declares compressed-tensors `pack-quantized`."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    qconfig = quantization_config(config)
    if not qconfig or qconfig.get("quant_method") != "compressed-tensors":
        return False
    groups = qconfig.get("config_groups") or {}
    formats = {qconfig.get("format")} | {g.get("format") for g in groups.values()}
    return "pack-quantized" in formats


def check_scheme(qconfig: dict[str, Any]) -> None:
    """Refuse, in one line naming it, any scheme but symmetric INT4 in groups of 32."""
    groups = qconfig.get("config_groups") or {}
    if len(groups) != 1:
        raise UnsupportedScheme(f"{len(groups)} quantization config groups; the packed "
                                "experts path runs exactly one")
    (group,) = groups.values()
    weights = group.get("weights") or {}
    scheme = {"format": group.get("format") or qconfig.get("format"),
              **{key: weights.get(key) for key in SUPPORTED if key != "format"}}
    wrong = {key: value for key, value in scheme.items() if value != SUPPORTED[key]}
    if group.get("input_activations") or group.get("output_activations"):
        wrong["activations"] = "quantized"
    if wrong:
        named = ", ".join(f"{key} {value!r}" for key, value in scheme.items())
        raise UnsupportedScheme(
            f"quantization scheme ({named}) is not supported by the packed experts path "
            f"(it runs symmetric int4 in groups of 32; {', '.join(sorted(wrong))} differ); "
            "use --experts dequantized")


# -- packing ------------------------------------------------------------------------------

def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """int32 `[..., n/8]` -> int8 `[..., n]` in [-8, 7] (compressed-tensors' layout)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF
    return (nibbles.to(torch.int8) - 8).flatten(-2)


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """int8 `[..., n]` in [-8, 7] -> int32 `[..., n/8]`: the inverse of `unpack_int4`
    (the top nibble lands in the word's sign bit, as in compressed-tensors)."""
    nibbles = (values.to(torch.int32) + 8).unflatten(-1, (-1, PACK))
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=values.device)
    words = nibbles << shifts
    out = words[..., 0].clone()
    for k in range(1, PACK):
        out |= words[..., k]
    return out


def dequantize(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The dense `[out, in]` weight, as compressed-tensors computes it (`q * scale` in the
    scale's dtype), then in `dtype`."""
    q = unpack_int4(packed)
    group = q.shape[-1] // scale.shape[-1]
    dense = q.to(scale.dtype).unflatten(-1, (-1, group)) * scale.unsqueeze(-1)
    return dense.flatten(-2).to(dtype)


# -- the module ---------------------------------------------------------------------------

def sort_by_expert(top_k_index: torch.Tensor, num_experts: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, counts): the flat (token, slot) pairs sorted by expert, on their device,
    and how many each expert receives (no host synchronisation)."""
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    return order, counts


class PackedExperts(nn.Module):
    """One MoE layer's routed experts in packed INT4 (see the module docstring)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, *,
                 scale_dtype: torch.dtype = torch.bfloat16, device: Any = "meta",
                 group_size: int = 32) -> None:
        super().__init__()
        self.num_experts, self.hidden_dim, self.intermediate_dim = (
            num_experts, hidden, intermediate)
        self.group_size = group_size
        self.use_kernel = True
        empty = {"device": device}
        self.register_buffer("gate_up_packed", torch.empty(
            num_experts, 2 * intermediate, hidden // PACK, dtype=torch.int32, **empty))
        self.register_buffer("gate_up_scale", torch.empty(
            num_experts, 2 * intermediate, hidden // group_size, dtype=scale_dtype, **empty))
        self.register_buffer("down_packed", torch.empty(
            num_experts, hidden, intermediate // PACK, dtype=torch.int32, **empty))
        self.register_buffer("down_scale", torch.empty(
            num_experts, hidden, intermediate // group_size, dtype=scale_dtype, **empty))

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, hidden={self.hidden_dim}, "
                f"intermediate={self.intermediate_dim}, int4 group {self.group_size}")

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        if self.use_kernel and hidden_states.is_cuda and hidden_states.dtype in (
                torch.bfloat16, torch.float16):
            from workers.eagle3.target import w4a16_moe

            if w4a16_moe.available():
                return w4a16_moe.moe_forward(
                    hidden_states, self.gate_up_packed, self.gate_up_scale,
                    self.down_packed, self.down_scale, top_k_index, top_k_weights)
        return self.reference(hidden_states, top_k_index, top_k_weights)

    def reference(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                  top_k_weights: torch.Tensor) -> torch.Tensor:
        """One expert dequantized at a time into the compute dtype; what the tests and
        the CPU run (one host synchronisation, for the counts)."""
        dtype = hidden_states.dtype
        out = torch.zeros_like(hidden_states)
        order, counts = sort_by_expert(top_k_index, self.num_experts)
        top_k = top_k_index.shape[-1]
        tokens, weights = order // top_k, top_k_weights.reshape(-1)[order]
        start = 0
        for expert, count in enumerate(counts.tolist()):
            if not count:
                continue
            rows = tokens[start:start + count]
            x = hidden_states[rows]
            gate_up = dequantize(self.gate_up_packed[expert], self.gate_up_scale[expert], dtype)
            gate, up = nn.functional.linear(x, gate_up).chunk(2, dim=-1)
            down = dequantize(self.down_packed[expert], self.down_scale[expert], dtype)
            y = nn.functional.linear(nn.functional.silu(gate) * up, down)
            out.index_add_(0, rows, (y * weights[start:start + count, None]).to(dtype))
            start += count
        return out


def fused_experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """transformers' fused routed-experts modules (3-D `gate_up_proj` and `down_proj`)."""
    return [(name, module) for name, module in model.named_modules()
            if name.endswith("mlp.experts") and hasattr(module, "gate_up_proj")
            and hasattr(module, "down_proj") and hasattr(module, "num_experts")]


# -- safetensors, read without mmap -------------------------------------------------------

DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
          "F64": torch.float64, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
          "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


@dataclass(frozen=True)
class Entry:
    """One tensor in a shard: where its bytes are."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # byte offset in the file
    nbytes: int


def read_header(file: Path) -> dict[str, Entry]:
    with open(file, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    base = 8 + size
    return {name: Entry(file, DTYPES[info["dtype"]], tuple(info["shape"]),
                        base + info["data_offsets"][0],
                        info["data_offsets"][1] - info["data_offsets"][0])
            for name, info in header.items()}


def checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / name for name in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files")
    return files


def checkpoint_entries(path: Path) -> dict[str, Entry]:
    entries: dict[str, Entry] = {}
    for file in checkpoint_files(Path(path)):
        entries.update(read_header(file))
    return entries


def read_into(entry: Entry, out: torch.Tensor, fh: Any) -> None:
    """The tensor's bytes into the contiguous CPU tensor `out` (same dtype, same size)."""
    view = out.reshape(-1).view(torch.uint8).numpy()
    fh.seek(entry.start)
    got = fh.readinto(memoryview(view))
    if got != entry.nbytes:
        raise OSError(f"{entry.file}: short read ({got} of {entry.nbytes} bytes)")


def read_tensor(entry: Entry, fh: Any) -> torch.Tensor:
    out = torch.empty(entry.shape, dtype=entry.dtype)
    if entry.nbytes:
        read_into(entry, out, fh)
    return out


# -- the loader ---------------------------------------------------------------------------

def module_name(file_name: str) -> str:
    for released, ours in RENAMES:
        if file_name.startswith(released):
            return ours + file_name[len(released):]
    return file_name


@dataclass
class LoadReport:
    bytes_read: int = 0
    seconds: float = 0.0
    packed_bytes: int = 0
    dense_bytes: int = 0

    @property
    def gb_per_s(self) -> float:
        return self.bytes_read / 1e9 / self.seconds if self.seconds else 0.0


def build_on_meta(config: Any, model_cls: Any, dtype: torch.dtype) -> nn.Module:
    """The model with every parameter and buffer on the meta device, its quantization
    removed from the config (the experts are swapped for `PackedExperts` next)."""
    for holder in (config, config.get_text_config(decoder=True)):
        if getattr(holder, "quantization_config", None) is not None:
            del holder.quantization_config
    with torch.device("meta"):
        model = model_cls.from_config(config, dtype=dtype)
    return model


def load_packed_model(path: Path, *, device: str, dtype: torch.dtype, config: Any,
                      model_cls: Any, progress: Callable[[int], None] | None = None,
                      threads: int = 4, device_map: dict[str, str] | None = None
                      ) -> tuple[nn.Module, LoadReport]:
    """The model at `path` with its routed experts packed (`PackedExperts`) on `device`,
    everything else in `dtype`; `progress(bytes_read_so_far)` as shards are read.
    `device_map` ({module name: device}, workers/eagle3/target/split.py's plan): each tensor goes to
    the device of the longest module name it starts with, `device` when none."""
    raw = json.loads((Path(path) / "config.json").read_text())
    qconfig = quantization_config(raw)
    if qconfig is None:
        raise UnsupportedScheme(f"{path}: no quantization_config (not a packed checkpoint)")
    check_scheme(qconfig)
    placed = Placement(device, device_map)
    model = build_on_meta(config, model_cls, dtype)
    experts = {}
    for name, fused in fused_experts_modules(model):
        parent = model.get_submodule(name.rpartition(".")[0])
        packed = PackedExperts(fused.num_experts, fused.gate_up_proj.shape[-1],
                               fused.down_proj.shape[-1], device="meta")
        parent.experts = packed
        experts[name.rpartition(".")[0]] = packed
    entries = checkpoint_entries(Path(path))
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers())
    plan: list[tuple[Entry, Callable[[torch.Tensor], None]]] = []
    seen: set[str] = set()
    filled: set[tuple[str, int, str, str]] = set()  # (layer, expert, proj, part)
    report = LoadReport()
    for file_name, entry in entries.items():
        match = EXPERT_KEY.match(file_name)
        if match:
            layer = module_name(match["layer"])
            if layer not in experts or match["part"] == "weight_shape":
                continue
            filled.add((layer, int(match["expert"]), match["proj"], match["part"]))
            plan.append((entry, expert_setter(experts[layer], match, entry)))
            report.packed_bytes += entry.nbytes
            continue
        name = module_name(file_name)
        if name in params or name in buffers:
            plan.append((entry, dense_setter(model, name, placed.of(name), dtype)))
            seen.add(name)
            report.dense_bytes += entry.nbytes
    missing = [n for n in params if n not in seen and not tied(model, n)]
    # every expert's packed weight and scale of gate, up and down: a buffer no tensor
    # fills would stay the uninitialised memory it is made with below
    missing += [f"{layer}.experts.{e}.{proj}_proj.{part}"
                for layer, module in experts.items() for e in range(module.num_experts)
                for proj in ("gate", "up", "down") for part in ("weight_packed", "weight_scale")
                if (layer, e, proj, part) not in filled]
    if missing:
        raise FileNotFoundError(f"{path}: {len(missing)} weights not in the checkpoint "
                                f"(first: {', '.join(missing[:3])})")
    for layer, module in experts.items():
        for name, buffer in module.named_buffers():
            setattr(module, name, torch.empty_like(buffer, device=placed.of(layer)))
    started = time.monotonic()
    read_shards(plan, report, progress, threads)
    report.seconds = time.monotonic() - started
    finish(model, placed)
    return model, report


class Placement:
    """The device of a module or tensor name under a {module name: device} map."""

    def __init__(self, default: str, device_map: dict[str, str] | None) -> None:
        self.default = torch.device(default)
        self.map = {name: torch.device(dev) for name, dev in (device_map or {}).items()}

    def of(self, name: str) -> torch.device:
        best, found = -1, self.default
        for prefix, dev in self.map.items():
            if (name == prefix or name.startswith(prefix + ".") or prefix == "") \
                    and len(prefix) > best:
                best, found = len(prefix), dev
        return found


def tied(model: nn.Module, name: str) -> bool:
    return bool(getattr(model.config.get_text_config(decoder=True), "tie_word_embeddings",
                        False)) and name.endswith("lm_head.weight")


def dense_setter(model: nn.Module, name: str, device: torch.device, dtype: torch.dtype
                 ) -> Callable[[torch.Tensor], None]:
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name)

    def put(tensor: torch.Tensor) -> None:
        if tensor.is_floating_point():
            tensor = tensor.to(dtype)
        tensor = tensor.to(device)
        if attr in owner._parameters:
            owner._parameters[attr] = nn.Parameter(tensor, requires_grad=False)
        else:
            owner._buffers[attr] = tensor
    return put


def expert_setter(module: PackedExperts, match: re.Match[str], entry: Entry
                  ) -> Callable[[torch.Tensor], None]:
    expert, proj, part = int(match["expert"]), match["proj"], match["part"]
    kind = "packed" if part == "weight_packed" else "scale"
    rows = module.intermediate_dim

    def put(tensor: torch.Tensor) -> None:
        if proj == "down":
            dest = getattr(module, f"down_{kind}")[expert]
        else:
            whole = getattr(module, f"gate_up_{kind}")[expert]
            dest = whole[:rows] if proj == "gate" else whole[rows:]
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ValueError(f"{entry.file}: {match.string} has shape {tuple(tensor.shape)}, "
                             f"the model expects {tuple(dest.shape)}")
        dest.copy_(tensor.to(dest.dtype))
    return put


def read_shards(plan: list[tuple[Entry, Callable[[torch.Tensor], None]]],
                report: LoadReport, progress: Callable[[int], None] | None,
                threads: int) -> None:
    """Every tensor read and put in place, one thread per shard at a time."""
    by_file: dict[Path, list[tuple[Entry, Callable[[torch.Tensor], None]]]] = {}
    for item in plan:
        by_file.setdefault(item[0].file, []).append(item)
    lock = threading.Lock()

    def load(items: list[tuple[Entry, Callable[[torch.Tensor], None]]]) -> None:
        with open(items[0][0].file, "rb", buffering=0) as fh:
            for entry, put in sorted(items, key=lambda item: item[0].start):
                put(read_tensor(entry, fh))
                with lock:
                    report.bytes_read += entry.nbytes
                    if progress is not None:
                        progress(report.bytes_read)

    with ThreadPoolExecutor(max(1, min(threads, len(by_file)))) as pool:
        list(pool.map(load, by_file.values()))


def finish(model: nn.Module, placed: Placement) -> None:
    """Buffers not in the checkpoint (rotary frequencies) made by the model's own
    initialisation on their module's device; tied embeddings tied."""
    for name, module in model.named_modules():
        meta = [n for n, b in module.named_buffers(recurse=False) if b.is_meta]
        meta += [n for n, p in module.named_parameters(recurse=False) if p.is_meta]
        if meta:
            module.to_empty(device=placed.of(name), recurse=False)
            model._init_weights(module)  # type: ignore[operator]
    if getattr(model.config.get_text_config(decoder=True), "tie_word_embeddings", False):
        model.tie_weights()


def iter_packed(model: nn.Module) -> Iterator[PackedExperts]:
    yield from (m for m in model.modules() if isinstance(m, PackedExperts))

"""Hidden states stored in fp8 (`workers.extract --store fp8`): float8_e4m3fn values
with one fp32 scale per token and per captured layer, about half the disk of bf16.

The layout of a sample file is otherwise unchanged: `aux_hidden_states` [S, 3H] and
`hidden_state` [S, H] (and `hidden_state_prenorm` [S, H]) keep their names and shapes
and become F8_E4M3; each gets a companion `<name>_scale` [S, n_layers] F32 (3 for the
aux states, low|mid|high; 1 for the others), `x ~= fp8 * scale` layer by layer. A reader
finds the store from the file itself (`is_encoded`: the dtype), so a reader never needs
extract_config.json to decode, and `read_feature` serves both stores.

Encoding: scale = amax(|x|) over the layer's H values of the token / 448 (e4m3's
largest finite value), computed in fp32; q = round_to_nearest_even(x / scale) in e4m3.
A row of zeros (or an amax so small the division underflows) gets scale 1 and stores
zeros. Per layer, not per token over all layers (speculators' FP8 connector's choice,
one scale for [4, H]): the residual stream grows with depth, and a scale set by the top
layer's amax would push the low layer's values into e4m3's subnormals.

What e4m3 guarantees (3 mantissa bits, exponent bias 7, smallest normal 2^-6,
subnormal spacing 2^-9, largest 448): for y = x / scale in [-448, 448], rounding to
nearest moves a normal y (|y| >= 2^-6) by at most half an ulp, 2^-4 |y|, and a
subnormal one by at most half the subnormal spacing, 2^-10. So, per element, decoded
to fp32:

    |x - decode(encode(x))| <= 2^-4 |x| + 2^-10 scale      (scale = row_amax / 448)

up to fp32's own rounding of x / scale and q * scale (2^-24 relative each). The first
term is reached to 16/17 (a value at 17/16 of a power of two, a tie, rounds to even:
an error of 2^-4 of the power, 1/17 of the value). The second
term is row_amax * 2^-10 / 448 ~ 2.2e-6 row_amax: relative error 1/16 at worst for
every element above row_amax * 2^-15, absolute error beyond that. Decoded to bf16, the
final rounding adds up to 2^-8 of the decoded value (bf16's unit roundoff).

Encoding is a few elementwise ops and one amax over the hidden dim, vectorised over
the whole batch on the device that computed it, with no host sync; it halves the
device-to-host copy as well as the file.

torch is imported where used: `workers.extract`'s parent of the ranks reads STORES and
`store_of` without loading it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

STORES = ("dtype", "fp8")
"""`workers.extract --store`: "dtype" keeps the compute dtype (--dtype: bf16 on a GPU,
fp32 on a CPU), as every extraction before this option did; "fp8" is this module's."""

DEFAULT_STORE = "fp8"
"""fp8 since the GPU measurements (docs/benchmarks.md, #29): a draft trained on fp8
features reached the tau of one trained on bf16 (within 0.01), at 50.5 % of the bytes,
extracted no slower and trained no slower. `--store dtype` keeps the compute dtype."""

FP8_MAX = 448.0
"""torch.finfo(torch.float8_e4m3fn).max: e4m3fn has no infinities, 0x7f is NaN."""

SAFETENSORS_FP8 = "F8_E4M3"
"""The safetensors dtype name of torch.float8_e4m3fn."""

SCALE_SUFFIX = "_scale"


def scale_name(name: str) -> str:
    """The scales tensor that goes with the fp8 tensor `name` in a sample file."""
    return name + SCALE_SUFFIX


def encode(x: torch.Tensor, layers: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., layers * H] (any float dtype, any device) -> (q [..., layers * H]
    float8_e4m3fn, scale [..., layers] float32), on x's device, without a host sync.
    One fp32 temporary the size of x."""
    import torch

    width = x.shape[-1]
    if width % layers:
        raise ValueError(f"last dimension {width} is not {layers} layers of equal width")
    grouped = x.unflatten(-1, (layers, width // layers))
    amax = grouped.abs().amax(-1).float()  # exact: |x| and max lose nothing
    scale = amax / FP8_MAX
    # zero rows, and amax so small that amax / 448 underflows: scale 1 stores zeros
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    # a copy even of an fp32 x (whose .float() is x itself): x is left as it was
    scaled = grouped.to(torch.float32, copy=True).div_(scale.unsqueeze(-1))
    # |x| / (amax / 448) may land a rounding above 448: saturate instead of NaN
    scaled.clamp_(-FP8_MAX, FP8_MAX)
    return scaled.to(torch.float8_e4m3fn).flatten(-2), scale


def decode(q: torch.Tensor, scale: torch.Tensor,
           dtype: torch.dtype | None = None) -> torch.Tensor:
    """q [..., layers * H] float8_e4m3fn and scale [..., layers] -> [..., layers * H] in
    `dtype` (None: fp32): the product is taken in fp32 (exact up to fp32 rounding),
    then cast once."""
    import torch

    layers = scale.shape[-1]
    width = q.shape[-1]
    if width % layers:
        raise ValueError(f"last dimension {width} is not {layers} layers of equal width")
    if dtype is None or dtype == torch.float32:
        grouped = q.unflatten(-1, (layers, width // layers)).to(torch.float32, copy=True)
        decoded: torch.Tensor = grouped.mul_(scale.float().unsqueeze(-1)).flatten(-2)
        return decoded
    # to a narrower dtype a layer at a time: the fp32 product of one layer is all that is
    # held beside the result (a whole 8B batch's aux in fp32 is 1.6 GB at 32k tokens)
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    part = width // layers
    for layer in range(layers):
        columns = slice(layer * part, (layer + 1) * part)
        product = q[..., columns].to(torch.float32).mul_(scale[..., layer:layer + 1].float())
        out[..., columns] = product
    return out


def is_encoded(handle: Any, name: str) -> bool:
    """Whether tensor `name` in an open safetensors file (`safe_open`) is stored fp8."""
    return bool(handle.get_slice(name).get_dtype() == SAFETENSORS_FP8)


def read_feature(handle: Any, name: str, length: int | None = None,
                 dtype: torch.dtype | None = None) -> torch.Tensor:
    """Tensor `name` [S, W] of an open sample file (`safe_open(..., framework="pt")`),
    its first `length` rows (memory-mapped: only those are read), in `dtype`. Either
    store: an fp8 one is decoded with its scales (to fp32 when `dtype` is None); any
    other is cast to `dtype`, or kept as stored when None."""
    part = handle.get_slice(name)
    rows: torch.Tensor = part[:length] if length is not None else part[:]
    if part.get_dtype() != SAFETENSORS_FP8:
        return rows if dtype is None else rows.to(dtype)
    scales = handle.get_slice(scale_name(name))
    scale: torch.Tensor = scales[:length] if length is not None else scales[:]
    return decode(rows, scale, dtype)


def store_of(config: dict[str, object]) -> str:
    """The store an extraction's extract_config.json records; one written before
    `--store` existed is "dtype"."""
    return str(config.get("store", "dtype"))

"""Does a sample's hidden state depend on what it was batched with? (issue #14)

The extraction packs samples into padded batches (workers/eagle3/extraction/extractor.py). In exact
arithmetic a right-padded causal forward pass gives each sample what it would get alone;
in floating point the kernels round differently for another batch shape, and a
mixture-of-experts target amplifies that: a token whose k-th and (k+1)-th expert scores
nearly tie can switch experts, and the switch propagates to every later layer.

`check_batch_invariance` re-runs N of the samples alone (a batch of one, no padding) and
compares them with the same samples inside the packed batches the extraction builds
(`pack_batches` with the same `batch_tokens`, padded by the same `pad_batch`):
- per decoder layer, the relative difference ||batched - alone|| / ||alone|| of the
  layer's output over the sample's real tokens (Frobenius norm over [tokens, hidden],
  computed in fp32), median and max over the N samples; the same for the final normed
  state (what `hidden_state` holds);
- per MoE layer, the share of tokens whose selected expert SET differs (routing flips);
  layers without a router (dense ones, e.g. DeepSeek's first `first_k_dense_replace`)
  have none;
- the share of loss-mask tokens whose lm_head argmax differs (the token EAGLE-3 learns
  to predict), with logits computed over those tokens only, in chunks.

The routing decision read is the one the model acted on: the router module that the
model itself declares for `router_logits` (`_can_record_outputs`, e.g.
DeepseekV3TopkRouter, Qwen3MoeTopKRouter, MixtralTopKRouter) is hooked, and the integer
tensor in its output — the `topk_indices` / `router_indices` [tokens, k] that the MoE
block hands to its experts — is taken as it is, not recomputed. For DeepSeek V3 these
are the group-limited top-k over sigmoid scores + `e_score_correction_bias`; for
Qwen3-MoE the top-k of the softmax. Where the model declares no `router_logits`
recorder (transformers 5.17's DeepSeek-V3), the module in each layer whose class name
ends in "Router" is taken. A router whose output has no such tensor (e.g. Llama 4's,
which returns scattered scores), or a layer with experts and no router found, is
refused with `CheckError`: the check never reports "no flips" for routing it could not
see.

The remedy that can be measured, `fp32_router=True`, computes the router logits in fp32.
DeepSeek V3's router already does (transformers upcasts its input and weight, and keeps
`gate.weight` and the bias in fp32 when loading), so there it changes nothing;
Qwen3-MoE's and Mixtral's compute them in the model dtype, and with it their logits —
and the routing weights derived from them — come out in fp32. The report names the
dtype the router logits had (`router_logits_dtype`).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from workers.eagle3.extraction.extractor import Sample, pack_batches, pad_batch

LOGIT_CHUNK_TOKENS = 1024  # lm_head rows at a time: 1024 x 129k vocabulary x 4 B = 0.5 GB
FINAL = "final"  # probe key of the final norm's output (layer outputs are keyed by index)


class CheckError(Exception):
    """The check cannot run on this model or these samples; the message says why."""


def pick_samples(batches: Sequence[Sequence[Sample]], n: int) -> list[Sample]:
    """`n` samples spread evenly over the lengths, taken first from batches of two or
    more (a batch of one is already alone: nothing to measure), then from the others;
    all of them when there are no more than `n`."""
    shared = [s for b in batches if len(b) > 1 for s in b]
    single = [s for b in batches if len(b) == 1 for s in b]
    picked = _spread(shared, n)
    return picked + _spread(single, n - len(picked))


def _spread(samples: Sequence[Sample], n: int) -> list[Sample]:
    ordered = sorted(samples, key=lambda s: (len(s.input_ids), s.index))
    if n < 1:
        return []
    if n >= len(ordered):
        return ordered
    if n == 1:
        return [ordered[len(ordered) // 2]]
    return [ordered[round(i * (len(ordered) - 1) / (n - 1))] for i in range(n)]


def routing_flips(batched: torch.Tensor, alone: torch.Tensor) -> torch.Tensor:
    """Per token, whether the selected expert sets differ: [T] bool from two [T, k]
    index tensors (the order within a token's k experts does not count)."""
    return (batched.sort(dim=-1).values != alone.sort(dim=-1).values).any(dim=-1)


def find_routers(decoder: Any) -> dict[int, tuple[torch.nn.Module, int]]:
    """Layer index -> (router module, position of the logits in its output) for each
    layer holding the router the model declares for `router_logits` (matched as
    transformers' own output recorder matches it: by class, or by module-path suffix,
    within `layer_name` when given). Empty for a dense model."""
    from transformers.utils.output_capturing import OutputRecorder

    declared = getattr(decoder, "can_record_outputs", {}).get("router_logits", [])
    recorders: list[_Recorder] = []
    for spec in declared if isinstance(declared, list) else [declared]:
        if isinstance(spec, OutputRecorder):
            recorders.append(_Recorder(spec.target_class, spec.class_name, spec.layer_name,
                                       spec.index))
        elif isinstance(spec, str):  # transformers' defaults for a bare class or name
            recorders.append(_Recorder(None, spec, None, 1))
        else:
            recorders.append(_Recorder(spec, None, None, 1))
    if not recorders:  # older transformers (5.17's DeepSeek-V3) declare none: by class name
        recorders.append(_Recorder(None, None, None, 0, class_suffix="Router"))
    routers: dict[int, tuple[torch.nn.Module, int]] = {}
    for i, layer in enumerate(decoder.layers):
        found = [(module, recorder.logits_at)
                 for name, module in layer.named_modules(prefix=f".layers.{i}")
                 for recorder in recorders if recorder.matches(name, module)]
        if len(found) > 1:
            raise CheckError(f"decoder layer {i} holds {len(found)} routers; one expected")
        if found:
            routers[i] = found[0]
        elif any(name.endswith(".experts") for name, _ in layer.named_modules()):
            raise CheckError(f"decoder layer {i} has experts but no router this check can "
                             "read: its routing flips cannot be counted")
    return routers


@dataclass(frozen=True)
class _Recorder:
    """A `router_logits` entry of `_can_record_outputs`: which modules, and where the
    logits are in their output."""
    target_class: type | None
    class_name: str | None
    layer_name: str | None
    logits_at: int
    class_suffix: str | None = None  # the fallback: a module whose class name ends so

    def matches(self, name: str, module: torch.nn.Module) -> bool:
        """As transformers matches it: by class, else by module-path suffix; within
        `layer_name` when given (`name` is the module's path with a leading dot)."""
        if self.class_suffix is not None:
            return type(module).__name__.endswith(self.class_suffix)
        if self.target_class is not None:
            found = isinstance(module, self.target_class)
        else:
            found = self.class_name is not None and name.endswith(self.class_name)
        if found and self.layer_name is not None:
            return f".{self.layer_name.strip('.')}." in f"{name}."
        return found


@contextmanager
def routers_in_fp32(routers: Iterable[torch.nn.Module]) -> Iterator[None]:
    """Within the block, each router computes in fp32: its floating parameters and
    buffers are widened to fp32 (exact from bf16/fp16) and its floating inputs cast
    with a pre-hook; the original tensors are put back on exit."""
    def widen(_module: Any, args: tuple[Any, ...],
              kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return (tuple(_fp32(a) for a in args), {k: _fp32(v) for k, v in kwargs.items()})

    originals: list[tuple[torch.Tensor, torch.Tensor]] = []
    handles = []
    try:
        for router in routers:
            for tensor in [*router.parameters(), *router.buffers()]:
                if tensor.is_floating_point() and tensor.dtype != torch.float32:
                    originals.append((tensor, tensor.data))
                    tensor.data = tensor.data.float()
            handles.append(router.register_forward_pre_hook(widen, with_kwargs=True))
        yield
    finally:
        for handle in handles:
            handle.remove()
        for tensor, data in originals:
            tensor.data = data


def _fp32(value: Any) -> Any:
    is_float = isinstance(value, torch.Tensor) and value.is_floating_point()
    return value.float() if is_float else value


class _Probe:
    """Forward hooks on every decoder layer, the final norm and each router. During a
    pass over a batch of `shape` (rows, padded length), each hook calls
    `sink(key, tensor [rows, length, ...])`: key = layer index (that layer's output),
    FINAL (the final norm's output) or ("route", layer index) (the selected expert ids
    [rows, length, k])."""

    def __init__(self, decoder: Any, routers: dict[int, tuple[torch.nn.Module, int]]):
        self.sink: Callable[[Any, torch.Tensor], None] = lambda _key, _tensor: None
        self.shape = (0, 0)
        self.router_logits_dtype: torch.dtype | None = None
        self.handles = [layer.register_forward_hook(self._layer(i))
                        for i, layer in enumerate(decoder.layers)]
        self.handles.append(decoder.norm.register_forward_hook(self._final))
        self.handles += [router.register_forward_hook(self._router(i, logits_at))
                         for i, (router, logits_at) in routers.items()]

    def _layer(self, i: int) -> Any:
        def hook(_module: Any, _args: Any, output: Any) -> None:
            self.sink(i, output[0] if isinstance(output, tuple) else output)
        return hook

    def _final(self, _module: Any, _args: Any, output: torch.Tensor) -> None:
        self.sink(FINAL, output)

    def _router(self, i: int, logits_at: int) -> Any:
        def hook(module: Any, _args: Any, output: Any) -> None:
            parts = output if isinstance(output, tuple) else (output,)
            ids = [p for p in parts if isinstance(p, torch.Tensor)
                   and not p.is_floating_point() and p.dtype != torch.bool]
            if not ids:
                raise CheckError(f"{type(module).__name__} (layer {i}) returns no selected "
                                 "expert ids: its routing cannot be read")
            rows, length = self.shape
            if ids[0].numel() % (rows * length):
                raise CheckError(f"{type(module).__name__} (layer {i}): expert ids of shape "
                                 f"{tuple(ids[0].shape)} for a batch of {rows} x {length}")
            self.router_logits_dtype = parts[logits_at].dtype
            self.sink(("route", i), ids[0].reshape(rows, length, -1))
        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


@dataclass
class _Measured:
    """One sample's figures: alone vs in its batch."""
    sample: Sample
    batch_samples: int
    batch_padded_tokens: int
    rel_diff: dict[Any, float] = field(default_factory=dict)  # layer index or FINAL
    flipped_tokens: dict[int, int] = field(default_factory=dict)  # MoE layer index
    argmax_differs: int | None = None  # loss-mask tokens (None without an lm_head)


def check_batch_invariance(decoder: Any, lm_head: Any | None, samples: Sequence[Sample], *,
                           n: int, batch_tokens: int, fp32_router: bool = False
                           ) -> dict[str, Any]:
    """The report (a JSON-able dict, see `format_report`) of `n` of `samples` run alone
    vs inside the packed batches the extraction builds from all of `samples` with
    `batch_tokens`. `decoder` is the text decoder (`layers`, `norm`, the token
    embedding), `lm_head` the output projection or None (then no argmax figure).
    Only the batches holding a chosen sample run. Host memory: the chosen samples of
    one batch keep every layer's output on the CPU until their own pass (layers x
    tokens x hidden in the model dtype: 3.6 GB for 4096 tokens of DeepSeek-V3).
    Raises CheckError when there is nothing to check or a router cannot be read."""
    if n < 1:
        raise CheckError(f"n must be >= 1, not {n}")
    if not samples:
        raise CheckError("no samples to check")
    batches = pack_batches(samples, batch_tokens)
    chosen = {s.index for s in pick_samples(batches, n)}
    routers = find_routers(decoder)
    measured: list[_Measured] = []
    probe = _Probe(decoder, routers)
    with ExitStack() as stack:
        stack.callback(probe.remove)
        if fp32_router:
            stack.enter_context(routers_in_fp32(router for router, _ in routers.values()))
        for batch in batches:
            rows = [row for row, s in enumerate(batch) if s.index in chosen]
            if rows:
                measured += _measure_batch(decoder, lm_head, probe, batch, rows)
    return _report(measured, decoder, batch_tokens, fp32_router, sorted(routers),
                   probe.router_logits_dtype, lm_head is not None)


def _measure_batch(decoder: Any, lm_head: Any | None, probe: _Probe, batch: Sequence[Sample],
                   rows: Sequence[int]) -> list[_Measured]:
    """One pass over the padded batch keeping the chosen rows' states on the CPU, then
    each chosen sample alone, compared layer by layer as its pass goes."""
    longest = max(len(s.input_ids) for s in batch)
    kept: dict[int, dict[Any, torch.Tensor]] = {row: {} for row in rows}
    argmax: dict[int, torch.Tensor] = {}

    def keep(key: Any, tensor: torch.Tensor) -> None:
        for row in rows:
            state = tensor[row, :len(batch[row].input_ids)]
            kept[row][key] = state.to("cpu", copy=True)
            if key == FINAL and lm_head is not None:
                argmax[row] = _loss_argmax(lm_head, state, batch[row])

    _forward(decoder, probe, batch, keep)
    results = []
    for row in rows:
        sample = batch[row]
        result = _Measured(sample, len(batch), len(batch) * longest)

        def compare(key: Any, tensor: torch.Tensor, row: int = row,
                    result: _Measured = result) -> None:
            alone = tensor[0]
            batched = kept[row].pop(key).to(alone.device)
            if isinstance(key, tuple):
                result.flipped_tokens[key[1]] = int(routing_flips(batched, alone).sum())
                return
            result.rel_diff[key] = _rel_diff(batched, alone)
            if key == FINAL and lm_head is not None:
                differs = _loss_argmax(lm_head, alone, result.sample) != argmax[row]
                result.argmax_differs = int(differs.sum())

        _forward(decoder, probe, [sample], compare)
        results.append(result)
    return results


def _forward(decoder: Any, probe: _Probe, batch: Sequence[Sample],
             sink: Callable[[Any, torch.Tensor], None]) -> None:
    ids, attention = pad_batch(batch)
    device = decoder.get_input_embeddings().weight.device
    probe.sink, probe.shape = sink, (ids.shape[0], ids.shape[1])
    with torch.inference_mode():
        decoder(input_ids=ids.to(device), attention_mask=attention.to(device), use_cache=False)


def _rel_diff(batched: torch.Tensor, alone: torch.Tensor) -> float:
    diff = torch.linalg.vector_norm(batched.float() - alone.float())
    return float(diff / torch.linalg.vector_norm(alone.float()))


def _loss_argmax(lm_head: Any, states: torch.Tensor, sample: Sample) -> torch.Tensor:
    """lm_head argmax [loss tokens] on the CPU, from a sample's final states [S, H],
    over its loss-mask positions only, LOGIT_CHUNK_TOKENS rows at a time."""
    positions = torch.tensor(sample.loss_mask, dtype=torch.bool).nonzero().squeeze(-1)
    chosen = states[positions.to(states.device)].to(lm_head.weight.device)
    ids = [lm_head(chunk).argmax(dim=-1).cpu() for chunk in chosen.split(LOGIT_CHUNK_TOKENS)]
    return torch.cat(ids) if ids else torch.empty(0, dtype=torch.long)


def _report(measured: list[_Measured], decoder: Any, batch_tokens: int, fp32_router: bool,
            moe_layers: list[int], router_logits_dtype: torch.dtype | None,
            has_lm_head: bool) -> dict[str, Any]:
    tokens = sum(len(m.sample.input_ids) for m in measured)
    layers = []
    for i in range(len(decoder.layers)):
        diffs = [m.rel_diff[i] for m in measured]
        entry: dict[str, Any] = {"layer": i, "moe": i in moe_layers,
                                 "rel_diff_median": statistics.median(diffs),
                                 "rel_diff_max": max(diffs),
                                 "routing_flip_share": None, "routing_flip_share_max": None}
        if i in moe_layers:
            entry["routing_flip_share"] = sum(m.flipped_tokens[i] for m in measured) / tokens
            entry["routing_flip_share_max"] = max(
                m.flipped_tokens[i] / len(m.sample.input_ids) for m in measured)
        layers.append(entry)
    finals = [m.rel_diff[FINAL] for m in measured]
    loss_tokens = sum(sum(m.sample.loss_mask) for m in measured)
    argmax_differs = sum(m.argmax_differs or 0 for m in measured)
    return {
        "dtype": _dtype_name(decoder.get_input_embeddings().weight.dtype),
        "n": len(measured), "batch_tokens": batch_tokens, "fp32_router": fp32_router,
        "router_logits_dtype": _dtype_name(router_logits_dtype),
        "moe_layers": moe_layers, "tokens": tokens, "loss_tokens": loss_tokens,
        "layers": layers,
        "final": {"rel_diff_median": statistics.median(finals), "rel_diff_max": max(finals)},
        "argmax_differs_share": (argmax_differs / loss_tokens
                                 if has_lm_head and loss_tokens else None),
        "samples": [{
            "index": m.sample.index, "id": m.sample.id, "tokens": len(m.sample.input_ids),
            "loss_tokens": sum(m.sample.loss_mask), "batch_samples": m.batch_samples,
            "batch_padded_tokens": m.batch_padded_tokens,
            "layer_rel_diff": [m.rel_diff[i] for i in range(len(decoder.layers))],
            "final_rel_diff": m.rel_diff[FINAL],
            "routing_flipped_tokens": {str(i): m.flipped_tokens[i] for i in moe_layers},
            "argmax_differs": m.argmax_differs,
        } for m in sorted(measured, key=lambda m: m.sample.index)],
    }


def _dtype_name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


def format_report(report: dict[str, Any]) -> str:
    """The report as a plain-text table for the log."""
    router = ("" if report["router_logits_dtype"] is None
              else f", router logits {report['router_logits_dtype']}")
    lines = [f"batch invariance: {report['n']} sample(s) alone vs in their packed batches "
             f"({report['dtype']}, batch_tokens {report['batch_tokens']}{router})",
             f"{'layer':>5}  {'rel diff median':>15}  {'rel diff max':>12}  "
             f"{'routing flips':>13}  {'worst sample':>12}"]
    for entry in report["layers"]:
        flips = worst = "-"
        if entry["moe"]:
            flips = f"{100 * entry['routing_flip_share']:.2f} %"
            worst = f"{100 * entry['routing_flip_share_max']:.2f} %"
        lines.append(f"{entry['layer']:>5}  {entry['rel_diff_median']:>15.2e}  "
                     f"{entry['rel_diff_max']:>12.2e}  {flips:>13}  {worst:>12}")
    final = report["final"]
    lines.append(f"{'final':>5}  {final['rel_diff_median']:>15.2e}  "
                 f"{final['rel_diff_max']:>12.2e}")
    if report["argmax_differs_share"] is not None:
        lines.append(f"lm_head argmax differs on {100 * report['argmax_differs_share']:.2f} % "
                     f"of {report['loss_tokens']} loss-mask tokens")
    lines.append("samples (tokens, in a batch of samples x padded length): " + ", ".join(
        f"{s['id']} ({s['tokens']}, {s['batch_samples']} x "
        f"{s['batch_padded_tokens'] // s['batch_samples']})" for s in report["samples"]))
    return "\n".join(lines)

"""Batched decoding with a static KV cache: the transformers backend's fast path for
targets of the Llama layout (Llama, Qwen2, Qwen3: pre-norm decoder layers of grouped-query
attention with rotary positions, and a gated MLP).

transformers' `generate` grows its cache a step at a time and runs every layer's Python
every step: SmolLM2-135M's decode step at batch 2,048 took 80 ms on an H200
(docs/benchmarks.md), ~25,000 new tokens/s, where reading its weights and cache takes a
few ms. Here the cache is allocated once per batch (prompt and answer length), every
decode step of a window has the same shapes, and on CUDA the step is captured as a CUDA
graph once per window and replayed: the per-step cost is the GPU's work, not Python's.
A window is the cache's first slots that a stretch of `WINDOW_TOKENS` steps reads (the
prompt and the answer so far, rounded up): a step reads those, not the whole cache. Where
a window starts, rows that have stopped are dropped once they are `COMPACT_SHARE` of the
batch, so a batch does not run at full size until its longest answer ends. Each graph's
first replay is checked against the same step run eagerly; a capture that fails or a
replay that differs is logged, and the steps run eagerly from then on. On CUDA the
attention runs on PyTorch's memory-efficient kernel (else its math kernel), not cuDNN's:
one kernel known to take a boolean mask broadcast over the query heads.

The model's own modules do the arithmetic (its embeddings, norms, projections, MLPs,
rotary table and head); this module owns the cache, the masks and the loop. Queries are
grouped by their key-value head, so grouped-query attention reads the cache as it is,
without repeating it per query head. Left-padded rows: a row's pad slots are masked out
of every attention, and its positions count from its first real token, as `generate`
counts them.

Greedy answers match `generate`'s up to floating-point near-ties (tests compare them on
a real tokenizer and a tiny Llama); sampled ones draw from softmax(logits / T) restricted
to the top-p nucleus, from a seeded generator: the same seed gives the same samples here,
not `generate`'s (its `multinomial` draws the same way, but the batch here shrinks)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections.abc import Collection, Sequence
from typing import Any

import torch
from torch.nn import functional
from torch.nn.attention import SDPBackend, sdpa_kernel

from workers.eagle3.draft.model import rotate_half

log = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3"})
"""`config.model_type`s whose decoder layers this module runs (the Llama layout)."""

PREFILL_TOKENS = 65_536
"""Prompt tokens per prefill chunk (rows x padded length, at least one row): bounds the
prefill's activations, whatever the batch."""

GRAPH_TOLERANCE = 0.03
"""How far (relative to the largest logit) a CUDA graph's first step may differ from the
same step run eagerly: the same kernels on the same inputs agree to a few bf16 roundings
(bf16 keeps 8 significant bits: 0.0078 relative)."""

CUDA_ATTENTION = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
"""The attention kernels allowed on CUDA, in PyTorch's order of preference."""

WINDOW_TOKENS = 32
"""Decode steps per window: the cache slots a step reads grow by this many at a time (one
graph each: 8 for 256 new tokens, which read ~30 % less cache than the whole at a
128-token prompt width), and where stopped rows may be dropped (`COMPACT_SHARE`). 64
dropped them too late for self prompts: 1.1 times `generate`'s speed on CPU, 1.5 with 32
(and with 16)."""

COMPACT_SHARE = 0.25
"""At the start of a window, the rows that have stopped are dropped from the batch once
they are this share of it: the steps after it cost in proportion to the rows left (a
batch runs until its longest answer ends; self prompts end after ~40 tokens of 128)."""

CACHE_SHARE = 0.8
"""Share of the device's free memory (its free bytes plus what PyTorch holds unused) a
batch's KV cache and per-row step buffers may take: a batch larger than that is decoded
in parts of as many rows as fit (`rows_that_fit`), where it would fail at the allocation
and fall back to ever smaller batches (batch 4,096 x 1,024 new tokens asks ~108 GB of
cache of SmolLM2)."""

NUCLEUS_CANDIDATES = 1024
"""Top-p sampling without a top-k draws its nucleus from the this many most likely
tokens (`topk`, not a sort of the whole vocabulary each step: 152k for Qwen), with their
probabilities over the whole vocabulary. A nucleus that would need more tokens than
this is cut there; at a top-p below 1 the tokens past the first thousand carry next to
nothing."""

DONE_CHECK_EVERY = 8
"""Decode steps between checks whether every row has stopped (each check waits for the
GPU)."""


@dataclasses.dataclass(frozen=True)
class Sampling:
    """Sampled decoding: softmax(logits / temperature) over the `top_k` most likely tokens
    (0: all), restricted to the smallest set of them whose probability reaches `top_p`,
    drawn with a generator seeded by `seed` (transformers' warpers, in their order)."""

    temperature: float
    top_p: float = 1.0
    seed: int = 0
    top_k: int = 0

    def __post_init__(self) -> None:
        if not self.temperature > 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"sampling needs a temperature > 0 and a top-p in (0, 1], not "
                             f"{self.temperature} and {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"sampling needs a top-k >= 0 (0: all tokens), not {self.top_k}")


def unsupported_reason(model: Any) -> str | None:
    """Why `StaticDecoder` cannot run `model` (None: it can)."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return (f"its model type is {model_type!r}; the static decoder runs "
                f"{', '.join(sorted(SUPPORTED_MODEL_TYPES))}")
    if getattr(config, "use_sliding_window", False):
        return "it uses sliding-window attention"
    rope = getattr(config, "rope_scaling", None) or getattr(config, "rope_parameters", None)
    rope_type = (rope or {}).get("rope_type", (rope or {}).get("type", "default"))
    if rope_type in ("dynamic", "longrope"):
        return f"its rotary scaling ({rope_type}) depends on the sequence's length"
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not layers or getattr(model, "lm_head", None) is None:
        return "it has no decoder layers or head where a causal LM keeps them"
    attention = getattr(layers[0], "self_attn", None)
    if not all(hasattr(attention, name) for name in ("q_proj", "k_proj", "v_proj", "o_proj")):
        return "its attention does not have separate q, k, v and o projections"
    return None


class StaticDecoder:
    """Decodes batches of token rows with `model` (`unsupported_reason` must be None)."""

    def __init__(self, model: Any, *, prefill_tokens: int = PREFILL_TOKENS,
                 window_tokens: int = WINDOW_TOKENS):
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"the static decoder cannot run this model: {reason}")
        config = model.config
        self.model, self.prefill_tokens, self.window_tokens = model, prefill_tokens, \
            window_tokens
        self.layers = list(model.model.layers)
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = (getattr(config, "head_dim", None)
                         or config.hidden_size // config.num_attention_heads)
        self.scale = getattr(self.layers[0].self_attn, "scaling", self.head_dim ** -0.5)
        weight = model.lm_head.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.graphs_failed = False
        """A capture failed, or a replay differed from the eager step: no more graphs
        (the generate worker reports it as its `graph_fallback` metric)."""
        self.vocab = int(model.lm_head.out_features)

    def row_bytes(self, slots: int, sampled: bool) -> int:
        """Device bytes one row of a batch of `slots` cache slots takes: its keys and
        values in every layer, and its step buffers (the logits, and sampling's fp32
        copies of them)."""
        cache = 2 * len(self.layers) * self.kv_heads * slots * self.head_dim \
            * self.dtype.itemsize
        logits = self.vocab * (self.dtype.itemsize * 2 + (12 if sampled else 0))
        return cache + logits

    def rows_that_fit(self, slots: int, sampled: bool) -> int | None:
        """How many rows of `slots` cache slots fit in `CACHE_SHARE` of the device's free
        memory; None where that is not known (a CPU)."""
        if self.device.type != "cuda":
            return None
        free, _ = torch.cuda.mem_get_info(self.device)
        unused = torch.cuda.memory_reserved(self.device) \
            - torch.cuda.memory_allocated(self.device)
        return max(1, int(CACHE_SHARE * (free + unused)) // self.row_bytes(slots, sampled))

    def generate(self, rows: Sequence[Sequence[int]], *, max_new_tokens: int,
                 stop_ids: Collection[int], sampling: Sampling | None = None,
                 max_rows: int | None = None) -> list[list[int]]:
        """Each row's new tokens: up to and including its first stop token, else
        `max_new_tokens` of them. Greedy unless `sampling`. Rows beyond what fits in the
        device's memory (`rows_that_fit`), or beyond `max_rows`, are decoded in parts,
        one after another (a part's samples seeded apart from the others')."""
        if not rows or max_new_tokens <= 0:
            return [[] for _ in rows]
        if any(len(row) == 0 for row in rows):
            raise ValueError("every row needs at least one prompt token")
        fit = self.rows_that_fit(max(map(len, rows)) + max_new_tokens, sampling is not None)
        part = min(n for n in (len(rows), fit, max_rows) if n is not None)
        if part < len(rows):
            log.info("decoding %d rows in parts of %d: the KV cache of all of them would "
                     "not fit in the device's free memory", len(rows), part)
        kernels = sdpa_kernel(CUDA_ATTENTION) if self.device.type == "cuda" \
            else contextlib.nullcontext()
        out: list[list[int]] = []
        with torch.inference_mode(), kernels:
            for start in range(0, len(rows), part):
                seeded = sampling if sampling is None or start == 0 else \
                    dataclasses.replace(sampling, seed=sampling.seed + start * 1_000_003)
                out += _Batch(self, rows[start:start + part], max_new_tokens, stop_ids,
                              seeded).run()
        return out


class _Batch:
    """One `generate` call's buffers: cache, masks, the step's inputs and outputs."""

    def __init__(self, decoder: StaticDecoder, rows: Sequence[Sequence[int]],
                 max_new_tokens: int, stop_ids: Collection[int], sampling: Sampling | None):
        self.decoder, self.sampling = decoder, sampling
        self.max_new_tokens = max_new_tokens
        device, d = decoder.device, decoder
        self.rows, self.prompt_width = len(rows), max(map(len, rows))
        self.slots = self.prompt_width + max_new_tokens
        # built on the host and copied once: a copy per row is thousands of small ones
        prompt = torch.zeros(self.rows, self.prompt_width, dtype=torch.long)
        valid = torch.zeros(self.rows, self.slots, dtype=torch.bool)
        for i, row in enumerate(rows):
            prompt[i, self.prompt_width - len(row):] = torch.tensor(row)
            valid[i, self.prompt_width - len(row):self.prompt_width] = True
        self.prompt, self.valid = prompt.to(device), valid.to(device)
        self.lengths = self.valid.sum(dim=1)  # each row's prompt tokens
        shape = (len(d.layers), self.rows, d.kv_heads, self.slots, d.head_dim)
        self.keys = torch.zeros(shape, dtype=d.dtype, device=device)
        self.values = torch.zeros(shape, dtype=d.dtype, device=device)
        positions = torch.arange(self.slots, device=device)[None]
        probe = torch.zeros(1, 1, dtype=d.dtype, device=device)
        cos, sin = d.model.model.rotary_emb(probe, positions)
        self.cos, self.sin = cos[0], sin[0]  # [slots, head_dim]: position -> rotation
        self.stop_ids = torch.tensor(sorted(stop_ids), dtype=torch.long, device=device)
        # the decode step's inputs and output, fixed tensors a CUDA graph replays over
        self.token = torch.zeros(self.rows, dtype=torch.long, device=device)
        self.position = torch.zeros(self.rows, dtype=torch.long, device=device)
        self.slot = torch.zeros(1, dtype=torch.long, device=device)
        # the head's dtype: greedy's argmax is the same in it (its float32 is exact)
        self.logits = torch.zeros(self.rows, d.model.lm_head.out_features, dtype=d.dtype,
                                  device=device)
        self.steps: dict[int, Any] = {}
        """Window -> how its decode step runs: a graph's replay, or `_step` eagerly."""
        self.graph_pool: Any = None
        """The memory pool the batch's graphs share (they never run at once)."""
        self.generator = None
        if sampling is not None:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(sampling.seed)

    # -- the model, layer by layer ------------------------------------------------------

    def _attention(self, layer: Any, hidden: torch.Tensor, positions: torch.Tensor,
                   index: int, write: slice | torch.Tensor, mask: torch.Tensor,
                   rows: slice) -> torch.Tensor:
        """One layer's attention for `hidden` [rows, S, H] at `positions` [rows, S]: its
        keys and values written to the cache at `write` (a slice of slots, or the step's
        slot tensor), queries attending over the slots `mask` [rows, 1, S, slots'] allows."""
        d, attention = self.decoder, layer.self_attn
        count, steps = hidden.shape[:2]
        group = d.heads // d.kv_heads

        def heads(projection: Any, number: int, norm: Any) -> torch.Tensor:
            x: torch.Tensor = projection(hidden).view(count, steps, number, d.head_dim)
            normed: torch.Tensor = x if norm is None else norm(x)
            return normed.transpose(1, 2)

        query = heads(attention.q_proj, d.heads, getattr(attention, "q_norm", None))
        key = heads(attention.k_proj, d.kv_heads, getattr(attention, "k_norm", None))
        value = heads(attention.v_proj, d.kv_heads, None)
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]
        query = query * cos + rotate_half(query) * sin
        key = key * cos + rotate_half(key) * sin
        if isinstance(write, slice):
            self.keys[index, rows, :, write] = key
            self.values[index, rows, :, write] = value
            keys, values = key, value
        else:
            self.keys[index].index_copy_(2, write, key)
            self.values[index].index_copy_(2, write, value)
            window = mask.shape[-1]  # the slots this step reads
            keys, values = self.keys[index, :, :, :window], self.values[index, :, :, :window]
        # query head h reads key-value head h // group: group the queries by it
        grouped = query.reshape(count, d.kv_heads, group * steps, d.head_dim)
        out = functional.scaled_dot_product_attention(
            grouped, keys, values, attn_mask=mask, scale=d.scale)
        # [count, kv, group * steps, dim] -> [count, steps, heads * dim], whatever the
        # kernel's output layout (CUDA's memory-efficient kernel returns a transposed one)
        out = out.unflatten(2, (group, steps)).permute(0, 3, 1, 2, 4)
        projected: torch.Tensor = attention.o_proj(out.reshape(count, steps,
                                                               d.heads * d.head_dim))
        return projected

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor,
                 write: slice | torch.Tensor, mask: torch.Tensor, rows: slice) -> torch.Tensor:
        """The last position's logits for `tokens` [rows, S]."""
        model = self.decoder.model
        hidden = model.model.embed_tokens(tokens)
        for index, layer in enumerate(self.decoder.layers):
            hidden = hidden + self._attention(layer, layer.input_layernorm(hidden), positions,
                                              index, write, mask, rows)
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        logits: torch.Tensor = model.lm_head(model.model.norm(hidden[:, -1]))
        return logits

    def _prefill(self) -> None:
        """The prompts through the model in chunks of rows: the cache's first
        `prompt_width` slots, and the first new token's logits."""
        d, width = self.decoder, self.prompt_width
        group = d.heads // d.kv_heads
        chunk = max(1, d.prefill_tokens // width)
        causal = torch.ones(width, width, dtype=torch.bool, device=d.device).tril()
        diagonal = torch.eye(width, dtype=torch.bool, device=d.device)
        for start in range(0, self.rows, chunk):
            rows = slice(start, min(start + chunk, self.rows))
            valid = self.valid[rows, :width]
            # a pad query attends to itself alone: masked rows of all False would be NaN
            mask = (causal[None] & valid[:, None, :]) | diagonal[None]
            mask = mask[:, None].repeat(1, 1, group, 1)  # [rows, 1, group * width, width]
            positions = (valid.cumsum(dim=1) - 1).clamp(min=0)
            self.logits[rows] = self._forward(self.prompt[rows], positions, slice(0, width),
                                              mask, rows)

    def _step(self, window: int) -> None:
        """One decode step for every row: `token` at `position`, written to `slot`,
        attending over the first `window` slots (`slot` among them)."""
        self.valid.index_fill_(1, self.slot, True)
        mask = self.valid[:, None, None, :window]
        self.logits.copy_(self._forward(self.token[:, None], self.position[:, None],
                                        self.slot, mask, slice(None)))

    def _window(self, slot: int) -> int:
        """The window of the step that writes `slot`: the slots up to it, rounded up to
        the end of its stretch of `window_tokens` steps (`WINDOW_TOKENS`)."""
        each = self.decoder.window_tokens
        stretch = (slot - self.prompt_width) // each + 1
        return min(self.slots, self.prompt_width + stretch * each)

    def _decode_step(self, slot: int) -> None:
        """The decode step that writes `slot` (`self.slot` holds it too), through its
        window's graph, captured and checked the first time the window comes."""
        window = self._window(slot)
        run = self.steps.get(window)
        if run is not None:
            run()
            return
        replay = self._graph(window, slot)
        if replay is None:
            self.steps[window] = run = functools.partial(self._step, window)
            run()
        else:
            self.steps[window] = self._checked(replay, window)

    def _graph(self, window: int, slot: int) -> Any:
        """`_step(window)` captured as a CUDA graph (its `replay`), on CUDA; else None,
        as where the capture fails (logged: the steps run eagerly). The warm-up steps
        write the last slot, which no decode step reaches (the last new token is chosen,
        never run), and mark it valid: the mark is undone, and `slot` put back."""
        device = self.decoder.device
        if device.type != "cuda" or self.decoder.graphs_failed:
            return None
        self.slot.fill_(self.slots - 1)
        stream = None
        try:
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._step(window)
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.graph_pool):
                self._step(window)
        except torch.OutOfMemoryError:
            raise  # the batch is too large: the worker's to handle, not the graph's
        except RuntimeError as exc:
            if "out of memory" in str(exc):  # as a capture's end reports it
                raise torch.OutOfMemoryError(str(exc)) from exc
            self.decoder.graphs_failed = True
            log.warning("the decode step could not be captured as a CUDA graph (%s): "
                        "decoding step by step", exc)
            return None
        finally:
            if stream is not None:  # the warm-up's writes, on its stream, come first
                torch.cuda.current_stream(device).wait_stream(stream)
            self.valid[:, self.slots - 1] = False
            self.slot.fill_(slot)
        if self.graph_pool is None:
            self.graph_pool = graph.pool()
        return graph.replay

    def _checked(self, replay: Any, window: int) -> Any:
        """This decode step, run eagerly and then replayed: how the window's steps run
        from here on, `replay` where the two give the same logits, else `_step` (logged,
        and no more graphs)."""
        self._step(window)
        eager = self.logits.clone()  # the head's dtype: fp32 copies at 4,096 x 152k are GBs
        replay()  # the same slot, token and position: the same writes
        scale = float(eager.abs().amax())
        difference = float(eager.sub_(self.logits).abs_().amax())
        if difference <= GRAPH_TOLERANCE * max(1.0, scale):
            return replay
        self.decoder.graphs_failed = True
        log.warning("the CUDA graph's decode step differs from the eager one (logits up to "
                    "%.3g apart): decoding step by step", difference)
        self._step(window)  # the eager step's keys, values and logits again, not the replay's
        return functools.partial(self._step, window)

    def _choose(self) -> torch.Tensor:
        """The next token of every row from `logits`."""
        if self.sampling is None:
            return self.logits.argmax(dim=-1)
        logits = self.logits.float()
        if 0 < self.sampling.top_k < logits.shape[-1]:
            kth = logits.topk(self.sampling.top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        scaled = logits / self.sampling.temperature
        if self.sampling.top_p < 1.0:
            # the nucleus from the most likely tokens only (`NUCLEUS_CANDIDATES`, or the
            # top-k already kept), ranked by `topk`: no sort of the whole vocabulary
            count = min(self.sampling.top_k or NUCLEUS_CANDIDATES, scaled.shape[-1])
            best, order = scaled.topk(count, dim=-1)  # descending
            ranked = (best - torch.logsumexp(scaled, dim=-1, keepdim=True)).exp_()
            before = ranked.cumsum(dim=-1) - ranked  # mass of the tokens ranked above
            ranked = ranked.masked_fill(before >= self.sampling.top_p, 0.0)
            return order.gather(1, self._draw(ranked)[:, None])[:, 0]
        return self._draw(torch.softmax(scaled, dim=-1))

    def _draw(self, weights: torch.Tensor) -> torch.Tensor:
        """One index per row, drawn in proportion to `weights` (rows of them, not
        normalized): the largest weight / Exp(1) wins (`multinomial`'s own way, without
        its checks, which read the whole tensor back to the host every step)."""
        noise = torch.empty_like(weights).exponential_(generator=self.generator)
        return (weights / noise).argmax(dim=-1)

    def _compact(self, live: torch.Tensor) -> None:
        """Go on with the `live` rows only (indices into the current ones, ascending):
        the cache's live rows moved to its front a layer at a time and the cache a view
        of them (no second cache: at batch 4,096 one is tens of GB), the masks and step
        buffers gathered into smaller ones, and the graphs, which read the old buffers,
        dropped (the next windows capture theirs anew)."""
        count = int(live.numel())
        for index in range(self.keys.shape[0]):
            self.keys[index, :count] = self.keys[index].index_select(0, live)
            self.values[index, :count] = self.values[index].index_select(0, live)
        self.keys, self.values = self.keys[:, :count], self.values[:, :count]
        self.valid = self.valid.index_select(0, live)
        self.position = self.position.index_select(0, live)
        self.token = self.token.index_select(0, live)
        self.logits = self.logits.index_select(0, live)
        self.rows = count
        self.steps, self.graph_pool = {}, None

    def run(self) -> list[list[int]]:
        self._prefill()
        device = self.decoder.device
        out = torch.zeros(self.rows, self.max_new_tokens, dtype=torch.long, device=device)
        ended_at = torch.full((self.rows,), self.max_new_tokens, dtype=torch.long,
                              device=device)
        row_of = torch.arange(self.rows, device=device)  # each current row's row in `rows`
        stopped = torch.zeros(self.rows, dtype=torch.bool, device=device)  # current rows
        self.position.copy_(self.lengths)
        self.slot.fill_(self.prompt_width)
        made = 0
        for made in range(1, self.max_new_tokens + 1):
            token = self._choose()
            out[row_of, made - 1] = token
            newly = ~stopped & torch.isin(token, self.stop_ids)
            ended_at[row_of] = torch.where(newly, made, ended_at[row_of])
            stopped |= newly
            if made == self.max_new_tokens or (
                    made % DONE_CHECK_EVERY == 0 and bool(stopped.all())):
                break
            slot = self.prompt_width + made - 1
            if made > 1 and (made - 1) % self.decoder.window_tokens == 0:  # a new window
                live = (~stopped).nonzero()[:, 0]
                if live.numel() == 0:  # the last rows stopped between two done checks
                    break
                if live.numel() <= (1 - COMPACT_SHARE) * self.rows:
                    self._compact(live)
                    row_of, stopped, token = row_of[live], stopped[live], token[live]
            self.token.copy_(token)
            self._decode_step(slot)
            self.position += 1
            self.slot += 1
        kept = ended_at.clamp(max=made).tolist()
        return [tokens[:n] for tokens, n in zip(out[:, :made].tolist(), kept, strict=True)]

"""Greedy speculative decoding of a HF causal LM with an EAGLE-3 draft proposing a chain
of k tokens per target pass, and plain greedy decoding to check it against. Batch 1,
KV caches on both sides. Used by `workers.evaluate`.

One pass, with the context x_0..x_n in the target's KV cache and x_{n+1} (the target's
latest greedy token) not yet run through it:

1. the draft proposes d_1..d_k (below);
2. the target runs [x_{n+1}, d_1..d_k] in one forward pass (KV cache, positions
   n+1..n+k+1), its greedy choices g_0..g_k;
3. accepted a = the longest prefix with d_{j+1} == g_j; emitted: d_1..d_a, then g_a
   (the bonus token), so the output is what greedy decoding of the target gives;
4. the target's cache is cropped back to the a+1 kept positions (`DynamicCache.crop`).

The draft at inference is the draft of training's TTT unroll (`Eagle3Draft.unroll`,
workers/eagle3/draft/model.py), run incrementally:

- step 0 at position t pairs fc(aux_t) (the target's captured layer inputs at t) with
  the embedding of x_{t+1}, RoPE position t, and attends causally to the step-0
  keys/values of positions 0..t. These are kept in a cache: after a pass the positions
  n+1..n+1+a are added, their aux states taken from the target's verification pass and
  their next tokens the emitted ones; the step-0 output at the last position proposes
  d_1;
- step i > 0 at position n feeds the draft's own output hidden state of step i-1 with
  the embedding of d_i, RoPE position n+i, and attends to the step-0 keys at 0..n plus
  the keys of steps 1..i at n (which are dropped after the pass); it proposes d_{i+1}.

Draft ids map to target ids as `id + d2t[id]`.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from workers.eagle3.draft.model import Eagle3Draft, rotate_half


def accept(proposals: Sequence[int], choices: Sequence[int]) -> tuple[int, list[int]]:
    """(accepted, emitted) of one verification pass. `choices[j]` is the target's greedy
    token after the context plus proposals[:j] (one more than the proposals). Accepted:
    the longest prefix of the proposals equal to the choices; emitted: that prefix and
    then the target's own choice at the first mismatch (or after the last proposal)."""
    if len(choices) != len(proposals) + 1:
        raise ValueError(f"{len(proposals)} proposals need {len(proposals) + 1} target "
                         f"choices, got {len(choices)}")
    accepted = 0
    while accepted < len(proposals) and proposals[accepted] == choices[accepted]:
        accepted += 1
    return accepted, [*proposals[:accepted], choices[accepted]]


@dataclass
class Acceptance:
    """Counts over verification passes with chains of k proposals."""

    k: int
    passes: int = 0
    emitted: int = 0
    """Accepted tokens plus one bonus token per pass, counted before the output is cut
    at a stop token or the token budget (the draft's merit, not the prompt's length)."""
    tried: list[int] = field(default_factory=list)
    """tried[i]: passes whose proposals 0..i-1 were all accepted (so i was checked)."""
    accepted: list[int] = field(default_factory=list)
    """accepted[i]: passes whose proposal i was accepted."""

    def __post_init__(self) -> None:
        self.tried = self.tried or [0] * self.k
        self.accepted = self.accepted or [0] * self.k

    def add(self, accepted: int) -> None:
        if not 0 <= accepted <= self.k:
            raise ValueError(f"accepted {accepted} of {self.k} proposals")
        self.passes += 1
        self.emitted += accepted + 1
        for i in range(self.k):
            self.tried[i] += i <= accepted
            self.accepted[i] += i < accepted

    def merge(self, other: Acceptance) -> None:
        if other.k != self.k:
            raise ValueError(f"k {other.k} merged into k {self.k}")
        self.passes += other.passes
        self.emitted += other.emitted
        self.tried = [a + b for a, b in zip(self.tried, other.tried, strict=True)]
        self.accepted = [a + b for a, b in zip(self.accepted, other.accepted, strict=True)]

    @property
    def acceptance_length(self) -> float | None:
        """tau: tokens emitted per target pass (the bonus token included)."""
        return self.emitted / self.passes if self.passes else None

    @property
    def rates(self) -> list[float | None]:
        """Per draft position i: the share of passes that accepted proposal i among
        those that accepted proposals 0..i-1 (None where position i was never tried)."""
        return [a / t if t else None for a, t in zip(self.accepted, self.tried, strict=True)]

    def as_dict(self) -> dict[str, Any]:
        return {"k": self.k, "acceptance_length": self.acceptance_length,
                "acceptance_rate": self.rates, "passes": self.passes,
                "emitted": self.emitted, "tried_by_position": self.tried,
                "accepted_by_position": self.accepted}


# -- the target ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Top2:
    """The two highest logits at one position (how near a tie the greedy choice was)."""

    ids: tuple[int, int]
    logits: tuple[float, float]


@dataclass
class TargetPass:
    choices: list[int]
    """The greedy token after each input position."""
    aux: torch.Tensor
    """[1, m, 3H]: the captured layer inputs at each input position, concatenated."""
    cache: Any
    top2: list[Top2]


class Target:
    """A HF causal LM run on one sequence with its KV cache, capturing the inputs of
    `layers` (`output_hidden_states` index i is the input of decoder layer i)."""

    def __init__(self, model: Any, layers: Sequence[int]):
        self.model = model
        self.layers = [int(i) for i in layers]
        self.device = model.get_input_embeddings().weight.device
        # transformers 5.x renamed `past_key_values` to `cache` (the old name warns)
        parameters = inspect.signature(model.forward).parameters
        self.cache_name = "cache" if "cache" in parameters else "past_key_values"

    def run(self, tokens: Sequence[int], cache: Any = None, *, aux: bool = True,
            last_only: bool = False) -> TargetPass:
        ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.device)
        extra: dict[str, Any] = {"logits_to_keep": 1} if last_only else {}
        extra[self.cache_name] = cache
        out = self.model(input_ids=ids, use_cache=True, output_hidden_states=aux, **extra)
        logits = out.logits[0].float()
        top = logits.topk(2, dim=-1)
        captured = torch.cat([out.hidden_states[i] for i in self.layers], dim=-1) if aux \
            else torch.empty(0)
        ids, values = top.indices.tolist(), top.values.tolist()
        top2 = [Top2((i[0], i[1]), (v[0], v[1])) for i, v in zip(ids, values, strict=True)]
        return TargetPass([i[0] for i in ids], captured, out[self.cache_name], top2)


def stop_index(tokens: Sequence[int], stop_ids: Iterable[int], max_new_tokens: int) -> int:
    """How many of `tokens` a decoder emits: up to and including the first stop token,
    at most max_new_tokens."""
    stops = set(stop_ids)
    for index, token in enumerate(tokens[:max_new_tokens]):
        if token in stops:
            return index + 1
    return min(len(tokens), max_new_tokens)


@dataclass
class Decoded:
    tokens: list[int]
    top2: list[Top2]
    """Per token: the top two logits of the target pass that chose it."""
    acceptance: Acceptance | None = None


@torch.inference_mode()
def greedy_decode(target: Target, prompt: Sequence[int], max_new_tokens: int,
                  stop_ids: Iterable[int]) -> Decoded:
    """Plain greedy decoding, one token per target pass."""
    stops = set(stop_ids)
    step = target.run(prompt, aux=False, last_only=True)
    tokens, top2 = [step.choices[-1]], [step.top2[-1]]
    while len(tokens) < max_new_tokens and tokens[-1] not in stops:
        step = target.run(tokens[-1:], step.cache, aux=False)
        tokens.append(step.choices[-1])
        top2.append(step.top2[-1])
    return Decoded(tokens, top2)


def first_difference(expected: Sequence[int], got: Sequence[int]) -> int | None:
    for index, (a, b) in enumerate(zip(expected, got, strict=False)):
        if a != b:
            return index
    return None if len(expected) == len(got) else min(len(expected), len(got))


def compare(reference: Decoded, decoded: Decoded,
            tie_tolerance: float) -> dict[str, Any] | None:
    """Where `decoded` first differs from plain greedy decoding (None: nowhere), and
    whether a logit near-tie explains it: the token speculative decoding chose is the
    reference pass's own runner-up, and the reference's top two logits and the
    speculative pass's top logit lie within `tie_tolerance` (relative to their magnitude)
    of each other. Mathematically both passes compute the same logits there (the tokens
    before are equal); in bf16 a 1-token and a (k+1)-token pass round differently, and
    a near-tie can flip (on SmolLM2 in bf16, three-way ties at equal bf16 logits occur:
    the speculative pass's runner-up is then a third token). A verification bug (a stale
    or misplaced KV cache) gives other logits altogether."""
    index = first_difference(reference.tokens, decoded.tokens)
    if index is None:
        return None
    found: dict[str, Any] = {
        "position": index, "near_tie": False,
        "expected": reference.tokens[index] if index < len(reference.tokens) else None,
        "got": decoded.tokens[index] if index < len(decoded.tokens) else None,
        "expected_length": len(reference.tokens), "got_length": len(decoded.tokens)}
    if found["expected"] is None or found["got"] is None:
        return found  # the same tokens, one output longer: only a bug does that
    ours, theirs = reference.top2[index], decoded.top2[index]
    logits = [*ours.logits, theirs.logits[0]]
    spread = (max(logits) - min(logits)) / max(1.0, *map(abs, logits))
    found.update(reference_top2=dataclasses.asdict(ours),
                 speculative_top2=dataclasses.asdict(theirs), relative_spread=spread,
                 near_tie=(found["got"] in ours.ids and spread <= tie_tolerance))
    return found



# -- the draft ----------------------------------------------------------------------------

class DraftState:
    """The draft's step-0 keys/values over the accepted context, and the step-0 output
    hidden state at its last position (module docstring)."""

    def __init__(self, draft: Eagle3Draft):
        self.draft = draft
        self.layer = draft.midlayer
        self.keys: torch.Tensor | None = None  # [1, Hkv, T, D], RoPE applied
        self.values: torch.Tensor | None = None
        self.hidden: torch.Tensor | None = None  # [1, 1, H]
        self.d2t: torch.Tensor = draft.get_buffer("d2t")
        self.device = self.d2t.device

    @property
    def length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def _project(self, embeds: torch.Tensor, hidden: torch.Tensor,
                 positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        layer, attn = self.layer, self.layer.self_attn
        x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(hidden)], dim=-1)
        batch, length, _ = x.shape
        q = attn.q_proj(x).view(batch, length, attn.heads, attn.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(batch, length, attn.kv_heads, attn.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(batch, length, attn.kv_heads, attn.head_dim).transpose(1, 2)
        cos, sin = self.draft.rope(positions)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v

    def _finish(self, hidden: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        layer = self.layer
        batch, _, length, _ = attended.shape
        hidden = hidden + layer.self_attn.o_proj(attended.transpose(1, 2).reshape(batch,
                                                                                  length, -1))
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, scale=1.0 / math.sqrt(q.shape[-1]),
            enable_gqa=q.shape[1] != keys.shape[1])

    def extend(self, aux: torch.Tensor, next_tokens: Sequence[int]) -> None:
        """Step 0 over m new context positions: aux [1, m, 3H] from the target, and the
        token that follows each position."""
        start, length = self.length, aux.shape[1]
        if len(next_tokens) != length:
            raise ValueError(f"{length} positions need {length} next tokens")
        ids = torch.tensor([list(next_tokens)], dtype=torch.long, device=self.device)
        hidden = self.draft.fc(aux)
        positions = torch.arange(start, start + length, device=self.device)
        q, k, v = self._project(self.draft.embed_tokens(ids), hidden, positions)
        self.keys = k if self.keys is None else torch.cat([self.keys, k], dim=2)
        self.values = v if self.values is None else torch.cat([self.values, v], dim=2)
        causal = torch.ones(length, start + length, dtype=torch.bool,
                            device=self.device).tril(diagonal=start)
        hidden = self._finish(hidden, self._attend(q, self.keys, self.values, causal))
        self.hidden = hidden[:, -1:]

    def _propose_token(self, hidden: torch.Tensor) -> int:
        draft_id = int(self.draft.logits(hidden)[0, -1].argmax())
        return draft_id + int(self.d2t[draft_id])

    def propose(self, k: int) -> list[int]:
        """k target token ids: the step-0 proposal, then k-1 chained steps."""
        if self.hidden is None or self.keys is None or self.values is None:
            raise RuntimeError("extend the draft with the prompt first")
        position = self.length - 1
        hidden, keys, values = self.hidden, self.keys, self.values
        proposals = [self._propose_token(hidden)]
        for i in range(1, k):
            ids = torch.tensor([[proposals[-1]]], dtype=torch.long, device=self.device)
            q, own_k, own_v = self._project(self.draft.embed_tokens(ids), hidden,
                                            torch.tensor([position + i], device=self.device))
            keys, values = torch.cat([keys, own_k], dim=2), torch.cat([values, own_v], dim=2)
            hidden = self._finish(hidden, self._attend(q, keys, values, None))
            proposals.append(self._propose_token(hidden))
        return proposals


def crop(cache: Any, tokens_to_remove: int) -> None:
    """Drop the newest tokens of a HF cache. A negative argument means "remove" both in
    transformers 5 (where a positive one is refused) and before (where it was a length)."""
    if tokens_to_remove > 0:
        cache.crop(-tokens_to_remove)


class Proposer(Protocol):
    """What speculative decoding needs of a draft (`DraftState` is the real one)."""

    def extend(self, aux: torch.Tensor, next_tokens: Sequence[int]) -> None: ...

    def propose(self, k: int) -> list[int]: ...


@torch.inference_mode()
def speculative_decode(target: Target, proposer: Proposer, prompt: Sequence[int], k: int,
                       max_new_tokens: int, stop_ids: Iterable[int]) -> Decoded:
    """Greedy speculative decoding (module docstring) with a fresh proposer (e.g.
    `DraftState(draft)`); the output is cut as `greedy_decode` cuts it."""
    stops = set(stop_ids)
    acceptance = Acceptance(k)
    prefill = target.run(prompt)
    cache, tokens, top2 = prefill.cache, [prefill.choices[-1]], [prefill.top2[-1]]
    proposer.extend(prefill.aux, [*prompt[1:], tokens[0]])
    while len(tokens) < max_new_tokens and not stops.intersection(tokens):
        proposals = proposer.propose(k)
        verify = target.run([tokens[-1], *proposals], cache)
        accepted, emitted = accept(proposals, verify.choices)
        acceptance.add(accepted)
        crop(verify.cache, k - accepted)
        proposer.extend(verify.aux[:, :accepted + 1], emitted)
        cache = verify.cache
        tokens += emitted
        top2 += verify.top2[:accepted + 1]
    end = stop_index(tokens, stops, max_new_tokens)
    return Decoded(tokens[:end], top2[:end], acceptance)

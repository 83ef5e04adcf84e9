"""The EAGLE-3 draft model, laid out as SGLang's `LlamaForCausalLMEagle3` (so SGLang and
vLLM load what `workers.train` saves), and its training-time-test (TTT) unroll.

    h_0   = fc(aux)                                  aux: the target's 3 layers, [B, L, 3H]
    x     = concat(input_layernorm(embed(token)), hidden_norm(h))          [B, L, 2H]
    h'    = h + o_proj(attention(q/k/v_proj(x)))                   residual on h, not x
    h_out = h' + mlp(post_attention_layernorm(h'))
    logits = lm_head(norm(h_out))                                    [.., draft_vocab]

TTT step i (0-based) at position t pairs the hidden state of step i-1 at t (step 0:
fc(aux_t)) with the embedding of the ground-truth token x_{t+1+i}; its RoPE position is
t + i, as at inference where each drafted token takes the next position. Attention at
step i, position t, sees:

- the step-0 keys/values at positions 0..t (causal), and
- the keys/values of steps 1..i at the same position t (its own earlier drafts),

which is Figure 6 of the EAGLE-3 paper and what a drafted token sees at inference. The
authors' training code and SpecForge's additionally hide the step-0 keys at t-i+1..t
from step i (a shifted diagonal mask); we do not (questioned in SafeAILab/EAGLE#247,
dropped by the open sgl-project/SpecForge#245).

How that attention is computed, exactly and with stock kernels: the keys of steps 1..i
differ per query, which no fused attention kernel takes. So the per-query scores
s_j = q_t . k_j[t] are computed outside (an einsum) and appended to the query as i extra
head dimensions; i "sink" keys are prepended whose vectors are one-hot in those extra
dimensions, so q' . sink_j = s_j; their values are one-hot too, so the output's extra
dimensions are the softmax weights w_j the sinks received, and the final output is
out[:D] + sum_j w_j * v_j[t]. With i dummy query rows prepended, a plain square causal
mask shows every query all sinks plus its step-0 prefix: one `scaled_dot_product_
attention(is_causal=True)` per step (a fused kernel on a GPU: cuDNN's on an H200 with
GQA), no dense mask, no [L, L] scores kept for the backward pass. The extra head
dimensions are padded to a multiple of 8 (head_dim 128 -> 136).
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from torch.utils.checkpoint import checkpoint

from workers.eagle3.draft import serving

log = logging.getLogger("workers.eagle3.draft.model")

ARCHITECTURE = "LlamaForCausalLMEagle3"


@dataclass
class DraftConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    """The target's vocabulary (rows of the frozen embedding, length of t2d)."""
    draft_vocab_size: int
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 4096
    rope: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default",
                                                          "rope_theta": 10000.0})
    """`rope_parameters` as transformers 5 writes them: rope_type, rope_theta, scaling."""
    aux_layer_ids: list[int] = field(default_factory=list)
    """The target layers the draft is fed, as layer *inputs* (HF `hidden_states`
    indices, what `workers.extract` captures); written in both engines' conventions
    (`workers.eagle3.draft.serving.config_layer_entries`). Empty: the engines' default."""
    token_ids: dict[str, Any] = field(default_factory=dict)
    """bos/eos/pad token ids, copied from the target into config.json."""

    @classmethod
    def from_hf(cls, hf: dict[str, Any], *, draft_vocab_size: int | None = None,
                aux_layer_ids: list[int] | None = None,
                target_num_layers: int | None = None) -> DraftConfig:
        """From a target's (or a saved draft's) config.json; a multimodal config's
        `text_config` is used when there is one. A draft's layer ids are read in either
        convention (`workers.eagle3.draft.serving.trained_layer_inputs`); without any, they are the
        engines' default for `target_num_layers` (empty when that is not given)."""
        text = hf.get("text_config") or hf
        heads = int(text["num_attention_heads"])
        hidden = int(text["hidden_size"])
        if aux_layer_ids is None:
            aux_layer_ids = stated_layer_inputs(hf, target_num_layers)
        return cls(
            hidden_size=hidden, intermediate_size=int(text["intermediate_size"]),
            num_attention_heads=heads,
            num_key_value_heads=int(text.get("num_key_value_heads") or heads),
            head_dim=int(text.get("head_dim") or hidden // heads),
            vocab_size=int(text["vocab_size"]),
            draft_vocab_size=int(draft_vocab_size or hf.get("draft_vocab_size")
                                 or text["vocab_size"]),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-5)),
            max_position_embeddings=int(text.get("max_position_embeddings", 4096)),
            rope=rope_parameters(text),
            aux_layer_ids=[int(i) for i in aux_layer_ids],
            token_ids={k: text[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
                       if text.get(k) is not None})

    def to_hf(self, torch_dtype: str) -> dict[str, Any]:
        """config.json for SGLang/vLLM: rope as `rope_theta` + `rope_scaling` (what both
        read; transformers 5 folds them back into `rope_parameters`); the layer ids under
        both keys (inputs at the top level for vLLM, inputs - 1 nested for SGLang); no
        `n_predict` (vLLM would then require it to divide `num_speculative_tokens`)."""
        scaling = {k: v for k, v in self.rope.items() if k != "rope_theta"}
        layers = serving.config_layer_entries(self.aux_layer_ids) if self.aux_layer_ids \
            else {serving.NESTED_KEY: {}}
        return {
            "architectures": [ARCHITECTURE], "model_type": "llama",
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "num_hidden_layers": 1, "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size, "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope["rope_theta"],
            "rope_scaling": None if scaling.get("rope_type", "default") == "default"
            else scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": torch_dtype,
            **self.token_ids,
            **layers,
            serving.NESTED_KEY: {**layers[serving.NESTED_KEY], "use_aux_hidden_state": True},
        }


def stated_layer_inputs(hf: dict[str, Any], target_num_layers: int | None) -> list[int]:
    """The layer inputs a draft config names (either convention), else the engines'
    default for `target_num_layers`, else []."""
    nested = (hf.get(serving.NESTED_KEY) or {}).get(serving.TOP_LEVEL_KEY)
    if hf.get(serving.TOP_LEVEL_KEY) or nested or target_num_layers:
        return serving.trained_layer_inputs(hf, int(target_num_layers or 0))
    return []


def rope_parameters(config: dict[str, Any]) -> dict[str, Any]:
    """Normalize the two spellings: transformers 5's `rope_parameters`, or the older
    `rope_theta` + `rope_scaling` (where `type` was once the key for `rope_type`)."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        rope = dict(params)
    else:
        rope = dict(config.get("rope_scaling") or {})
        rope["rope_theta"] = float(config.get("rope_theta", 10000.0))
    rope["rope_type"] = rope.pop("type", None) or rope.get("rope_type") or "default"
    return rope


def rope_inverse_frequencies(config: DraftConfig) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim/2], cos/sin scaling) as the target computes them; scaled
    variants (llama3, linear, yarn, ...) go through transformers' own functions."""
    rope = config.rope
    dim = config.head_dim
    if rope["rope_type"] == "default":
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        return 1.0 / (float(rope["rope_theta"]) ** exponents), 1.0
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = LlamaConfig(hidden_size=config.hidden_size, head_dim=dim,
                     num_attention_heads=config.num_attention_heads,
                     max_position_embeddings=config.max_position_embeddings,
                     rope_parameters=dict(rope))
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf, None)
    return inv_freq.float().cpu(), float(scaling)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def ttt_attention(q: torch.Tensor, cache: list[tuple[torch.Tensor, torch.Tensor]],
                  scale: float) -> torch.Tensor:
    """Attention of step i = len(cache) - 1 (module docstring). q: [B, Hq, L, D];
    cache[j] = (k_j, v_j), each [B, Hkv, L, D], RoPE applied. Returns [B, Hq, L, D]."""
    k0, v0 = cache[0]
    gqa = q.shape[1] != k0.shape[1]
    if len(cache) == 1:
        return F.scaled_dot_product_attention(q, k0, v0, is_causal=True, scale=scale,
                                              enable_gqa=gqa)
    batch, heads, length, dim = q.shape
    kv_heads = k0.shape[1]
    extra = len(cache) - 1
    width = -(-extra // 8) * 8
    grouped = q.view(batch, kv_heads, heads // kv_heads, length, dim)
    own_k = torch.stack([k for k, _ in cache[1:]], dim=3)  # [B, Hkv, L, i, D]
    own_v = torch.stack([v for _, v in cache[1:]], dim=3)
    own_scores = torch.einsum("bhgld,bhljd->bhglj", grouped, own_k)
    own_scores = own_scores.reshape(batch, heads, length, extra)
    q_aug = torch.cat([q, own_scores, q.new_zeros(batch, heads, length, width - extra)], -1)
    q_aug = torch.cat([q_aug.new_zeros(batch, heads, extra, dim + width), q_aug], dim=2)
    sink = torch.cat([q.new_zeros(extra, dim), torch.eye(extra, width, dtype=q.dtype,
                                                         device=q.device)], dim=-1)
    sink = sink.expand(batch, kv_heads, extra, dim + width)
    k_aug = torch.cat([sink, F.pad(k0, (0, width))], dim=2)
    v_aug = torch.cat([sink, F.pad(v0, (0, width))], dim=2)
    out = F.scaled_dot_product_attention(q_aug, k_aug, v_aug, is_causal=True, scale=scale,
                                         enable_gqa=gqa)[:, :, extra:]
    weights = out[..., dim:dim + extra].reshape(batch, kv_heads, heads // kv_heads, length,
                                                extra)
    own = torch.einsum("bhglj,bhljd->bhgld", weights, own_v.to(weights.dtype))
    return out[..., :dim] + own.reshape(batch, heads, length, dim)


class Attention(nn.Module):
    def __init__(self, c: DraftConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = (c.num_attention_heads,
                                                    c.num_key_value_heads, c.head_dim)
        self.q_proj = nn.Linear(2 * c.hidden_size, self.heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, self.kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, self.kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * c.head_dim, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        batch, length, _ = x.shape
        q = self.q_proj(x).view(batch, length, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        cache.append((k, v))
        out = ttt_attention(q, cache, 1.0 / math.sqrt(self.head_dim))
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


class MLP(nn.Module):
    def __init__(self, c: DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, c: DraftConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, cache: list[tuple[torch.Tensor, torch.Tensor]]
                ) -> torch.Tensor:
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        hidden = hidden + self.self_attn(x, cos, sin, cache)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Eagle3Draft(nn.Module):
    """Trainable: fc, midlayer, norm, lm_head. Frozen: embed_tokens (the target's).
    Buffers d2t [draft_vocab] int64 and t2d [vocab] bool."""

    def __init__(self, config: DraftConfig, embed_weight: torch.Tensor | None = None,
                 init_std: float = 0.02):
        super().__init__()
        c = self.config = config
        if embed_weight is None:
            embed_weight = torch.zeros(c.vocab_size, c.hidden_size)
        if tuple(embed_weight.shape) != (c.vocab_size, c.hidden_size):
            raise ValueError(f"embedding is {list(embed_weight.shape)}, expected "
                             f"[{c.vocab_size}, {c.hidden_size}]")
        self.embed_tokens = nn.Embedding.from_pretrained(embed_weight, freeze=True)
        self.fc = nn.Linear(3 * c.hidden_size, c.hidden_size, bias=False)
        self.midlayer = DecoderLayer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))
        inv_freq, self.rope_scaling = rope_inverse_frequencies(c)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=init_std)

    @torch.no_grad()
    def init_head(self, lm_head: torch.Tensor, norm: torch.Tensor | None) -> None:
        """Starts the output head as the target's: lm_head from the target's rows of the
        draft vocabulary (`lm_head[t2d]`, draft ids in ascending target-id order, as
        `set_vocab` maps them), the final norm from the target's (none: ones). The draft's
        logits are then the target's own head applied to the draft's hidden state, so
        training starts from "predict the target's last hidden state" instead of from a
        random projection (speculators' trainer starts its draft the same way)."""
        rows = lm_head[self.t2d.to(lm_head.device)]
        if tuple(rows.shape) != tuple(self.lm_head.weight.shape):
            raise ValueError(f"the target's lm_head gives {list(rows.shape)} draft rows, "
                             f"the draft's is {list(self.lm_head.weight.shape)}")
        self.lm_head.weight.copy_(rows)
        if norm is not None:
            self.norm.weight.copy_(norm)

    def trainable(self) -> dict[str, nn.Parameter]:
        """The trained weights by SGLang name, in a stable order (optimizer state)."""
        return {n: p for n, p in self.named_parameters() if p.requires_grad}

    @torch.no_grad()
    def load_trainable(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, param in self.trainable().items():
            param.copy_(tensors[name])

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]
        angles = torch.cat([freqs, freqs], dim=-1)
        return angles.cos() * self.rope_scaling, angles.sin() * self.rope_scaling

    def unroll(self, aux: torch.Tensor, input_ids: torch.Tensor,
               steps: int) -> Iterator[torch.Tensor]:
        """The hidden state after each TTT step, [B, L, H] (before the final norm). Step
        i at position t sees token x_{t+1+i}: positions past the end get token 0 and
        are never targets."""
        length = input_ids.shape[1]
        embeds = self.embed_tokens(input_ids)
        cos, sin = self.rope(torch.arange(length + steps, device=input_ids.device))
        hidden = self.fc(aux)
        cache: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i in range(steps):
            shifted = F.pad(embeds[:, 1 + i:], (0, 0, 0, min(1 + i, length)))
            hidden = self.midlayer(shifted, hidden, cos[i:i + length], sin[i:i + length],
                                   cache)
            yield hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))


# -- the TTT objective --------------------------------------------------------------

TARGET_CHUNK_BYTES = 1 << 30
"""Full-vocabulary target logits are computed in row chunks of at most this size."""


class TargetHead:
    """The frozen target lm_head, giving per batch the draft-vocabulary target logits
    [B, L, draft_vocab] and the valid-position mask [B, L]."""

    def __init__(self, weight: torch.Tensor, t2d: torch.Tensor):
        self.weight = weight  # [V, H]
        self.t2d = t2d.to(weight.device)
        self.draft_ids = torch.nonzero(self.t2d).reshape(-1)

    @torch.no_grad()
    def __call__(self, hidden: torch.Tensor,
                 loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch, length, width = hidden.shape
        flat = hidden.reshape(-1, width)
        rows = max(1, TARGET_CHUNK_BYTES // (self.weight.shape[0] * 4))
        draft_logits, in_draft = [], []
        for start in range(0, flat.shape[0], rows):
            logits = flat[start:start + rows].to(self.weight.dtype) @ self.weight.T
            in_draft.append(self.t2d[logits.argmax(-1)])
            draft_logits.append(logits.index_select(-1, self.draft_ids))
        valid = torch.cat(in_draft).view(batch, length) & loss_mask
        return torch.cat(draft_logits).view(batch, length, -1), valid


STEP_WEIGHT = 0.8
"""TTT step i's loss is weighted STEP_WEIGHT ** i in the objective."""


def ttt_losses(model: Eagle3Draft, aux: torch.Tensor, input_ids: torch.Tensor,
               target_logits: torch.Tensor, valid: torch.Tensor, steps: int, *,
               temperature: float = 1.0) -> tuple[list[torch.Tensor], ...]:
    """Per TTT step: (mean cross-entropy against the target at `temperature` (`head_loss`),
    correct top-1 count, valid count). The draft head runs only on the valid positions of
    each step."""
    losses, correct, counts = [], [], []
    length = input_ids.shape[1]
    for i, hidden in enumerate(model.unroll(aux, input_ids, steps)):
        span = max(length - 1 - i, 0)
        mask = valid[:, 1 + i:]  # target position t + 1 + i for draft position t
        rows, target = hidden[:, :span][mask], target_logits[:, 1 + i:][mask]
        if torch.is_grad_enabled():  # the [rows, draft_vocab] logits are made again in
            # backward instead of kept: 7 steps of them were most of training's memory
            total, hits = checkpoint(head_loss, model, rows, target, temperature,
                                     use_reentrant=False)
        else:
            total, hits = head_loss(model, rows, target, temperature)
        count = mask.sum()
        losses.append(total / count.clamp(min=1))
        correct.append(hits)
        counts.append(count)
    return losses, correct, counts


def head_loss(model: Eagle3Draft, rows: torch.Tensor, target_logits: torch.Tensor,
              temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed cross-entropy against softmax(target_logits / temperature), top-1 hits)
    of the draft head on hidden-state rows [N, H], in fp32. Temperature 0: against the
    target's argmax alone (one-hot)."""
    logits = model.logits(rows).float()
    target_logits = target_logits.float()
    best = target_logits.argmax(-1)
    if temperature == 0:
        per_row = torch.logsumexp(logits, -1) - logits.gather(-1, best[:, None])[:, 0]
    else:
        target = (target_logits / temperature).softmax(-1)
        per_row = torch.logsumexp(logits, -1) - (target * logits).sum(-1)
    return per_row.sum(), (logits.argmax(-1) == best).sum()


# -- files -----------------------------------------------------------------------------

class DraftFileError(Exception):
    """A draft directory or file that does not fit this target."""


def load_draft_weights(path: Path, model: Eagle3Draft) -> dict[str, torch.Tensor]:
    """The trained weights of a saved draft directory (or safetensors file), by SGLang
    name (a `model.` prefix is dropped), checked against `model`'s shapes."""
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    expected = model.trainable()
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            names = list(f.keys())
            for key in names:  # only these: an older draft also holds the embedding
                if key.removeprefix("model.") in expected:
                    tensors[key.removeprefix("model.")] = f.get_tensor(key)
    missing = [name for name in expected if name not in tensors]
    if missing:
        raise DraftFileError(f"{path}: not an EAGLE-3 draft: missing {', '.join(missing[:4])}")
    for name, param in expected.items():
        if tuple(tensors[name].shape) != tuple(param.shape):
            raise DraftFileError(f"{path}: {name} is {list(tensors[name].shape)}, this "
                                 f"target needs {list(param.shape)}: a draft for another "
                                 "target?")
    return {name: tensors[name] for name in expected}


def has_own_mapping(config: DraftConfig) -> bool:
    """Whether the draft's files carry d2t/t2d: only when its vocabulary is a subset.
    vLLM creates `draft_id_to_target_id` only when draft_vocab_size != vocab_size, and
    its loader fails on a `d2t` it has no parameter for."""
    return config.draft_vocab_size != config.vocab_size


def write_draft(out: Path, model: Eagle3Draft, dtype: torch.dtype) -> Path:
    """out/draft/ (config.json, model.safetensors under SGLang names), built under a
    temp name and swapped in. The trained weights only: no `embed_tokens` (both engines
    take the target's; `load_draft` does too), and d2t/t2d only when the draft
    vocabulary is smaller than the target's (`has_own_mapping`)."""
    tmp = out / f".draft.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors = {n: p.detach().to(dtype).cpu().contiguous() for n, p in model.trainable().items()}
    if has_own_mapping(model.config):
        tensors.update(d2t=model.d2t.cpu(), t2d=model.t2d.cpu())
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    dtype_name = str(dtype).removeprefix("torch.")
    config = model.config.to_hf(dtype_name)
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for file in tmp.iterdir():
        os.chmod(file, 0o644)  # safetensors creates its files 0600; servers run as others
    final, old = out / "draft", out / f".draft.old-{os.getpid()}"
    if final.exists():
        os.rename(final, old)
    os.rename(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    return final


def identity_mapping(vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) of a draft whose vocabulary is the target's: draft id i is target id i."""
    return (torch.zeros(vocab_size, dtype=torch.int64),
            torch.ones(vocab_size, dtype=torch.bool))


def read_draft_config(draft_dir: Path, target_num_layers: int | None = None, *,
                      warn: bool = True) -> DraftConfig:
    """A saved draft's config.json (layer ids in either convention; a config the engines
    disagree on is read as SGLang reads it, with a warning unless `warn` is False)."""
    file = draft_dir / "config.json"
    if not file.is_file():
        raise DraftFileError(f"{draft_dir}: no config.json: not a saved draft directory")
    try:
        hf = json.loads(file.read_text(encoding="utf-8"))
        config = DraftConfig.from_hf(hf, target_num_layers=target_num_layers)
    except (ValueError, KeyError, TypeError) as exc:
        raise DraftFileError(f"{file}: not an EAGLE-3 draft config: {exc!r}") from exc
    conflict = serving.layer_id_conflict(hf, int(target_num_layers or 0)) if warn else None
    if conflict:
        log.warning("%s: %s", file, conflict)
    return config


def read_draft_mapping(draft_dir: Path, config: DraftConfig | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) of a saved draft (a directory with config.json, or a vocab file): its
    own tensors, or the identity mapping when it has none and its vocabulary is the
    target's (what `write_draft` writes then)."""
    from workers.eagle3.draft.vocab_mapping import VocabError, load_mapping

    if draft_dir.is_dir():
        config = config or read_draft_config(draft_dir, warn=False)
        files = sorted(draft_dir.glob("*.safetensors"))
        keys: set[str] = set()
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                names = list(f.keys())
            keys.update(k.rsplit(".", 1)[-1] for k in names)
        if not has_own_mapping(config) and not {"d2t", "t2d"} & keys:
            return identity_mapping(config.vocab_size)
    try:
        d2t, t2d, _ = load_mapping(draft_dir)
    except VocabError as exc:
        raise DraftFileError(str(exc)) from exc
    if config is not None and (t2d.numel(), d2t.numel()) != (config.vocab_size,
                                                              config.draft_vocab_size):
        raise DraftFileError(f"{draft_dir}: d2t/t2d cover {d2t.numel()} of {t2d.numel()} ids, "
                             f"its config.json says {config.draft_vocab_size} of "
                             f"{config.vocab_size}")
    return d2t, t2d


def load_draft(draft_dir: str | Path, target_embedding: torch.Tensor, *,
               target_num_layers: int | None = None) -> Eagle3Draft:
    """A saved draft directory (`workers.train`'s out/draft/, or a checkpoint directory)
    as an `Eagle3Draft` in eval mode, with the target's token embedding
    `target_embedding` [V, H] (the draft files hold none; it is used as is, not copied)
    and its trained weights cast to that embedding's dtype and device.

    d2t/t2d come from the files, or are the identity when the draft's vocabulary is the
    target's. `model.config.aux_layer_ids` are the layer inputs the draft must be fed
    (either config convention read back); `target_num_layers` is only needed for a
    config that names no layers (the engines' default [2, N//2, N-3] then)."""
    path = Path(draft_dir)
    config = read_draft_config(path, target_num_layers)
    if tuple(target_embedding.shape) != (config.vocab_size, config.hidden_size):
        raise DraftFileError(f"{path}: the draft is for a target with vocab_size "
                             f"{config.vocab_size} and hidden_size {config.hidden_size}; the "
                             f"embedding given is {list(target_embedding.shape)}")
    d2t, t2d = read_draft_mapping(path, config)
    model = Eagle3Draft(config, embed_weight=target_embedding)
    model.set_vocab(d2t, t2d)
    model.load_trainable(load_draft_weights(path, model))
    model.to(target_embedding.device)
    for param in model.trainable().values():
        param.data = param.data.to(target_embedding.dtype)
    return model.eval()

"""The W4A16 grouped-expert GEMM for packed INT4 routed experts, in Triton (CUDA).

One MoE layer's routed experts in two kernel launches and a handful of torch ops, none of
which waits for the host (so a model split over the GPUs of a node pipelines):
1. `align`: the (token, slot) pairs sorted by expert, each expert's run padded to a
   multiple of BLOCK_M, and the expert of every block — on the GPU, the sizes bounded
   statically (`pairs + min(pairs, experts) * (BLOCK_M - 1)` rows), blocks past the end
   marked -1 and left at once by the kernel;
2. `gate_up` kernel: per block of BLOCK_M sorted rows and BLOCK_N intermediate columns,
   the gate and the up tiles accumulated in fp32 from the activations (gathered by token)
   and the packed weights — each int32 word loaded, its nibble shifted out in registers,
   `(q - 8)` times its group's scale in the scale's dtype (bf16: exactly the weight
   compressed-tensors dequantizes), then `tl.dot` — and `silu(gate) * up` written once
   (the fused activation saves a [rows, 2I] round trip through memory);
3. `down` kernel: the same over the intermediate rows, each row's result times its
   routing weight, written to its (token, slot) place;
4. the top-k slots of every token summed in fp32 (deterministic: no atomics).

Layout (compressed-tensors `pack_to_int32`, read from its source): weight `[out, in]`
packed along `in`, element k in bits 4*(k % 8) of word k // 8 as `q + 8`; a scale per
32 inputs. Triton is optional: `available()` is False without it (CPU machines, CI),
and `PackedExperts` then runs its reference path.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: the reference path serves
    triton = None


def available() -> bool:
    return triton is not None and torch.cuda.is_available()


def block_m_for(pairs: int, experts: int) -> int:
    """Rows per block: small when an expert gets few rows (decode), 128 for prefill
    (the best of bench/moe_w4a16.py's sweep at 4k-16k tokens, 85-340 rows an expert)."""
    per_expert = pairs / experts
    return 16 if per_expert < 24 else 32 if per_expert < 48 else 64 if per_expert < 80 \
        else 128


def align(top_k_index: torch.Tensor, num_experts: int, block_m: int
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs, block_expert): the flat pair indexes sorted by expert, each
    expert's run padded to a multiple of `block_m` with `pairs` (a row to skip); the
    expert of every block of `block_m` rows, -1 past the last. No host synchronisation."""
    flat = top_k_index.reshape(-1)
    pairs = flat.numel()
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat.long(), torch.ones_like(flat, dtype=torch.int64))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    padded_start = padded_end - padded
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order].long()
    rank = torch.arange(pairs, device=device) - (counts.cumsum(0) - counts)[expert_of]
    rows = pairs + min(pairs, num_experts) * (block_m - 1)
    rows = (rows + block_m - 1) // block_m * block_m
    sorted_pairs = torch.full((rows,), pairs, dtype=torch.int32, device=device)
    sorted_pairs[padded_start[expert_of] + rank] = order.to(torch.int32)
    block_start = torch.arange(0, rows, block_m, device=device)
    block_expert = torch.searchsorted(padded_end, block_start, right=True)
    block_expert = torch.where(block_start < padded_end[-1], block_expert, -1)
    return sorted_pairs, block_expert.to(torch.int32)


if triton is not None:

    @triton.jit
    def _dequant_tile(w_ptr, s_ptr, offs_n, n_mask, k0, stride_wn, stride_sn,
                      GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """The [BLOCK_N, BLOCK_K] tile of W: BLOCK_K / 8 consecutive words of each row
        loaded once (coalesced along the row), the nibbles shifted out in registers,
        `(q - 8)` times the group's scale in the scale's dtype."""
        offs_w = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        words = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_w[None, :],
                        mask=n_mask[:, None], other=0)
        shifts = tl.arange(0, 8) * 4
        q = (words[:, :, None] >> shifts[None, None, :]) & 0xF
        q = tl.reshape(q, (BLOCK_N, BLOCK_K // GROUP, GROUP)) - 8
        offs_s = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
        scale = tl.load(s_ptr + offs_n[:, None] * stride_sn + offs_s[None, :],
                        mask=n_mask[:, None], other=0.0)
        return tl.reshape(q.to(scale.dtype) * scale[:, :, None], (BLOCK_N, BLOCK_K))

    @triton.jit
    def _gate_up_kernel(x_ptr, w_ptr, s_ptr, out_ptr, sorted_ptr, block_expert_ptr,
                        num_pairs, hidden: tl.constexpr, inter: tl.constexpr,
                        stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_om,
                        TOP_K: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        expert = tl.load(block_expert_ptr + pid_m)
        if expert < 0:
            return
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(sorted_ptr + offs_m)
        valid = pair < num_pairs
        token = pair // TOP_K
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < inter
        w_ptr += expert.to(tl.int64) * stride_we
        s_ptr += expert.to(tl.int64) * stride_se
        acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(x_ptr + token[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
                        mask=valid[:, None], other=0.0)
            gate = _dequant_tile(w_ptr, s_ptr, offs_n, n_mask, k0, stride_wn, stride_sn,
                                 GROUP, BLOCK_N, BLOCK_K)
            acc_gate = tl.dot(a, tl.trans(gate.to(a.dtype)), acc_gate)
            up = _dequant_tile(w_ptr, s_ptr, offs_n + inter, n_mask, k0, stride_wn,
                               stride_sn, GROUP, BLOCK_N, BLOCK_K)
            acc_up = tl.dot(a, tl.trans(up.to(a.dtype)), acc_up)
        h = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up
        tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
                 h.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])

    @triton.jit
    def _down_kernel(h_ptr, w_ptr, s_ptr, out_ptr, sorted_ptr, block_expert_ptr, weight_ptr,
                     num_pairs, hidden: tl.constexpr, inter: tl.constexpr,
                     stride_hm, stride_we, stride_wn, stride_se, stride_sn, stride_om,
                     GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        expert = tl.load(block_expert_ptr + pid_m)
        if expert < 0:
            return
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(sorted_ptr + offs_m)
        valid = pair < num_pairs
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hidden
        w_ptr += expert.to(tl.int64) * stride_we
        s_ptr += expert.to(tl.int64) * stride_se
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(h_ptr + offs_m[:, None].to(tl.int64) * stride_hm + offs_k[None, :],
                        mask=valid[:, None], other=0.0)
            w = _dequant_tile(w_ptr, s_ptr, offs_n, n_mask, k0, stride_wn, stride_sn,
                              GROUP, BLOCK_N, BLOCK_K)
            acc = tl.dot(a, tl.trans(w.to(a.dtype)), acc)
        routing = tl.load(weight_ptr + pair, mask=valid, other=0.0).to(tl.float32)
        acc = acc * routing[:, None]
        tl.store(out_ptr + pair[:, None].to(tl.int64) * stride_om + offs_n[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


def moe_forward(hidden_states: torch.Tensor, gate_up_packed: torch.Tensor,
                gate_up_scale: torch.Tensor, down_packed: torch.Tensor,
                down_scale: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor, *, block_m: int | None = None,
                block_n: int = 128, block_k: int = 128, num_warps: int | None = None,
                num_stages: int = 3) -> torch.Tensor:
    """The routed experts' output `[T, H]` for `hidden_states` `[T, H]` (bf16 or fp16)
    routed to `top_k_index` `[T, k]` with `top_k_weights` `[T, k]`; the tile sizes as
    bench/moe_w4a16.py measured them best on an H200 at Kimi-K2.5's shapes."""
    if triton is None:
        raise RuntimeError("Triton is not installed: use PackedExperts.reference")
    x = hidden_states.contiguous()
    tokens, hidden = x.shape
    num_experts, two_inter, _ = gate_up_packed.shape
    inter = two_inter // 2
    group = hidden // gate_up_scale.shape[-1]
    if hidden % block_k or inter % block_k or block_k % group:
        raise ValueError(f"hidden {hidden} and intermediate {inter} must be multiples of "
                         f"block_k {block_k}, itself a multiple of the group {group}")
    top_k = top_k_index.shape[-1]
    pairs = tokens * top_k
    block_m = block_m or block_m_for(pairs, num_experts)
    num_warps = num_warps or (8 if block_m >= 128 else 4)
    sorted_pairs, block_expert = align(top_k_index, num_experts, block_m)
    current = torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()
    with current:  # Triton launches on the current device: a split model's is not x's
        return launch(x, gate_up_packed, gate_up_scale, down_packed, down_scale,
                      top_k_weights, sorted_pairs, block_expert, top_k, group,
                      (block_m, block_n, block_k, num_warps, num_stages))


def launch(x: torch.Tensor, gate_up_packed: torch.Tensor, gate_up_scale: torch.Tensor,
           down_packed: torch.Tensor, down_scale: torch.Tensor, top_k_weights: torch.Tensor,
           sorted_pairs: torch.Tensor, block_expert: torch.Tensor, top_k: int, group: int,
           tiles: tuple[int, int, int, int, int]) -> torch.Tensor:
    """The two kernels and the top-k sum (see `moe_forward`)."""
    block_m, block_n, block_k, num_warps, num_stages = tiles
    tokens, hidden = x.shape
    inter = gate_up_packed.shape[1] // 2
    pairs = tokens * top_k
    rows = sorted_pairs.numel()
    blocks = rows // block_m
    h = torch.empty(rows, inter, dtype=x.dtype, device=x.device)
    grid: Any = (blocks, triton.cdiv(inter, block_n))
    _gate_up_kernel[grid](
        x, gate_up_packed, gate_up_scale, h, sorted_pairs, block_expert,
        pairs, hidden, inter,
        x.stride(0), gate_up_packed.stride(0), gate_up_packed.stride(1),
        gate_up_scale.stride(0), gate_up_scale.stride(1), h.stride(0),
        TOP_K=top_k, GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=num_warps, num_stages=num_stages)
    out = torch.empty(pairs, hidden, dtype=x.dtype, device=x.device)
    weights = top_k_weights.reshape(-1).contiguous()
    grid = (blocks, triton.cdiv(hidden, block_n))
    _down_kernel[grid](
        h, down_packed, down_scale, out, sorted_pairs, block_expert, weights,
        pairs, hidden, inter,
        h.stride(0), down_packed.stride(0), down_packed.stride(1),
        down_scale.stride(0), down_scale.stride(1), out.stride(0),
        GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=num_warps, num_stages=num_stages)
    return out.view(tokens, top_k, hidden).sum(1, dtype=torch.float32).to(x.dtype)

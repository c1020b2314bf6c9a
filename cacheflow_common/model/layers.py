"""The pieces of a decoder layer as plain functions over weights looked up by Hugging Face name."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cacheflow_common.model.config import ModelConfig

Weights = dict[str, torch.Tensor]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, in float32, cast back before the weight (as Hugging Face does)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def linear(x: torch.Tensor, w: Weights, name: str) -> torch.Tensor:
    return F.linear(x, w[name + ".weight"], w.get(name + ".bias"))


def dense_mlp(x: torch.Tensor, w: Weights, prefix: str) -> torch.Tensor:
    """SwiGLU: down(silu(gate(x)) * up(x)); x [R, hidden] -> [R, hidden]."""
    gated = F.silu(linear(x, w, prefix + "gate_proj")) * linear(x, w, prefix + "up_proj")  # [R, inter]
    return linear(gated, w, prefix + "down_proj")


def moe_mlp(x: torch.Tensor, w: Weights, prefix: str, config: ModelConfig) -> torch.Tensor:
    """Qwen3-MoE: softmax router, top-k experts, weighted sum; only experts that got tokens run."""
    moe = config.moe
    if moe is None:
        raise ValueError("moe_mlp called on a dense model")
    probs = torch.softmax(linear(x, w, prefix + "gate").float(), dim=-1)  # [R, E]
    top_w, top_i = probs.topk(moe.experts_per_token, dim=-1)  # [R, k]
    if moe.norm_topk_prob:
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
    top_w = top_w.to(x.dtype)
    out = torch.zeros_like(x)  # [R, hidden]
    for expert in top_i.unique().tolist():
        rows, slot = (top_i == expert).nonzero(as_tuple=True)  # [M], [M]
        y = dense_mlp(x[rows], w, f"{prefix}experts.{expert}.") * top_w[rows, slot, None]  # [M, hidden]
        out.index_add_(0, rows, y)
    return out


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """Causal attention of queries at positions [start, start+T) over keys [0, start+T).

    q [H, T, D], k/v [Hkv, start+T, D] -> [H, T, D].
    """
    end = k.shape[1]
    if start == 0:
        out = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, enable_gqa=True)
    elif q.is_cuda:
        # A bottom-right causal bias keeps the fused kernels (an explicit mask falls back to the
        # O(T * end) math path); those kernels want K/V expanded to every query head.
        group = q.shape[0] // k.shape[0]
        k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)  # [H, end, D]
        from torch.nn.attention.bias import causal_lower_right  # here: importing it costs ~1 s of CPU (dynamo)

        bias = causal_lower_right(q.shape[1], end)
        out = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=bias)
    else:
        q_pos = torch.arange(start, end, device=q.device)  # [T]
        mask = torch.arange(end, device=q.device)[None, :] <= q_pos[:, None]  # [T, end]
        out = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, enable_gqa=True)
    return out[0]

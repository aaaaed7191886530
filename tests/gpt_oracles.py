"""GPT-2 and GPT-NeoX decoder layers written out by hand from the weights: the independent oracle
for every site the tests capture on these families (no hook, no transformers forward).

``gpt2_layer`` / ``neox_layer`` take the residual stream entering a layer, ``[b, p, d_model]``, and
return every site of that layer in the address space's shapes. GPT-2's ``Conv1D`` weights are used
as they are stored, ``x @ W + b`` with ``W`` ``[in, out]``; GPT-NeoX's ``nn.Linear`` as ``x @ W.T + b``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's ``gelu_new``: the tanh approximation of GELU."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


def gelu_erf(x: torch.Tensor) -> torch.Tensor:
    """GPT-NeoX's ``gelu``: the exact GELU."""
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def layer_norm(x: torch.Tensor, module) -> torch.Tensor:
    mean = x.mean(-1, keepdim=True)
    var = (x - mean).pow(2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + module.eps) * module.weight + module.bias


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of ``[b, p, heads, d_head]`` q, k, v: ``(z [b, p, h, d], pattern [b, h, q, k])``."""
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    n = q.shape[1]
    future = torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1)
    pattern = scores.masked_fill(future, float("-inf")).softmax(-1)
    return torch.einsum("bhqk,bkhd->bqhd", pattern, v), pattern


def gpt2_layer(hf, layer: int, resid_pre: torch.Tensor) -> dict[str, torch.Tensor]:
    block = hf.transformer.h[layer]
    d = resid_pre.shape[-1]
    heads = hf.config.n_head
    qkv = layer_norm(resid_pre, block.ln_1) @ block.attn.c_attn.weight + block.attn.c_attn.bias
    q, k, v = (t.unflatten(-1, (heads, d // heads)) for t in qkv.split(d, dim=-1))
    z, pattern = attend(q, k, v)
    attn_out = z.flatten(-2) @ block.attn.c_proj.weight + block.attn.c_proj.bias
    resid_mid = resid_pre + attn_out
    mlp_post = gelu_tanh(layer_norm(resid_mid, block.ln_2) @ block.mlp.c_fc.weight + block.mlp.c_fc.bias)
    mlp_out = mlp_post @ block.mlp.c_proj.weight + block.mlp.c_proj.bias
    return dict(resid_pre=resid_pre, q=q, k=k, v=v, z=z, pattern=pattern, attn_out=attn_out, attn_out_post=attn_out,
                resid_mid=resid_mid, mlp_post=mlp_post, mlp_out=mlp_out, mlp_out_post=mlp_out,
                resid_post=resid_mid + mlp_out)


def _rotate(x: torch.Tensor, rot: int, base: float) -> torch.Tensor:
    """NeoX rotary on the first ``rot`` features of each head (halves rotated), the rest passed."""
    pos = torch.arange(x.shape[1], dtype=torch.float32)
    inv = 1.0 / (base ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
    angles = torch.outer(pos, inv)
    cos, sin = torch.cat([angles.cos()] * 2, -1)[None, :, None], torch.cat([angles.sin()] * 2, -1)[None, :, None]
    head, rest = x[..., :rot], x[..., rot:]
    half = torch.cat([-head[..., rot // 2:], head[..., : rot // 2]], dim=-1)
    return torch.cat([head * cos + half * sin, rest], dim=-1)


def neox_layer(hf, layer: int, resid_pre: torch.Tensor) -> dict[str, torch.Tensor]:
    block = hf.gpt_neox.layers[layer]
    config = hf.config
    heads = config.num_attention_heads
    d_head = config.hidden_size // heads
    rot = int(d_head * config.rope_parameters["partial_rotary_factor"])
    base = config.rope_parameters["rope_theta"]
    qkv = F.linear(layer_norm(resid_pre, block.input_layernorm), block.attention.query_key_value.weight,
                   block.attention.query_key_value.bias)
    q, k, v = qkv.unflatten(-1, (heads, 3 * d_head)).chunk(3, dim=-1)  # per head: [q | k | v]
    q, k = _rotate(q, rot, base), _rotate(k, rot, base)
    z, pattern = attend(q, k, v)
    attn_out = F.linear(z.flatten(-2), block.attention.dense.weight, block.attention.dense.bias)
    mlp_in = resid_pre if config.use_parallel_residual else resid_pre + attn_out
    mlp_post = gelu_erf(F.linear(layer_norm(mlp_in, block.post_attention_layernorm), block.mlp.dense_h_to_4h.weight,
                                 block.mlp.dense_h_to_4h.bias))
    mlp_out = F.linear(mlp_post, block.mlp.dense_4h_to_h.weight, block.mlp.dense_4h_to_h.bias)
    sites = dict(resid_pre=resid_pre, q=q, k=k, v=v, z=z, pattern=pattern, attn_out=attn_out, attn_out_post=attn_out,
                 mlp_post=mlp_post, mlp_out=mlp_out, mlp_out_post=mlp_out, resid_post=resid_pre + attn_out + mlp_out)
    if not config.use_parallel_residual:
        sites["resid_mid"] = resid_pre + attn_out
    return sites

"""Site tables of the families whose residual is several streams.

Hyper-connection models (DeepSeek-V4, HY-v4, Qwen4-Exp) carry ``hc_mult`` residual streams
through every layer as one ``[batch, pos, stream, d_model]`` tensor (Qwen4-Exp:
``[batch, pos, stream * d_model]``); each block reads a learned mix of the streams and writes its
output back into every stream with per-token weights. Gemma 3n's AltUp
carries ``altup_num_inputs`` predictions as ``[stream, batch, pos, d_model]``; the blocks run on
the active one (stream 0) and AltUp corrects the others from it.

``resid_streams.L.S`` is stream ``S`` of the layer's output. The single-stream residual sites
(``resid_pre``, ``resid_mid``, ``resid_post``) are not in these tables: there is no one residual
to name, and the address check says so. ``attn_out_post`` / ``mlp_out_post`` are what each block writes,
before it is spread over the streams (``attn_out`` / ``mlp_out`` the raw outputs: the same tensors
except on Gemma 3n, which norms them first). Sites whose module these families lay out differently
(DeepSeek-V4's grouped output projection, HY-v4's latent attention) are left out and refused
with the list of what is served.
"""

from __future__ import annotations

from . import vllm_reads
from .base import Arch, Hook
from .dense import ATTENTION
from .moe import ROUTER_SITES

_HYPER_CONNECTION_SITES = {
    "attn_out": Hook("self_attn", "out"),
    "mlp_out": Hook("mlp", "out"),
    "resid_streams": Hook("", "out", layout="b p s d"),
    **ROUTER_SITES,
}

#: Qwen4-Exp keeps its streams side by side in the feature axis, ``[b, p, stream * d_model]``, and
#: mixes linear-attention (``linear_attn``) and attention (``self_attn``) layers, so it has no
#: one module for ``attn_out``.
_QWEN4_EXP_SITES = {
    "mlp_out": Hook("mlp", "out"),
    "resid_streams": Hook("", "out", layout="b p (s d)"),
    **ROUTER_SITES,
}

#: Gemma 3n normalises each block's output (like Gemma 2) before AltUp mixes it in: ``attn_out`` /
#: ``mlp_out`` are the raw outputs, ``attn_out_post`` / ``mlp_out_post`` the normed ones.
_GEMMA3N_SITES = {
    "attn_out": Hook("self_attn", "out"),
    "attn_out_post": Hook("post_attention_layernorm", "out"),
    "mlp_out": Hook("mlp", "out"),
    "mlp_out_post": Hook("post_feedforward_layernorm", "out"),
    "z": Hook("self_attn.o_proj", "in"),
    "mlp_post": Hook("mlp.down_proj", "in"),
    "resid_streams": Hook("", "out", layout="s b p d"),
    **ATTENTION,
}

ARCHS = (
    Arch("deepseek_v4", ("deepseek_v4",), _HYPER_CONNECTION_SITES, streams_config="hc_mult"),
    Arch("hy_v4", ("hy_v4",), _HYPER_CONNECTION_SITES, streams_config="hc_mult"),
    # Qwen4-Exp's final norm is model.hyper_connection_mixer: it normalises the streams and collapses
    # them into the one [b, p, d_model] row the unembedding reads (there is no model.norm)
    Arch("qwen4_exp", ("qwen4_exp_text",), _QWEN4_EXP_SITES, streams_config="hc_count",
         final_norm="model.hyper_connection_mixer",
         refused={"ln_final_normalized": "Qwen4-Exp's final norm, its hyper_connection_mixer, normalises the streams "
                                         "and collapses them in one module, so no output before a gain exists"}),
    Arch("gemma3n", ("gemma3n_text",), _GEMMA3N_SITES, streams_config="altup_num_inputs",
         vllm=vllm_reads.GEMMA3N),
)

"""Dictionaries from files and tensors, checked against the maths written out by hand.

Each format (a SAELens folder in the v6 and the v5 layout, a Gemma Scope ``params.npz``, a dict of
tensors) and each option that changes the maths (ReLU, JumpReLU, TopK, a BatchTopK checkpoint,
``apply_b_dec_to_input``, the three normalisations, decoder-norm rescaling, transcoders with and
without a skip connection, v5's finetuning scaling factor) is loaded and run on random inputs; the
result must equal the formula below, computed one token at a time with no shared code. The SAELens
oracle (its own ``SAE`` forward) is in test_features_saelens.py.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from interp_engine import Address
from interp_engine.compare import SAME_BACKEND, relative_error
from interp_engine.errors import AddressError, DictionaryError
from interp_engine.features import load_dictionary

D_IN, D_SAE = 16, 48


def weights(seed=0, d_in=D_IN, d_sae=D_SAE, d_out=None, threshold=False, skip=False):
    g = torch.Generator().manual_seed(seed)
    d_out = d_out or d_in
    w = {"W_enc": torch.randn(d_in, d_sae, generator=g) / math.sqrt(d_in),
         "b_enc": torch.randn(d_sae, generator=g) * 0.1,
         "W_dec": torch.randn(d_sae, d_out, generator=g) / math.sqrt(d_sae),
         "b_dec": torch.randn(d_out, generator=g) * 0.1}
    if threshold:
        w["threshold"] = torch.rand(d_sae, generator=g) * 0.3
    if skip:
        w["W_skip"] = torch.randn(d_out, d_in, generator=g) * 0.1
    return w


def inputs(seed=1, shape=(3, 5), d=D_IN):
    return torch.randn(*shape, d, generator=torch.Generator().manual_seed(seed)) * 2.0


def by_hand(w, x, *, act="relu", k=None, b_dec_in=False, norm="none", scale=None, rescale=False,
            transcoder=False):
    """(features, reconstruction) of each token, from the formulas, one token at a time."""
    feats, recons = [], []
    for token in x.reshape(-1, x.shape[-1]).double():
        W_enc, b_enc, W_dec, b_dec = (w[n].double() for n in ("W_enc", "b_enc", "W_dec", "b_dec"))
        xin, mul, add = token, 1.0, 0.0
        if norm == "constant_norm_rescale":
            coeff = math.sqrt(len(token)) / float(torch.sqrt((token * token).sum()))
            xin, mul = token * coeff, 1.0 / coeff
        elif norm == "layer_norm":
            mu = float(token.mean())
            std = float(torch.sqrt(((token - mu) ** 2).sum() / (len(token) - 1)))
            xin, mul, add = (token - mu) / (std + 1e-5), std, mu
        elif norm == "scale":
            xin, mul = token * scale, 1.0 / scale
        if b_dec_in:
            xin = xin - b_dec
        pre = torch.stack([(xin * W_enc[:, j]).sum() + b_enc[j] for j in range(W_enc.shape[1])])
        norms = torch.sqrt((W_dec * W_dec).sum(dim=1))
        if rescale:
            pre = pre * norms
        f = torch.zeros_like(pre)
        if act == "relu":
            f = torch.where(pre > 0, pre, f)
        elif act == "jumprelu":
            f = torch.where((pre > w["threshold"].double()) & (pre > 0), pre, f)
        else:
            for j in sorted(range(len(pre)), key=lambda j: -float(pre[j]))[:k]:
                f[j] = max(float(pre[j]), 0.0)
        fd = f / norms if rescale else f
        out = sum(fd[j] * W_dec[j] for j in range(len(fd))) + b_dec
        if not transcoder:
            out = out * mul + add
        if "W_skip" in w:
            out = out + w["W_skip"].double() @ token
        feats.append(f)
        recons.append(out)
    lead = x.shape[:-1]
    return torch.stack(feats).reshape(*lead, -1), torch.stack(recons).reshape(*lead, -1)


def check(d, w, x, **maths):
    want_f, want_r = by_hand(w, x, **maths)
    got_f, got_r = d.forward(x)
    assert relative_error(got_f, want_f) <= SAME_BACKEND
    assert relative_error(got_r, want_r) <= SAME_BACKEND
    assert torch.equal(got_f, d.encode(x))
    # the active set is exact away from ties: the threshold / top-k boundary is far from every value here
    assert torch.equal(got_f != 0, want_f != 0)


def saelens_folder(path, cfg, tensors):
    path.mkdir(parents=True, exist_ok=True)
    (path / "cfg.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "sae_weights.safetensors"))
    return path


def v6(architecture, hook="blocks.2.hook_resid_post", **extra):
    meta = {"sae_lens_version": "6.54.12", "hook_name": hook, **extra.pop("metadata", {})}
    return {"d_in": D_IN, "d_sae": D_SAE, "dtype": "float32", "device": "cpu", "apply_b_dec_to_input": True,
            "normalize_activations": "none", "reshape_activations": "none", "metadata": meta,
            "architecture": architecture, **extra}


@pytest.mark.parametrize("architecture, maths", [
    ("standard", {"act": "relu"}),
    ("jumprelu", {"act": "jumprelu"}),
    ("topk", {"act": "topk", "k": 5}),
])
def test_saelens_v6_folder(tmp_path, architecture, maths):
    w = weights(threshold=architecture == "jumprelu")
    extra = {"k": 5} if architecture == "topk" else {}
    d = load_dictionary(saelens_folder(tmp_path / "sae", v6(architecture, **extra), w))
    assert d.reads == Address("resid_post", 2) and d.writes == d.reads and not d.is_transcoder
    assert (d.d_in, d.d_sae, d.activation) == (D_IN, D_SAE, maths["act"])
    check(d, w, inputs(), b_dec_in=True, **maths)


def test_saelens_v5_folder(tmp_path):
    """The pre-6 layout: hook at the top, TopK as an activation function with kwargs."""
    w = weights()
    cfg = {"architecture": "standard", "d_in": D_IN, "d_sae": D_SAE, "activation_fn_str": "topk",
           "activation_fn_kwargs": {"k": 7}, "apply_b_dec_to_input": False, "finetuning_scaling_factor": False,
           "hook_name": "blocks.1.hook_mlp_out", "hook_layer": 1, "hook_head_index": None,
           "normalize_activations": "none", "dtype": "float32", "device": "cpu", "sae_lens_training_version": "5.9.1"}
    d = load_dictionary(saelens_folder(tmp_path / "v5", cfg, w))
    assert d.reads == Address("mlp_out_post", 1) and d.k == 7
    check(d, w, inputs(), act="topk", k=7)


def test_v5_finetuning_scaling_factor_multiplies_features_before_decoding(tmp_path):
    w = weights()
    factor = torch.linspace(0.5, 2.0, D_SAE)
    cfg = {"architecture": "standard", "d_in": D_IN, "d_sae": D_SAE, "activation_fn_str": "relu",
           "apply_b_dec_to_input": True, "finetuning_scaling_factor": True, "hook_point": "blocks.0.hook_resid_pre",
           "normalize_activations": False, "dtype": "float32"}
    d = load_dictionary(saelens_folder(tmp_path / "ft", cfg, {**w, "scaling_factor": factor}))
    assert d.reads == Address("resid_pre", 0)
    x = inputs()
    f, recon = d.forward(x)
    want_f, _ = by_hand(w, x, b_dec_in=True)
    want_r = (want_f * factor.double()) @ w["W_dec"].double() + w["b_dec"].double()
    assert relative_error(f, want_f) <= SAME_BACKEND and relative_error(recon, want_r) <= SAME_BACKEND
    cfg["finetuning_scaling_factor"] = False
    with pytest.raises(DictionaryError, match="inconsistent"):
        load_dictionary(saelens_folder(tmp_path / "bad", cfg, {**w, "scaling_factor": factor}))


def test_batchtopk_checkpoint_runs_as_jumprelu_at_its_threshold(tmp_path):
    w = weights()
    d = load_dictionary(saelens_folder(tmp_path / "btk", v6("batchtopk", k=4.0),
                                       {**w, "topk_threshold": torch.tensor(0.2, dtype=torch.float64)}))
    assert d.activation == "jumprelu"
    check(d, {**w, "threshold": torch.full((D_SAE,), 0.2)}, inputs(), act="jumprelu", b_dec_in=True)
    with pytest.raises(DictionaryError, match="topk_threshold"):
        load_dictionary(saelens_folder(tmp_path / "nothr", v6("batchtopk", k=4.0), w))


@pytest.mark.parametrize("norm", ["constant_norm_rescale", "layer_norm"])
def test_normalisation_is_undone_on_the_way_out(tmp_path, norm):
    w = weights(threshold=True)
    d = load_dictionary(saelens_folder(tmp_path / norm, v6("jumprelu", normalize_activations=norm), w))
    check(d, w, inputs(), act="jumprelu", b_dec_in=True, norm=norm)


def test_expected_average_only_in_needs_its_factor(tmp_path):
    w = weights()
    folder = saelens_folder(tmp_path / "avg", v6("standard", normalize_activations="expected_average_only_in"), w)
    with pytest.raises(DictionaryError, match="norm_scaling_factor="):
        load_dictionary(folder)
    check(load_dictionary(folder, norm_scaling_factor=0.25), w, inputs(), b_dec_in=True, norm="scale", scale=0.25)


def test_topk_rescaled_by_decoder_norm(tmp_path):
    w = weights()
    w["W_dec"] = w["W_dec"] * torch.linspace(0.2, 3.0, D_SAE)[:, None]
    d = load_dictionary(saelens_folder(tmp_path / "r", v6("topk", k=6, rescale_acts_by_decoder_norm=True), w))
    check(d, w, inputs(), act="topk", k=6, b_dec_in=True, rescale=True)


@pytest.mark.parametrize("architecture", ["transcoder", "skip_transcoder", "jumprelu_transcoder",
                                          "jumprelu_skip_transcoder"])
def test_transcoders_read_one_site_and_predict_another(tmp_path, architecture):
    skip = "skip" in architecture
    w = weights(d_out=12, threshold="jumprelu" in architecture, skip=skip)
    cfg = v6(architecture, hook="blocks.3.hook_resid_mid", d_out=12, apply_b_dec_to_input=False,
             metadata={"hook_name_out": "blocks.3.hook_mlp_out"})
    d = load_dictionary(saelens_folder(tmp_path / architecture, cfg, w))
    assert (d.reads, d.writes, d.is_transcoder, d.d_out) == (Address("resid_mid", 3), Address("mlp_out_post", 3), True, 12)
    assert (d.W_skip is not None) == skip
    check(d, w, inputs(), act="jumprelu" if "jumprelu" in architecture else "relu", transcoder=True)


def test_gemma_scope_npz(tmp_path):
    w = weights(threshold=True)
    np.savez(tmp_path / "params.npz", **{k: v.numpy() for k, v in w.items()})
    with pytest.raises(DictionaryError, match="reads="):
        load_dictionary(tmp_path / "params.npz")
    d = load_dictionary(tmp_path, reads="blocks.5.hook_resid_post")  # the folder holding params.npz
    assert d.reads == Address("resid_post", 5) and d.activation == "jumprelu" and not d.apply_b_dec_to_input
    check(d, w, inputs(), act="jumprelu")


def test_plain_tensors_infer_the_activation():
    w = weights(threshold=True)
    assert load_dictionary(w, reads="resid_post.1").activation == "jumprelu"
    plain = {k: v for k, v in w.items() if k != "threshold"}
    assert load_dictionary(plain, reads="resid_post.1").activation == "relu"
    d = load_dictionary(plain, reads=("z", 1), k=3, apply_b_dec_to_input=True)
    assert d.activation == "topk" and d.reads == Address("z", 1)
    check(d, plain, inputs(), act="topk", k=3, b_dec_in=True)


def test_dtype_and_device_and_key():
    w = weights()
    d = load_dictionary(w, reads="resid_post.1", dtype="bfloat16")
    assert d.W_enc.dtype == torch.bfloat16 and d.device.type == "cpu"
    assert load_dictionary(w, reads="resid_post.1").key == load_dictionary(dict(w), reads="resid_post.1").key
    assert load_dictionary(w, reads="resid_post.1").key != load_dictionary(w, reads="resid_post.2").key
    changed = {**w, "b_enc": w["b_enc"] + 1e-6}
    assert load_dictionary(changed, reads="resid_post.1").key != load_dictionary(w, reads="resid_post.1").key


@pytest.mark.parametrize("bad, match", [
    ({"reads": "blocks.3.ln2.hook_scale"}, "resid_mid.3"),
    ({"reads": "blocks.3.hook_nonsense"}, "known: blocks.L.hook_resid_pre"),
    ({"reads": "pattern.1"}, "one vector per position at one of"),
    ({"reads": "logits"}, "one vector per position at one of"),
    ({"reads": "resid_post.1", "activation": "gelu"}, "known: relu, jumprelu, topk"),
    ({"reads": "resid_post.1", "k": 0}, "int k in 1..48"),
    ({"reads": "resid_post.1", "writes": "mlp_out.1", "apply_b_dec_to_input": True}, "transcoder"),
])
def test_bad_options_are_refused_with_the_fix(bad, match):
    with pytest.raises((DictionaryError, AddressError), match=match):
        load_dictionary(weights(), **bad)


def test_bad_files_are_refused_with_the_fix(tmp_path):
    w = weights()
    with pytest.raises(DictionaryError, match="no such file"):
        load_dictionary(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DictionaryError, match="neither a SAELens folder"):
        load_dictionary(tmp_path / "empty")
    with pytest.raises(DictionaryError, match="'gated' is not supported"):
        load_dictionary(saelens_folder(tmp_path / "g", v6("gated"), w))
    with pytest.raises(DictionaryError, match="hook_name_out"):
        load_dictionary(saelens_folder(tmp_path / "t", v6("transcoder", d_out=D_IN, apply_b_dec_to_input=False), w))
    transposed = {**w, "W_dec": w["W_dec"].T.contiguous()}
    with pytest.raises(DictionaryError, match="transposed"):
        load_dictionary(transposed, reads="resid_post.1")
    with pytest.raises(DictionaryError, match="missing tensors"):
        load_dictionary({"W_enc": w["W_enc"]}, reads="resid_post.1")
    folder = saelens_folder(tmp_path / "trunc", v6("standard"), w)
    (folder / "sae_weights.safetensors").write_bytes(b"\x00" * 10)
    with pytest.raises(DictionaryError, match="damaged"):
        load_dictionary(folder)

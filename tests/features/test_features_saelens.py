"""SAELens as the oracle: random SAEs and transcoders built and saved by SAELens itself, loaded by
``load_dictionary``, must encode and decode as SAELens's own ``SAE`` does (its ``encode``,
``decode`` and forward), within the same-backend tolerance, with the same active features.

Needs ``sae-lens`` (the ``test`` extra). SAELens 6 requires TransformerLens 3; where TransformerLens
4 replaced it (``make bench`` keeps its 4.3 in .venv-bench for that reason), SAELens does not import
and this module skips, saying so, and on CI the run fails (tests/conftest.py, ORACLES);
test_features_load.py checks the same maths written out by hand.
"""

from __future__ import annotations

import json

import pytest
import torch

from interp_engine import Address
from interp_engine.compare import SAME_BACKEND, relative_error
from interp_engine.features import load_dictionary

try:
    import sae_lens
    from sae_lens.saes.sae import SAEMetadata
except ImportError as err:  # pragma: no cover - depends on the environment
    pytest.skip(f"sae-lens does not import here ({err}); install the test extra (sae-lens needs "
                f"transformer-lens<4)", allow_module_level=True)

D_IN, D_SAE = 16, 64


def randomise(sae, seed):
    """Every parameter of ``sae`` random (SAELens initialises biases and thresholds to zero)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sae.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() > 1 else 0.1))
            if name == "threshold":
                p.copy_(torch.rand(p.shape, generator=g) * 0.2)
    return sae


def x_for(seed=7, d=D_IN, shape=(2, 6)):
    return torch.randn(*shape, d, generator=torch.Generator().manual_seed(seed)) * 1.5


def agree(ours, theirs, x, *, transcoder=False):
    """Our encode / decode / forward against SAELens's on ``x``."""
    got_f, got_out = ours.forward(x)
    with torch.no_grad():
        want_f = theirs.encode(x)
        want_recon = theirs.decode(want_f)
        want_out = theirs(x)
    assert relative_error(got_f, want_f) <= SAME_BACKEND
    assert torch.equal(got_f != 0, want_f != 0), "the active features differ"
    if not transcoder:
        assert relative_error(got_out, want_recon) <= SAME_BACKEND
    assert relative_error(got_out, want_out) <= SAME_BACKEND
    return got_f


def meta(hook="blocks.2.hook_resid_post", **extra):
    return SAEMetadata(hook_name=hook, **extra)


@pytest.mark.parametrize("kind", ["standard", "jumprelu", "topk", "topk_rescaled"])
@pytest.mark.parametrize("b_dec_in", [True, False])
def test_saelens_saes(tmp_path, kind, b_dec_in):
    options = dict(d_in=D_IN, d_sae=D_SAE, apply_b_dec_to_input=b_dec_in, metadata=meta())
    if kind == "standard":
        sae = sae_lens.StandardSAE(sae_lens.StandardSAEConfig(**options))
    elif kind == "jumprelu":
        sae = sae_lens.JumpReLUSAE(sae_lens.JumpReLUSAEConfig(**options))
    else:
        sae = sae_lens.TopKSAE(sae_lens.TopKSAEConfig(k=6, rescale_acts_by_decoder_norm=kind == "topk_rescaled",
                                                      **options))
    randomise(sae, seed=10 * len(kind) + b_dec_in).save_model(tmp_path / "sae")
    theirs = sae_lens.SAE.load_from_disk(tmp_path / "sae")
    ours = load_dictionary(tmp_path / "sae")
    assert ours.reads == Address("resid_post", 2) and ours.apply_b_dec_to_input == b_dec_in
    f = agree(ours, theirs, x_for())
    if kind.startswith("topk"):
        assert int((f != 0).sum(-1).max()) <= 6


@pytest.mark.parametrize("norm", ["constant_norm_rescale", "layer_norm"])
def test_saelens_runtime_normalisation(tmp_path, norm):
    sae = sae_lens.StandardSAE(sae_lens.StandardSAEConfig(d_in=D_IN, d_sae=D_SAE, normalize_activations=norm,
                                                          metadata=meta()))
    randomise(sae, 3).save_model(tmp_path / "sae")
    agree(load_dictionary(tmp_path / "sae"), sae_lens.SAE.load_from_disk(tmp_path / "sae"), x_for())


def test_saelens_expected_average_factor_matches_its_folded_weights(tmp_path):
    sae = sae_lens.JumpReLUSAE(sae_lens.JumpReLUSAEConfig(d_in=D_IN, d_sae=D_SAE, metadata=meta(),
                                                          normalize_activations="expected_average_only_in"))
    randomise(sae, 4).save_model(tmp_path / "sae")
    theirs = sae_lens.SAE.load_from_disk(tmp_path / "sae")
    theirs.fold_activation_norm_scaling_factor(0.3)  # what SAELens's from_pretrained does with the release's factor
    agree(load_dictionary(tmp_path / "sae", norm_scaling_factor=0.3), theirs, x_for())


def test_saelens_batchtopk_saved_for_inference(tmp_path):
    from sae_lens.saes.batchtopk_sae import BatchTopKTrainingSAE, BatchTopKTrainingSAEConfig

    sae = BatchTopKTrainingSAE(BatchTopKTrainingSAEConfig(d_in=D_IN, d_sae=D_SAE, k=5.0, metadata=meta()))
    randomise(sae, 5)
    sae.topk_threshold = torch.tensor(0.15, dtype=torch.double)
    sae.save_inference_model(tmp_path / "sae")
    assert json.loads((tmp_path / "sae" / "cfg.json").read_text())["architecture"] == "jumprelu"
    agree(load_dictionary(tmp_path / "sae"), sae_lens.SAE.load_from_disk(tmp_path / "sae"), x_for())


@pytest.mark.parametrize("kind", ["Transcoder", "SkipTranscoder", "JumpReLUTranscoder", "JumpReLUSkipTranscoder"])
def test_saelens_transcoders(tmp_path, kind):
    from sae_lens.saes import transcoder as tc

    cfg = getattr(tc, f"{kind}Config")(d_in=D_IN, d_sae=D_SAE, d_out=12, apply_b_dec_to_input=False,
                                       metadata=meta("blocks.1.hook_resid_mid", hook_name_out="blocks.1.hook_mlp_out"))
    randomise(getattr(tc, kind)(cfg), 6).save_model(tmp_path / "tc")
    ours = load_dictionary(tmp_path / "tc")
    assert (ours.reads, ours.writes) == (Address("resid_mid", 1), Address("mlp_out_post", 1))
    assert (ours.W_skip is not None) == ("Skip" in kind)
    agree(ours, sae_lens.SAE.load_from_disk(tmp_path / "tc"), x_for(), transcoder=True)


def test_saelens_reads_a_v5_folder_as_we_do(tmp_path):
    """A config in the pre-6 layout, which SAELens 6 converts on load (its own compatibility path)."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(8)
    w = {"W_enc": torch.randn(D_IN, D_SAE, generator=g) * 0.3, "b_enc": torch.randn(D_SAE, generator=g) * 0.1,
         "W_dec": torch.randn(D_SAE, D_IN, generator=g) * 0.3, "b_dec": torch.randn(D_IN, generator=g) * 0.1}
    (tmp_path / "v5").mkdir()
    save_file(w, str(tmp_path / "v5" / "sae_weights.safetensors"))
    (tmp_path / "v5" / "cfg.json").write_text(json.dumps({
        "architecture": "standard", "d_in": D_IN, "d_sae": D_SAE, "activation_fn_str": "topk",
        "activation_fn_kwargs": {"k": 9}, "apply_b_dec_to_input": True, "finetuning_scaling_factor": False,
        "hook_name": "blocks.4.hook_resid_pre", "hook_layer": 4, "hook_head_index": None, "context_size": 128,
        "model_name": "tiny", "prepend_bos": True, "dataset_path": "", "dataset_trust_remote_code": False,
        "normalize_activations": "none", "dtype": "float32", "device": "cpu",
        "sae_lens_training_version": "5.10.0"}))
    theirs = sae_lens.SAE.load_from_disk(tmp_path / "v5")
    assert type(theirs).__name__ == "TopKSAE"
    ours = load_dictionary(tmp_path / "v5")
    assert ours.reads == Address("resid_pre", 4) and ours.k == 9
    agree(ours, theirs, x_for())


def test_saelens_hook_z_flattens_heads(tmp_path):
    n_heads, d_head = 4, 4
    sae = sae_lens.StandardSAE(sae_lens.StandardSAEConfig(d_in=n_heads * d_head, d_sae=D_SAE,
                                                          reshape_activations="hook_z",
                                                          metadata=meta("blocks.1.attn.hook_z")))
    randomise(sae, 9).save_model(tmp_path / "z")
    ours = load_dictionary(tmp_path / "z")
    assert ours.reads == Address("z", 1)
    z = x_for(shape=(2, 3, n_heads), d=d_head)
    with torch.no_grad():
        want = sae_lens.SAE.load_from_disk(tmp_path / "z").encode(z)
    assert relative_error(ours.encode(z.flatten(-2)), want) <= SAME_BACKEND


@pytest.mark.parametrize("kind", ["relu", "jumprelu", "topk", "scaled", "transcoder", "skip_transcoder"])
def test_a_saved_dictionary_runs_the_same_in_saelens(tmp_path, kind):
    from interp_engine.features import save_dictionary

    g = torch.Generator().manual_seed(11)
    d_out = 12 if "transcoder" in kind else D_IN
    w = {"W_enc": torch.randn(D_IN, D_SAE, generator=g) * 0.3, "b_enc": torch.randn(D_SAE, generator=g) * 0.1,
         "W_dec": torch.randn(D_SAE, d_out, generator=g) * 0.3, "b_dec": torch.randn(d_out, generator=g) * 0.1}
    options = {"reads": "resid_mid.2", "writes": "mlp_out.2"} if "transcoder" in kind else {"reads": "resid_post.2"}
    if kind == "jumprelu":
        w["threshold"] = torch.rand(D_SAE, generator=g) * 0.2
    if kind == "skip_transcoder":
        w["W_skip"] = torch.randn(d_out, D_IN, generator=g) * 0.1
    if kind == "topk":
        options["k"] = 5
    if kind == "scaled":
        options["norm_scaling_factor"] = 0.4
    ours = load_dictionary(w, apply_b_dec_to_input=kind in ("relu", "scaled"), **options)
    folder = save_dictionary(ours, tmp_path / kind)
    agree(ours, sae_lens.SAE.load_from_disk(folder), x_for(), transcoder="transcoder" in kind)
    back = load_dictionary(folder)
    assert (back.reads, back.writes) == (ours.reads, ours.writes)
    f, out = back.forward(x_for())
    want_f, want_out = ours.forward(x_for())
    assert relative_error(f, want_f) <= SAME_BACKEND and relative_error(out, want_out) <= SAME_BACKEND


def test_a_transcoder_trained_on_ln2_hook_normalized_reads_that_tensor(tmp_path, eager_models):
    """Gemma Scope's / circuit-tracer's transcoders read TransformerLens's ``ln2.hook_normalized``:
    the pre-MLP norm before its gain. One saved by SAELens with that hook loads, runs at
    ``ln2_normalized.L`` and its features equal SAELens's own encode of that tensor, written out
    here from the norm's input (Gemma 2: ``pre_feedforward_layernorm``). The MLP's input (after
    the gain) would give other features."""
    from sae_lens.saes import transcoder as tc

    from interp_engine import run_with_cache

    model = eager_models("gemma2")
    d = model.d_model
    cfg = tc.TranscoderConfig(d_in=d, d_sae=D_SAE, d_out=d, apply_b_dec_to_input=False,
                              metadata=meta("blocks.1.ln2.hook_normalized", hook_name_out="blocks.1.hook_mlp_out"))
    randomise(tc.Transcoder(cfg), 12).save_model(tmp_path / "tc")
    theirs = sae_lens.SAE.load_from_disk(tmp_path / "tc")
    ours = load_dictionary(tmp_path / "tc")
    assert (ours.reads, ours.writes) == (Address("ln2_normalized", 1), Address("mlp_out_post", 1))
    tokens = model.to_tokens("The quick brown fox jumps over")
    seen = {}
    norm = model.hf.model.layers[1].pre_feedforward_layernorm
    handle = norm.register_forward_pre_hook(lambda m, args: seen.__setitem__("x", args[0].detach().clone()))
    try:
        cache = run_with_cache(model, tokens, ["ln2_normalized.1.features", "mlp_in.1"], saes=ours)
    finally:
        handle.remove()
    x = seen["x"].double()
    normalized = (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps)).float()
    with torch.no_grad():
        want = theirs.encode(normalized)
        wrong = theirs.encode(cache["mlp_in.1"])
    got = cache["ln2_normalized.1.features"]
    assert relative_error(got, want) <= SAME_BACKEND
    assert torch.equal(got != 0, want != 0), "the active features differ"
    # the MLP's input (after the gain, near 1 in a random tiny model) is another tensor
    assert relative_error(wrong, want) > 1e-2

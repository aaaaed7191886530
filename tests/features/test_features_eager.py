"""Feature points on the eager backend: captured inside the hook that makes the activation and
edited there, checked against the dense capture through the maths written out by hand and against
Hugging Face forwards with hand-written hooks (the edits' oracle)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from interp_engine import Add, AddressError, Cache, InputError, Scale, Set, Zero, capture_generation, run_with_cache
from interp_engine.address import FeatureAddress, parse_address
from interp_engine.errors import DictionaryError

from .. import sparse_dicts as sd
from ..devices import on
from ..oracles import REL_SAME, assert_near

PROMPT = "features, not just activations"


@pytest.fixture(scope="module")
def model(eager_models):
    return eager_models("llama")


@pytest.fixture(scope="module")
def tokens(model):
    return model.to_tokens(PROMPT)


def hf_logits(model, tokens, layer=None, fn=None, module=""):
    """The model's own logits, with ``fn`` replacing an output of decoder layer ``layer`` by hand."""
    with torch.no_grad():
        if fn is None:
            return model.hf(input_ids=on(model, tokens)).logits
        with sd.layer_output_hook(model, layer, fn, module):
            return model.hf(input_ids=on(model, tokens)).logits


@pytest.mark.parametrize("kind", ["relu", "jumprelu", "topk"])
def test_features_and_error_equal_the_maths_on_the_captured_activation(model, tokens, kind):
    sae = sd.sae(jumprelu=kind == "jumprelu", k=12 if kind == "topk" else None)
    cache = run_with_cache(model, tokens, ["resid_post.1", "resid_post.1.features", "resid_post.1.features[3,40]",
                                           "resid_post.1.sae_error"], saes=[sae])
    x = cache["resid_post.1"]
    f = cache["resid_post.1.features"]
    assert f.shape == (1, tokens.shape[1], sd.D_SAE)
    assert_near(f, sd.encode_by_hand(sae, x).to(f.dtype), "features", REL_SAME)
    assert torch.equal(cache["resid_post.1.features[3,40]"], f[..., [3, 40]])
    assert_near(cache["resid_post.1.sae_error"], (x.double() - sd.decode_by_hand(sae, f)).float(), "error", REL_SAME)
    active = (f != 0).sum(-1)
    assert int(active.min()) > 0 and int(active.max()) < sd.D_SAE // 2  # sparse, and not empty
    if kind == "topk":
        assert int(active.max()) <= 12
    # the encoding in the hook is the dictionary's own maths on the captured tensor: the same computation
    assert torch.equal(f, sae.encode(x))


def test_feature_points_alone_stop_after_their_layer_and_keep_no_dense_tensor(model, tokens):
    sae = sd.sae("mlp_out.0")
    cache = run_with_cache(model, tokens, "mlp_out.0.features", saes=sae)
    assert list(cache) == [parse_address("mlp_out.0.features")]
    full = run_with_cache(model, tokens, ["mlp_out.0"])
    assert torch.equal(cache["mlp_out.0.features"], sae.encode(full["mlp_out.0"]))


def test_a_padded_batch_row_equals_the_prompt_alone_and_padding_is_zero(model):
    sae = sd.sae(k=10)
    batch = model.tok.to_tokens(["a much longer prompt here", "short"])
    cache = run_with_cache(model, batch, ["resid_post.1.features"], saes=sae)
    for row, text in enumerate(["a much longer prompt here", "short"]):
        alone = run_with_cache(model, model.to_tokens(text), ["resid_post.1.features"], saes=sae)
        n = alone["resid_post.1.features"].shape[1]
        assert_near(cache["resid_post.1.features"][row, :n], alone["resid_post.1.features"][0], "row", REL_SAME)
        assert not cache["resid_post.1.features"][row, n:].any()


def test_positions_select_feature_rows_in_the_hook(model, tokens):
    sae = sd.sae()
    full = run_with_cache(model, tokens, ["resid_post.1.features"], saes=sae)
    some = run_with_cache(model, tokens, ["resid_post.1.features[5]", "resid_post.1.sae_error"], saes=sae,
                          positions=[0, -1])
    assert some.positions.tolist() == [[0, tokens.shape[1] - 1]]
    assert torch.equal(some["resid_post.1.features[5]"], full["resid_post.1.features"][:, [0, -1]][..., [5]])


def test_zeroing_the_error_splices_the_reconstruction(model, tokens):
    sae = sd.sae(k=16)
    spliced = run_with_cache(model, tokens, ["logits", "resid_post.1"], saes=sae,
                             edits={"resid_post.1.sae_error": Zero()})
    want = hf_logits(model, tokens, 1, lambda x: sae.forward(x)[1].to(x.dtype))
    assert_near(spliced["logits"], want, "spliced logits", REL_SAME)
    clean = run_with_cache(model, tokens, ["resid_post.1"])
    assert_near(spliced["resid_post.1"], sae.forward(clean["resid_post.1"])[1], "reconstruction", REL_SAME)
    assert not torch.allclose(spliced["logits"], hf_logits(model, tokens))


def test_an_edit_that_changes_nothing_leaves_the_model_bit_for_bit(model, tokens):
    sae = sd.sae()
    clean = run_with_cache(model, tokens, ["logits", "resid_post.1"])
    same = run_with_cache(model, tokens, ["logits", "resid_post.1"], saes=sae,
                          edits={"resid_post.1.features[2,9]": Scale(1.0), "resid_post.1.sae_error": Scale(1.0)})
    assert torch.equal(same["logits"], clean["logits"]) and torch.equal(same["resid_post.1"], clean["resid_post.1"])


def test_clamping_a_feature_moves_along_its_decoder_row_and_keeps_the_error(model, tokens):
    sae = sd.sae()
    j = 11
    edited = run_with_cache(model, tokens, ["logits", "resid_post.1.features"], saes=sae,
                            edits={f"resid_post.1.features[{j}]": Set(4.0, positions=[2, -1])})
    n = tokens.shape[1]

    def by_hand(x):  # x + (4 - f_j) W_dec[j] at the edited positions: the error term unchanged
        f = sd.encode_by_hand(sae, x)[..., j]
        out = x.clone()
        for p in (2, n - 1):
            out[:, p] = (x[:, p].double() + (4.0 - f[:, p, None]) * sae.W_dec[j].double()).to(x.dtype)
        return out

    assert_near(edited["logits"], hf_logits(model, tokens, 1, by_hand), "clamped logits", REL_SAME)
    f = edited["resid_post.1.features"]
    assert f[0, 2, j] == 4.0 and f[0, -1, j] == 4.0  # the capture shows the value after the edit
    clean = run_with_cache(model, tokens, ["resid_post.1.features"], saes=sae)["resid_post.1.features"]
    assert torch.equal(f[0, [0, 1, 3]], clean[0, [0, 1, 3]])


def test_adding_to_a_feature_adds_its_decoder_direction(model, tokens):
    sae = sd.sae()
    by_feature = run_with_cache(model, tokens, ["logits"], saes=sae, edits={"resid_post.1.features[7]": Add(3.0)})
    by_vector = run_with_cache(model, tokens, ["logits"], edits={"resid_post.1": Add(sae.W_dec[7], scale=3.0)})
    assert_near(by_feature["logits"], by_vector["logits"], "decoder direction", REL_SAME)


def test_a_zero_ablated_feature_set_changes_what_follows(model, tokens):
    sae = sd.sae()
    f = run_with_cache(model, tokens, ["resid_post.1.features"], saes=sae)["resid_post.1.features"]
    top = f[0].sum(0).topk(3).indices.tolist()
    edited = run_with_cache(model, tokens, ["logits", "resid_post.1.features"], saes=sae,
                            edits={f"resid_post.1.features[{','.join(map(str, top))}]": Zero()})
    assert not edited["resid_post.1.features"][..., top].any()
    want = hf_logits(model, tokens, 1, lambda x: (x.double() - sd.encode_by_hand(sae, x)[..., top]
                                                  @ sae.W_dec[top].double()).to(x.dtype))
    assert_near(edited["logits"], want, "ablated logits", REL_SAME)


@pytest.mark.parametrize("skip", [False, True])
def test_a_transcoder_reads_resid_mid_and_predicts_mlp_out(model, tokens, skip):
    tc = sd.transcoder(skip=skip)
    cache = run_with_cache(model, tokens, ["resid_mid.1", "mlp_out.1", "resid_mid.1.features", "mlp_out.1.sae_error"],
                           saes=[tc])
    x, y, f = cache["resid_mid.1"], cache["mlp_out.1"], cache["resid_mid.1.features"]
    assert_near(f, sd.encode_by_hand(tc, x).float(), "transcoder features", REL_SAME)
    prediction = sd.decode_by_hand(tc, f, x)
    assert_near(cache["mlp_out.1.sae_error"], (y.double() - prediction).float(), "transcoder error", REL_SAME)
    spliced = run_with_cache(model, tokens, ["resid_mid.1", "mlp_out.1", "resid_post.1"], saes=tc,
                             edits={"mlp_out.1.sae_error": Zero()})
    assert_near(spliced["mlp_out.1"], prediction.float(), "the MLP replaced by the transcoder", REL_SAME)
    assert_near(spliced["resid_post.1"], spliced["resid_mid.1"] + spliced["mlp_out.1"], "identity", REL_SAME)
    with pytest.raises(AddressError, match="needs a dictionary that writes resid_mid.1"):
        run_with_cache(model, tokens, ["resid_mid.1.sae_error"], saes=tc)


def test_feature_edits_apply_at_every_decode_step(model, tokens):
    sae = sd.sae(k=16)
    edit = {"resid_post.1.features[5]": Set(6.0)}
    completion, cache = capture_generation(model, tokens, ["resid_post.1.features[5]"], max_tokens=5, saes=sae,
                                           edits=edit)
    assert (cache["resid_post.1.features[5]"] == 6.0).all()
    with sd.layer_output_hook(model, 1, lambda x: (x.double() + (6.0 - sd.encode_by_hand(sae, x)[..., 5:6])
                                                   * sae.W_dec[5].double()).to(x.dtype)):
        ids = on(model, tokens)
        out = []
        with torch.no_grad():
            for _ in range(5):
                nxt = int(model.hf(input_ids=ids).logits[0, -1].argmax())
                out.append(nxt)
                ids = torch.cat([ids, torch.tensor([[nxt]], device=ids.device)], dim=1)
    assert completion.token_ids == out


def test_async_capture_keys_feature_points_by_address(model, tokens):
    sae = sd.sae()
    got = asyncio.run(model.capture(tokens, ["resid_post.1.features[1,2]"], saes=sae))
    assert list(got) == [FeatureAddress(parse_address("resid_post.1"), "features", (1, 2))]
    with pytest.raises(KeyError):
        got["resid_post.1.features[1,2]"]


def test_gradients_flow_through_features(eager_models, tiny_path):
    from interp_engine import load_model

    model = load_model(str(tiny_path("llama")), backend="eager", requires_grad=True)
    sae = sd.sae()
    cache = run_with_cache(model, model.to_tokens(PROMPT), ["resid_post.1.features"], saes=sae, detach=False)
    cache["resid_post.1.features"].sum().backward()
    assert model.hf.model.layers[0].mlp.down_proj.weight.grad.abs().sum() > 0


def test_a_cache_of_features_saves_and_loads(model, tokens, tmp_path):
    cache = run_with_cache(model, tokens, ["resid_post.1.features[4,8]", "resid_post.1.sae_error"], saes=sd.sae())
    cache.save(tmp_path / "f.safetensors")
    back = Cache.load(tmp_path / "f.safetensors")
    assert list(back) == list(cache)
    assert all(torch.equal(back[a], cache[a]) for a in cache)


def test_bad_feature_requests_say_what_to_do(model, tokens):
    sae = sd.sae()
    with pytest.raises(AddressError, match=r"needs a dictionary that reads resid_post.2: pass one with saes="):
        run_with_cache(model, tokens, ["resid_post.2.features"], saes=sae)
    with pytest.raises(AddressError, match="needs a dictionary"):
        run_with_cache(model, tokens, ["resid_post.1.features"])
    with pytest.raises(AddressError, match=f"features 0..{sd.D_SAE - 1}"):
        run_with_cache(model, tokens, [f"resid_post.1.features[{sd.D_SAE}]"], saes=sae)
    with pytest.raises(DictionaryError, match="256 wide"):
        run_with_cache(model, tokens, ["mlp_post.1.features"], saes=sd.sae("mlp_post.1"))
    with pytest.raises(DictionaryError, match="one dictionary per site"):
        run_with_cache(model, tokens, ["resid_post.1.features"], saes=[sae, sd.sae(seed=1)])
    with pytest.raises(DictionaryError, match="layers 0..2"):
        run_with_cache(model, tokens, ["resid_post.1"], saes=sd.sae("resid_post.7"))
    with pytest.raises(DictionaryError, match="saes= takes a Dictionary"):
        run_with_cache(model, tokens, ["resid_post.1.features"], saes={"x": sae})
    with pytest.raises(InputError, match="no head axis"):
        run_with_cache(model, tokens, ["logits"], saes=sae, edits={"resid_post.1.features[1]": Zero(heads=[0])})
    with pytest.raises(InputError, match=r"does not fit"):
        run_with_cache(model, tokens, ["logits"], saes=sae, edits={"resid_post.1.features[1,2]": Set([1.0, 2.0, 3.0])})
    with pytest.raises(InputError, match="out of range"):
        run_with_cache(model, tokens, ["logits"], saes=sae, edits={"resid_post.1.features[1]": Zero(positions=[99])})
    with pytest.raises(DictionaryError, match="before"):
        run_with_cache(model, tokens, ["logits"], saes=sd.transcoder("mlp_out.1", "resid_mid.1"))


def test_ce_loss_recovered_equals_the_loss_by_hand(model):
    import torch.nn.functional as F

    from interp_engine.features import ce_loss_recovered

    prompts = ["one prompt here", "and another, a little longer", "third"]
    sae = sd.sae(k=24)
    got = ce_loss_recovered(model, sae, prompts, batch_size=2)

    def loss(fn=None):
        total, n = 0.0, 0
        for p in prompts:
            ids = model.to_tokens(p)
            logits = hf_logits(model, ids, 1, fn) if fn else hf_logits(model, ids)
            total += float(F.cross_entropy(logits[0, :-1].float().cpu(), ids[0, 1:], reduction="sum"))
            n += ids.shape[1] - 1
        return total / n, n

    clean, n = loss()
    spliced, _ = loss(lambda x: sae.forward(x)[1].to(x.dtype))
    ablated, _ = loss(torch.zeros_like)
    assert got.tokens == n
    for name, want in (("clean", clean), ("spliced", spliced), ("ablated", ablated)):
        assert abs(getattr(got, name) - want) <= REL_SAME * abs(want), name


def test_a_dictionary_that_reconstructs_exactly_recovers_all_the_loss(model):
    from interp_engine.features import ce_loss_recovered, load_dictionary

    eye = torch.eye(sd.D_MODEL)
    exact = load_dictionary({"W_enc": torch.cat([eye, -eye], 1), "b_enc": torch.zeros(2 * sd.D_MODEL),
                             "W_dec": torch.cat([eye, -eye], 0), "b_dec": torch.zeros(sd.D_MODEL)},
                            reads="resid_post.1")  # relu(x) - relu(-x) = x
    got = ce_loss_recovered(model, exact, ["an exact reconstruction", "loses nothing"])
    assert abs(got.spliced - got.clean) <= REL_SAME * got.clean
    # the random model's loss moves little even when ablated (ablated - clean ~ 1e-3), so the ratio
    # carries the splice's float rounding amplified: 1 within 1e-2
    assert got.ablated != got.clean and abs(got.recovered - 1.0) < 1e-2


def test_a_dropped_dictionary_leaves_the_eager_models_device_copies(model):
    """``drop_dictionary`` (a service replica calls it for each dictionary it drops) forgets the
    device copies an eager model keeps between calls; the next call places it again."""
    a, b = sd.sae(seed=1), sd.sae(seed=2)
    placed = model._dictionaries
    meta = torch.device("meta")  # a device other than the dictionaries': copies are kept
    first = placed(a, meta)
    assert placed(a, meta) is first and placed(b, meta).device == meta
    model.drop_dictionary(a.key)
    assert [key for key, _ in placed._held] == [b.key]
    assert placed(a, meta) is not first
    model.drop_dictionary(a.key), model.drop_dictionary(b.key)

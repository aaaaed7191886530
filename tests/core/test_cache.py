"""The Cache: lookups by Address or string, mask and tokens, safetensors round trip."""

import pytest
import torch

from interp_engine import Address, Cache


def make_cache():
    tokens = torch.tensor([[5, 6, 7], [8, 9, -1]])
    data = {Address("resid_post", 1): torch.randn(2, 3, 4), Address("logits"): torch.randn(2, 3, 10)}
    return Cache(data, tokens, model_name="m", backend="eager")


def test_lookup_forms():
    cache = make_cache()
    t = cache[Address("resid_post", 1)]
    assert cache["resid_post.1"] is t and cache.get("resid_post", 1) is t and cache[("resid_post", 1)] is t
    assert "resid_post.1" in cache and Address("logits") in cache and "mlp_out.1" not in cache
    assert "nonsense" not in cache
    assert list(cache) == [Address("resid_post", 1), Address("logits")]
    assert len(cache) == 2
    assert cache.mask.tolist() == [[True, True, True], [True, True, False]]
    assert cache.lengths.tolist() == [3, 2]
    with pytest.raises(KeyError, match="holds: resid_post.1, logits"):
        cache["mlp_out.1"]


def test_save_load_round_trip(tmp_path):
    cache = make_cache()
    cache.save(tmp_path / "c.safetensors")
    back = Cache.load(tmp_path / "c.safetensors")
    assert list(back) == list(cache)
    for a in cache:
        assert torch.equal(back[a], cache[a])
    assert torch.equal(back.tokens, cache.tokens) and torch.equal(back.mask, cache.mask)
    assert (back.model_name, back.backend) == ("m", "eager")
    # safetensors, not pickle: the file starts with a little-endian header length then JSON
    raw = (tmp_path / "c.safetensors").read_bytes()
    assert raw[8:9] == b"{"


def test_load_rejects_other_files(tmp_path):
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, str(tmp_path / "x.safetensors"))
    with pytest.raises(ValueError, match="not an interp_engine cache"):
        Cache.load(tmp_path / "x.safetensors")


def test_cache_holds_no_model():
    cache = make_cache()
    assert not any(isinstance(v, torch.nn.Module) for v in vars(cache).values())

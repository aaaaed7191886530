"""A stream feeds SAELens's trainer: the adapter's batches, and the example that trains a TopK SAE
from a stream and saves it with save_dictionary (read back by SAELens and by load_dictionary)."""

from __future__ import annotations

import pytest
import torch

from interp_engine import InputError, activation_stream, load_dictionary, run_with_cache
from interp_engine.examples.stream_sae import prompts, train_sae
from interp_engine.stream.saelens import SAELensActivations

sae_lens = pytest.importorskip("sae_lens")


def test_adapter_is_an_activation_store(llama):
    stream = activation_stream(llama, prompts(12), ["resid_post.1", "mlp_out.0"], batch_tokens=32,
                               shuffle_buffer=64, seed=1, progress=False)
    with pytest.raises(InputError, match="point="):
        SAELensActivations(stream)
    store = SAELensActivations(stream, "mlp_out.0")
    direct = [b["mlp_out.0"] for b in stream]
    got = [store.next_batch()] + [next(store) for _ in range(len(direct) - 1)]
    assert all(torch.equal(a.float(), b) and b.dtype == torch.float32 for a, b in zip(direct, got))
    with pytest.raises(StopIteration):
        next(store)
    assert store.state() == {**stream.state(), "epoch": 1, "batches": 0}


def test_example_trains_a_topk_sae_from_a_stream(llama, tmp_path):
    texts = prompts(40)
    torch.manual_seed(0)
    saved = train_sae(llama, texts, "resid_post.1", tmp_path / "sae", tokens=2048, d_sae=64, k=8, batch_tokens=64,
                      shuffle_buffer=256, lr=3e-3, progress=False)
    theirs = sae_lens.SAE.load_from_disk(str(tmp_path / "sae"))
    ours = load_dictionary(tmp_path / "sae")
    assert type(theirs).__name__ == "TopKSAE" and ours.k == 8 and str(ours.reads) == "resid_post.1"
    x = run_with_cache(llama, llama.to_tokens(texts[:4]), ["resid_post.1"])["resid_post.1"].flatten(0, 1)
    with torch.no_grad():
        mine = ours.decode(ours.encode(x))
        assert torch.allclose(mine, theirs.decode(theirs.encode(x)), atol=1e-5)
        fvu = ((mine - x) ** 2).sum() / ((x - x.mean(0)) ** 2).sum()
    assert fvu < 0.6, f"fraction of variance unexplained {fvu:.3f}: the SAE did not learn"
    assert saved.k == 8

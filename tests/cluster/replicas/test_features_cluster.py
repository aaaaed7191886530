"""Feature points through a cluster model (a simulated 3-node Ray cluster, two eager replicas):
each replica fetches the dictionary once, encodes the features where its activations are made and
sends back only the active ones; the cluster's features, feature edits, sparse dataset and
dashboard equal the local model's within the equality contract (a replica runs another batch
shape and thread count: tests/oracles.py)."""

from __future__ import annotations

import pytest
import torch

from interp_engine import Set, Zero, build_dataset, capture_generation, feature_dashboard, load_model, run_with_cache

from ... import sparse_dicts as sd
from ...oracles import REL_SAME, assert_near

ray = pytest.importorskip("ray")
PROMPTS = ["The quick brown fox", "jumps", "over the lazy dog again", "!!", "and one more prompt here"]


def test_cluster_features_and_edits_equal_local(cluster_llama, eager_models, monkeypatch):
    from interp_engine.features import transfer as wire

    local = eager_models("llama")
    tokens = local.tok.to_tokens(PROMPTS)
    sae, tc = sd.sae(k=12), sd.transcoder()
    # the model is shared with the folder's other tests: start this one with nothing put, count the puts
    monkeypatch.setattr(cluster_llama, "_dictionaries", {})
    puts = []
    for_replica = wire.dictionary_for_replica
    monkeypatch.setattr(wire, "dictionary_for_replica", lambda d: puts.append(d.key) or for_replica(d))
    points = ["resid_post.1.features", "resid_post.1.features[2,5]", "resid_post.1.sae_error",
              "resid_mid.1.features", "mlp_out.1.sae_error", "logits"]
    edits = {"resid_post.1.features[5]": Set(4.0, positions=[-1]), "mlp_out.1.sae_error": Zero()}
    for kwargs in ({}, {"edits": edits}):
        got = run_with_cache(cluster_llama, tokens, points, saes=[sae, tc], **kwargs)
        want = run_with_cache(local, tokens, points, saes=[sae, tc], **kwargs)
        assert list(got) == list(want)
        for point in points:
            assert_near(got[point], want[point], point, REL_SAME)
        assert torch.equal(got.mask, want.mask)
    assert (got["resid_post.1.features[2,5]"][torch.arange(len(PROMPTS)), got.lengths - 1, 1] == 4.0).all()
    # each put in the object store once, for both calls
    assert sorted(puts) == sorted([sae.key, tc.key]) and set(cluster_llama._dictionaries) == set(puts)


def test_replicas_send_back_only_active_features(cluster_llama, eager_models):
    local = eager_models("llama")
    tokens = local.tok.to_tokens(PROMPTS)
    sae = sd.sae(k=12)
    handles = cluster_llama._replicas
    before = sum(ray.get([h.returned_bytes.remote() for h in handles]))
    got = run_with_cache(cluster_llama, tokens, ["resid_post.1.features"], saes=sae)
    sent = sum(ray.get([h.returned_bytes.remote() for h in handles])) - before
    dense = got["resid_post.1.features"]
    rows = dense.shape[0] * dense.shape[1]  # every padded row of each replica's share
    active = int((dense != 0).sum())
    assert active > 0
    # at least each active feature's id and value (4 + 4 bytes), at most those plus row offsets and tokens
    assert active * 8 <= sent <= active * 8 + 2 * (rows + 2) * 8 + 2 * rows * 8 < dense.numel() * 4 / 10


def test_cluster_generation_with_a_feature_edit_equals_local(cluster_llama, eager_models):
    local = eager_models("llama")
    tokens = local.to_tokens("steer me")
    kwargs = dict(max_tokens=4, saes=sd.sae(k=12), edits={"resid_post.1.features[7]": Set(8.0)})
    got_c, got = capture_generation(cluster_llama, tokens, ["resid_post.1.features[7]"], **kwargs)
    want_c, want = capture_generation(local, tokens, ["resid_post.1.features[7]"], **kwargs)
    assert got_c.token_ids == want_c.token_ids and (got["resid_post.1.features[7]"] == 8.0).all()


def test_ce_loss_recovered_on_a_cluster_equals_local(cluster_llama, eager_models):
    """The splice runs where the activations are made (the replicas), through the same calls."""
    from interp_engine.features import ce_loss_recovered

    tc = sd.transcoder()
    got = ce_loss_recovered(cluster_llama, tc, PROMPTS[:3] + PROMPTS[4:], batch_size=2)
    want = ce_loss_recovered(eager_models("llama"), tc, PROMPTS[:3] + PROMPTS[4:], batch_size=2)
    assert got.tokens == want.tokens > 0
    for name in ("clean", "spliced", "ablated"):
        assert abs(getattr(got, name) - getattr(want, name)) <= 1e-5 * abs(getattr(want, name)), name
    assert want.spliced != want.clean != want.ablated


def test_cluster_dataset_and_dashboard_equal_local(cluster_llama, eager_models, tmp_path):
    local = eager_models("llama")
    sae = sd.sae(k=12)
    kwargs = dict(layout="token", shard_size=2, progress=False, saes=sae)
    got = build_dataset(cluster_llama, PROMPTS, ["resid_post.1.features"], tmp_path / "c", **kwargs)
    want = build_dataset(local, PROMPTS, ["resid_post.1.features"], tmp_path / "l", **kwargs)
    assert_near(got.tensor("resid_post.1.features"), want.tensor("resid_post.1.features"), "dataset", REL_SAME)
    dash_c = feature_dashboard(cluster_llama, PROMPTS, [sae], tmp_path / "dc", top_k=3, shard_size=2)
    dash_l = feature_dashboard(local, PROMPTS, [sae], tmp_path / "dl", top_k=3, shard_size=2)
    fc, fl = dash_c.features().to_pandas(), dash_l.features().to_pandas()
    assert (fc["n_fired"] == fl["n_fired"]).all()
    assert_near(torch.tensor(fc["max_activation"].to_numpy()), torch.tensor(fl["max_activation"].to_numpy()),
                "dashboard maxima", REL_SAME)


def test_killing_a_replica_mid_dashboard_changes_nothing(cluster_llama, tiny_path, tmp_path):
    import threading
    import time

    from ...faults import kill_replica

    prompts = [f"prompt {i}: " + "word " * (i % 7) for i in range(24)]
    sae = sd.sae(k=12)
    # CPU-only replicas, one torch thread each: a shard moved to the other replica is the same computation
    model = load_model(str(tiny_path("llama")), replicas=2, gpus_per_replica=0, cpus_per_replica=0.25,
                       torch_threads=1)
    try:
        clean = feature_dashboard(model, prompts, [sae], tmp_path / "clean", top_k=3, shard_size=2)
        out = tmp_path / "faulty"

        def killer():
            while len(list(out.glob("stats-*.parquet"))) < 2:
                time.sleep(0.01)
            kill_replica(model, 1, restart=False)

        thread = threading.Thread(target=killer, daemon=True)
        thread.start()
        try:
            faulty = feature_dashboard(model, prompts, [sae], out, top_k=3, shard_size=2)
        finally:
            thread.join(timeout=30)
        assert ray.get(model._coordinator.resubmitted.remote()) >= 1  # the kill hit work in flight
        for name in ("features.parquet", "contexts.parquet"):
            assert (tmp_path / "clean" / name).read_bytes() == (out / name).read_bytes()
        assert faulty.tokens == clean.tokens
    finally:
        model.close()

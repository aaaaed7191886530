"""positions=, whole sites, tokens and the logit lens on cluster models (a simulated 3-node Ray
cluster, eager replicas; and a vLLM replica).

A replica applies the selection inside its model, so what it returns shrinks: each replica
counts the bytes of the activations it has returned (``model.bytes_returned()``), and a
selection of one position must return exactly that share of the full capture's bytes. The
tensors equal the full capture's (bit for bit: each replica pins one torch thread and runs the
same shard either way) and the local model's within the float tolerance of a different batch.
"""

from __future__ import annotations

import pytest
import torch

from interp_engine import capture_generation, logit_lens, run_with_cache

from ...oracles import REL_SAME, assert_near

ray = pytest.importorskip("ray")
PROMPTS = ["The quick brown fox", "jumps", "over the lazy dog again", "!"]
POINTS = ["resid_post", "z.0", "logits"]


def sent(model) -> int:
    return sum(model.bytes_returned())


def full_and_last(model, tokens, points):
    """The full capture and the last position's, each with the bytes the replicas returned for it;
    the last position's rows equal the full capture's at each prompt's last real position."""
    lengths = (tokens >= 0).sum(1).tolist()
    before = sent(model)
    full = run_with_cache(model, tokens, points)
    full_bytes = sent(model) - before
    before = sent(model)
    last = run_with_cache(model, tokens, points, positions=-1)
    last_bytes = sent(model) - before
    assert last.positions.tolist() == [[n - 1] for n in lengths]
    for address in full:
        for b, n in enumerate(lengths):
            assert torch.equal(last[address][b, 0], full[address][b, n - 1]), address
    return full, last, full_bytes, last_bytes


def test_positions_on_a_padded_batch_and_the_bytes_returned(cluster_llama, eager_models):
    local = eager_models("llama")
    tokens = local.tok.to_tokens(PROMPTS)
    lengths = (tokens >= 0).sum(1).tolist()
    full, last, full_bytes, last_bytes = full_and_last(cluster_llama, tokens, POINTS)
    # each replica returns its two rows at the batch's padded width; the selection one position
    # per row (and that position, an int64)
    per_position = sum(t[0, 0].nbytes for t in full.values())
    assert full_bytes == per_position * len(PROMPTS) * tokens.shape[1]
    assert last_bytes == (per_position + 8) * len(PROMPTS)
    want = run_with_cache(local, tokens, POINTS, positions=-1)
    assert torch.equal(want.positions, last.positions)
    for address in want:
        assert_near(last[address], want[address], str(address))


def test_generation_and_slices_on_a_cluster(cluster_llama, eager_models):
    local = eager_models("llama")
    tokens = local.to_tokens("Hello there")
    n = tokens.shape[1]
    c1, full = capture_generation(cluster_llama, tokens, ["resid_post.2"], max_tokens=5)
    c2, gen = capture_generation(cluster_llama, tokens, ["resid_post.2"], max_tokens=5, positions="generated")
    assert c1 == c2 and gen.positions.tolist() == [list(range(n, full.tokens.shape[1]))]
    assert torch.equal(gen["resid_post.2"], full["resid_post.2"][:, n:])
    batch = local.tok.to_tokens(PROMPTS)
    got = run_with_cache(cluster_llama, batch, ["resid_post.1"], positions=slice(-3, None))
    want = run_with_cache(local, batch, ["resid_post.1"], positions=slice(-3, None))
    assert torch.equal(got.positions, want.positions)
    assert_near(got["resid_post.1"], want["resid_post.1"], "slice of resid_post.1", REL_SAME)
    # and each selected row is that position of the cluster's own full capture
    whole = run_with_cache(cluster_llama, batch, ["resid_post.1"])
    for b, row in enumerate(got.positions.tolist()):
        for k, p in enumerate(row):
            if p >= 0:
                assert torch.equal(got["resid_post.1"][b, k], whole["resid_post.1"][b, p]), (b, p)


def test_whole_sites_lens_and_tokens_on_a_cluster(cluster_llama, eager_models):
    local = eager_models("llama")
    assert cluster_llama.points() == local.points()
    assert cluster_llama.points("resid_post") == local.points("resid_post")
    tokens = local.to_tokens("The lens")
    got = run_with_cache(cluster_llama, tokens, ["resid_post", "logits"])
    want = run_with_cache(local, tokens, ["resid_post", "logits"])
    assert list(got) == list(want)
    # the final norm and unembedding came from a replica once, and compute what eager computes
    assert torch.equal(cluster_llama.unembed_weight(), local.unembed_weight().detach())
    assert cluster_llama.unembed_weight() is cluster_llama.unembed_weight()
    assert_near(logit_lens(cluster_llama, got), logit_lens(local, want), "cluster lens", rel=1e-4)
    assert cluster_llama.to_str_tokens("The lens") == local.to_str_tokens("The lens")
    assert cluster_llama.to_string(tokens) == local.to_string(tokens)


def test_bad_positions_fail_before_any_work(cluster_llama):
    from interp_engine import InputError

    tokens = cluster_llama.tok.to_tokens(PROMPTS)
    before = sent(cluster_llama)
    with pytest.raises(InputError, match="out of range for batch row 3"):
        run_with_cache(cluster_llama, tokens, POINTS, positions=3)
    with pytest.raises(InputError, match="selects no position"):
        run_with_cache(cluster_llama, tokens, POINTS, positions=[])
    from interp_engine import AddressError

    with pytest.raises(AddressError, match="matched no address"):
        run_with_cache(cluster_llama, tokens, [lambda a: a.name == "nothing"])
    assert sent(cluster_llama) == before


def test_a_vllm_replica_selects_inside_its_engine(cluster_vllm, eager_models):
    """A padded batch goes to the vLLM replica prompt by prompt; each prompt's engine request keeps
    only its last row, so the replica returns one position per prompt."""
    tokens = eager_models("llama").tok.to_tokens(PROMPTS)
    lengths = (tokens >= 0).sum(1).tolist()
    full, last, full_bytes, last_bytes = full_and_last(cluster_vllm, tokens, ["resid_post.1", "z.0"])
    per_position = sum(t[0, 0].nbytes for t in full.values())
    # one prompt per shard, at its true length: every real position, and then one per prompt
    assert full_bytes == per_position * sum(lengths)
    assert last_bytes == (per_position + 8) * len(PROMPTS)
    got = logit_lens(cluster_vllm, run_with_cache(cluster_vllm, tokens[:1], ["resid_post.2"]))[:, :, : lengths[0]]
    local = eager_models("llama")
    assert_near(got, logit_lens(local, run_with_cache(local, tokens[:1, : lengths[0]], ["resid_post.2"])),
                "vLLM replica lens")

"""bench/peer_points.py's own parts, without the peer: the name map, the deliberate-difference
rules, the safetensors exchange with bench/peer_side.py, and its command line. (The comparison
itself needs the peer's own venv and runs by hand; its last run is in docs/PEER.md.)"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from interp_engine import SITES

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _module(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


sys.path.insert(0, str(BENCH))  # peer_points imports peer_names beside it, as a script does
try:
    names = _module("peer_names")
    pp = _module("peer_points")
    side = _module("peer_side")
finally:
    sys.path.remove(str(BENCH))


def test_the_peer_names_map_onto_ours():
    sites = {"pattern", "mlp_post", "v", "resid_pre", "logits", "z", "attn_out"}
    assert names.our_addresses("attn_probs.2", sites) == [("pattern", 2)]
    assert names.our_addresses("mlp_act.0", sites) == [("mlp_post", 0)]
    assert names.our_addresses("value.1", sites) == [("v", 1)]
    assert names.our_addresses("lm_head", sites) == [("logits", None)]
    assert names.our_addresses("embeddings", sites) == [("resid_pre", 0)]  # model-level there, layer 0 here
    assert names.our_addresses("z.3", sites) == [("z", 3)]
    assert names.our_addresses("attn_in.1", sites) == []
    assert names.our_addresses("attn_in.1", sites | {"attn_in"}) == [("attn_in", 1)]  # a name we gain is compared
    # a name the model serves is compared under that name only; its alias only where the model lacks it
    assert names.our_addresses("embeddings", sites | {"embeddings"}) == [("embeddings", None)]
    assert names.our_addresses("embeddings", sites | {"embeddings"}, served=sites) == [("embeddings", None),
                                                                                       ("resid_pre", 0)]


def test_every_alias_and_rule_names_a_real_site():
    assert {a.partition(".")[0] for a in names.ALIASES.values()} <= set(SITES), "an alias names no site of ours"
    for rule in names.DELIBERATE:
        assert rule.why and rule.ours in SITES, rule
        assert rule.ours == rule.name or names.ALIASES[rule.name].partition(".")[0] == rule.ours, rule


def _ctx(peer: dict, address: str, **config) -> object:
    return names.Context(config, peer, address)


def test_heads_compare_flattened_and_a_changed_value_fails():
    ours = torch.randn(2, 5, 4, 8)
    peer = ours.reshape(2, 5, 32).clone()
    assert names.judge("z.1", "z", ours, peer, _ctx({"z.1": peer}, "z.1"))[0] == "agrees"
    peer[1, 2, 3] += 1e-3 * peer.abs().max()
    assert names.judge("z.1", "z", ours, peer, _ctx({"z.1": peer}, "z.1"))[0] == "DIFFERS"
    assert names.judge("z.1", "z", torch.randn(2, 5, 4, 7), peer, _ctx({}, "z.1"))[0] == "SHAPE"


def test_attn_out_is_the_raw_output_on_both_sides():
    raw, post = torch.randn(1, 4, 16), torch.randn(1, 4, 16)
    ctx = _ctx({"attn_out.0": raw, "attn_out_post.0": post}, "attn_out.0")
    assert names.judge("attn_out.0", "attn_out", raw, raw, ctx)[0] == "agrees"
    assert names.judge("attn_out.0", "attn_out", post, raw, ctx)[0] == "DIFFERS"  # no rule excuses it any more
    assert not {("attn_out", "attn_out"), ("mlp_out", "mlp_out")} & set(names.DELIBERATE_BY_PAIR)


def test_logits_after_the_softcap_against_lm_head_before_it():
    lm_head = torch.randn(1, 3, 11) * 40
    capped = 30.0 * torch.tanh(lm_head / 30.0)
    ctx = _ctx({"lm_head": lm_head}, "lm_head", final_logit_softcapping=30.0)
    assert names.judge("lm_head", "logits", capped, lm_head, ctx)[0] == "deliberate"
    assert names.judge("lm_head", "logits", lm_head, lm_head, ctx)[0] == "STALE"
    assert names.judge("lm_head", "logits", torch.randn(1, 3, 11), lm_head, ctx)[0] == "DIFFERS"  # neither
    uncapped = _ctx({"lm_head": lm_head}, "lm_head", final_logit_softcapping=None)
    assert names.judge("lm_head", "logits", lm_head, lm_head, uncapped)[0] == "agrees"
    # the rule is about our logits: our own lm_head (same name) must equal the peer's, capped or not
    assert names.judge("lm_head", "lm_head", lm_head, lm_head, ctx)[0] == "agrees"
    assert names.judge("lm_head", "lm_head", capped, lm_head, ctx)[0] == "DIFFERS"


def test_the_exchange_file_round_trips(tmp_path):
    shared = torch.randn(2, 3, 16)
    tensors = {"attn_out.0": shared, "attn_out_post.0": shared,  # one tensor under two names
               "attn_probs.1": torch.rand(2, 4, 3, 3), "expert_indices.1": torch.randint(0, 8, (2, 3, 2))}
    refused = {"q_norm_in": "Layer 0 has no q_norm"}
    out = tmp_path / "peer.safetensors"
    side.write_result(str(out), tensors, "1.14.2", refused, order=["attn_out", "attn_out_post"])
    got = pp.read_peer_result(out)
    assert set(got.tensors) == set(tensors)
    for name, tensor in tensors.items():
        assert got.tensors[name].dtype == tensor.dtype and torch.equal(got.tensors[name], tensor), name
    assert (got.refused, got.error, got.version, got.order) == (refused, "", "1.14.2", ("attn_out", "attn_out_post"))
    side.write_result(str(out), {}, "1.14.2", {}, "ValueError: no such architecture")
    assert pp.read_peer_result(out).error == "ValueError: no such architecture"
    assert b"pickle" not in out.read_bytes() and out.read_bytes()[8:9] == b"{"  # a safetensors JSON header


def test_the_command_line(tmp_path):
    done = subprocess.run([sys.executable, str(BENCH / "peer_points.py"), "--help"], capture_output=True, text=True)
    assert done.returncode == 0 and "--peer-venv" in done.stdout, done.stderr
    with pytest.raises(SystemExit, match="inside this checkout"):
        pp.ensure_peer_venv(pp.ROOT / "peer-venv")


def test_a_shape_mismatch_is_excused_only_where_a_rule_applies():
    ours, peer = torch.randn(2, 21, 128), torch.randn(168, 32)  # the peer's Qwen4-Exp final_norm: a gated norm
    qwen4 = _ctx({"final_norm": peer}, "final_norm", model_type="qwen4_exp_text")
    assert names.judge("final_norm", "final_norm", ours, peer, qwen4)[0] == "deliberate"
    llama = _ctx({"final_norm": peer}, "final_norm", model_type="llama")
    assert names.judge("final_norm", "final_norm", ours, peer, llama)[0] == "SHAPE"

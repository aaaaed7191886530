"""Bad input gets a clear error naming the fix, and leaves no state behind: no hook stays
attached, the attention implementation is restored, and the same model serves the next call."""

import pytest
import torch

from interp_engine import AddressError, InputError, ModelNotFound, load_model, run_with_cache
from interp_engine.backends.eager import attention

GOOD = ["resid_post.1", "pattern.0"]


def hooks(model):
    """Every hook on the model; transformers keeps a few of its own, which must stay as they are."""
    return [(name, len(m._forward_hooks), len(m._forward_pre_hooks)) for name, m in model.hf.named_modules()]


@pytest.fixture(scope="module")
def model(eager_models):
    model = eager_models("llama")
    # transformers adds hooks of its own the first time hidden states are asked for
    model.hf(input_ids=model.to_tokens("warm"), output_hidden_states=True)
    model.baseline_hooks = hooks(model)
    return model


def no_state_left(model):
    assert hooks(model) == model.baseline_hooks
    assert len(attention._LISTENERS) == 0
    assert attention.implementation(model.hf) == attention.SDPA


def still_serves(model):
    tokens = model.to_tokens("still here")
    cache = run_with_cache(model, tokens, GOOD)
    ref = model.hf(input_ids=tokens, output_hidden_states=True).hidden_states[2]
    torch.testing.assert_close(cache.get("resid_post", 1), ref, atol=1e-5, rtol=0)
    no_state_left(model)


BAD = [
    ("unknown site", lambda m: run_with_cache(m, m.to_tokens("a"), ["resid_psot.1"]), AddressError, "known sites"),
    ("layer too big", lambda m: run_with_cache(m, m.to_tokens("a"), ["resid_post.3"]), AddressError, r"layers 0\.\.2"),
    ("negative layer past the first", lambda m: run_with_cache(m, m.to_tokens("a"), ["resid_post.-4"]), AddressError,
     r"layers 0\.\.2.*-3 is layer 0"),
    ("stream on dense", lambda m: run_with_cache(m, m.to_tokens("a"), ["resid_streams.1.1"]), AddressError, "only stream 0"),
    ("detach without grad", lambda m: run_with_cache(m, m.to_tokens("a"), GOOD, detach=False), InputError, "requires_grad=True"),
    ("empty prompt", lambda m: run_with_cache(m, torch.zeros(1, 0, dtype=torch.long), GOOD), InputError, "empty prompt"),
    ("empty row", lambda m: run_with_cache(m, torch.tensor([[5, 6], [-1, -1]]), GOOD), InputError, "empty prompt at batch row 1"),
    ("id >= vocab", lambda m: run_with_cache(m, torch.tensor([[1, 320]]), GOOD), InputError, "vocabulary"),
    ("too long", lambda m: run_with_cache(m, torch.ones(1, 257, dtype=torch.long), GOOD), InputError, "256 positions"),
    ("float tokens", lambda m: run_with_cache(m, torch.ones(1, 3), GOOD), InputError, "integer ids"),
    ("list of strings", lambda m: run_with_cache(m, ["a b"], GOOD), InputError, "torch tensor"),
    ("list of negative ids", lambda m: run_with_cache(m, [[1, -2]], GOOD), InputError, "negative"),
    ("left padding", lambda m: run_with_cache(m, torch.tensor([[-1, 5]]), GOOD), InputError, "right padding"),
    ("no points", lambda m: run_with_cache(m, m.to_tokens("a"), []), AddressError, "no points"),
    ("max_tokens 0", lambda m: m.capture_generation(m.to_tokens("a"), GOOD, max_tokens=0), InputError, "max_tokens"),
    ("generate batch", lambda m: m.capture_generation(m.tok.to_tokens(["a", "bc"]), GOOD), InputError, "one prompt"),
]


@pytest.mark.parametrize("case, call, error, message", BAD, ids=[b[0] for b in BAD])
def test_bad_input(model, case, call, error, message):
    with pytest.raises(error, match=message):
        call(model)
    still_serves(model)


def test_error_inside_forward_removes_hooks(model):
    def boom(*_):
        raise RuntimeError("boom")

    handle = model.hf.model.layers[1].mlp.register_forward_hook(boom)
    try:
        with pytest.raises(RuntimeError, match="boom"):
            run_with_cache(model, model.to_tokens("x"), ["resid_post.2", "pattern.1", "q.2"])
    finally:
        handle.remove()
    still_serves(model)


def test_duplicate_points_are_captured_once(model):
    cache = run_with_cache(model, model.to_tokens("dup"), ["resid_post.1", ("resid_post", 1), "mlp_out.0"])
    assert [str(a) for a in cache] == ["resid_post.1", "mlp_out.0"]


def test_hub_id_not_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFound, match="never downloads"):
        load_model("nobody/not-a-model")


def test_folder_without_config(tmp_path):
    with pytest.raises(ModelNotFound, match="no config.json"):
        load_model(str(tmp_path))


def test_unknown_backend():
    with pytest.raises(ValueError, match="eager, vllm"):
        load_model("x", backend="tpu")


def test_hub_id_resolved_from_local_cache(tmp_path, monkeypatch, tiny_path):
    import shutil

    snapshot = tmp_path / "hub" / "models--tiny-org--tiny-llama" / "snapshots" / ("0" * 40)
    shutil.copytree(tiny_path("llama"), snapshot)
    (tmp_path / "hub" / "models--tiny-org--tiny-llama" / "refs").mkdir()
    (tmp_path / "hub" / "models--tiny-org--tiny-llama" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = load_model("tiny-org/tiny-llama")
    assert model.name == "tiny-org/tiny-llama" and model.n_layers == 3


def test_every_public_error_lives_in_one_module():
    """Every error and warning class the library defines is in ``interp_engine.errors`` (and
    re-exported by the package), keeping the built-in bases that generic handlers rely on."""
    import ast
    import inspect
    from pathlib import Path

    import interp_engine
    from interp_engine import errors

    root = Path(interp_engine.__file__).resolve().parents[1]
    stray = []
    for folder in ("interp_engine", "actors", "jobs"):
        for path in (root / folder).rglob("*.py"):
            if path.name == "errors.py":
                continue
            for node in ast.parse(path.read_text()).body:
                bases = {getattr(b, "id", getattr(b, "attr", "")) for b in getattr(node, "bases", [])}
                public = isinstance(node, ast.ClassDef) and not node.name.startswith("_")
                if public and any(b.endswith(("Error", "Warning")) for b in bases) and node.name not in \
                        {"ReplicaDied", "NoReplicasLeft"}:
                    stray.append(f"{path.relative_to(root)}:{node.lineno} {node.name}")
    assert not stray, f"error classes outside interp_engine/errors.py: {stray}"
    defined = {n for n, c in vars(errors).items() if inspect.isclass(c) and c.__module__ == errors.__name__}
    assert defined <= set(dir(interp_engine)) | {"RemoteError", "ConfigError"}
    assert issubclass(errors.MissingActivations, KeyError) and issubclass(errors.MissingActivations, InputError)
    assert issubclass(errors.DatasetBusyError, FileExistsError) and issubclass(errors.ModelNotFound, FileNotFoundError)
    assert str(errors.MissingActivations("the cache lacks z.0")) == "the cache lacks z.0"

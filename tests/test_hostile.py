"""Hostile input, as a catalogue, on every backend: the eager model, a vLLM engine and a 2-replica
cluster model of the same tiny Llama.

Each case is a call a hostile (or careless) user makes. It must raise a project error (InputError,
AddressError, ClusterError, ...) whose message names what was wrong and what is valid, within
``HANG_AFTER`` seconds; and afterwards the same model must return captures and a generation equal
(``torch.equal``: same backend, same computation) to the ones it returned when it was fresh. The
module prints its tally per backend at the end: clear / unclear (another error type, no error, or a
message that does not say what and what instead) / hang (no answer; a hung call holds the model, so
every later case on that backend counts as a hang too). On the code before issue 14 the eager
backend scored 32 clear / 8 unclear, then hung at ``max_tokens=10**9``.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import re
import tempfile
import threading
from typing import Any, Callable

import numpy as np
import pytest
import torch

from interp_engine import (
    AddressError,
    ClusterError,
    InputError,
    build_dataset,
    capture_generation,
    load_model,
    run_with_cache,
)

from . import hostile_edits
from .clusters import REPLICA, simulated_cluster

BACKENDS = ["eager", "vllm", "cluster"]
ALL = tuple(BACKENDS)
HANG_AFTER = 60
VLLM_MAX_LEN = 128  # below the model's 256 positions, so both limits can be hit
POINTS = ["resid_post.1", "z.2", "logits"]
#: replicas ask for one (fake) GPU each, so they land on the two worker nodes


@dataclasses.dataclass
class Hostile:
    """What a case gets: the model under test and what is needed to call around it."""

    backend: str
    model: Any
    path: str
    reference: tuple = ()
    wedged: str = ""  # the case whose call never returned

    @property
    def limit(self) -> int:
        return self.model.position_limit()[0]

    def tokens(self, text: str = "hostile") -> torch.Tensor:
        return self.model.to_tokens(text)


@dataclasses.dataclass(frozen=True)
class Case:
    category: str
    call: Callable[[Hostile], Any]
    error: type
    says: str  # regex: what was wrong
    valid: str  # regex: what is valid, or how to fix it
    backends: tuple = ALL
    never: str = ""  # regex the message must not match (e.g. another backend's advice)


def gen(h, **options):
    return capture_generation(h.model, h.tokens(), ["resid_post.0"], **options)


def acapture(h, tokens=None, **options):
    return asyncio.run(h.model.capture(h.tokens() if tokens is None else tokens, ["resid_post.0"], **options))


def run(h, tokens=None, points=None):
    return run_with_cache(h.model, h.tokens() if tokens is None else tokens, POINTS if points is None else points)


def surrogate_dataset(h):
    with tempfile.TemporaryDirectory() as tmp:
        build_dataset(h.model, ["fine", "bro\udc80ken"], ["resid_post.0"], f"{tmp}/out", progress=False)


def long_prompt(h, n):
    tokens = torch.full((1, n), 65)
    tokens[0, 0] = 256
    return tokens


CASES: dict[str, Case] = {
    # -- sites ----------------------------------------------------------------------------------
    "unknown site": Case("sites", lambda h: run(h, points=["resid_psot.1"]), AddressError,
                         "unknown site 'resid_psot'", "known sites: resid_pre"),
    "layer too big": Case("sites", lambda h: run(h, points=["resid_post.3"]), AddressError,
                          "layer 3 is out of range", r"layers 0\.\.2"),
    "negative layer past the first": Case("sites", lambda h: run(h, points=["resid_post.-4"]), AddressError,
                                          "layer -4 is out of range", r"layers 0\.\.2.*-3 is layer 0"),
    "stream on a dense model": Case("sites", lambda h: run(h, points=["resid_streams.1.1"]), AddressError,
                                    "resid_streams.1.1", "only stream 0"),
    "MoE site on a dense model": Case("sites", lambda h: run(h, points=["router_logits.0"]), AddressError,
                                      "dense model", "valid sites: resid_pre"),
    "logits with a layer": Case("sites", lambda h: run(h, points=["logits.3"]), AddressError,
                                "model-level", r"Address\('logits'\)"),
    "filter that matches nothing": Case("sites", lambda h: run(h, points=[lambda a: False]), AddressError,
                                        "matched no address", r"model\.points\(\) lists the valid ones"),
    "layer that is not a number": Case("sites", lambda h: run(h, points=["resid_post.x"]), AddressError,
                                       "cannot parse 'resid_post.x'", r"name\.layer\[\.stream\]"),
    "too many coordinates": Case("sites", lambda h: run(h, points=["z.1.2.3"]), AddressError,
                                 "cannot parse 'z.1.2.3'", "at most a layer and a stream"),
    "float layer in a tuple": Case("sites", lambda h: run(h, points=[("resid_post", 1.5)]), AddressError,
                                   "got 1.5", "must be an int"),
    "pattern on vLLM": Case("sites", lambda h: run(h, points=["pattern.0"]), AddressError,
                            "'pattern.0' is eager-only", "backend='eager'", backends=("vllm",)),
    # -- containers -----------------------------------------------------------------------------
    "points=None": Case("containers", lambda h: run_with_cache(h.model, h.tokens(), None), AddressError,
                        "got NoneType", "list of addresses"),
    "no points": Case("containers", lambda h: run(h, points=[]), AddressError, "no points",
                      r"\['resid_post.0'\]"),
    "points=5": Case("containers", lambda h: run_with_cache(h.model, h.tokens(), 5), AddressError,
                     "got int", "list of addresses"),
    "points as bytes": Case("containers", lambda h: run_with_cache(h.model, h.tokens(), b"resid_post.1"),
                            AddressError, "got bytes", "list of addresses"),
    "points as a dict": Case("containers", lambda h: run_with_cache(h.model, h.tokens(), {"resid_post.1": 1}),
                             AddressError, "got dict", "list of addresses"),
    "None in the points": Case("containers", lambda h: run(h, points=[None]), AddressError,
                               "cannot read None", r"Address\('resid_post', 10\)"),
    "an int in the points": Case("containers", lambda h: run(h, points=["resid_post.1", 3]), AddressError,
                                 "cannot read 3", "'resid_post.10'"),
    # -- tokens ---------------------------------------------------------------------------------
    "tokens as a list of strings": Case("tokens", lambda h: run(h, ["hi"]), InputError, "got list", "to_tokens"),
    "a token list with a negative id": Case("tokens", lambda h: run(h, [[1, -2]]), InputError, "negative",
                                            "right-padded"),
    "tokens as numpy": Case("tokens", lambda h: run(h, np.ones((1, 3), dtype=np.int64)), InputError,
                            "got ndarray", "to_tokens"),
    "float tokens": Case("tokens", lambda h: run(h, torch.ones(1, 3)), InputError, "dtype torch.float32",
                         "integer ids"),
    "bool tokens": Case("tokens", lambda h: run(h, torch.ones(1, 3, dtype=torch.bool)), InputError,
                        "dtype torch.bool", "integer ids"),
    "0-d tokens": Case("tokens", lambda h: run(h, torch.tensor(3)), InputError, r"shape \(\)", r"\[batch, pos\]"),
    "3-d tokens": Case("tokens", lambda h: run(h, torch.ones(1, 2, 3, dtype=torch.long)), InputError,
                       r"shape \(1, 2, 3\)", r"\[batch, pos\]"),
    "0-d tokens": Case("tokens", lambda h: run(h, torch.tensor(5)), InputError, r"shape \(\)", r"\[batch, pos\]"),
    "tokens on the meta device": Case("tokens", lambda h: run(h, torch.ones(1, 3, dtype=torch.long, device="meta")),
                                      InputError, "meta device", "to_tokens"),
    "sparse tokens": Case("tokens", lambda h: run(h, h.tokens().to_sparse()), InputError, "sparse", "dense"),
    "id outside the vocabulary": Case("tokens", lambda h: run(h, torch.tensor([[256, 320]])), InputError,
                                      "token id 320", r"vocabulary \(size 320\)"),
    "huge id": Case("tokens", lambda h: run(h, torch.tensor([[256, 2**40]])), InputError,
                    f"token id {2**40}", r"size 320"),
    "negative id": Case("tokens", lambda h: run(h, torch.tensor([[256, -5]])), InputError,
                        "negative token id -5", r"only -1 \(padding\)"),
    "left padding": Case("tokens", lambda h: run(h, torch.tensor([[-1, 256, 65]])), InputError,
                         "padding must be at the end", "right padding"),
    "empty prompt": Case("tokens", lambda h: run(h, torch.zeros(1, 0, dtype=torch.long)), InputError,
                         "empty prompt", "every prompt needs a token"),
    "empty batch": Case("tokens", lambda h: run(h, torch.zeros(0, 3, dtype=torch.long)), InputError,
                        "batch size 0", "at least one prompt"),
    "a padding-only row": Case("tokens", lambda h: run(h, torch.tensor([[256, 65], [-1, -1]])), InputError,
                               "empty prompt at batch row 1", "every prompt needs a token",
                               backends=("eager", "cluster")),
    # -- lengths --------------------------------------------------------------------------------
    "prompt longer than the model": Case("lengths", lambda h: run(h, long_prompt(h, 300)), InputError,
                                         "300 tokens is longer than the model's 256 positions",
                                         r"tokens\[:, :256\]"),
    "prompt longer than max_model_len": Case("lengths", lambda h: run(h, long_prompt(h, 200)), InputError,
                                             "200 tokens is longer than this engine's max_model_len=128",
                                             r"tokens\[:, :128\]|larger max_model_len", backends=("vllm",)),
    "max_tokens=0": Case("lengths", lambda h: gen(h, max_tokens=0), InputError, "got 0", "positive int"),
    "max_tokens<0": Case("lengths", lambda h: gen(h, max_tokens=-3), InputError, "got -3", "positive int"),
    "max_tokens=2.5": Case("lengths", lambda h: gen(h, max_tokens=2.5), InputError, "got 2.5", "positive int"),
    "max_tokens=True": Case("lengths", lambda h: gen(h, max_tokens=True), InputError, "got True", "positive int"),
    "max_tokens='8'": Case("lengths", lambda h: gen(h, max_tokens="8"), InputError, "got '8'", "positive int"),
    "max_tokens past the positions": Case("lengths", lambda h: gen(h, max_tokens=300), InputError,
                                          r"max_tokens=300 needs \d+ positions, more than (the model's 256|"
                                          r"this engine's max_model_len=128)", r"max_tokens <= \d+"),
    "max_tokens=10**9": Case("lengths", lambda h: gen(h, max_tokens=10**9), InputError,
                             "max_tokens=1000000000 needs", r"max_tokens <= \d+"),
    "max_tokens=10**9 async": Case("lengths", lambda h: acapture(h, max_tokens=10**9), InputError,
                                   "max_tokens=1000000000 needs", r"max_tokens <= \d+"),
    "a full-length prompt, then generation": Case(
        "lengths", lambda h: capture_generation(h.model, long_prompt(h, h.limit), ["resid_post.0"], max_tokens=1),
        InputError, "max_tokens=1 needs", "shorten the prompt below"),
    # -- sampling -------------------------------------------------------------------------------
    "temperature=nan": Case("sampling", lambda h: gen(h, temperature=float("nan")), InputError,
                            "temperature .*got nan", "finite number >= 0"),
    "temperature=inf": Case("sampling", lambda h: gen(h, temperature=float("inf")), InputError,
                            "temperature .*got inf", "finite number >= 0"),
    "temperature<0": Case("sampling", lambda h: gen(h, temperature=-0.5), InputError,
                          "temperature .*got -0.5", "finite number >= 0"),
    "temperature as text": Case("sampling", lambda h: gen(h, temperature="hot"), InputError,
                                "temperature .*got 'hot'", "finite number >= 0"),
    "temperature=None": Case("sampling", lambda h: gen(h, temperature=None), InputError,
                             "temperature .*got None", "finite number >= 0"),
    "top_p>1": Case("sampling", lambda h: gen(h, top_p=1.5), InputError, "top_p .*got 1.5", r"in \(0, 1\]"),
    "top_p=0": Case("sampling", lambda h: gen(h, top_p=0), InputError, "top_p .*got 0", r"in \(0, 1\]"),
    "top_p=nan": Case("sampling", lambda h: gen(h, top_p=float("nan")), InputError, "top_p .*got nan",
                      r"in \(0, 1\]"),
    "top_k<0": Case("sampling", lambda h: gen(h, top_k=-1), InputError, "top_k .*got -1", "int >= 0"),
    "top_k=2.5": Case("sampling", lambda h: gen(h, top_k=2.5), InputError, "top_k .*got 2.5", "int >= 0"),
    "seed as text": Case("sampling", lambda h: gen(h, seed="x"), InputError, "seed .*got 'x'", "None or an int"),
    "negative seed": Case("sampling", lambda h: gen(h, seed=-1), InputError, "seed .*got -1", r"\[0, 2\*\*63\)"),
    "huge seed": Case("sampling", lambda h: gen(h, seed=2**70), InputError, "seed .*got 1180591620717411303424",
                      r"\[0, 2\*\*63\)"),
    "stop_at_eos as text": Case("sampling", lambda h: gen(h, stop_at_eos="yes"), InputError,
                                "stop_at_eos .*got 'yes'", "True or False"),
    "temprature= (typo)": Case("sampling", lambda h: gen(h, temprature=0.7), InputError,
                               "unknown generation option 'temprature'",
                               "did you mean 'temperature'.*max_tokens, temperature, top_p, top_k, seed"),
    "typo in an async capture": Case("sampling", lambda h: acapture(h, tmperature=0.7), InputError,
                                     "unknown generation option 'tmperature'", "the options are max_tokens"),
    "nan in an async capture": Case("sampling", lambda h: acapture(h, max_tokens=3, temperature=float("nan")),
                                    InputError, "temperature .*got nan", "finite number >= 0"),
    # -- text -----------------------------------------------------------------------------------
    "lone surrogate": Case("text", lambda h: h.model.to_tokens("caf\ud800e"), InputError,
                           r"'\\ud800' at character 3, a lone surrogate", "errors='replace'"),
    "lone surrogate in a batch": Case("text", lambda h: h.model.tok.to_tokens(["ok", "x\udcff"]), InputError,
                                      "prompt 1 holds", "Remove it"),
    "lone surrogate in a dataset": Case("text", surrogate_dataset, InputError, "lone surrogate", "errors='replace'"),
    "to_tokens(None)": Case("text", lambda h: h.model.to_tokens(None), InputError, "got NoneType",
                            "a string or a list of strings"),
    "to_tokens(bytes)": Case("text", lambda h: h.model.to_tokens(b"abc"), InputError, "got bytes",
                             "a string or a list of strings"),
    "a number among the prompts": Case("text", lambda h: h.model.tok.to_tokens(["a", 3]), InputError,
                                       "item 1 is int", "a list of strings"),
    "no prompts": Case("text", lambda h: h.model.tok.to_tokens([]), InputError, "empty list of prompts",
                       "at least one string"),
    # -- backend-specific -----------------------------------------------------------------------
    "detach=False without gradients": Case("backend", lambda h: run_with_cache(h.model, h.tokens(), POINTS,
                                                                                detach=False),
                                           InputError, "detach=False", "requires_grad=True"),
    "a batch on vLLM": Case("backend", lambda h: run(h, h.model.tok.to_tokens(["Paris is", "Berlin is in"])),
                            InputError, "got a batch of 2", r"await model\.capture|replicas=N", backends=("vllm",)),
    "a batch to an async capture": Case("backend", lambda h: acapture(h, h.model.tok.to_tokens(["a", "b c"])),
                                        InputError, r"model\.capture\(\.\.\.\) takes one prompt per call, got a "
                                                    r"batch of 2", r"tokens\[i:i\+1\]", never="vLLM"),
    "a batch to capture_generation": Case("backend", lambda h: capture_generation(
        h.model, h.model.tok.to_tokens(["a", "b c"]), ["resid_post.0"]), InputError,
        "capture_generation takes one prompt per call, got a batch of 2", r"tokens\[i:i\+1\]", never="vLLM"),
    "generation past max_model_len": Case("backend", lambda h: capture_generation(
        h.model, long_prompt(h, 120), ["resid_post.0"], max_tokens=20), InputError,
        "needs 140 positions, more than this engine's max_model_len=128", "max_tokens <= 8", backends=("vllm",)),
    # -- cluster --------------------------------------------------------------------------------
    "replicas=0": Case("cluster", lambda h: load_model(h.path, replicas=0), InputError,
                       "replicas must be a positive int.*got 0", "replicas=1", backends=("cluster",)),
    "replicas=True": Case("cluster", lambda h: load_model(h.path, replicas=True), InputError,
                          "got True", "replicas=1", backends=("cluster",)),
    "replicas='2'": Case("cluster", lambda h: load_model(h.path, replicas="2"), InputError,
                         "got '2'", "replicas=1", backends=("cluster",)),
    "more replicas than fit": Case("cluster", lambda h: load_model(h.path, replicas=3, **REPLICA), ClusterError,
                                   "3 replicas .* do not fit", "at most 2 fit. Use replicas=2",
                                   backends=("cluster",)),
    "more GPUs per replica than a node has": Case(
        "cluster", lambda h: load_model(h.path, replicas=1, gpus_per_replica=2, device="cpu"), ClusterError,
        "needs 2 GPUs on one node", "Lower tensor_parallel_size", backends=("cluster",)),
    "gradients on a cluster": Case("cluster", lambda h: load_model(h.path, replicas=1, requires_grad=True),
                                   InputError, "gradients do not cross Ray processes", "requires_grad=True\\)",
                                   backends=("cluster",)),
    "a batch to an async cluster capture": Case(
        "cluster", lambda h: acapture(h, h.model.tok.to_tokens(["a", "b c"])), InputError,
        "takes one prompt per call", "splits it over the replicas", backends=("cluster",)),
}

CASES.update({name: Case("edits", *case) for name, case in hostile_edits.CASES.items()})

TALLY: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
UNCLEAR: list[str] = []


# -- the three models ------------------------------------------------------------------------------
def _fresh_reference(model):
    tokens = model.to_tokens("still serving?")
    cache = run_with_cache(model, tokens, POINTS)
    completion, generated = capture_generation(model, tokens, ["resid_post.2"], max_tokens=4, stop_at_eos=False)
    return tokens, cache, completion, generated


@pytest.fixture(scope="module", params=BACKENDS)
def hostile(request, tiny_path, eager_models):
    path = str(tiny_path("llama"))
    if request.param == "eager":
        model = eager_models("llama")
        yield Hostile("eager", model, path, _fresh_reference(model))
    elif request.param == "vllm":
        pytest.importorskip("vllm")
        with load_model(path, backend="vllm", max_model_len=VLLM_MAX_LEN) as model:
            yield Hostile("vllm", model, path, _fresh_reference(model))
    else:
        pytest.importorskip("ray")
        with simulated_cluster():
            model = load_model(path, replicas=2, **REPLICA)
            try:
                yield Hostile("cluster", model, path, _fresh_reference(model))
            finally:
                model.close()


@pytest.fixture(scope="module", autouse=True)
def print_tally(request):
    yield
    reporter = request.config.pluginmanager.getplugin("terminalreporter")
    lines = [f"hostile inputs ({len(CASES)} cases): " + "; ".join(
        f"{backend} {TALLY[backend]['clear']} clear / {TALLY[backend]['unclear']} unclear / "
        f"{TALLY[backend]['hang']} hang" for backend in BACKENDS if TALLY[backend])]
    lines += [f"  unclear: {line}" for line in UNCLEAR]
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():  # past pytest's capture, so it shows without -s
        for line in lines:
            reporter.write_line(line) if reporter is not None else print(line)


def assert_serves_as_fresh(h: Hostile) -> None:
    tokens, cache, completion, generated = h.reference
    again = run_with_cache(h.model, tokens, POINTS)
    assert list(again) == list(cache)
    for address in cache:
        assert torch.equal(again[address], cache[address]), f"{address} changed after the bad input"
    completion2, generated2 = capture_generation(h.model, tokens, ["resid_post.2"], max_tokens=4, stop_at_eos=False)
    assert completion2 == completion
    assert torch.equal(generated2["resid_post.2"], generated["resid_post.2"])


def classify(case: Case, call: Callable[[], Any]) -> tuple[str, str]:
    """('clear' | 'unclear' | 'hang', what happened). The call runs in a daemon thread, so a call
    that never returns cannot keep the test process alive."""
    outcome: list = []
    thread = threading.Thread(target=lambda: outcome.append(_outcome(call)), daemon=True)
    thread.start()
    thread.join(HANG_AFTER)
    if not outcome:
        return "hang", f"no answer after {HANG_AFTER}s"
    err = outcome[0]
    if err is None:
        return "unclear", "no error at all"
    text = f"{type(err).__name__}: {err}"
    clear = (isinstance(err, case.error) and re.search(case.says, str(err)) and re.search(case.valid, str(err))
             and not (case.never and re.search(case.never, str(err))))
    return ("clear" if clear else "unclear"), text


def _outcome(call) -> BaseException | None:
    try:
        call()
    except Exception as err:  # noqa: BLE001 - any exception is judged by classify
        return err
    return None


@pytest.mark.parametrize("name", list(CASES))
def test_hostile_input_is_a_clear_error_and_the_model_serves_on(hostile, name):
    case = CASES[name]
    if hostile.backend not in case.backends:
        pytest.skip(f"{name!r} does not apply to the {hostile.backend} backend")
    if hostile.wedged:  # a call still running holds the model: nothing after it can be judged
        TALLY[hostile.backend]["hang"] += 1
        pytest.fail(f"the {hostile.backend} model stopped answering at {hostile.wedged!r}")
    outcome, what = classify(case, lambda: case.call(hostile))
    if outcome == "hang":
        hostile.wedged = name
    TALLY[hostile.backend][outcome] += 1
    if outcome != "clear":
        UNCLEAR.append(f"{hostile.backend} / {name}: {outcome}: {what[:300]}")
    assert outcome == "clear", (
        f"{name} on {hostile.backend}: {outcome}: {what}\n"
        f"wanted {case.error.__name__} saying /{case.says}/ and /{case.valid}/"
        + (f" and never /{case.never}/" if case.never else "")
    )
    assert_serves_as_fresh(hostile)


@pytest.mark.parametrize("check", hostile_edits.CHECKS, ids=lambda check: check.__name__)
def test_one_requests_values_never_reach_another(hostile, check):
    """Edit values that are accepted, or poison that bypasses the checks (hostile_edits.py); then the
    model serves exactly as when fresh."""
    if hostile.wedged:
        pytest.fail(f"the {hostile.backend} model stopped answering at {hostile.wedged!r}")
    check(hostile)
    assert_serves_as_fresh(hostile)


def test_the_catalogue_covers_every_category():
    categories = collections.Counter(case.category for case in CASES.values())
    assert set(categories) == {"sites", "containers", "tokens", "lengths", "sampling", "text", "backend", "cluster",
                               "edits"}
    assert all(n >= 3 for n in categories.values()), categories
    for case in CASES.values():  # every pattern compiles and names something
        assert re.compile(case.says).pattern and re.compile(case.valid).pattern

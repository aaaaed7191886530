"""What sampling means, checked the same way on every backend.

A backend samples token ``t`` at step ``i`` from the logits at the position before it, which a
capture of ``logits`` records. From those logits alone this module says which tokens the options
allow (temperature, then top-k, then top-p over the renormalised top-k, as the eager backend and
vLLM both apply them) and what probability each token has, so a test can check a backend's draws
against them:

- :func:`assert_allowed`: every generated token is inside the set its step's options allow;
- :func:`assert_frequencies_match`: the first token's frequencies over many seeds match the
  softmax, each within a Bernstein bound whose false-failure probability (for independent draws,
  union over the vocabulary) is :data:`FALSE_FAILURE`. The seeds are fixed, so a run is
  deterministic; the bound is what makes the fixed seeds a fair sample.
"""

from __future__ import annotations

import math

import torch

#: probability that honest independent draws fail :func:`assert_frequencies_match`
FALSE_FAILURE = 1e-9
#: slack for a backend whose logits differ from the captured ones by float rounding: a token
#: this close to a top-k / top-p boundary counts as allowed (vLLM against its own capture)
BOUNDARY_SLACK = 1e-4


def probabilities(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """The sampling distribution over a ``[vocab]`` logit vector: softmax(logits / temperature)
    restricted to the top-k tokens, then to the smallest most-probable set of mass >= top_p."""
    probs = torch.softmax(logits.double() / temperature, -1)
    keep = allowed(logits, temperature, top_k, top_p, slack=0.0)
    probs = torch.where(keep, probs, 0.0)
    return probs / probs.sum()


def allowed(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
            slack: float = BOUNDARY_SLACK) -> torch.Tensor:
    """Boolean ``[vocab]`` mask of the tokens the options may emit. A token is in the top-k when
    fewer than k tokens beat it by more than ``slack`` (in logits / temperature); it is in the
    top-p set when the mass of the tokens that beat it is below ``top_p + slack``."""
    scaled = logits.double() / temperature
    keep = torch.ones_like(scaled, dtype=torch.bool)
    if top_k:
        beaten_by = (scaled[None, :] > scaled[:, None] + slack).sum(1)
        keep &= beaten_by < top_k
    if top_p < 1:
        probs = torch.softmax(scaled.masked_fill(~keep, float("-inf")), -1)
        ahead = ((scaled[None, :] > scaled[:, None]) * probs[None, :]).sum(1)
        keep &= ahead < top_p + slack
    return keep


def assert_allowed(token_ids: list[int], step_logits: torch.Tensor, **options) -> None:
    """Each ``token_ids[i]`` is allowed by ``options`` under ``step_logits[i]`` ([steps, vocab])."""
    assert step_logits.shape[0] == len(token_ids)
    for step, (token, logits) in enumerate(zip(token_ids, step_logits)):
        keep = allowed(logits, **options)
        assert keep[token], (f"step {step}: token {token} is outside the {int(keep.sum())} tokens that "
                             f"{options} allow")


def bernstein_bound(p: float, n: int, delta: float) -> float:
    """Half-width t with P(|mean of n Bernoulli(p) - p| >= t) <= delta (Bernstein's inequality:
    2 exp(-n t^2 / (2 p (1 - p) + 2 t / 3)) = delta, solved for t)."""
    log_term = math.log(2 / delta)
    return (log_term / 3 + math.sqrt(log_term ** 2 / 9 + 2 * n * p * (1 - p) * log_term)) / n


def assert_frequencies_match(draws: list[int], probs: torch.Tensor) -> None:
    """The empirical frequency of every token in ``draws`` is within its Bernstein bound of
    ``probs`` (a union bound over the vocabulary gives :data:`FALSE_FAILURE` in all)."""
    n = len(draws)
    counts = torch.bincount(torch.tensor(draws), minlength=probs.numel()).double()
    delta = FALSE_FAILURE / probs.numel()
    for token in range(probs.numel()):
        p, freq = float(probs[token]), float(counts[token]) / n
        bound = bernstein_bound(p, n, delta)
        assert abs(freq - p) <= bound, (f"token {token}: frequency {freq:.3f} over {n} seeds, softmax "
                                        f"{p:.3f} (bound +-{bound:.3f}); top tokens drawn "
                                        f"{counts.topk(3).indices.tolist()}, most probable "
                                        f"{probs.topk(3).indices.tolist()}")


# The properties, each a check of one model (any backend) on one prompt; test modules run them
# on their own shared model: ``@pytest.mark.parametrize("check", PROPERTIES, ids=...)``.

PROMPT = "Once upon"
#: a temperature at which the tiny random models' nearly flat logits give a few likely tokens,
#: so that a wrong temperature, a greedy pick or an ignored seed moves the frequencies far
COLD = 0.05
#: first tokens drawn per frequency check: enough that the bound is about +-0.12 for p = 0.4
SEEDS = 1000


def generate(model, tokens, **options):
    """(token ids, [steps, vocab] logits each was sampled from) of one generation."""
    from interp_engine import capture_generation

    completion, cache = capture_generation(model, tokens, ["logits"], **options)
    return completion.token_ids, cache["logits"][0, tokens.shape[1] - 1:].float()


def first_tokens(model, tokens, seeds, **options) -> list[int]:
    """The first generated token for each seed, all requests in flight at once."""
    import asyncio

    async def all_at_once():
        return await asyncio.gather(*(model.capture_generation_async(tokens, ["resid_pre.0"], max_tokens=1,
                                                                     seed=seed, **options) for seed in seeds))

    return [completion.token_ids[0] for completion, _ in asyncio.run(all_at_once())]


def different_seeds_differ(model):
    tokens = model.to_tokens(PROMPT)
    runs = {seed: generate(model, tokens, max_tokens=6, temperature=1.0, seed=seed)[0] for seed in range(6)}
    assert len({tuple(ids) for ids in runs.values()}) == len(runs), runs
    assert generate(model, tokens, max_tokens=6, temperature=1.0, seed=3)[0] == runs[3]


def top_k_1_is_greedy(model):
    tokens = model.to_tokens(PROMPT)
    greedy, logits = generate(model, tokens, max_tokens=8, stop_at_eos=False)
    assert greedy == logits.argmax(-1).tolist()
    for seed in range(3):
        ids, _ = generate(model, tokens, max_tokens=8, stop_at_eos=False, temperature=1.0, top_k=1, seed=seed)
        assert ids == greedy, seed


def top_k_and_top_p_stay_in_the_allowed_set(model):
    tokens = model.to_tokens(PROMPT)
    cases = [dict(top_k=5), dict(top_p=0.3), dict(top_k=40, top_p=0.2), dict(temperature=0.1, top_p=0.6)]
    for options in cases:
        options = {"temperature": 1.0, **options}
        for seed in range(3):
            ids, logits = generate(model, tokens, max_tokens=8, stop_at_eos=False, seed=seed, **options)
            assert_allowed(ids, logits, **options)
        # power: the options shut out most of the vocabulary, so ignoring them would be seen
        assert allowed(logits[0], **options).sum() < logits.shape[-1] // 2, options


def first_token_frequencies_match_the_softmax(model):
    tokens = model.to_tokens(PROMPT)
    _, logits = generate(model, tokens, max_tokens=1)
    probs = probabilities(logits[0], COLD)
    assert 0.1 < float(probs.max()) < 0.9, "the check needs a few likely tokens: change COLD"
    assert_frequencies_match(first_tokens(model, tokens, range(SEEDS), temperature=COLD), probs)


PROPERTIES = [different_seeds_differ, top_k_1_is_greedy, top_k_and_top_p_stay_in_the_allowed_set,
              first_token_frequencies_match_the_softmax]

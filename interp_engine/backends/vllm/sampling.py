"""A call's sampling options as vLLM's ``SamplingParams``, and vLLM's per-step logprobs as a
:class:`~interp_engine.model.Completion` carries them."""

from __future__ import annotations

from interp_engine.model import Sampling


def sampling_params(options: Sampling | None):
    from vllm import SamplingParams

    if options is None:  # a prefill only: one token is sampled and thrown away
        return SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False)
    return SamplingParams(
        max_tokens=options.max_tokens,
        temperature=options.temperature,
        top_p=options.top_p,
        top_k=options.top_k,
        seed=options.seed,
        ignore_eos=not options.stop_at_eos,
        logprobs=options.top_logprobs,  # 0: the sampled token's own (raw: before temperature)
    )


def scores(steps, generated: list[int], top: int) -> tuple[list[float], list[dict[int, float]] | None]:
    """The sampled tokens' logprobs and each step's ``top`` most likely tokens (by vLLM's rank),
    from vLLM's per-step ``{token id: Logprob}`` (the sampled token is always among them)."""
    steps = [steps[i] for i in range(len(generated))]
    logprobs = [float(step[token].logprob) for step, token in zip(steps, generated)]
    if not top:
        return logprobs, None
    tops = [{t: float(p.logprob) for t, p in sorted(step.items(), key=lambda item: item[1].rank)
             if p.rank is not None and p.rank <= top} for step in steps]
    return logprobs, tops

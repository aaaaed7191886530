"""The main job (``make demo``): the seed's examples on the embedded SmolLM2, then a logit lens.

It runs offline on the embedded default model (see :mod:`interp_engine.embedded`) and prints
what each call returns, with a few checks of the address contract (``resid_mid = resid_pre +
attn_out`` and the like) computed from the captured tensors. It ends with a logit-lens table
for "The capital of France is" — every layer's ``resid_post`` through the final norm and the
unembedding — printed and written as a PNG heatmap (and the same table as JSON) under
``--out``. Any failed check makes the exit status 1, so CI notices a demo that rots.

    python -m interp_engine.examples.demo [--out DIR] [--model NAME_OR_PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from interp_engine import (Address, capture_generation, embedded, head_contributions, lens_top, load_model,
                           logit_lens, run_with_cache)
from interp_engine.compare import SAME_BACKEND, relative_error

from .lens_plot import heatmap, show

PROMPT = "The capital of France is"


class Checks:
    """Prints each check as it runs and remembers which failed."""

    def __init__(self):
        self.failed: list[str] = []
        self.count = 0

    def _report(self, label: str, ok: bool, detail: str = "") -> None:
        self.count += 1
        if not ok:
            self.failed.append(label)
        print(f"  check  {label:<62} {detail:<20} {'ok' if ok else 'FAILED'}")

    def close(self, label: str, actual: torch.Tensor, expected: torch.Tensor, rel: float = SAME_BACKEND) -> None:
        """Equal within ``rel`` relative error (max|diff| / max|expected|; 0.0 = bit for bit)."""
        if rel == 0.0:
            self._report(label, torch.equal(actual, expected), "bit for bit")
            return
        error = relative_error(actual, expected)
        self._report(label, error <= rel, f"rel err {error:.1e}")

    def true(self, label: str, ok: bool, detail: str = "") -> None:
        self._report(label, bool(ok), detail)


def section(title: str) -> None:
    print(f"\n== {title} " + "=" * max(0, 86 - len(title)))


# -- the seed's examples -----------------------------------------------------------------------
def one_point(model, checks: Checks) -> None:
    section("One point")
    point = Address("resid_post", 10)
    tokens = model.to_tokens(PROMPT)
    cache = run_with_cache(model, tokens, [point])
    print(f"  tokens {tuple(tokens.shape)}: {model.tok.to_str_tokens(tokens)}")
    print(f"  cache[{point!r}] -> {tuple(cache[point].shape)}   [batch, pos, d_model]")
    checks.true("cache[Address] is cache['resid_post.10']", cache[point] is cache["resid_post.10"])
    checks.true("shape is [1, pos, d_model]", tuple(cache[point].shape) == (1, tokens.shape[1], model.d_model),
                str(tuple(cache[point].shape)))


def several_points(model, checks: Checks) -> None:
    section("Several points")
    tokens = model.to_tokens(PROMPT)
    cache = run_with_cache(model, tokens, ["resid_post.10", "mlp_out.10", "attn_out.10"])
    print(f"  {cache!r}")
    print(f"  cache.get('mlp_out', 10) -> {tuple(cache.get('mlp_out', 10).shape)}")
    # The identities of the address contract, at one layer, from one capture.
    names = ["resid_pre", "attn_out", "resid_mid", "mlp_out", "resid_post", "z", "mlp_post"]
    full = run_with_cache(model, tokens, [f"{n}.10" for n in names])

    def get(name):
        return full.get(name, 10)

    checks.close("resid_mid.10 == resid_pre.10 + attn_out.10", get("resid_mid"), get("resid_pre") + get("attn_out"))
    checks.close("resid_post.10 == resid_mid.10 + mlp_out.10", get("resid_post"), get("resid_mid") + get("mlp_out"))
    checks.close("same capture, same values (resid_post.10)", get("resid_post"), cache.get("resid_post", 10), 0.0)
    print(f"  z.10 -> {tuple(get('z').shape)} [batch, pos, n_heads, d_head];  "
          f"mlp_post.10 -> {tuple(get('mlp_post').shape)} [batch, pos, d_mlp]")


def every_layer(model, checks: Checks) -> None:
    section("Every layer")
    points = [Address("resid_post", layer) for layer in range(model.n_layers)]
    cache = run_with_cache(model, model.to_tokens("Hello"), points)
    print(f"  {len(cache)} addresses, each {tuple(cache[points[0]].shape)}")
    norms = [float(cache[p][0, -1].norm()) for p in points]
    print("  |resid_post.L| at the last position: " + " ".join(f"{n:.0f}" for n in norms))
    checks.true("one resid_post per layer", list(cache) == points, f"{len(cache)} layers")


def a_batch(model, checks: Checks) -> None:
    section("A batch")
    prompts = ["Paris is in", "Berlin is in the country of"]
    tokens = model.tok.to_tokens(prompts)
    mask = tokens >= 0
    cache = run_with_cache(model, tokens, ["resid_post.10"])
    batched = cache.get("resid_post", 10)
    print(f"  tokens {tuple(tokens.shape)}, right-padded with -1:")
    print("    " + str(tokens).replace("\n", "\n    "))
    print(f"  mask = tokens >= 0 -> real positions per row {mask.sum(1).tolist()}")
    print(f"  cache.get('resid_post', 10) -> {tuple(batched.shape)}")
    checks.true("cache.mask == (tokens >= 0)", torch.equal(cache.mask, mask))
    checks.true("padded positions hold zeros", bool((batched[~mask] == 0).all()))
    for row, prompt in enumerate(prompts):
        alone = run_with_cache(model, model.to_tokens(prompt), ["resid_post.10"]).get("resid_post", 10)[0]
        # Different shapes take different kernel paths: equal up to float rounding, not bitwise.
        checks.close(f"row {row} == {prompt!r} alone (real positions)", batched[row, mask[row]], alone)


def per_head(model, checks: Checks) -> None:
    section("Per-head contributions")
    cache = run_with_cache(model, model.to_tokens("Hello"), ["z.10", "attn_out.10"])
    heads = head_contributions(model, cache, 10)
    print(f"  z.10 {tuple(cache.get('z', 10).shape)} -> head_contributions {tuple(heads.shape)} "
          f"[batch, pos, n_heads, d_model]")
    size = heads[0, -1].norm(dim=-1)
    print("  |head h| at the last position: " + " ".join(f"{float(s):.2f}" for s in size))
    checks.close("sum over heads == attn_out.10 (o_proj has no bias)", heads.sum(2), cache.get("attn_out", 10))


def gradients(name: str, checks: Checks) -> None:
    section("Gradients")
    model = load_model(name, backend="eager", requires_grad=True)
    cache = run_with_cache(model, model.to_tokens("Hello"), ["resid_post.10"], detach=False)
    resid = cache.get("resid_post", 10)
    resid.sum().backward()
    embed = model.hf.get_input_embeddings().weight
    print(f"  resid_post.10 requires_grad={resid.requires_grad}, grad_fn={type(resid.grad_fn).__name__}")
    print(f"  after .sum().backward(): |d embed| = {float(embed.grad.norm()):.3g}")
    checks.true("gradient reached the embedding", embed.grad is not None and float(embed.grad.abs().sum()) > 0)
    del model, cache, resid


def generation(model, checks: Checks) -> None:
    section("While generating (eager)")
    tokens = model.to_tokens(PROMPT)
    completion, cache = capture_generation(model, tokens, ["resid_post.10"], max_tokens=8)
    print(f"  completion.text = {completion.text!r}")
    print(f"  completion.token_ids = {completion.token_ids}")
    positions = cache.get("resid_post", 10).shape[1]
    expected = tokens.shape[1] + len(completion.token_ids) - 1
    print(f"  cache.get('resid_post', 10).shape[1] = {positions}  (prompt {tokens.shape[1]} "
          f"+ generated {len(completion.token_ids)} - 1)")
    checks.true("positions == len(prompt) + len(generated) - 1", positions == expected, f"{positions}")


# -- the logit lens ----------------------------------------------------------------------------
def lens_table(model, checks: Checks, out: Path) -> dict:
    section(f"Logit lens: {PROMPT!r}")
    tokens = model.to_tokens(PROMPT)
    # whole sites: the embedding, then resid_post of every layer, and the model's logits
    cache = run_with_cache(model, tokens, ["resid_pre.0", "resid_post", "logits"])
    top = lens_top(model, cache)
    words = model.to_str_tokens(tokens)
    with torch.no_grad():
        embed = model.unembed(model.final_norm(cache["resid_pre.0"]))[0].float().softmax(-1)  # [pos, vocab]
    e_probs, e_ids = embed.max(-1)
    ids = torch.cat([e_ids[None], top.ids[:, 0]])  # [1 + layers, pos]: the embedding row first
    probs = torch.cat([e_probs[None], top.probs[:, 0]])
    labels = ["embed"] + [str(layer) for layer in top.layers]
    table = [[model.tok.decode([int(i)]) for i in row] for row in ids]

    target_id = int(cache["logits"][0, -1].argmax())
    target = model.tok.decode([target_id])
    lens_logits = logit_lens(model, cache)[:, 0, -1].float()  # [layers, vocab] at the last position
    p_target = torch.cat([embed[-1, target_id][None], lens_logits.softmax(-1)[:, target_id]])

    width = 13
    print("  each layer's resid_post -> final norm -> unembedding: top token (probability at the last position)")
    print(f"  p(target) is the probability of the model's own answer {target!r} at the last position")
    print("  layer " + "".join(f"{show(w, width - 1):>{width}}" for w in words) + "     p(last)  p(target)")
    for label, row, p_last, p_t in zip(labels, table, probs[:, -1], p_target):
        cells = "".join(f"{show(t, width - 1):>{width}}" for t in row)
        print(f"  {label:>5} {cells}  {float(p_last):>9.3f}  {float(p_t):>9.3f}")

    final = logit_lens(model, cache, [model.n_layers - 1])[0]
    checks.close("lens at the last layer == the model's logits", final, cache["logits"], 1e-4)
    lens_answer = table[-1][-1]
    print(f"  the lens's answer at the last layer: {lens_answer!r}; the model's own next token: {target!r}")
    checks.true("lens answer == model's argmax", lens_answer == target, repr(lens_answer))

    out.mkdir(parents=True, exist_ok=True)
    png = heatmap(PROMPT, words, table, probs, labels, p_target, target, out / "logit_lens.png")
    record = {"prompt": PROMPT, "model": model.name, "input_tokens": words, "layers": top.layers,
              "top_tokens": table[1:], "top_probs": probs[1:].tolist(), "answer": lens_answer,
              "embedding": {"top_tokens": table[0], "top_probs": probs[0].tolist(), "target_prob": float(p_target[0])},
              "target": target, "target_probs": p_target[1:].tolist(), "png": str(png)}
    table_json = (out / "logit_lens.json").resolve()
    table_json.write_text(json.dumps(record, indent=1))
    print(f"\n  logit-lens heatmap written to {png}")
    print(f"  the same table as JSON:       {table_json}")
    return record


# -- the job -----------------------------------------------------------------------------------
def cluster(model, checks: Checks, out: Path) -> None:
    """The same calls through a local Ray cluster: 2 replicas, one capture, a small dataset."""
    from .cluster_demo import demo_summary

    section("A Ray cluster: 2 replicas of the same model, and an activation dataset")
    summary = demo_summary(replicas=2, output=out / "activations", local=model, echo=lambda line: print("  " + line))
    checks.true("cluster capture == local capture on the same rows (torch.equal)", summary["bitwise_on_same_rows"])
    checks.true(f"cluster capture == local batch (relative error <= {SAME_BACKEND:g})", summary["close_to_local"])
    expected = sum(len(model.tok.encode(p)) for p in summary["prompts"])
    checks.true("dataset rows (one per token) == tokens of the prompts", summary["rows"] == expected > 0,
                f"{summary['rows']} rows")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m interp_engine.examples.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("INTERP_ENGINE_DEMO_OUT", "out"),
                        help="folder for the logit-lens PNG and JSON (default ./out)")
    parser.add_argument("--no-cluster", action="store_true", help="skip the Ray cluster part")
    parser.add_argument("--model", default=embedded.NAME,
                        help=f"model name or local folder with at least 11 layers (the examples read layer 10, as the "
                             f"seed does; default: the embedded {embedded.NAME})")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    torch.manual_seed(0)
    started = time.perf_counter()
    print(f"interp_engine demo: loading {args.model} (eager) ...")
    model = load_model(args.model, backend="eager")
    print(f"  n_layers={model.n_layers} d_model={model.d_model} n_heads={model.n_heads} "
          f"d_head={model.d_head} d_mlp={model.d_mlp} vocab={model.info.d_vocab}")
    checks = Checks()

    one_point(model, checks)
    several_points(model, checks)
    every_layer(model, checks)
    a_batch(model, checks)
    per_head(model, checks)
    gradients(args.model, checks)
    generation(model, checks)
    lens_table(model, checks, out)

    if not args.no_cluster:
        cluster(model, checks, out)

    section("Summary")
    print(f"  {checks.count - len(checks.failed)}/{checks.count} checks passed "
          f"in {time.perf_counter() - started:.0f} s")
    if checks.failed:
        print("  FAILED: " + "; ".join(checks.failed))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

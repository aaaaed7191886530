"""The cluster part of ``make demo``: a local Ray cluster, 2 replicas of the embedded SmolLM2, one
capture through them, and a small activation dataset built by them."""

from __future__ import annotations

import os
from pathlib import Path

from interp_engine.compare import SAME_BACKEND, relative_error

PROMPTS = [
    "The capital of France is", "Water boils at", "The largest planet in the solar system is",
    "In 1969, astronauts landed on", "A haiku has three lines and", "The chemical symbol for gold is",
    "Photosynthesis turns sunlight into", "The fastest land animal is", "Shakespeare wrote plays such as",
    "The speed of light is about", "Mount Everest is located in", "The Pacific Ocean is the",
]


def demo_summary(n_prompts: int = 24, replicas: int = 2, output=None, echo=print, local=None) -> dict:
    """Start a local Ray cluster (unless one is connected), capture through ``replicas`` replicas
    of the embedded SmolLM2, build a small dataset, print a summary, and return it as a dict
    (rows, shards, tokens_per_s, output, nodes, and, when ``local`` — the same model loaded in this
    process — is given: ``bitwise_on_same_rows``, the cluster's capture equal bit for bit to the
    local model run on each replica's rows with the same threads, and ``close_to_local``, equal to
    the local model's whole batch within the equality contract of :mod:`.compare`)."""
    import ray

    from interp_engine import build_dataset, load_model, run_with_cache
    from interp_engine.embedded import NAME, cache_dir
    from interp_engine.loopback import start_local_ray

    started = not ray.is_initialized()
    if started:
        start_local_ray()  # loopback only, token auth: the same Ray load_model starts
    import torch

    cpus = ray.cluster_resources().get("CPU", 1)
    # Bitwise equality with the local model needs the same computation, threads included.
    threads = torch.get_num_threads() if local is not None else max(1, (os.cpu_count() or 1) // replicas)
    model = None
    try:
        model = load_model(NAME, replicas=replicas, cpus_per_replica=min(1.0, cpus / (replicas + 1)),
                           torch_threads=threads)
        layer = model.n_layers // 2
        points = [f"resid_post.{layer}", f"mlp_out.{layer}"]
        echo(f"cluster: {replicas} replicas of {NAME} ({model.backend}) on {len(set(model.nodes))} node(s)")
        tokens = model.to_tokens(PROMPTS[:2])
        cache = run_with_cache(model, tokens, points)
        echo(f"run_with_cache through the cluster: {points[0]} {tuple(cache[points[0]].shape)} "
             f"(a padded batch of 2, split over the replicas)")
        same = close = None
        if local is not None:
            same, error = _compare(local, cache, tokens, points, replicas)
            close = error <= SAME_BACKEND
            echo(f"  each replica's rows == the local model on the same rows, same threads (bit for bit): {same}")
            echo(f"  == the local model's whole batch within {SAME_BACKEND:g} relative error: {close} "
                 f"(measured {error:.1e}; a different batch shape is a different computation)")
        prompts = [PROMPTS[i % len(PROMPTS)] + f" (variant {i})" for i in range(n_prompts)]
        out = Path(output or cache_dir() / "demo_dataset")
        dataset = build_dataset(model, prompts, points, out, layout="token", dtype="bfloat16", shard_size=4,
                                overwrite=True, progress=False)
        rate = dataset.tokens / dataset.seconds if dataset.seconds else 0.0
        echo(f"dataset: {dataset.rows} rows (one per token) in {dataset.shards} Parquet shards, "
             f"{dataset.prompts} prompts, {rate:.0f} tokens/s, at {dataset.path}")
        echo(f"  read it back: pyarrow.parquet.read_table({str(dataset.path)!r}), or "
             f"ActivationDataset.open({str(dataset.path)!r}).to_ray() (ray.data.read_parquet waits for a free CPU)")
        return {"rows": dataset.rows, "prompts": prompts, "shards": dataset.shards, "tokens_per_s": rate,
                "output": str(dataset.path),
                "nodes": len(set(model.nodes)), "replicas": replicas,
                "bitwise_on_same_rows": same, "close_to_local": close}
    finally:
        if model is not None:
            model.close()
        if started:
            ray.shutdown()


def _compare(local, cache, tokens, points, replicas) -> tuple[bool, float]:
    """(bitwise equal to the local model on each replica's chunk, relative error to the local batch)."""
    import torch

    from interp_engine import run_with_cache
    from interp_engine.batching import chunk_bounds

    whole = run_with_cache(local, tokens, points)
    chunks = [run_with_cache(local, tokens[a:b], points) for a, b in chunk_bounds(tokens.shape[0], replicas)]
    same = all(torch.equal(cache[p], torch.cat([c[p] for c in chunks])) for p in points)
    return same, max(relative_error(cache[p], whole[p]) for p in points)


if __name__ == "__main__":
    demo_summary()

"""The cluster part of ``make demo``: a local Ray cluster, 2 replicas of the embedded SmolLM2, one
capture through them, and a small activation dataset built by them."""

from __future__ import annotations

import os
from pathlib import Path

PROMPTS = [
    "The capital of France is", "Water boils at", "The largest planet in the solar system is",
    "In 1969, astronauts landed on", "A haiku has three lines and", "The chemical symbol for gold is",
    "Photosynthesis turns sunlight into", "The fastest land animal is", "Shakespeare wrote plays such as",
    "The speed of light is about", "Mount Everest is located in", "The Pacific Ocean is the",
]


def demo_summary(n_prompts: int = 24, replicas: int = 2, output=None, echo=print, local=None) -> dict:
    """Start a local Ray cluster (unless one is connected), capture through ``replicas`` replicas
    of the embedded SmolLM2, build a small dataset, print a summary, and return it as a dict
    (rows, shards, tokens_per_s, output, nodes, and ``equal_to_local`` when ``local`` — the same
    model loaded in this process — is given to compare the cluster's capture with)."""
    import ray

    from .cluster import load_cluster_model
    from .dataset import build_dataset
    from .embedded import NAME, cache_dir
    from .model import run_with_cache

    started = not ray.is_initialized()
    if started:
        ray.init(address="local", include_dashboard=False, log_to_driver=False)
    import torch

    cpus = ray.cluster_resources().get("CPU", 1)
    # Bitwise equality with the local model needs its thread count: float sums split differently.
    threads = torch.get_num_threads() if local is not None else max(1, (os.cpu_count() or 1) // replicas)
    model = None
    try:
        model = load_cluster_model(NAME, replicas=replicas, cpus_per_replica=min(1.0, cpus / (replicas + 1)),
                                   torch_threads=threads)
        layer = model.n_layers // 2
        points = [f"resid_post.{layer}", f"mlp_out.{layer}"]
        echo(f"cluster: {replicas} replicas of {NAME} ({model.backend}) on {len(set(model.nodes))} node(s)")
        tokens = model.to_tokens(PROMPTS[:2])
        cache = run_with_cache(model, tokens, points)
        echo(f"run_with_cache through the cluster: {points[0]} {tuple(cache[points[0]].shape)} "
             f"(a padded batch of 2, split over the replicas)")
        equal = None
        if local is not None:
            want = run_with_cache(local, tokens, points)
            equal = all(torch.equal(cache[p], want[p]) for p in points)
            echo(f"  equal to the local model's capture: {equal}")
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
                "nodes": len(set(model.nodes)), "replicas": replicas, "equal_to_local": equal}
    finally:
        if model is not None:
            model.close()
        if started:
            ray.shutdown()


if __name__ == "__main__":
    demo_summary()

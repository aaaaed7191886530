"""Ray job entrypoint: build an activation dataset from a YAML/JSON config.

Locally (starts a Ray on loopback, or joins ``RAY_ADDRESS``)::

    python jobs/build_dataset.py config.yaml

On a cluster (the job server sets ``RAY_ADDRESS`` for the entrypoint)::

    ray job submit --working-dir . -- python jobs/build_dataset.py config.yaml

Rerunning the same command resumes a build that was interrupted. The last line printed is a
JSON summary (rows, shards, tokens/s, output). A config, prompts file, point list or output that
cannot work is refused before Ray starts (:mod:`interp_engine.jobs.preflight`), and any refused
input is one ``error: ...`` line on stderr with exit code 2, not a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys

from interp_engine.jobs.config import BuildConfig, load_config
from interp_engine.errors import ConfigError
from interp_engine.jobs.preflight import preflight


def run(config: BuildConfig):
    """Load the model on the cluster and build the dataset the config describes."""
    from interp_engine import load_model
    from interp_engine.dataset.build import build_dataset

    print(f"loading {config.model} ({config.backend}, {config.replicas} replica(s)); the build's progress "
          f"follows", file=sys.stderr, flush=True)
    model = load_model(config.model, **config.load_options())
    try:
        return build_dataset(model, config.prompts, config.points, config.output, layout=config.layout,
                             dtype=config.storage_dtype, shard_size=config.shard_size, overwrite=config.overwrite,
                             text_key=config.text_key, progress=config.progress, shuffle=config.shuffle,
                             seed=config.seed, saes=[sae.load() for sae in config.saes] or None)
    finally:
        model.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build an activation dataset (Parquet) on a Ray cluster.")
    parser.add_argument("config", help="YAML or JSON build config (see interp_engine.jobs.config)")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config)
        preflight(config)  # before Ray or a replica starts: the config, model facts, points, prompts, output
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    from interp_engine.errors import DatasetCorruptError
    from interp_engine.errors import DatasetExistsError
    from interp_engine.errors import InputError

    try:
        dataset = run(config)
    except (InputError, DatasetExistsError, DatasetCorruptError) as err:  # refused input: no traceback
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(dataset.summary())
    rate = dataset.tokens / dataset.seconds if dataset.seconds else 0.0
    print(json.dumps({"rows": dataset.rows, "shards": dataset.shards, "prompts": dataset.prompts,
                      "tokens": dataset.tokens, "tokens_per_s": round(rate, 1), "output": str(dataset.path),
                      "resumed_shards": dataset.resumed_shards}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

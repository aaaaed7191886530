"""Job entrypoint: build a feature dashboard from a YAML/JSON config.

    python jobs/feature_dashboard.py config.yaml
    ray job submit --working-dir . -- python jobs/feature_dashboard.py config.yaml

The model runs in the job's own process (eager or vLLM), or on ``replicas: N`` copies on the
Ray cluster (each encodes its share; the job merges the tallies). A config such as::

    model: HuggingFaceTB/SmolLM2-135M-Instruct
    prompts: prompts.jsonl            # read beside this file when relative
    saes:
      - path: saes/l10-topk           # a SAELens folder, or a params.npz with reads:
        name: l10
    output: /data/dashboards/l10
    top_k: 20

Rerunning the same command resumes. The last line printed is a JSON summary; refused input is
one ``error: ...`` line on stderr with exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from interp_engine.embedded import NAME as EMBEDDED
from interp_engine.errors import ConfigError
from interp_engine.jobs.config import load_config


class DictionarySpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str
    name: str | None = None
    reads: str | None = None
    writes: str | None = None
    norm_scaling_factor: float | None = Field(None, gt=0, allow_inf_nan=False)


class DashboardConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = EMBEDDED
    backend: Literal["eager", "vllm"] = "eager"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    backend_options: dict = Field(default_factory=dict)
    replicas: int = Field(1, ge=1, le=4096, description="model copies on the Ray cluster (1: in this process)")
    prompts: str | list[str]
    text_key: str = "text"
    saes: list[DictionarySpec] = Field(min_length=1)
    output: str
    top_k: int = Field(20, ge=1, le=10_000)
    samples: int = Field(20, ge=0, le=10_000)
    window: tuple[int, int] = (8, 4)
    shard_size: int = Field(64, ge=1, le=1 << 31)
    overwrite: bool = False
    progress: bool = True


def run(config: DashboardConfig, base: Path = Path(".")):
    """Load the model and the dictionaries and build the dashboard the config describes."""
    from interp_engine import load_dictionary, load_model
    from interp_engine.dataset.dashboard import feature_dashboard

    saes = [load_dictionary(base / spec.path, reads=spec.reads, writes=spec.writes, name=spec.name,
                            norm_scaling_factor=spec.norm_scaling_factor) for spec in config.saes]
    replicas = {"replicas": config.replicas} if config.replicas > 1 else {}
    model = load_model(config.model, backend=config.backend, dtype=config.dtype, **replicas, **config.backend_options)
    try:
        return feature_dashboard(model, config.prompts, saes, config.output, top_k=config.top_k,
                                 samples=config.samples, window=tuple(config.window), shard_size=config.shard_size,
                                 text_key=config.text_key, overwrite=config.overwrite, progress=config.progress)
    finally:
        model.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build a feature dashboard (Parquet) for sparse dictionaries.")
    parser.add_argument("config", help="YAML or JSON dashboard config (see interp_engine.jobs.feature_dashboard)")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config, DashboardConfig)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    from interp_engine.errors import DatasetExistsError, InputError

    try:
        dashboard = run(config, Path(args.config).parent)
    except (InputError, DatasetExistsError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    rate = dashboard.tokens / dashboard.seconds if dashboard.seconds else 0.0
    print(json.dumps({"tokens": dashboard.tokens, "tokens_per_s": round(rate, 1), "output": str(dashboard.path),
                      "features": sum(s["d_sae"] for s in dashboard.identity["saes"]),
                      "resumed_shards": dashboard.resumed_shards}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

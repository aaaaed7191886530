"""The configuration of a dataset-build job, validated field by field with pydantic.

A YAML or JSON file such as::

    model: HuggingFaceTB/SmolLM2-135M-Instruct
    backend: eager
    replicas: 2
    prompts: prompts.jsonl          # or a list of strings; a relative path is read beside this file
    points: [resid_post.10, mlp_out.10]
    output: /data/acts/smollm2-l10  # or s3://bucket/prefix (AWS_* credentials); relative: the working dir
    layout: token                   # or sequence
    storage_dtype: bfloat16

Every problem is reported at once, each with the field it is in.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator

from interp_engine.address import parse_address
from interp_engine.embedded import NAME as EMBEDDED


class ConfigError(ValueError):
    """A job configuration that does not validate; the message lists every bad field."""


def _point(text: str) -> str:
    parse_address(text)  # AddressError is a ValueError: pydantic reports it on this list item
    return text


Point = Annotated[str, AfterValidator(_point)]


class BuildConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = EMBEDDED
    backend: Literal["eager", "vllm"] = "eager"
    replicas: int = Field(1, ge=1, description="model copies on the cluster")
    tensor_parallel_size: int = Field(1, ge=1)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str | None = Field(None, description="torch device on each replica; default cuda where GPUs are reserved")
    gpus_per_replica: float | None = Field(None, ge=0)
    cpus_per_replica: float = Field(1, ge=0)
    torch_threads: int | None = Field(None, ge=1)
    backend_options: dict = Field(default_factory=dict)
    env_vars: dict[str, str] = Field(default_factory=dict)

    prompts: str | list[str]
    text_key: str = "text"
    points: list[Point] = Field(min_length=1)
    output: str
    layout: Literal["sequence", "token"] = "sequence"
    storage_dtype: Literal["float32", "bfloat16", "float16"] | None = None
    shard_size: int = Field(64, ge=1)
    shuffle: bool = Field(False, description="build-time shuffle: shards hold seeded random prompts, rows mixed")
    seed: int = Field(0, ge=0)
    overwrite: bool = False
    progress: bool = True

    @field_validator("prompts")
    @classmethod
    def _prompts_given(cls, prompts):
        if isinstance(prompts, list) and not prompts:
            raise ValueError("no prompts: give a .jsonl/.parquet path or a non-empty list of strings")
        return prompts

    def load_options(self) -> dict:
        options = dict(self.backend_options)
        if self.tensor_parallel_size != 1:
            options["tensor_parallel_size"] = self.tensor_parallel_size
        return dict(backend=self.backend, replicas=self.replicas, dtype=self.dtype, device=self.device,
                    gpus_per_replica=self.gpus_per_replica, cpus_per_replica=self.cpus_per_replica,
                    torch_threads=self.torch_threads, env_vars=self.env_vars or None, **options)


def load_config(source: str | Path | dict) -> BuildConfig:
    """Read and validate a config (a YAML/JSON path or a dict); :class:`ConfigError` lists every
    bad field."""
    label = "config"
    if not isinstance(source, dict):
        path = Path(source)
        label = str(path)
        if not path.exists():
            raise ConfigError(f"config file {label!r} does not exist")
        text = path.read_text()
        if path.suffix.lower() == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
        if not isinstance(data, dict):
            raise ConfigError(f"{label}: expected a mapping of fields (model:, points:, ...), got {type(data).__name__}")
        if isinstance(data.get("prompts"), str) and not Path(data["prompts"]).expanduser().is_absolute():
            data["prompts"] = str(path.parent / data["prompts"])  # read beside the config, wherever it runs
        source = data
    try:
        return BuildConfig.model_validate(source)
    except ValidationError as err:
        lines = [f"  {_where(e['loc'])}: {e['msg'].removeprefix('Value error, ')}"
                 + (f" (got {e['input']!r})" if _show(e) else "")
                 for e in err.errors()]
        raise ConfigError(f"{label}: {len(lines)} problem(s):\n" + "\n".join(lines)) from None


def _where(loc) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def _show(error) -> bool:
    return error["type"] not in ("missing",) and not isinstance(error.get("input"), (dict, list))

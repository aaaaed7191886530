"""The configuration of a dataset-build job, validated field by field with pydantic.

A YAML or JSON file such as::

    model: HuggingFaceTB/SmolLM2-135M-Instruct
    backend: eager
    replicas: 2
    prompts: prompts.jsonl          # or a list of strings; a relative path is read beside this file
    points: [resid_post.10, mlp_out.10]
    output: ~/acts/smollm2-l10      # or s3://bucket/prefix (AWS_* credentials); relative: the working dir
    layout: token                   # or sequence
    storage_dtype: bfloat16
    saes: [sae/l10]                 # dictionaries (SAELens folders; or {path:, reads:, k:, ...});
                                    # points: may then name resid_post.10.features

Every problem is reported at once, each with the field it is in. The file itself is read
strictly: UTF-8, at most 1 MiB, YAML through a safe loader (no tags that build Python objects)
that also refuses a key given twice (plain YAML silently keeps the last one), JSON with the
same rule; what cannot be read is one :class:`ConfigError` line with the file, line and column.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator

from interp_engine.address import parse_address
from interp_engine.embedded import NAME as EMBEDDED
from interp_engine.errors import ConfigError


def _point(text: str) -> str:
    parse_address(text)  # AddressError is a ValueError: pydantic reports it on this list item
    return text


Point = Annotated[str, AfterValidator(_point)]


class SaeConfig(BaseModel):
    """One dictionary of ``saes:``: its ``path`` (a SAELens folder or a Gemma Scope ``params.npz``;
    relative: beside the config) and the options of :func:`interp_engine.load_dictionary`."""

    model_config = ConfigDict(extra="forbid")

    path: str
    reads: Point | None = None
    writes: Point | None = None
    activation: Literal["relu", "jumprelu", "topk"] | None = None
    k: int | None = Field(None, ge=1)
    norm_scaling_factor: float | None = Field(None, allow_inf_nan=False)
    apply_b_dec_to_input: bool | None = None
    name: str | None = None

    def load(self):
        from interp_engine import load_dictionary

        return load_dictionary(self.path, **self.model_dump(exclude={"path"}, exclude_none=True))


class BuildConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = EMBEDDED
    backend: Literal["eager", "vllm"] = "eager"
    replicas: int = Field(1, ge=1, le=4096, description="model copies on the cluster")
    tensor_parallel_size: int = Field(1, ge=1, le=1024)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str | None = Field(None, description="torch device on each replica; default cuda where GPUs are reserved")
    gpus_per_replica: float | None = Field(None, ge=0, le=1024, allow_inf_nan=False)
    cpus_per_replica: float = Field(1, ge=0, le=4096, allow_inf_nan=False)
    torch_threads: int | None = Field(None, ge=1, le=4096, description="torch threads per replica")
    backend_options: dict = Field(default_factory=dict)
    env_vars: dict[str, str] = Field(default_factory=dict)

    prompts: str | list[str]
    text_key: str = "text"
    points: list[Point] = Field(min_length=1)
    output: str
    layout: Literal["sequence", "token"] = "sequence"
    storage_dtype: Literal["float32", "bfloat16", "float16"] | None = None
    shard_size: int = Field(64, ge=1, le=1 << 31)
    shuffle: bool = Field(False, description="build-time shuffle: shards hold seeded random prompts, rows mixed")
    seed: int = Field(0, ge=0, lt=1 << 64)
    overwrite: bool = False
    progress: bool = True
    saes: list[SaeConfig] = Field(default_factory=list, description="dictionaries whose feature points points: may name")

    @field_validator("saes", mode="before")
    @classmethod
    def _sae_paths(cls, saes):
        return [{"path": sae} if isinstance(sae, str) else sae for sae in saes] if isinstance(saes, list) else saes

    @field_validator("output")
    @classmethod
    def _own_output(cls, output):
        """``~`` is this user's home (a per-user path: ``~/datasets/...``); a URI is kept as given."""
        return output if "://" in output else str(Path(output).expanduser())

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


def load_config(source: str | Path | dict, schema: type[BaseModel] = BuildConfig):
    """Read and validate a config (a YAML/JSON path or a dict) against ``schema`` (a build's by
    default); :class:`ConfigError` lists every bad field. A file that cannot be read, does not parse, repeats a key in one mapping, nests
    deeper than Python can follow, or carries a YAML tag that builds an object is refused too."""
    label = "config"
    if not isinstance(source, dict):
        path = Path(source)
        label = str(path)
        data = _parse(path, _read(path))
        if not isinstance(data, dict):
            raise ConfigError(f"{label}: expected a mapping of fields (model:, points:, ...), got {type(data).__name__}")
        if isinstance(data.get("prompts"), str) and not Path(data["prompts"]).expanduser().is_absolute():
            data["prompts"] = str(path.parent / data["prompts"])  # read beside the config, wherever it runs
        if isinstance(data.get("saes"), list):
            data["saes"] = [_beside(path, sae) for sae in data["saes"]]
        source = data
    try:
        return schema.model_validate(source)
    except ValidationError as err:
        lines = [f"  {_where(e['loc'])}: {e['msg'].removeprefix('Value error, ')}"
                 + (f" (got {e['input']!r:.80})" if _show(e) else "")
                 for e in err.errors()]
        raise ConfigError(f"{label}: {len(lines)} problem(s):\n" + "\n".join(lines)) from None


def _beside(config: Path, sae):
    """A ``saes:`` entry with a relative path made relative to the config's folder."""
    entry = {"path": sae} if isinstance(sae, str) else sae
    if isinstance(entry, dict) and isinstance(entry.get("path"), str) and not Path(entry["path"]).expanduser().is_absolute():
        # absolute, so that a job that joins its own base folder (feature_dashboard.py) keeps it
        return {**entry, "path": str(config.parent.resolve() / Path(entry["path"]).expanduser())}
    return sae


_MAX_BYTES = 1 << 20  # a config is a page of settings; prompts belong in their own file


def _read(path: Path) -> str:
    if not path.exists():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    if path.is_dir():
        raise ConfigError(f"config {str(path)!r} is a folder; pass a YAML or JSON file (e.g. jobs/examples/build.yaml)")
    try:
        with open(path, "rb") as f:
            data = f.read(_MAX_BYTES + 1)
    except OSError as err:
        raise ConfigError(f"cannot read config {str(path)!r}: {err.strerror or err}") from None
    if len(data) > _MAX_BYTES:
        raise ConfigError(f"config {str(path)!r} is over {_MAX_BYTES >> 20} MiB; a config holds settings, put the "
                          f"prompts in a .jsonl file and name it in prompts:")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[:err.start].count(b"\n") + 1
        raise ConfigError(f"{path}:{line}: not UTF-8 text (byte {data[err.start]:#04x}); a config is a YAML or JSON "
                          f"text file") from None


def _parse(path: Path, text: str):
    try:
        if path.suffix.lower() == ".json":
            try:
                return json.loads(text, object_pairs_hook=_unique_pairs)
            except json.JSONDecodeError as err:
                raise ConfigError(f"{path}:{err.lineno}:{err.colno}: not valid JSON ({err.msg})") from None
        try:
            return yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader: no tags that build objects
        except yaml.constructor.ConstructorError as err:
            raise ConfigError(f"{path}:{_line(err)}: {err.problem}; a config holds plain values (strings, numbers, "
                              f"lists, mappings), so tags such as !!python/object are refused") from None
        except yaml.YAMLError as err:
            raise ConfigError(f"{path}:{_line(err)}: not valid YAML ({getattr(err, 'problem', None) or err})") from None
    except RecursionError:
        raise ConfigError(f"{path}: nested too deeply to read; a config is a flat mapping of fields") from None
    except _Duplicate as err:
        raise ConfigError(f"{path}{err}") from None


class _Duplicate(Exception):
    pass


def _unique_pairs(pairs):
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise _Duplicate(f": key {key!r} appears twice in one object; keep one")
        seen[key] = value
    return seen


def _line(err) -> str:
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    return f"{mark.line + 1}:{mark.column + 1}" if mark is not None else "?"


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping (plain YAML keeps the last)."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base` may be overridden below it
                continue
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, (str, int, float, bool)):
                if key in seen:
                    raise _Duplicate(f":{key_node.start_mark.line + 1}: key {key!r} appears twice in one mapping "
                                     f"(first at line {seen[key]}); keep one")
                seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def _where(loc) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def _show(error) -> bool:
    return error["type"] not in ("missing",) and not isinstance(error.get("input"), (dict, list))

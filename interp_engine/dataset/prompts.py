"""Where the prompts of a dataset build come from: a Python list, a JSONL or Parquet file, or a
Ray Dataset. Every source is read as a stream, in order, so a build never holds more than a
shard of prompts at once; :meth:`PromptSource.scan` reads it once up front to check it and to
fingerprint it before any work starts.

The fingerprint (``prompts_sha256`` in the manifest) hashes each prompt's UTF-8 bytes after
its length (8 bytes, little-endian), so it names one list of prompts: ``["a\\0b", "c"]`` and
``["a", "b\\0c"]`` differ. (Manifests before format 3 joined the prompts with NUL, which let two
lists share a fingerprint; see :mod:`.manifest` for what happens to those datasets.)
"""

from __future__ import annotations

import array
import dataclasses
import hashlib
import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..errors import PromptsError


@dataclasses.dataclass(frozen=True)
class Scan:
    """What one pass over the prompts found."""

    count: int
    sha256: str
    max_length: int
    tokens: int
    shard_tokens: tuple[int, ...] = ()  # real tokens per shard of ``shard_size`` prompts
    lengths: Any = ()  # tokens of each prompt (an ``array('i')``)


@dataclasses.dataclass(frozen=True)
class PromptSource:
    """A re-readable stream of prompt strings. Build one with :meth:`of`."""

    kind: str  # "list" | "jsonl" | "parquet" | "ray"
    data: Any
    text_key: str = "text"

    @classmethod
    def of(cls, prompts, text_key: str = "text") -> "PromptSource":
        if isinstance(prompts, PromptSource):
            return prompts
        if isinstance(prompts, (str, Path)):
            path = Path(prompts).expanduser().resolve()  # the coordinator may run elsewhere
            if not path.exists():
                raise PromptsError(f"prompts file {str(path)!r} does not exist; pass a .jsonl or .parquet file "
                                   f"with a {text_key!r} field, or a list of strings")
            suffix = path.suffix.lower()
            if suffix in (".jsonl", ".json", ".ndjson"):
                if not path.is_file():
                    raise PromptsError(f"prompts path {str(path)!r} is not a file; pass a .jsonl file (one JSON "
                                       f"value per line)")
                return cls("jsonl", str(path), text_key)
            if suffix == ".parquet" or path.is_dir():
                return cls("parquet", str(path), text_key)
            raise PromptsError(f"cannot read prompts from {str(path)!r}: use a .jsonl or .parquet file")
        if isinstance(prompts, (list, tuple)):
            bad = next((i for i, p in enumerate(prompts) if not isinstance(p, str)), None)
            if bad is not None:
                raise PromptsError(f"prompt {bad} is a {type(prompts[bad]).__name__}, not a string; "
                                   f"pass a list of strings")
            return cls("list", tuple(prompts), text_key)
        if type(prompts).__module__.startswith("ray.data"):
            return cls("ray", prompts, text_key)
        raise PromptsError(f"prompts must be a list of strings, a .jsonl/.parquet path or a Ray Dataset, "
                           f"got {type(prompts).__name__}")

    @property
    def label(self) -> str:
        return {"list": "a Python list", "ray": "a Ray Dataset"}.get(self.kind, str(self.data))

    def __iter__(self) -> Iterator[str]:
        if self.kind == "list":
            yield from self.data
        elif self.kind == "jsonl":
            yield from self._jsonl()
        elif self.kind == "parquet":
            yield from self._parquet()
        else:
            yield from self._ray()

    def _ray(self) -> Iterator[str]:
        # Shard i must hold the same prompts on every pass: keep the dataset's order while reading.
        from ray.data import DataContext

        options = DataContext.get_current().execution_options
        previous, options.preserve_order = options.preserve_order, True
        try:
            for batch in self.data.iter_batches(batch_size=256, batch_format="pyarrow"):
                yield from self._column(batch)
        finally:
            options.preserve_order = previous

    def _jsonl(self) -> Iterator[str]:
        try:
            f = open(self.data, "rb")
        except OSError as err:
            raise PromptsError(f"cannot read prompts file {self.data!r} ({err.strerror or err}); pass a readable "
                               f".jsonl file") from None
        with f:
            for number, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as err:
                    raise PromptsError(f"{self.data}:{number}: not UTF-8 text (byte {raw[err.start]:#04x} at column "
                                       f"{err.start + 1}); a .jsonl prompts file holds one UTF-8 JSON value per "
                                       f"line") from None
                if not line.strip():
                    continue
                try:
                    item = json.loads(line)
                except json.JSONDecodeError as err:
                    raise PromptsError(f"{self.data}:{number}: not valid JSON ({err.msg})") from None
                if isinstance(item, str):
                    yield item
                elif isinstance(item, dict) and isinstance(item.get(self.text_key), str):
                    yield item[self.text_key]
                else:
                    raise PromptsError(f"{self.data}:{number}: each line must be a JSON string or an object "
                                       f"with a string {self.text_key!r} field")

    def _parquet(self) -> Iterator[str]:
        import pyarrow as pa
        import pyarrow.dataset as pads

        try:
            dataset = pads.dataset(self.data, format="parquet")
        except (OSError, pa.ArrowException) as err:
            raise PromptsError(f"cannot read prompts from {self.data!r} as Parquet ({str(err).splitlines()[0][:200]}); "
                               f"pass a Parquet file or folder with a {self.text_key!r} column, or a .jsonl file") from None
        if self.text_key not in dataset.schema.names:
            raise PromptsError(f"{self.data} has no {self.text_key!r} column (columns: "
                               f"{', '.join(dataset.schema.names)}); pass text_key=...")
        for batch in dataset.to_batches(columns=[self.text_key], batch_size=1024):
            yield from self._column(batch)

    def _column(self, batch) -> Iterator[str]:
        if self.text_key not in batch.schema.names:
            raise PromptsError(f"{self.label} has no {self.text_key!r} column (columns: "
                               f"{', '.join(batch.schema.names)}); pass text_key=...")
        yield from batch.column(self.text_key).to_pylist()

    def shards(self, shard_size: int, skip: set[int] = frozenset(), order=None) -> Iterator[tuple[int, list[str]]]:
        """``(shard index, its prompts)`` in order, leaving out the shards in ``skip``. With an
        ``order`` (a permutation of the prompt indices: a shuffled build) shard ``i`` holds
        prompts ``order[i*shard_size : (i+1)*shard_size]``; the prompt texts are then held in
        memory for the pass (the texts only, never activations)."""
        if order is not None:
            texts = list(self)
            for index in range(-(-len(texts) // shard_size)):
                if index not in skip:
                    yield index, [texts[j] for j in order[index * shard_size:(index + 1) * shard_size]]
            return
        stream = iter(self)
        for index in itertools.count():
            chunk = list(itertools.islice(stream, shard_size))
            if not chunk:
                return
            if index not in skip:
                yield index, chunk

    def scan(self, encode, n_ctx: int, shard_size: int = 1) -> Scan:
        """Check every prompt (a non-empty string that fits the model), fingerprint the set and
        count the tokens of each shard."""
        digest = hashlib.sha256()
        count = max_length = tokens = 0
        shard_tokens: list[int] = []
        lengths = array.array("i")
        for i, text in enumerate(self):
            if not isinstance(text, str) or not text:
                raise PromptsError(f"prompt {i} of {self.label} is empty or not a string ({text!r}); "
                                   f"remove it or fill it in")
            n = len(encode(text))
            if n > n_ctx:
                raise PromptsError(f"prompt {i} of {self.label} is {n} tokens, longer than the model's {n_ctx} "
                                   f"positions; shorten or drop it")
            data = text.encode("utf-8")
            digest.update(len(data).to_bytes(8, "little"))  # length-prefixed: no two prompt lists collide
            digest.update(data)
            if count % shard_size == 0:
                shard_tokens.append(0)
            shard_tokens[-1] += n
            lengths.append(n)
            count += 1
            tokens += n
            max_length = max(max_length, n)
        if count == 0:
            raise PromptsError(f"{self.label} holds no prompts; a dataset needs at least one")
        return Scan(count, digest.hexdigest(), max_length, tokens, tuple(shard_tokens), lengths)

"""A finished activation dataset: where it is, what it holds, and the ways to read it.

:class:`ActivationDataset` is what ``build_dataset`` returns and what ``ActivationDataset.open``
gives back for a dataset written earlier: the manifest and the counts, shard files on a local
disk or an object store, and readers (Arrow, pandas, a Ray Dataset, a streaming torch loader,
SAELens's cached-activation layout), each in a module of its own.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from ..address import format_address
from .integrity import verify_dataset
from ..errors import DatasetCorruptError, InputError
from .columns import SHAPE_KEY
from .manifest import MANIFEST, read_manifest
from .shard import read_tensor, shard_name
from .store import Store


@dataclasses.dataclass(frozen=True, repr=False)
class ActivationDataset:
    """A finished dataset: where it is, what it holds, and how it was built.

    ``build_dataset`` returns one; :meth:`open` opens one written earlier (checking that every
    shard is there with its recorded size); :meth:`verify` checks every shard's sha256.
    """

    path: "Path | str"  # a local Path, or the URI the dataset was written to
    manifest: dict
    rows: int
    shards: int
    prompts: int
    tokens: int
    seconds: float
    resumed_shards: int = 0
    repaired: tuple[str, ...] = ()  # shards a resume found bad and rewrote
    store: Store | None = None
    #: seconds the shards this build wrote spent in each phase, summed over shards (``capture``,
    #: ``encode``, ``hash``, ``write``, ``waiting``; they overlap across shards) and their ``bytes``
    phases: dict = dataclasses.field(default_factory=dict, compare=False)
    #: tokens of the shards this build wrote itself (the rest were resumed); None: all of them
    built_tokens: int | None = dataclasses.field(default=None, compare=False)

    def __repr__(self) -> str:
        points = self.manifest.get("identity", {}).get("points", [])
        shown = ", ".join(points[:4]) + (f", ... ({len(points)} points)" if len(points) > 4 else "")
        return (f"ActivationDataset({str(self.path)!r}, {self.rows} rows, {self.shards} shards, "
                f"points: {shown or 'none'})")

    @classmethod
    def open(cls, output, *, filesystem=None, verify: bool = False) -> "ActivationDataset":
        """Open a finished dataset (local path, URI or ``(filesystem, path)``). Raises
        :class:`DatasetCorruptError` if a shard is missing or has the wrong size (with
        ``verify=True``: the wrong sha256)."""
        store = Store.of(output, filesystem)
        manifest = read_manifest(store)
        if manifest is None:
            raise FileNotFoundError(f"no dataset at {store.location()!r} (no {MANIFEST}); build one with build_dataset")
        if manifest.get("status") != "complete":
            raise DatasetCorruptError(f"the build at {store.location()!r} has not finished (status "
                                      f"{manifest.get('status')!r}); rerun the same build_dataset call to finish it")
        verify_dataset(store, manifest, full=verify)
        result = manifest["result"]
        return cls(where(store), manifest, result["rows"], result["shards"], result["prompts"], result["tokens"],
                   0.0, store=store)

    @property
    def _store(self) -> Store:
        return self.store if self.store is not None else Store.of(self.path)

    @property
    def names(self) -> list[str]:
        n = self.manifest["identity"]["n_shards"]
        return [shard_name(i, n) for i in range(n)]

    @property
    def files(self) -> list:
        """The shard files: local Paths, or URIs for a dataset on object storage."""
        store = self._store
        return [Path(store.key(n)) if store.is_local else store.location(n) for n in self.names]

    def verify(self) -> None:
        """Check every shard's size and sha256 against the manifest; raise
        :class:`DatasetCorruptError` naming the shards that differ."""
        verify_dataset(self._store, self.manifest, full=True)

    def to_arrow(self):
        store = self._store
        return pq.read_table([store.key(n) for n in self.names], filesystem=store.fs)

    def to_pandas(self):
        return self.to_arrow().to_pandas()

    def to_ray(self, *, num_cpus: float = 0, wait_s: float = 30.0):
        """The dataset as a Ray Dataset, read lazily shard by shard (see :mod:`.ray_data`).

        Read tasks reserve ``num_cpus`` CPUs each, 0 by default, so they run while model replicas
        hold every CPU of the cluster; given more, a read that cannot get them within ``wait_s``
        seconds raises a :class:`~interp_engine.ClusterError` saying what holds them."""
        from .ray_data import to_ray

        return to_ray(self, num_cpus=num_cpus, wait_s=wait_s)

    def loader(self, point, batch_size: int, **options):
        """A streaming torch ``IterableDataset`` of ``[batch_size, *shape]`` token rows of
        ``point`` (shuffle buffer across sequences, DDP rank split; see :mod:`.loader`)."""
        from .loader import ShardLoader

        return ShardLoader(self, point_name(point), batch_size, **options)

    def export_saelens(self, out_dir, point, context_size: int, **options):
        """Write ``point`` as a folder SAELens's ``ActivationsStore(cached_activations_path=...)``
        loads (see :mod:`.export`); returns its path."""
        from .export import export_saelens

        return export_saelens(self, out_dir, point_name(point), context_size, **options)

    def tensor(self, point) -> "object":
        """One point's column as a torch tensor ``[rows, ...]`` in its stored dtype (a
        dictionary's sparse features densified: ``[rows, (max_length,) d_sae]``)."""
        name = point_name(point)
        table = self.to_arrow()
        if f"{name}.ids" not in table.column_names:
            return read_tensor(table, name)
        ids = table.schema.field(f"{name}.ids")
        lead = (table.num_rows, ids.type.list_size) if pa.types.is_fixed_size_list(ids.type) else (table.num_rows,)
        return self.sparse(point, table).dense(lead)

    def sparse(self, point, table=None):
        """A dictionary's features stored sparse (``"resid_post.3.features"``) as
        :class:`~interp_engine.features.sparse.SparseRows`, one row per stored position."""
        from ..features.sparse import read_sparse

        name = point_name(point)
        table = self.to_arrow() if table is None else table
        if f"{name}.ids" not in table.column_names:
            sparse = [c[:-4] for c in table.column_names if c.endswith(".ids")]
            raise InputError(f"{name!r} is not stored sparse in this dataset; sparse feature points here: "
                             f"{', '.join(sparse) or 'none'}")
        field = table.schema.field(f"{name}.ids")
        width = json.loads(field.metadata[SHAPE_KEY])[0]
        return read_sparse(table.column(f"{name}.ids"), table.column(f"{name}.values"), width)

    def summary(self) -> str:
        """One line: what the dataset holds, and how fast this build wrote what it wrote (a resumed
        build's rate counts only the shards it wrote, not those an earlier run left)."""
        done = self.tokens if self.built_tokens is None else self.built_tokens
        rate = f"{done / self.seconds:.0f} tokens/s" if self.seconds and done else "no tokens/s"
        if not self.resumed_shards:
            return (f"{self.rows} rows in {self.shards} shards ({self.prompts} prompts, {self.tokens} tokens, "
                    f"{rate}) at {self.path}")
        written = self.shards - self.resumed_shards
        return (f"{self.rows} rows in {self.shards} shards ({self.resumed_shards} resumed from an earlier run, "
                f"{written} written now; {self.prompts} prompts, {self.tokens} tokens; {rate} over the {done} "
                f"tokens written now) at {self.path}")


def point_name(point) -> str:
    return point if isinstance(point, str) else format_address(point)


def where(store: Store):
    """A dataset's location as users name it: a local Path, or the URI on an object store."""
    return Path(store.root) if store.is_local else store.location()

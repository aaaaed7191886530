"""Export one point of a dataset in the layout SAELens trains from.

SAELens's ``ActivationsStore(cached_activations_path=...)`` (read in sae_lens
``training/activations_store.py``, v6) calls ``datasets.load_from_disk(path)``, selects the
column named by the TransformerLens hook (``blocks.10.hook_resid_post``) and ``token_ids``,
formats them as torch and checks that ``features[hook].shape == (context_size, d_in)``. So the
export is a ``save_to_disk`` folder with two columns: ``Array2D((context_size, d_in))``
activations and ``Sequence(int32, length=context_size)`` token ids. Rows are the dataset's real
tokens in stored order, cut into contexts of ``context_size`` (the tail that does not fill one is
dropped); multi-head points (``z``, ``q``, ``k``, ``v``) are flattened to ``heads * d_head``, as
SAELens does for ``hook_z``. bf16 is written as its exact float32 values.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from ..address import parse_address
from .columns import to_numpy
from ..errors import InputError
from ..scalars import integer
from ..tl_names import TL_HOOKS, tl_name

def tl_hook_name(point: str) -> str:
    """The TransformerLens hook name of ``point`` (``resid_post.10`` -> ``blocks.10.hook_resid_post``)."""
    address = parse_address(point)
    if address.name not in TL_HOOKS or address.layer is None:
        raise InputError(f"point {point!r} has no TransformerLens hook name; SAELens exports take one of "
                         f"{', '.join(f'{n}.L' for n, t in TL_HOOKS.items() if '{L}' in t)}")
    return tl_name(address)


def export_saelens(dataset, out_dir, point: str, context_size: int, *, dtype: str = "float32",
                   rows_per_write: int = 256) -> Path:
    """Write ``point`` of ``dataset`` as a SAELens cached-activations folder at ``out_dir``."""
    import datasets as hf

    point = str(parse_address(str(point)))  # a TransformerLens name reads as the same point
    hook = tl_hook_name(point)
    if point not in dataset.manifest["identity"]["points"]:
        raise InputError(f"point {point!r} is not in this dataset; it holds {', '.join(dataset.manifest['identity']['points'])}")
    if integer(context_size) is None or integer(context_size) < 1:
        raise InputError(f"context_size must be a positive int, got {context_size!r}")
    context_size = integer(context_size)
    if dtype not in ("float32", "float16"):
        raise InputError(f"dtype must be 'float32' or 'float16' (what Arrow and SAELens hold), got {dtype!r}")
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise InputError(f"{str(out)!r} is not empty; pick a new folder for the export")
    layout = dataset.manifest["identity"]["layout"]
    store = dataset._store
    d_in = int(np.prod(_row_shape(store, dataset.names[0], point, layout)))
    features = hf.Features({hook: hf.Array2D(shape=(context_size, d_in), dtype=dtype),
                            "token_ids": hf.Sequence(hf.Value("int32"), length=context_size)})

    def contexts():
        acts, toks, held = [], [], 0
        for block, ids in _tokens(store, dataset.names, point, layout):
            acts.append(block.reshape(len(block), -1).astype(dtype))
            toks.append(ids.astype(np.int32))
            held += len(block)
            while held >= context_size:
                a, t = np.concatenate(acts), np.concatenate(toks)
                for start in range(0, len(a) - context_size + 1, context_size):
                    yield {hook: a[start:start + context_size], "token_ids": t[start:start + context_size]}
                used = len(a) // context_size * context_size
                acts, toks, held = [a[used:]], [t[used:]], len(a) - used

    with tempfile.TemporaryDirectory(prefix="saelens-export-") as cache:
        built = hf.Dataset.from_generator(contexts, features=features, cache_dir=cache,
                                          writer_batch_size=rows_per_write)
        built.save_to_disk(str(out))
        del built
        shutil.rmtree(cache, ignore_errors=True)
    return out


def _row_shape(store, name: str, point: str, layout: str) -> tuple[int, ...]:
    from .columns import column_shape

    with store.fs.open_input_file(store.key(name)) as f:
        shape = column_shape(pq.read_schema(f), point)
    return shape[1:] if layout == "sequence" else shape


def _tokens(store, names, point, layout):
    """``(activations [n, ...], token ids [n])`` of real tokens, shard by shard, in stored order."""
    tokens = "token" if layout == "token" else "tokens"
    columns = [point, tokens] + (["length"] if layout == "sequence" else [])
    for name in names:
        with store.fs.open_input_file(store.key(name)) as f:
            for batch in pq.ParquetFile(f).iter_batches(batch_size=1024, columns=columns):
                acts = to_numpy(batch.column(point))
                ids = to_numpy(batch.column(tokens))
                if layout == "sequence":
                    mask = np.arange(acts.shape[1])[None, :] < batch.column("length").to_numpy()[:, None]
                    acts, ids = acts[mask], ids[mask]
                yield acts, ids

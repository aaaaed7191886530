"""The service's HTTP wire format, shared by the server and the Python client (no Ray, no pickle).

Requests are JSON (docs/SERVICE.md has the schema; the server validates it with the pydantic
models of :mod:`.http_api`). A tensor inside a request (an edit's vector or value) is
``{"shape": [...], "dtype": "float32", "data": "<base64 of the little-endian bytes>"}``, so it
crosses exactly, without a detour through decimal text.

Activations come back as one safetensors file (``application/octet-stream``): a tensor per
captured address, named by its string form (``"resid_post.10"``), ``"tokens"`` (int64 ``[batch,
pos]``, right-padded with -1: what the model ran) and, when ``positions=`` kept a selection,
``"positions"`` (int64 ``[batch, held]``, -1 where a row holds fewer). Neither reserved name is an
address. A dictionary's whole feature vector (``"resid_post.3.features"``) travels as its active
entries only, compressed rows: ``"<point>/offsets"`` (int64, one more than the rows), ``"<point>/ids"``
(int32) and ``"<point>/values"``; row ``r``'s features are ``ids[offsets[r]:offsets[r+1]]``. The
header's ``__metadata__`` holds ``format`` (:data:`FORMAT`), ``points`` (a JSON list of the
addresses in request order), ``sparse`` when there are such points (a JSON object: point ->
``{"shape": [batch, pos], "width": d_sae}``) and, for a generation, ``completion``: a JSON object
``{"text", "token_ids", "finish_reason", "scores"}`` (``scores``: ``{"logprobs": [...],
"top_logprobs": [[[id, logprob], ...], ...] or null}``).
"""

from __future__ import annotations

import base64
import json
import math

import numpy as np
import torch

from ..edit_directions import NUMBERS
from ..wire import CaptureReply, GenerationReply
from ..wire import Packed, SparsePacked
from ..errors import InputError, InternalError, shown

FORMAT = "interp_engine.capture/1"
DICTIONARY_FORMAT = "interp_engine.dictionary/1"
#: tensors of a capture response that are not addresses
RESERVED = ("tokens", "positions")
#: the dtypes a JSON tensor may carry, by name
JSON_DTYPES = {"float32": np.dtype("<f4"), "int64": np.dtype("<i8")}


# -- tensors inside JSON ------------------------------------------------------------------------
def tensor_to_json(array) -> dict:
    """A float32 array (or tensor) as ``{"shape", "dtype", "data"}`` (base64 of little-endian bytes)."""
    if isinstance(array, torch.Tensor):
        array = array.detach().cpu().numpy()
    array = np.ascontiguousarray(array, dtype=JSON_DTYPES["float32"])
    return {"shape": list(array.shape), "dtype": "float32", "data": base64.b64encode(array.tobytes()).decode()}


def tensor_from_json(data: dict, where: str = "a tensor") -> np.ndarray:
    """The array :func:`tensor_to_json` described; an ``InputError`` naming ``where`` (the request
    field) and the mismatch otherwise. The size the shape names is checked against the data before
    anything is built."""
    dtype = JSON_DTYPES.get(data.get("dtype", "float32"))
    if dtype is None:
        raise InputError(f"{where}: dtype {shown(data.get('dtype'))} is not one of {', '.join(JSON_DTYPES)}")
    shape = data.get("shape")
    if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
        raise InputError(f"{where}: shape must be a list of non-negative ints, got {shown(shape)}")
    text = data.get("data")
    need = math.prod(shape) * dtype.itemsize
    if not isinstance(text, str) or len(text) != 4 * math.ceil(need / 3):
        raise InputError(f"{where}: data must be the base64 of the {need} bytes shape {shape} of {dtype.name} "
                         f"needs ({4 * math.ceil(need / 3)} characters), got "
                         f"{f'{len(text)} characters' if isinstance(text, str) else type(text).__name__}")
    try:
        raw = base64.b64decode(text, validate=True)
    except ValueError:
        raise InputError(f"{where}: data is not base64 (A-Z, a-z, 0-9, '+', '/', '=' padding): encode the "
                         f"tensor's little-endian bytes with standard base64") from None
    if len(raw) != need:
        raise InputError(f"{where}: data holds {len(raw)} bytes, but shape {shape} of {dtype.name} needs {need}")
    return np.frombuffer(raw, dtype=dtype).reshape(shape).astype(np.float32 if dtype.kind == "f" else np.int64)


# -- edits and positions as JSON ----------------------------------------------------------------
#: the numbers of the directional edits (Cap's bounds, Swap's projection, Rotate's angle)
DIRECTION_NUMBERS = tuple(sorted({name for names in NUMBERS.values() for name in names}))


def edits_to_json(plain: dict | None) -> dict | None:
    """Checked edits in their plain form (:func:`interp_engine.wire.edits_for_replica`: per
    address, its edits in order) as JSON: per address, a list of edit objects."""
    if not plain:
        return None
    return {point: [_edit_to_json(data) for data in chain] for point, chain in plain.items()}


def _edit_to_json(data: dict) -> dict:
    item = {"kind": data["kind"], "heads": data.get("heads"), "positions": data.get("positions")}
    for key in ("scale", "norm_relative", "factor", *DIRECTION_NUMBERS):
        if key in data:
            item[key] = data[key]
    for key in ("vector", "value", "direction"):
        if key in data:
            item[key] = tensor_to_json(data[key])
    return item


def edits_from_json(edits: dict | None) -> dict | None:
    """The plain form (:func:`interp_engine.wire.edits_from_replica` reads it) of JSON edits: per
    address one edit object, or a list of them applied in order. Each edit carries the fields of
    its kind and no other (:data:`EDIT_FIELDS`); an ``InputError`` names the one that is missing
    or foreign."""
    if not edits:
        return None
    return {point: [_edit_from_json(item, f"edits[{point!r}]" + (f"[{i}]" if isinstance(chain, list) else ""))
                    for i, item in enumerate(chain if isinstance(chain, list) else [chain])]
            for point, chain in edits.items()}


#: per edit kind: the fields it needs, and those it may carry besides (heads, positions: every kind);
#: a directional edit needs its direction and numbers (a Cap one bound or both)
EDIT_FIELDS = {"add": ({"vector"}, {"scale", "norm_relative"}), "scale": ({"factor"}, set()),
               "set": ({"value"}, set()), "zero": (set(), set()),
               **{kind: ({"direction"}, set(names)) if kind == "cap" else ({"direction", *names}, set())
                  for kind, names in NUMBERS.items()}}


def _edit_from_json(item: dict, where: str = "an edit") -> dict:
    kind = item.get("kind")
    if kind not in EDIT_FIELDS:
        raise InputError(f"{where}: kind must be one of {', '.join(EDIT_FIELDS)}, got {shown(kind)}")
    needed, optional = EDIT_FIELDS[kind]
    given = {k for k, v in item.items() if v is not None} - {"kind", "heads", "positions"}
    missing, foreign = sorted(needed - given), sorted(given - needed - optional)
    if missing:
        raise InputError(f"{where}: a {kind!r} edit needs {' and '.join(map(repr, missing))} (e.g. " + {
            "add": '{"kind": "add", "vector": {"shape": [d_model], "data": "<base64>"}}',
            "scale": '{"kind": "scale", "factor": 0.5}',
            "set": '{"kind": "set", "value": {"shape": [d_model], "data": "<base64>"}}'}.get(
            kind, f'{{"kind": "{kind}", "direction": {{"shape": [d_model], "data": "<base64>"}}'
                  + "".join(f', "{n}": 1.0' for n in NUMBERS.get(kind, ())) + "}") + ")")
    if foreign:
        raise InputError(f"{where}: {', '.join(map(repr, foreign))} is not a field of a {kind!r} edit (it takes "
                         f"{', '.join(sorted(needed | optional | {'heads', 'positions'}))}): send each edit's "
                         f"own fields only")
    data = {"kind": kind, "heads": item.get("heads"), "positions": item.get("positions")}
    if kind == "add":
        data.update(scale=1.0 if item.get("scale") is None else item["scale"],
                    norm_relative=bool(item.get("norm_relative")))
    if kind == "scale":
        data["factor"] = item["factor"]
    if kind in NUMBERS:  # a directional edit: its numbers (a Cap's bounds may be null)
        data.update({key: item.get(key) for key in NUMBERS[kind]})
    for key in ("vector", "value", "direction"):
        if item.get(key) is not None:
            data[key] = tensor_from_json(item[key], f"{where}.{key}")
            data["shape"] = list(data[key].shape)
    return data


# -- dictionaries --------------------------------------------------------------------------------
#: the request field that carries dictionaries' weights, by key (sent once a replica asks for them)
MISSING = "dictionaries"


def dictionary_to_json(dictionary) -> str:
    """A :class:`~interp_engine.features.Dictionary` as the base64 of one safetensors file: its
    tensors in their own dtypes, its options and addresses in the header's metadata."""
    from ..features.transfer import dictionary_for_worker

    data = dictionary_for_worker(dictionary)
    metadata = {"format": DICTIONARY_FORMAT, "key": data["key"], "options": json.dumps(data["options"]),
                "reads": data["reads"], "writes": data["writes"]}
    return base64.b64encode(encode_tensors(data["tensors"], metadata)).decode()


def dictionary_from_json(text: str, key: str):
    """The :class:`~interp_engine.features.Dictionary` :func:`dictionary_to_json` wrote; an
    ``InputError`` naming what is wrong unless it is well formed and its content is what ``key`` names."""
    from ..features.transfer import dictionary_from_worker

    where = f"dictionaries[{shown(key)}]"
    try:
        tensors, metadata = decode_tensors(base64.b64decode(text, validate=True))
    except Exception as err:  # noqa: BLE001 - any malformed upload is the client's error
        raise InputError(f"{where} is not the base64 of a safetensors file ({type(err).__name__}): send "
                         f"http_wire.dictionary_to_json(dictionary), see docs/SERVICE.md") from None
    if metadata.get("format") != DICTIONARY_FORMAT:
        raise InputError(f"{where} has format {shown(metadata.get('format'))}, not {DICTIONARY_FORMAT!r}")
    missing = [k for k in ("options", "reads", "writes") if k not in metadata]
    if missing:
        raise InputError(f"{where}: the file's metadata lacks {', '.join(map(repr, missing))} (a dictionary "
                         f"carries format, key, options (JSON), reads and writes; docs/SERVICE.md)")
    try:
        options = json.loads(metadata["options"])
    except ValueError:
        options = None
    if not isinstance(options, dict):
        raise InputError(f"{where}: its 'options' metadata must be a JSON object of the dictionary's options")
    try:
        dictionary = dictionary_from_worker({"key": key, "tensors": tensors, "options": options,
                                             "reads": metadata["reads"], "writes": metadata["writes"]})
    except InputError as err:
        raise type(err)(f"{where}: {err}") from None
    except (TypeError, ValueError, KeyError) as err:
        raise InputError(f"{where} is not a dictionary this engine can build: {type(err).__name__}: "
                         f"{str(err)[:300]}") from None
    if dictionary.key != key:
        raise InputError(f"the weights sent as dictionary {shown(key)} are another dictionary's (their content key "
                         f"differs): send each dictionary under its own key")
    return dictionary


# -- capture responses as safetensors -----------------------------------------------------------
def encode_capture(result: CaptureReply | GenerationReply, points: list[str] | None = None) -> bytes:
    """One capture (or generation) result as the bytes of a safetensors file (see the module doc)."""
    from safetensors.torch import save

    tensors, sparse = {}, {}
    for name, packed in result.tensors.items():
        if isinstance(packed, SparsePacked):  # a dictionary's features: the active ones, as compressed rows
            tensors[f"{name}/offsets"] = torch.from_numpy(np.array(packed.offsets, dtype=np.int64))
            tensors[f"{name}/ids"] = torch.from_numpy(np.array(packed.ids, dtype=np.int32))
            tensors[f"{name}/values"] = packed.values.tensor()
            sparse[name] = {"shape": list(packed.shape), "width": packed.width}
        else:
            tensors[name] = packed.tensor()
    tensors["tokens"] = torch.from_numpy(np.array(result.tokens, dtype=np.int64))
    if result.positions is not None:
        tensors["positions"] = torch.from_numpy(np.array(result.positions, dtype=np.int64))
    metadata = {"format": FORMAT, "points": json.dumps(points if points is not None else list(result.tensors))}
    if sparse:
        metadata["sparse"] = json.dumps(sparse)
    if isinstance(result, GenerationReply):
        metadata["completion"] = json.dumps({"text": result.text, "token_ids": list(result.token_ids),
                                             "finish_reason": result.finish_reason, "scores": result.scores})
    return save(tensors, metadata)


def decode_capture(body: bytes) -> CaptureReply | GenerationReply:
    """The result :func:`encode_capture` wrote."""
    from safetensors.torch import load

    metadata = _metadata(body)
    if metadata.get("format") != FORMAT:
        raise InternalError(f"[Internal] the service answered a capture in format {metadata.get('format')!r}, "
                            f"not {FORMAT!r}: client and service are different versions")
    loaded = load(body)
    points = json.loads(metadata["points"])
    sparse = json.loads(metadata.get("sparse", "{}"))
    def packed(p: str):
        if p not in sparse:
            return Packed.of(loaded[p])
        return SparsePacked(loaded[f"{p}/offsets"].numpy(), loaded[f"{p}/ids"].numpy(),
                            Packed.of(loaded[f"{p}/values"]), tuple(sparse[p]["shape"]), int(sparse[p]["width"]))

    tensors = {p: packed(p) for p in points}
    tokens = loaded["tokens"].numpy()
    positions = loaded["positions"].numpy() if "positions" in loaded else None
    if "completion" in metadata:
        done = json.loads(metadata["completion"])
        return GenerationReply(done["text"], list(done["token_ids"]), done["finish_reason"], tensors, tokens, positions,
                               done.get("scores"))
    return CaptureReply(tensors, tokens, positions)


def encode_tensors(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> bytes:
    from safetensors.torch import save

    return save({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, {"format": FORMAT, **(metadata or {})})


def decode_tensors(body: bytes) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    from safetensors.torch import load

    return load(body), _metadata(body)


def _metadata(body: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file held in memory: the 8-byte little-endian header
    length, then the JSON header."""
    if len(body) < 8:
        raise InternalError(f"[Internal] the service answered {len(body)} bytes, not a safetensors file")
    size = int.from_bytes(body[:8], "little")
    return json.loads(body[8:8 + size]).get("__metadata__", {}) or {}

"""The service's HTTP API: FastAPI routes served by every replica behind Serve's proxy.

Requests are validated twice, as everywhere in the library: their *form* by the pydantic models
below, with strict JSON types (a boolean is not an int, a token id fits int64; the OpenAPI schema
is at ``/docs`` and ``/openapi.json``), their *meaning* by the model itself (an unknown address, a
position out of range, a sampling option out of range) with the library's own messages; both are
answered 400 ``{"error": "AddressError", "message": "..."}``, a message that names the field and
never quotes the request's values. A request over a limit is a 413 naming the limit
(:mod:`.limits`), checked on the parsed request before any array is built from it. Authentication,
the body's deadline and the replica's capture slots come first (:mod:`.http_guard`). Activations
come back as safetensors bytes (:mod:`.http_wire`); nothing is pickled. docs/SERVICE.md describes
the wire format for clients in other languages.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Union

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, Strict
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import AddressError, InputError, LimitExceeded, MissingDictionary, shown
from . import http_wire
from .http_guard import Guard, error as _error

app = FastAPI(title="interp_engine capture service",
              description="Activations of a deployed model, by address (docs/SERVICE.md). Every request needs "
                          "`Authorization: Bearer <token>`.")

SAFETENSORS = "application/octet-stream"

# -- strict JSON types: a boolean is no int, a number is finite, an int fits int64 --------------
Int = Annotated[int, Strict(), Field(ge=-2**62, le=2**62)]
Count = Annotated[int, Strict(), Field(ge=0, le=2**62)]
TokenId = Annotated[int, Strict(), Field(ge=-1, le=2**62, description="a token id, -1 where padded")]
Number = Annotated[float, Strict(), Field(allow_inf_nan=False)]
Text = Annotated[str, Strict()]
Key = Annotated[str, Strict(), Field(min_length=1, max_length=128, description="a dictionary's content key")]
Flag = Annotated[bool, Strict()]


# -- request bodies -----------------------------------------------------------------------------
class TensorJSON(BaseModel):
    """A float32 tensor: its shape and the base64 of its little-endian bytes."""

    model_config = ConfigDict(extra="forbid")
    shape: list[Count]
    dtype: Literal["float32"] = "float32"
    data: Text


class SliceJSON(BaseModel):
    """Python's ``slice(start, stop, step)``, each None or an int."""

    model_config = ConfigDict(extra="forbid")
    slice: tuple[Int | None, Int | None, Int | None]


Positions = Union[Int, list[Int], Literal["prompt", "generated"], SliceJSON, None]


class EditJSON(BaseModel):
    """One edit: ``add`` (``vector``, ``scale``, ``norm_relative``), ``scale`` (``factor``),
    ``set`` (``value``) or ``zero``; a directional edit (``direction``): ``ablate``, ``cap``
    (``max`` / ``min``), ``swap`` (``projection``), ``rotate`` (``angle``); ``heads`` on
    per-head sites; ``positions`` as for captures. An edit carries its own kind's fields only
    (:data:`.http_wire.EDIT_FIELDS`)."""

    model_config = ConfigDict(extra="forbid")
    kind: Literal["add", "scale", "set", "zero", "ablate", "cap", "swap", "rotate"]
    vector: TensorJSON | None = None
    scale: Number | None = None
    norm_relative: Flag | None = None
    factor: Number | None = None
    value: TensorJSON | None = None
    direction: TensorJSON | None = None
    max: Number | None = None
    min: Number | None = None
    projection: Number | None = None
    angle: Number | None = None
    heads: list[Count] | None = None
    positions: Positions = None


class CaptureRequest(BaseModel):
    """``run_with_cache``: a padded batch of token ids (rows right-padded with -1) and the points."""

    model_config = ConfigDict(extra="forbid")
    tokens: list[list[TokenId]] = Field(description="[batch, pos] token ids, each row right-padded with -1")
    points: list[Text] = Field(description="addresses ('resid_post.10') or site names ('resid_post': every layer)")
    positions: Positions = Field(None, description="positions to keep: an int, a list, 'prompt', 'generated' "
                                                   "or {'slice': [start, stop, step]}; null keeps all")
    edits: dict[str, EditJSON | list[EditJSON]] | None = Field(
        None, description="address -> an edit, or a list of edits applied in order")
    saes: list[Key] | None = Field(
        None, description="content keys of the dictionaries the call's feature points and edits use; a replica "
                          "that holds none under a key answers 409 {'error': 'MissingDictionary', 'keys': [...]}")
    dictionaries: dict[Key, Text] | None = Field(
        None, description="key -> a dictionary's weights (base64 of a safetensors file, docs/SERVICE.md), "
                          "sent when a replica asked for them")


class GenerateRequest(CaptureRequest):
    """``capture_generation``: one prompt (a single row), the points, and the sampling options."""

    max_tokens: Count = 16
    temperature: Number = 0.0
    top_p: Number = 1.0
    top_k: Count = 0
    seed: Int | None = None
    stop_at_eos: Flag = True
    top_logprobs: Count = 0


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    text: Text | list[Text]
    prepend_bos: Flag | None = None


# -- authentication, the body's deadline, slots (http_guard) and errors ----------------------------
def replica():
    from ray import serve

    return serve.get_replica_context().servable_object


app.add_middleware(Guard, replica=replica)


def _refusal(err: Exception) -> JSONResponse:
    """A library refusal as its HTTP answer: 413 over a limit, 409 with the keys for dictionaries
    this replica lacks (the client sends them), 400 for any other bad input."""
    if isinstance(err, MissingDictionary):
        return _error(409, "MissingDictionary", str(err), keys=err.keys)
    status = 413 if isinstance(err, LimitExceeded) else 400
    return _error(status, type(err).__name__, str(err))


REFUSED = (InputError, AddressError, ValueError, TypeError, KeyError, MissingDictionary)


@app.exception_handler(RequestValidationError)
async def malformed(request, err: RequestValidationError) -> JSONResponse:
    """A body that does not match the schema: 400 naming each wrong field and what it must be,
    never its value (FastAPI's own 422 echoes the input)."""
    problems = []
    for item in err.errors()[:5]:
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{shown(p)}" if len(str(p)) > 40 else f".{p}"
                        for p in item.get("loc", ())[1:]).lstrip(".")
        problems.append(f"{where or 'the body'}: {str(item.get('msg', 'invalid'))[:200]}")
    more = f" (and {len(err.errors()) - 5} more)" if len(err.errors()) > 5 else ""
    return _error(400, "InputError", f"the request does not match the schema (/docs): {'; '.join(problems)}{more}")


@app.exception_handler(StarletteHTTPException)
async def unreadable(request, err: StarletteHTTPException):
    """FastAPI's own 400 (a body it cannot parse, e.g. an integer of thousands of digits) in the
    library's error form; other statuses as FastAPI answers them."""
    if err.status_code == 400:
        return _error(400, "InputError", f"the request body is not JSON this service can read ({err.detail}): "
                      f"send a JSON object as /docs describes")
    return await http_exception_handler(request, err)


@app.exception_handler(Exception)
async def failure(request, err: Exception) -> JSONResponse:
    """A failure inside the model: a 500 that says what failed, which clients do not send again
    (a 500 without this body is a replica lost under the request, which they do)."""
    return _error(500, "RemoteError", f"{type(err).__name__}: {err}")


# -- routes -------------------------------------------------------------------------------------
@app.get("/ping")
async def ping() -> dict[str, int]:
    """The answering replica's process id: a cheap authenticated round trip."""
    return {"pid": await replica().ping()}


@app.get("/info")
async def info() -> dict[str, Any]:
    """The model's shape, capabilities, dtype and tokenizer files (base64), and the service's facts."""
    owner = replica()
    return await owner.info_json()


@app.post("/capture", response_class=Response, responses={200: {"content": {SAFETENSORS: {}}}})
async def capture(body: CaptureRequest, request: Request) -> Response:
    """``run_with_cache`` of a padded batch; the activations as a safetensors file."""
    owner = replica()
    try:
        tokens, points, positions, edits = _parsed(owner, body)
        saes, widths = _dictionaries(owner, body, int(request.headers["content-length"]))
        owner.check_limits(tokens, points, positions, widths=widths)
        captured = await owner._run_now(tokens, points, positions, edits, saes)
        data = http_wire.encode_capture(captured, points)
        owner.limits.check_response(len(data))
    except REFUSED as err:
        return _refusal(err)
    return Response(data, media_type=SAFETENSORS)


@app.post("/generate", response_class=Response, responses={200: {"content": {SAFETENSORS: {}}}})
async def generate(body: GenerateRequest, request: Request) -> Response:
    """``capture_generation`` of one prompt; the activations and the completion (in the file's metadata)."""
    owner = replica()
    options = {k: getattr(body, k) for k in ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop_at_eos",
                                             "top_logprobs")}
    try:
        tokens, points, positions, edits = _parsed(owner, body, body.max_tokens)
        saes, widths = _dictionaries(owner, body, int(request.headers["content-length"]))
        owner.check_limits(tokens, points, positions, body.max_tokens, widths=widths)
        generated = await owner._generate_now(tokens, points, options, positions, edits, saes)
        data = http_wire.encode_capture(generated, points)
        owner.limits.check_response(len(data))
    except REFUSED as err:
        return _refusal(err)
    return Response(data, media_type=SAFETENSORS)


@app.post("/tokenize")
async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
    """Token ids of a text (``[1, pos]``) or a list of texts (right-padded with -1)."""
    from ..tokens import pad_batch

    owner = replica()
    texts = [body.text] if isinstance(body.text, str) else body.text
    try:
        if not texts:
            raise InputError("text must be a string or a non-empty list of strings")
        owner.limits.check_request(len(texts), 0, 0)
        rows = [owner.model.tok.encode(t, where=f"text[{i}]", prepend_bos=body.prepend_bos)
                for i, t in enumerate(texts)]
        owner.limits.check_request(len(rows), max(len(r) for r in rows), 0)
    except REFUSED as err:
        return _refusal(err)
    return {"tokens": pad_batch(rows).tolist()}


@app.get("/unembedding", response_class=Response, responses={200: {"content": {SAFETENSORS: {}}}})
async def unembedding() -> Response:
    """The final norm's weights (``norm.<name>``) and ``W_U`` (``weight``); the HF config and the norm's
    module path in the metadata (``config``, ``norm_path``)."""
    plain = await replica().unembed_weights()
    tensors = {f"norm.{k}": v.tensor() for k, v in plain["norm"].items()}
    tensors["weight"] = plain["weight"].tensor()
    data = http_wire.encode_tensors(tensors, {"config": json.dumps(plain["config"]), "norm_path": plain["norm_path"]})
    return Response(data, media_type=SAFETENSORS)


@app.get("/o_proj/{layer}", response_class=Response, responses={200: {"content": {SAFETENSORS: {}}}})
async def o_proj(layer: int) -> Response:
    """Layer ``layer``'s attention output projection (``weight``, ``[d_model, n_heads * d_head]``)."""
    try:
        packed = await replica().o_proj_weight(layer)
    except REFUSED as err:
        return _refusal(err)
    return Response(http_wire.encode_tensors({"weight": packed.tensor()}), media_type=SAFETENSORS)


@app.get("/fingerprint")
async def fingerprint() -> dict[str, str]:
    """``weights_sha256``: the fingerprint of the weight files a dataset manifest records."""
    return {"weights_sha256": await replica().weights_sha256()}


@app.get("/status")
async def status() -> dict[str, Any]:
    """The deployment's replicas, their health and queue lengths."""
    from .status import service_status

    owner = replica()
    return await owner._in_thread(service_status, owner.service["name"])


def _parsed(owner, body: CaptureRequest, new_tokens: int = 0):
    """The request's tokens as an int64 array, its points checked against the model (site names
    expanded), its positions spec and its edits in their plain form. Every count is checked against
    the limits before anything is built from it (the rows are padded to the widest)."""
    from ..positions import check_spec

    rows = body.tokens
    width = max((len(r) for r in rows), default=0)
    if not rows or width == 0:
        raise InputError("tokens must be a non-empty [batch, pos] list of token ids")
    edits_given = sum(len(v) if isinstance(v, list) else 1 for v in (body.edits or {}).values())
    owner.limits.check_request(len(rows), width, len(body.points), new_tokens, edits_given)
    points = owner.checked_points(body.points)
    owner.limits.check_request(len(rows), width, len(points), new_tokens, edits_given)
    tokens = np.full((len(rows), width), -1, dtype=np.int64)
    for i, row in enumerate(rows):
        tokens[i, :len(row)] = row
    positions = body.positions
    if isinstance(positions, SliceJSON):
        positions = slice(*positions.slice)
    positions = check_spec(positions)
    edits = None
    if body.edits:
        edits = http_wire.edits_from_json({k: [e.model_dump() for e in v] if isinstance(v, list) else v.model_dump()
                                           for k, v in body.edits.items()})
        for item in (item for chain in edits.values() for item in chain):
            if isinstance(item.get("positions"), dict):  # SliceJSON dumped
                item["positions"] = {"slice": list(item["positions"]["slice"])}
    return tokens, points, positions, edits


def _dictionaries(owner, body: CaptureRequest, size: int) -> tuple[list | None, dict[str, int]]:
    """The request's dictionaries as ``[(key, dictionary)]`` (sent with it, or held here), and each
    attached site's feature count (for the response bound). A
    :class:`~interp_engine.errors.MissingDictionary` names the keys this replica lacks. ``size``:
    the body's bytes; what is not dictionaries' weights stays under ``max_request_bytes``."""
    rest = size - sum(len(text) for text in (body.dictionaries or {}).values())
    if rest > owner.limits.max_request_bytes:
        raise owner.limits.refuse("max_request_bytes", f"a body of {rest} bytes besides dictionaries' weights",
                                  "send smaller edits or fewer prompts")
    if not body.saes:
        if body.dictionaries:
            raise InputError("'dictionaries' came without 'saes': name the call's dictionaries by key in 'saes'")
        return None, {}
    if len(set(body.saes)) > owner.limits.max_points:
        raise owner.limits.refuse("max_points", f"{len(set(body.saes))} dictionaries",
                                  "attach fewer dictionaries per request")
    given = {key: http_wire.dictionary_from_json(text, key) for key, text in (body.dictionaries or {}).items()}
    unused = sorted(set(given) - set(body.saes))
    if unused:
        raise InputError(f"dictionaries {shown(unused)} were sent but 'saes' does not name them")
    held = owner.held_dictionaries([key for key in body.saes if key not in given])
    missing = [key for key in dict.fromkeys(body.saes) if key not in given and key not in held]
    if missing:
        raise MissingDictionary(f"this replica holds no dictionary {missing} (yet, or no longer): send the request "
                                f"again with their weights in 'dictionaries'", missing)
    saes = [(key, given[key] if key in given else held[key]) for key in body.saes]
    owner.check_dictionary_memory(saes)
    return saes, {str(d.reads): d.d_sae for _, d in saes}

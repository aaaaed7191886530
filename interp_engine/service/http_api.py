"""The service's HTTP API: FastAPI routes served by every replica behind Serve's proxy.

Requests are validated twice, as everywhere in the library: their *form* by the pydantic models
below (a malformed body is a 422 whose JSON names the field; the OpenAPI schema is at ``/docs``
and ``/openapi.json``), their *meaning* by the model itself (an unknown address, a position out
of range, a sampling option out of range) with the library's own messages, answered as 400
``{"error": "AddressError", "message": "..."}``. A request over a limit is a 413 naming the limit
(:mod:`.limits`). Every path needs ``Authorization: Bearer <token>``: 401 without, 403 with a wrong
one (compared in constant time, :mod:`.auth`). Activations come back as safetensors bytes
(:mod:`.http_wire`); nothing is pickled. docs/SERVICE.md describes the wire format for clients in
other languages.
"""

from __future__ import annotations

import json
from typing import Any, Literal, Union

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from ..errors import AddressError, InputError, LimitExceeded, MissingDictionary
from . import http_wire
from .auth import matches

app = FastAPI(title="interp_engine capture service",
              description="Activations of a deployed model, by address (docs/SERVICE.md). Every request needs "
                          "`Authorization: Bearer <token>`.")

SAFETENSORS = "application/octet-stream"
#: the header of a request that carries dictionaries' weights (its body may be larger by
#: ``Limits.max_dictionary_bytes``)
DICTIONARIES_HEADER = b"x-interp-engine-dictionaries"


# -- request bodies -----------------------------------------------------------------------------
class TensorJSON(BaseModel):
    """A float32 tensor: its shape and the base64 of its little-endian bytes."""

    model_config = ConfigDict(extra="forbid")
    shape: list[int]
    dtype: Literal["float32"] = "float32"
    data: str


class SliceJSON(BaseModel):
    """Python's ``slice(start, stop, step)``, each None or an int."""

    model_config = ConfigDict(extra="forbid")
    slice: tuple[int | None, int | None, int | None]


Positions = Union[int, list[int], Literal["prompt", "generated"], SliceJSON, None]


class EditJSON(BaseModel):
    """One edit: ``add`` (``vector``, ``scale``, ``norm_relative``), ``scale`` (``factor``),
    ``set`` (``value``) or ``zero``; a directional edit (``direction``): ``ablate``, ``cap``
    (``max`` / ``min``), ``swap`` (``projection``), ``rotate`` (``angle``); ``heads`` on
    per-head sites; ``positions`` as for captures."""

    model_config = ConfigDict(extra="forbid")
    kind: Literal["add", "scale", "set", "zero", "ablate", "cap", "swap", "rotate"]
    vector: TensorJSON | None = None
    scale: float = 1.0
    norm_relative: bool = False
    factor: float | None = None
    value: TensorJSON | None = None
    direction: TensorJSON | None = None
    max: float | None = None
    min: float | None = None
    projection: float | None = None
    angle: float | None = None
    heads: list[int] | None = None
    positions: Positions = None


class CaptureRequest(BaseModel):
    """``run_with_cache``: a padded batch of token ids (rows right-padded with -1) and the points."""

    model_config = ConfigDict(extra="forbid")
    tokens: list[list[int]] = Field(description="[batch, pos] token ids, each row right-padded with -1")
    points: list[str] = Field(description="addresses ('resid_post.10') or site names ('resid_post': every layer)")
    positions: Positions = Field(None, description="positions to keep: an int, a list, 'prompt', 'generated' "
                                                   "or {'slice': [start, stop, step]}; null keeps all")
    edits: dict[str, EditJSON | list[EditJSON]] | None = Field(
        None, description="address -> an edit, or a list of edits applied in order")
    saes: list[str] | None = Field(
        None, description="content keys of the dictionaries the call's feature points and edits use; a replica "
                          "that holds none under a key answers 409 {'error': 'MissingDictionary', 'keys': [...]}")
    dictionaries: dict[str, str] | None = Field(
        None, description="key -> a dictionary's weights (base64 of a safetensors file, docs/SERVICE.md), "
                          "sent when a replica asked for them")


class GenerateRequest(CaptureRequest):
    """``capture_generation``: one prompt (a single row), the points, and the sampling options."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_at_eos: bool = True
    top_logprobs: int = 0


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    text: str | list[str]
    prepend_bos: bool | None = None


# -- authentication and request size ------------------------------------------------------------
def replica():
    from ray import serve

    return serve.get_replica_context().servable_object


def _error(status: int, kind: str, message: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": kind, "message": message}, status_code=status, headers=headers)


def _refused(headers: dict[bytes, bytes], method: str) -> JSONResponse | None:
    """The answer to a request without this deployment's bearer token, or with a body over the limit."""
    owner = replica()
    header = headers.get(b"authorization", b"").decode("latin-1")
    scheme, _, token = header.partition(" ")
    if not header:
        return _error(401, "ServiceAuthError", "this service needs a bearer token: send 'Authorization: Bearer "
                      "<token>' (serve() returned it as info.token and stored it in a file only you can read)",
                      {"WWW-Authenticate": "Bearer"})
    if scheme.lower() != "bearer" or not matches(token.strip(), owner.token_sha256):
        return _error(403, "ServiceAuthError", "the bearer token is not this service's; use the token serve() "
                      "returned for it (info.token, or its token file)")
    if method == "POST":
        size = headers.get(b"content-length")
        if size is None or not size.isdigit():
            return _error(411, "InputError", "send the request body with a Content-Length header")
        limit = "max_dictionary_bytes" if DICTIONARIES_HEADER in headers else "max_request_bytes"
        allowed = owner.limits.max_request_bytes + (owner.limits.max_dictionary_bytes
                                                    if limit == "max_dictionary_bytes" else 0)
        if int(size) > allowed:
            return _error(413, "LimitExceeded", str(owner.limits.refuse(
                limit, f"a body of {int(size)} bytes", "send smaller dictionaries" if limit == "max_dictionary_bytes"
                else "send smaller edits or fewer prompts")))
    return None


class BearerToken:
    """ASGI middleware: every path (the schema and /docs too) needs the deployment's bearer token."""

    def __init__(self, inner):
        self.inner = inner

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            refusal = _refused(dict(scope["headers"]), scope["method"])
            if refusal is not None:
                return await refusal(scope, receive, send)
        await self.inner(scope, receive, send)


app.add_middleware(BearerToken)


def _refusal(err: Exception) -> JSONResponse:
    """A library refusal as its HTTP answer: 413 over a limit, 409 with the keys for dictionaries
    this replica lacks (the client sends them), 400 for any other bad input."""
    if isinstance(err, MissingDictionary):
        return JSONResponse({"error": "MissingDictionary", "message": str(err), "keys": err.keys}, status_code=409)
    status = 413 if isinstance(err, LimitExceeded) else 400
    return _error(status, type(err).__name__, str(err))


REFUSED = (InputError, AddressError, ValueError, TypeError, KeyError, MissingDictionary)


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
        captured = await owner.run(tokens, points, positions, edits, saes)
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
        tokens, points, positions, edits = _parsed(owner, body)
        saes, widths = _dictionaries(owner, body, int(request.headers["content-length"]))
        owner.check_limits(tokens, points, positions, body.max_tokens, widths=widths)
        generated = await owner.generate(tokens, points, options, positions, edits, saes)
        data = http_wire.encode_capture(generated, points)
        owner.limits.check_response(len(data))
    except REFUSED as err:
        return _refusal(err)
    return Response(data, media_type=SAFETENSORS)


@app.post("/tokenize")
async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
    """Token ids of a text (``[1, pos]``) or a list of texts (right-padded with -1)."""
    owner = replica()
    try:
        tokens = owner.model.to_tokens(body.text, prepend_bos=body.prepend_bos)
    except REFUSED as err:
        return _refusal(err)
    return {"tokens": tokens.tolist()}


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


def _parsed(owner, body: CaptureRequest):
    """The request's tokens as an int64 array, its points checked against the model (site names
    expanded), its positions spec and its edits in their plain form."""
    from ..positions import check_spec

    rows = body.tokens
    width = max((len(r) for r in rows), default=0)
    if not rows or width == 0:
        raise InputError("tokens must be a non-empty [batch, pos] list of token ids")
    tokens = np.full((len(rows), width), -1, dtype=np.int64)
    for i, row in enumerate(rows):
        tokens[i, :len(row)] = row
    points = owner.checked_points(body.points)
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
    """The request's dictionaries as ``[(key, dictionary or None where the replica holds it)]``, and each
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
    given = {key: http_wire.dictionary_from_json(text, key) for key, text in (body.dictionaries or {}).items()}
    unused = sorted(set(given) - set(body.saes))
    if unused:
        raise InputError(f"dictionaries {unused} were sent but 'saes' does not name them")
    missing = [key for key in owner.missing_dictionaries(body.saes) if key not in given]
    if missing:
        raise MissingDictionary(f"this replica holds no dictionary {missing} yet: send the request again with "
                                f"their weights in 'dictionaries'", missing)
    return [(key, given.get(key)) for key in body.saes], owner.feature_widths(body.saes, given)

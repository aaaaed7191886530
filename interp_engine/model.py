"""The model handle every backend returns, and the calls users write.

``load_model(...)`` returns a :class:`CaptureModel`: the eager backend, the vLLM backend and the
cluster-backed model all implement the same few methods, so ``run_with_cache(model, tokens,
points)`` is one call whatever runs the model. Switching backend is the ``backend=`` argument
and nothing else.
"""

from __future__ import annotations

from typing import Any

import torch

from . import cancel
from .address import Address, AddressLike
from .points import ModelInfo, all_points
from .cache import Cache
from .capabilities import Capabilities
from .edits import Planned, check_edits
from .errors import InputError
from .features.plan import plan_features, split_edits
from .generation import Completion as Completion
from .generation import Sampling as Sampling
from .positions import Selection, check_spec, resolve
from .request import Points, Request
from .tokens import Tokenizer, check_tokens


class CaptureModel:
    """A loaded model that captures activations. Backends subclass it.

    Subclasses declare their :class:`~.capabilities.Capabilities` (narrowed per model to the sites
    it cannot read), set ``info`` and ``tok``, and implement :meth:`_execute` (and, when it can
    wait without a thread, :meth:`_execute_async`): this class checks what users pass in once,
    into a :class:`~.request.Request`, so every backend gives the same errors and runs only
    checked requests.
    The contract as a whole, and the optional capabilities (unembedding, o_proj weights, writing
    dataset shards), is written down in :mod:`.protocol`.
    """

    #: what this backend can do (the core decides from these fields, never from a name)
    capabilities: Capabilities = Capabilities("")
    info: ModelInfo
    tok: Tokenizer
    #: the dtype the weights are held in: "float32", "bfloat16" or "float16"
    dtype: str = "float32"
    #: the local folder the weights were loaded from (set by the loader; None on a cluster model)
    source = None
    #: where to send a batch that a one-prompt call refused
    batch_hint: str = "For a padded batch, run_with_cache(model, tokens, points) takes it whole."

    # -- facts ---------------------------------------------------------------------------------
    def __repr__(self) -> str:
        """``EagerModel('SmolLM2-135M-Instruct', 30 layers, float32, cpu)``: what it is, not its modules."""
        extra = "".join(f", {x}" for x in self._repr_extras())
        return f"{type(self).__name__}({self.cfg.model_name!r}, {self.n_layers} layers, {self.dtype}{extra})"

    def _repr_extras(self) -> list[str]:
        """What a backend adds to its repr (its device, its engine's size, its replicas)."""
        return []

    @property
    def backend(self) -> str:
        """The ``backend=`` name this model was loaded with."""
        return self.capabilities.name

    @property
    def unserved(self) -> frozenset[str]:
        """Sites this model cannot read exactly (they get a clear error instead)."""
        return self.capabilities.unserved

    @property
    def batched(self) -> bool:
        """Whether a call may carry a batch of several prompts."""
        return self.capabilities.batched

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def n_layers(self) -> int:
        return self.info.n_layers

    @property
    def d_model(self) -> int:
        return self.info.d_model

    @property
    def n_heads(self) -> int:
        return self.info.n_heads

    @property
    def d_head(self) -> int:
        return self.info.d_head

    @property
    def d_mlp(self) -> int:
        return self.info.d_mlp

    @property
    def d_vocab(self) -> int:
        return self.info.d_vocab

    @property
    def cfg(self):
        """The model's facts under TransformerLens's config names (``cfg.d_model``, ``cfg.n_layers``,
        ``cfg.n_key_value_heads``, ...), read-only: :class:`~.tl_names.TLConfig`."""
        from .tl_names import tl_config

        return tl_config(self.info, self.dtype, getattr(self, "device", None))

    @property
    def tokenizer(self):
        """The Hugging Face tokenizer (``model.tok`` wraps it with ``to_tokens`` and padding)."""
        return self.tok.hf

    def to_tokens(self, text: str | list[str], *, prepend_bos: bool | None = None) -> torch.Tensor:
        """``"text"`` -> ``[1, pos]`` token ids; a list -> a right-padded batch (see tokens.py).
        ``prepend_bos``: None = the tokenizer's own special tokens, True/False = force a BOS / none."""
        return self.tok.to_tokens(text, prepend_bos=prepend_bos)

    def to_str_tokens(self, text_or_tokens, *, prepend_bos: bool | None = None):
        """Each token as text: ``"text"`` or ``[1, pos]`` -> ``list[str]``; a batch -> one list per row."""
        return self.tok.to_str_tokens(text_or_tokens, prepend_bos=prepend_bos)

    def to_string(self, tokens):
        """Token ids back to text: ``[pos]`` / ``[1, pos]`` / a list of ids -> ``str``; a batch -> ``list[str]``."""
        return self.tok.to_string(tokens)

    def chat_tokens(self, messages, *, add_generation_prompt: bool = False):
        """``messages`` (``[{"role": ..., "content": ...}]``) through the model's own chat template:
        a :class:`~interp_engine.chat.ChatTokens` ``(tokens [1, pos], spans, text)``, ``spans[i]``
        the ``(start, end)`` positions of message ``i``'s content (see :mod:`.chat`)."""
        from .chat import chat_tokens

        return chat_tokens(self.tok.hf, messages, add_generation_prompt=add_generation_prompt)

    def points(self, site: str | None = None) -> list[Address]:
        """Every address this model serves on this backend, in forward order (layer by layer,
        sites in the order of the site table, ``logits`` last); ``site`` keeps one site's."""
        return all_points(self.info, self.capabilities, site)

    def facts(self) -> dict:
        """What a dataset manifest records about the model: ``model_dtype`` (its weights' dtype)
        and ``weights_sha256`` (a fingerprint of its weight files, computed once per process)."""
        from .fingerprint import weights_fingerprint

        if self.source is None:
            raise NotImplementedError(f"{type(self).__name__} knows no local folder to fingerprint")
        return {"model_dtype": self.dtype, "weights_sha256": weights_fingerprint(self.source)}

    # -- validation shared by all backends ------------------------------------------------------
    def check(self, tokens, points, *, single: bool | None = None,
              call: str = "run_with_cache") -> tuple[torch.Tensor, list[Address]]:
        single = (not self.batched) if single is None else single
        tokens = check_tokens(tokens, self.info.d_vocab, self.info.n_ctx, single=single,
                              why=self._one_prompt(call, tokens) if single else "")
        return tokens, list(self.check_points(points))

    def check_points(self, points) -> Points:
        """``points`` checked against this model, once: pass the result as ``points`` to any call
        and it is not checked again (see :mod:`.request`)."""
        return Points.check(points, self.info, self.capabilities)

    def position_limit(self) -> tuple[int, str]:
        """How many positions a sequence (prompt + generated) may fill, and how to name that limit."""
        return self.info.n_ctx, f"the model's {self.info.n_ctx} positions"

    def _check_generation(self, tokens, points, options: Sampling, call: str):
        tokens, addresses = self.check(tokens, points, single=True, call=call)
        options.check_length(tokens.shape[1], *self.position_limit())
        return tokens, addresses

    def _one_prompt(self, call: str, tokens) -> str:
        """The message for a batch given to ``call`` where one prompt is expected."""
        n = tokens.shape[0] if isinstance(tokens, torch.Tensor) and tokens.dim() == 2 else "several"
        if call == "run_with_cache":  # only a backend that takes one prompt per call gets here (vLLM)
            return (
                f"the {self.backend} backend takes one prompt per call, got a batch of {n}: it runs each prompt at "
                f"its true length. Call once per prompt (tokens[i:i+1]), or await model.capture(...) for many "
                f"prompts at once. {self.batch_hint}"
            )
        return (
            f"{call} takes one prompt per call, got a batch of {n}: pass one row (tokens[i:i+1]) per call; to run "
            f"many at once, gather several awaits (asyncio.gather(*(model.capture(row, points) for row in rows)), "
            f"or model.capture_generation_async). {self.batch_hint}"
        )

    @staticmethod
    def _selection(tokens: torch.Tensor, positions, options: Sampling | None = None) -> Selection | None:
        """``positions=`` resolved against each row of a checked batch (see positions.py)."""
        lengths = (tokens >= 0).sum(dim=1).tolist()
        return resolve(check_spec(positions), lengths, generating=options is not None,
                       max_tokens=options.max_tokens if options else None)

    def _edits(self, edits, tokens: torch.Tensor,
               options: Sampling | None = None) -> dict[Address, tuple[Planned, ...]] | None:
        """``edits=`` checked against this model and the checked batch (see edits.py)."""
        return check_edits(edits, self.info, self.capabilities, tokens,
                           generating=options is not None, max_tokens=options.max_tokens if options else None)

    def _features(self, addresses: list, edits, saes, tokens: torch.Tensor, options: Sampling | None):
        """The plain addresses and edits of a call, and the plan of its feature points and feature
        edits with the dictionaries ``saes`` (None when it has no feature work; see
        :mod:`interp_engine.features`)."""
        plain_edits, feature_edits = split_edits(edits)
        caps = self.capabilities
        addresses, plan = plan_features(addresses, feature_edits, saes, self.info, tokens,
                                        writable=frozenset(caps.writable - caps.unserved),
                                        generating=options is not None,
                                        max_tokens=options.max_tokens if options else None)
        if plan is not None and not caps.features:
            raise InputError(f"dictionaries (saes=) do not run on the {self.backend} backend yet; load the model with "
                             f"backend='eager'")
        return addresses, plain_edits, plan

    def request(self, tokens, points, *, positions=None, edits=None, options: Sampling | None = None,
                detach: bool = True, single: bool | None = None, call: str = "run_with_cache",
                saes=None) -> Request:
        """Everything a call asks for, checked against this model once (see :mod:`.request`).
        ``saes``: the dictionaries whose feature points and edits the call may use."""
        if options is None:
            tokens, addresses = self.check(tokens, points, single=single, call=call)
        else:
            tokens, addresses = self._check_generation(tokens, points, options, call)
        addresses, edits, features = self._features(addresses, edits, saes, tokens, options)
        return Request(tokens, Points(addresses), self._selection(tokens, positions, options),
                       self._edits(edits, tokens, options), options, detach, features)

    def execute(self, request: Request):
        """Run a checked request: a :class:`Cache`, or ``(completion, cache)`` when it generates."""
        return self._stamped(self._execute(request))

    def _stamped(self, result):
        """The result with its cache told this model's layer count (negative layers in lookups
        count from it)."""
        cache = result[1] if isinstance(result, tuple) else result
        cache.n_layers = self.info.n_layers
        return result

    # -- the calls ------------------------------------------------------------------------------
    def run_with_cache(self, tokens, points, *, detach: bool = True, positions=None, edits=None,
                       saes=None) -> Cache:
        return self.execute(self.request(tokens, points, positions=positions, edits=edits, detach=detach, saes=saes))

    def run_many(self, rows: list[torch.Tensor], points, *, positions=None, edits=None, saes=None) -> list[Cache]:
        """``run_with_cache`` of each one-prompt batch in ``rows``. A backend whose engine
        batches requests itself (vLLM) keeps them all in flight at once; this default runs them
        one after another (the points checked once for all rows). ``edits``: the same for every row,
        or a list of each row's own."""
        points = self.check_points(points)
        each = edits if isinstance(edits, list) else [edits] * len(rows)
        return [self.run_with_cache(row, points, positions=positions, edits=e, saes=saes) for row, e in zip(rows, each)]

    def capture_generation(self, tokens, points, *, max_tokens: int = 16, positions=None, edits=None, saes=None,
                           **sampling) -> tuple[Completion, Cache]:
        options = Sampling.from_options({"max_tokens": max_tokens, **sampling})
        return self.execute(self.request(tokens, points, positions=positions, edits=edits, options=options,
                                         call="capture_generation", saes=saes))

    async def capture_generation_async(self, tokens, points, *, max_tokens: int = 16, positions=None,
                                       edits=None, saes=None, **sampling) -> tuple[Completion, Cache]:
        """``await`` form of :func:`capture_generation`: ``(completion, cache)`` for one prompt.
        Many may be in flight at once (they share the vLLM engine's batching)."""
        options = Sampling.from_options({"max_tokens": max_tokens, **sampling})
        return self._stamped(await self._execute_async(self.request(tokens, points, positions=positions, edits=edits,
                                                                    options=options, call="capture_generation_async",
                                                                    saes=saes)))

    async def stream(self, tokens, points, *, max_tokens: int = 16, edits=None, **sampling):
        """Generate from one prompt token by token: ``async for step in model.stream(tokens,
        points, ...)`` yields a :class:`~interp_engine.generation.Step` per token as it is chosen,
        with the captures of the forward that chose it (the options of ``capture_generation``;
        every position is captured). Closing the iterator early (``aclose()``, a cancelled task)
        ends the generation at its next step."""
        options = Sampling.from_options({"max_tokens": max_tokens, **sampling})
        request = self.request(tokens, points, edits=edits, options=options, single=True, call="model.stream(...)")
        async for step in self._stream(request):
            yield step

    async def _stream(self, request):
        raise InputError(f"model.stream(...) runs on a local eager model so far, and this is a {type(self).__name__}; "
                         f"`await model.capture_generation_async(...)` returns the whole generation at once")
        yield  # an async generator, like the backends' own

    async def capture(self, tokens, points, *, positions=None, edits=None, saes=None,
                      **sampling) -> dict[Address, torch.Tensor]:
        """Async capture of one prompt: a plain dict keyed by Address (a string is a KeyError).

        Many calls may be in flight at once; each gets exactly its own rows. With
        ``max_tokens=N`` it also generates and captures the generated positions. With
        ``positions=`` each tensor holds the selected positions only, in position order.
        ``edits=`` applies to this request only, even while others share its batch.
        """
        options = Sampling.from_options(sampling) if sampling else None
        result = await self._execute_async(self.request(tokens, points, positions=positions, edits=edits,
                                                        options=options, single=True, call="await model.capture(...)",
                                                        saes=saes))
        return (result if options is None else result[1]).to_dict()

    def close(self) -> None:
        """Release the engine and its processes. Idempotent."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- what a backend implements --------------------------------------------------------------
    # A checked Request: ``positions`` is None (every position) or a Selection resolved against
    # ``tokens``, ``edits`` None or the planned edits by address; the backend applies both where
    # each activation is produced. ``options`` None: a capture; else a generation.
    def _execute(self, request: Request):
        """A :class:`Cache` for a capture, ``(completion, cache)`` for a generation."""
        raise NotImplementedError

    async def _execute_async(self, request: Request):
        """:meth:`_execute` without blocking the event loop; by default on a thread, stopped
        between steps when the caller gives up (:mod:`.cancel`)."""
        return await cancel.in_thread(self._execute, request)


def run_with_cache(model: CaptureModel, tokens, points: list[AddressLike], *, detach: bool = True,
                   positions=None, edits=None, saes=None) -> Cache:
    """Run ``tokens`` through ``model`` and return the activations at ``points`` as a Cache.

    ``points`` holds Addresses, their string forms (``"resid_post.10"``), tuples, whole sites
    (``"resid_post"``: every layer) or a filter (``lambda a: a.layer == 3``). ``positions``
    keeps only some positions (``-1``: each row's last token; see :mod:`.positions`). With
    ``detach=False`` (eager, ``load_model(..., requires_grad=True)``) the tensors keep their graph.
    ``edits`` writes to activations on the way (``{"resid_post.3": Add(vector)}``; see :mod:`.edits`).
    ``saes`` attaches sparse dictionaries to this call: their feature points
    (``"resid_post.3.features"``, ``"resid_post.3.sae_error"``) may then be captured and edited
    (see :mod:`interp_engine.features`).
    """
    return model.run_with_cache(tokens, points, detach=detach, positions=positions, edits=edits, saes=saes)


def capture_generation(model: CaptureModel, tokens, points, *, max_tokens: int = 16, positions=None,
                       edits=None, saes=None, **sampling: Any):
    """Generate from one prompt and capture ``points`` at every prompt and generated position.

    Returns ``(completion, cache)``. The cache has ``len(prompt) + len(generated) - 1``
    positions: the final sampled token is never fed back through the model. ``positions``
    keeps fewer (``"generated"``: the generated ones only; ``-1``: the last prompt token).
    ``edits`` applies at every forward of the generation (prefill and each decode step).
    """
    return model.capture_generation(tokens, points, max_tokens=max_tokens, positions=positions, edits=edits,
                                    saes=saes, **sampling)

"""Every error and warning the library raises at its users, in one place.

Two kinds of failure reach a caller. A *user error* means the request cannot run as written:
its message says what is wrong and how to fix it, and the model keeps serving. Most are
``InputError`` (a ``ValueError``), so ``except InputError`` catches every refusal of bad input;
each also keeps the built-in base that fits it (a missing activation is a ``KeyError``, a model
that cannot be found a ``FileNotFoundError``), so generic handlers keep working. An
:class:`InternalError` means an invariant of the library itself broke: a bug to report, whose
message starts with ``"[Internal]"``.

Errors raised in a replica cross the process boundary by type: ``wire.relabel`` rebuilds
the same class with the replica and shard in front of the message, so every class here must be
constructible from its message alone.
"""

from __future__ import annotations


class InputError(ValueError):
    """Tokens, prompts or options the engine cannot run (the message says how to fix them)."""


class AddressError(ValueError):
    """An address that does not name a point of this model (the message lists what does)."""


class ModelNotFound(FileNotFoundError):
    """The name is neither a local folder, the embedded model, nor in the local HF cache."""


class UnsupportedModel(ValueError):
    """A model whose family no record names and that the generic path cannot serve either (no
    decoder layers, final norm or unembedding found, or they do not behave as such on the probe);
    the message says what is missing."""


class AnalysisError(InputError):
    """An argument an analysis helper cannot use (the message says what is wrong and what to pass)."""


class MissingActivations(AnalysisError, KeyError):
    """The cache lacks activations the helper needs (the message names them and what to capture).
    Also a ``KeyError``, as a missing key of the cache is."""

    __str__ = BaseException.__str__  # the message as written, not KeyError's quoted repr


class RoutingError(ValueError):
    """The cache does not hold what :func:`expert_assignment` needs, or disagrees with it."""


class CacheFileError(InputError):
    """A file :meth:`Cache.load` cannot read as a cache: not one, damaged, or inconsistent
    (the message names the file and what is wrong with it)."""


class DictionaryError(InputError):
    """A sparse dictionary (an SAE or transcoder: its files, config or tensors) the engine cannot
    run, or one that does not fit the model it is attached to; the message says what would fix it."""


class Cancelled(RuntimeError):
    """The caller of this capture cancelled it; the work stopped before it finished."""


# --- the vLLM engine ---------------------------------------------------------------------------


class EngineMemoryError(MemoryError):
    """The vLLM engine cannot reserve its memory (the message says what to set)."""


class EngineStopped(RuntimeError):
    """The engine was closed, or failed; load the model again."""


class UnsupportedVllmVersion(ImportError):
    """The installed vLLM is not a release this adapter was written for (the message says what to do)."""


# --- the Ray service ---------------------------------------------------------------------------


class ClusterError(RuntimeError):
    """The cluster cannot serve the request (too few resources, replicas that failed to start)."""


class ShardFailed(ClusterError):
    """One shard of the work failed ``max_attempts`` times (its replicas died under it, or it
    raised something other than an input error); the message names the shard and replicas."""


class LoopbackError(ClusterError):
    """The library will not start its own Ray the way the environment asks (no token auth)."""


class RemoteError(RuntimeError):
    """An error raised inside a replica or the coordinator, with where it happened.

    The original exception is ``__cause__``; the message starts with the replica and shard.
    """


class ServiceError(ClusterError):
    """A deployed capture service cannot be found, reached or started (the message says which and why)."""


class ServiceAuthError(ServiceError):
    """The service refused the request's bearer token: none was sent (HTTP 401) or a wrong one (403)."""


class MissingDictionary(ServiceError):
    """A service replica holds no dictionary under ``keys`` yet (HTTP 409): the client sends the
    request again with those dictionaries' weights. Clients handle it; callers never see it."""

    def __init__(self, message: str, keys=()):
        super().__init__(message)
        self.keys = list(keys)


class LimitExceeded(InputError):
    """A request asks a service for more than one of its limits allows (HTTP 413; the message names
    the limit, its value and how to fit)."""


class ConfigError(ValueError):
    """A job configuration that does not validate; the message lists every bad field."""


# --- activation datasets -----------------------------------------------------------------------


class PromptsError(InputError):
    """The prompts cannot be read or are unusable (the message says which and how to fix)."""


class StorageError(InputError):
    """The dataset's location cannot be used (unknown scheme, no bucket, no credentials, read-only)."""


class DatasetExistsError(FileExistsError):
    """The output path holds a different dataset (or other files)."""


class DatasetBusyError(DatasetExistsError):
    """Another build is writing into this output now (the message names it)."""


class DatasetCorruptError(RuntimeError):
    """Shards of a dataset are missing or do not match the manifest (the message names them)."""


class DatasetRepairWarning(UserWarning):
    """A resume found a shard that failed its check and is rewriting it."""


class DatasetLeaseWarning(UserWarning):
    """A dead build's lease was found and removed."""


class DatasetForeignFilesWarning(UserWarning):
    """The output folder holds files that are not the dataset's; the build left them alone."""


# --- bugs --------------------------------------------------------------------------------------


class InternalError(RuntimeError):
    """An invariant of the library broke (a bug: please report it with the message, which starts
    with ``"[Internal]"``). Never raised for anything a caller passed."""


def user_error(err: BaseException) -> BaseException:
    """The exception a remote call raised, out of Ray's ``RayTaskError`` wrapper (its message
    already names the replica and shard); ``err`` itself when it carries none."""
    cause = getattr(err, "cause", None)
    return cause if isinstance(cause, BaseException) else err


# --- how values appear in messages ---------------------------------------------------------------

#: the longest repr of a value a message quotes in full
SHOWN_CHARS = 60


def shown(value) -> str:
    """``value`` as a message quotes it: a tensor or array as its kind, shape and dtype
    (``Tensor[576] float32``), never its numbers; any other value's repr, cut to a few dozen
    characters. No error of the library prints a whole tensor."""
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is not None and dtype is not None and hasattr(value, "ndim"):
        kind = "Tensor" if type(value).__module__.startswith("torch") else type(value).__name__
        if getattr(value, "ndim", 1) == 0:
            if kind == "Tensor":
                return f"Tensor({_cut(repr(value.item()))}) {str(dtype).removeprefix('torch.')}"
            return _cut(repr(value.item()))  # a numpy scalar reads as its number
        return f"{kind}[{', '.join(map(str, shape))}] {str(dtype).removeprefix('torch.')}"
    if isinstance(value, (list, tuple)) and len(value) > 8:
        return f"{type(value).__name__} of {len(value)}: {repr(list(value[:3]))[:-1]}, ...]"
    return _cut(repr(value))


def _cut(text: str) -> str:
    return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS - 12]}... ({len(text)} chars)"


# --- the service's client against a hostile or changed peer (issue 35) -------------------------


class UnsafeServiceAnswer(ServiceError):
    """A service (or whatever answers at its URL) asked this client for something a client never
    lets a peer choose: a file path outside its own folder, an unbounded allocation. The message
    names the entry; the connection is refused and nothing was written."""


class TokenOriginError(ServiceAuthError):
    """The token stored on this machine for a service belongs to another URL (scheme, host, port,
    path): it is never sent anywhere else. Pass ``token=`` to send a token to this URL."""


class ServiceChanged(ServiceError):
    """The service a client connected to was redeployed under it (another deploy id, model, backend
    or weights): its answers would be another model's. Connect again."""

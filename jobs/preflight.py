"""What a dataset-build job checks before it starts Ray or loads a replica.

Starting Ray and a replica takes seconds to minutes; a typo in a point or a broken prompts file
should not. So, on the driver, from files alone:

- **model**: resolved to its local folder (no download) and its ``config.json`` read — no
  weights — for the facts that decide which points exist (:func:`interp_engine.archs.model_info`);
- **points**: checked against those facts and the backend's site table, with the message a
  loaded model would give;
- **prompts**: read once in full with the model's tokenizer: each a non-empty string, none longer
  than the model's positions, a readable UTF-8 ``.jsonl`` / Parquet file;
- **output**: a location the store accepts (scheme, credentials, bucket), not a file, not a
  folder of someone else's files, no malformed manifest (unless ``overwrite``), and no other
  build holding it now.

A model that is not on the driver (a cluster whose nodes hold it at a path the driver lacks), or
whose family has no record (the generic path proves what it serves when a replica loads it),
skips the model, points-against-model and prompt-length checks; the replicas check those. Each
problem is a :class:`~interp_engine.errors.ConfigError` naming the config field.
"""

from __future__ import annotations

from interp_engine.jobs.config import BuildConfig
from interp_engine.errors import ConfigError


def preflight(config: BuildConfig) -> None:
    """Raise :class:`ConfigError` (naming the field) for anything checkable before Ray starts."""
    from interp_engine.errors import AddressError, DatasetCorruptError, DatasetExistsError, InputError, ModelNotFound
    from interp_engine.local import find_model

    try:
        folder = find_model(config.model)
    except ModelNotFound:
        folder = None  # perhaps only the cluster's nodes hold it: the replicas report it
    try:
        info, caps, tokenizer = _model_facts(folder, config) if folder is not None else (None, None, None)
    except (OSError, ValueError) as err:
        raise ConfigError(f"model: cannot read {config.model!r}'s config or tokenizer ({_line(err)})") from None
    if info is not None:
        from interp_engine.points import check_points

        try:
            check_points(config.points, info, caps)
        except AddressError as err:
            raise ConfigError(f"points: {err}") from None
    try:
        _check_prompts(config, info, tokenizer)
    except InputError as err:
        raise ConfigError(f"prompts: {err}") from None
    try:
        _check_output(config)
    except (InputError, DatasetExistsError, DatasetCorruptError) as err:
        raise ConfigError(f"output: {err}") from None


def _model_facts(folder, config: BuildConfig):
    from transformers import AutoConfig, AutoTokenizer

    from interp_engine.archs import has_record, model_info
    from interp_engine.capabilities import backend_class
    from interp_engine.tokens import Tokenizer

    hf_config = AutoConfig.from_pretrained(folder)
    if not has_record(hf_config):  # the generic path: a replica proves what it serves when it loads it
        return None, None, None
    info = model_info(hf_config, config.model)
    caps = backend_class(config.backend).capabilities_for(hf_config)
    return info, caps, Tokenizer(AutoTokenizer.from_pretrained(folder))


def _check_prompts(config: BuildConfig, info, tokenizer) -> None:
    from interp_engine.dataset.prompts import PromptSource

    source = PromptSource.of(config.prompts, config.text_key)
    if tokenizer is None:
        source.scan(lambda text: (), 1)  # readable, non-empty strings; lengths need the tokenizer
        return
    source.scan(lambda text: tokenizer.encode(text), info.n_ctx)


def _check_output(config: BuildConfig) -> None:
    from interp_engine.dataset.lease import inspect_free_output
    from interp_engine.dataset.store import Store
    from interp_engine.dataset.uri import check_access

    store = Store.of(config.output)
    check_access(store, explicit=False)
    inspect_free_output(store, None, overwrite=config.overwrite)


def _line(err: Exception) -> str:
    return (str(err).splitlines() or [type(err).__name__])[0][:300]

"""Which deployment a connected client talks to.

A service name can be deployed again (``serve(..., replace=True)``, a config file, ``shutdown``
then ``serve``) while clients hold a handle to it; Serve then routes their calls to the new
replicas, which may serve another model. So every deployment carries an identity: a deploy id made
once per deployment (:func:`~.app.application`), the model, backend and dtype it was given, and
the SHA-256 of the weights its replicas loaded (:func:`~interp_engine.fingerprint.weights_fingerprint`).
A client learns it when it connects and sends it with every call; a replica of another deployment
refuses the call (:func:`check`) with ``ServiceChanged`` naming what changed, so no answer of
another model ever reaches the client.
"""

from __future__ import annotations

from ..errors import ServiceChanged

#: what an identity holds, in the order a message names the changes
FIELDS = ("deploy_id", "model", "backend", "dtype", "weights_sha256")


def identity(service: dict, dtype: str, weights_sha256: str | None) -> dict:
    """The identity of a replica of the deployment described by ``service`` (its facts, :mod:`.app`)."""
    return {"deploy_id": service.get("deploy_id"), "model": service.get("model"), "backend": service.get("backend"),
            "dtype": dtype, "weights_sha256": weights_sha256}


def check(expected, actual: dict, name: str) -> None:
    """Refuse (``ServiceChanged``) a call whose client connected to another deployment than ``actual``."""
    if not isinstance(expected, dict):
        raise ServiceChanged(f"a call to service {name!r} named no deployment it was meant for; connect again: "
                             f"connect({name!r})")
    changed = [f"{key} {_short(expected.get(key))} -> {_short(actual.get(key))}" for key in FIELDS
               if expected.get(key) != actual.get(key)]
    if changed:
        raise ServiceChanged(f"service {name!r} was redeployed since this client connected ({'; '.join(changed)}): "
                             f"its answers would come from another deployment. Connect again: connect({name!r})")


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:16]}...{text[-8:]}"

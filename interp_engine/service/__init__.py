"""The capture service: a model deployed once on a Ray cluster with Ray Serve, used from many
notebooks, jobs and HTTP clients with the same calls as a local model.

``serve(model, name=...)`` deploys it (:mod:`.deploy`), ``connect(name)`` or ``connect(url,
token=...)`` returns a :class:`~interp_engine.model.CaptureModel` that talks to it through Ray or
over HTTP (:mod:`.client`), ``shutdown(name)`` ends it. The replicas (:mod:`.replica`) run the
cluster's replica code; the HTTP API (:mod:`.http_api`) speaks JSON in and safetensors out
(:mod:`.http_wire`), behind a bearer token (:mod:`.auth`) and per-request limits
(:mod:`.limits`). docs/SERVICE.md is the guide and the wire format.
"""

from .client import ServiceModel as ServiceModel
from .client import connect as connect
from .deploy import ServiceInfo as ServiceInfo
from .deploy import serve as serve
from .deploy import shutdown as shutdown
from .limits import Limits as Limits

"""The driver side of a Ray cluster: the model object a caller holds when replicas serve it.

``model.py`` (:class:`~.model.ClusterModel`) checks requests, splits batches over replicas and
joins their answers; ``placement.py`` connects to (or starts) Ray and places the replicas. The
replicas themselves run :mod:`interp_engine.actors`, in their own processes.
"""

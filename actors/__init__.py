"""Ray actor classes of the capture service (installed as ``interp_engine.actors``): the replica,
the coordinator, and the plain scheduler they share. See docs/CLUSTER.md."""

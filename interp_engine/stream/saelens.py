"""SAELens reads a stream: the activation-store interface its trainer pulls from.

SAELens 6's ``SAETrainer(cfg, sae, data_provider)`` takes any iterator of ``[batch, d_in]``
tensors (``DataProvider``) and calls ``next()`` on it once per step; its own
``ActivationsStore`` is one, with ``next_batch()`` beside ``__next__``. :class:`SAELensActivations`
is the same surface over an :func:`~interp_engine.activation_stream`: the stream's batches as
float tensors on the trainer's device, one point's, for as many epochs as the stream has (then
``StopIteration``: size ``epochs`` for ``total_training_samples``). Its ``state()`` is the
stream's, so a trainer checkpoint can hold it and a resumed stream continues the same rows.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ..errors import InputError


class SAELensActivations:
    """``next_batch()`` / ``next()`` / ``iter()``: ``[batch_tokens, d]`` float tensors of ``point``
    (default: the stream's only point) on ``device``, in ``dtype`` (float32 by default: what a
    SAELens trainer computes in)."""

    def __init__(self, stream, point: str | None = None, *, device: str = "cpu", dtype=torch.float32):
        points = list(stream.spec.points)
        if point is None and len(points) != 1:
            raise InputError(f"the stream carries {len(points)} points ({', '.join(points)}); an SAE trains on "
                             f"one: SAELensActivations(stream, point={points[0]!r})")
        if point is not None and point not in points:
            raise InputError(f"point {point!r} is not in the stream; it carries {', '.join(points)}")
        self.stream, self.point, self.device, self.dtype = stream, point, device, dtype
        self._batches: Iterator | None = None

    def __iter__(self) -> "SAELensActivations":
        return self

    def __next__(self) -> torch.Tensor:
        if self._batches is None:
            self._batches = iter(self.stream)
        batch = next(self._batches)
        if isinstance(batch, dict):
            batch = batch[self.point]
        return batch.to(device=self.device, dtype=self.dtype)

    def next_batch(self) -> torch.Tensor:
        """The next batch (SAELens ``ActivationsStore.next_batch``)."""
        return self.__next__()

    def state(self) -> dict:
        """The stream's checkpoint after the batches taken so far."""
        return self.stream.state()

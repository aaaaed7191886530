"""The dictionaries one service replica keeps for its clients, within a byte bound.

A client's sparse dictionary reaches a replica once (over HTTP, when the replica asks for it with a
409; through Ray, as an object in the store) and is kept by its content key for the calls after.
Kept forever, distinct uploads would grow the replica without end: :class:`HeldDictionaries` keeps
them in least-recently-used order and drops the oldest once their weights pass the bound
(``Limits.max_dictionary_memory_bytes``). A dropped dictionary costs one round trip: the next call
that names it is answered 409 and its client sends it again (through Ray, the replica fetches the
object again).

A dictionary dropped here is dropped where the model keeps it too (``on_drop``: a vLLM engine's
workers hold their own copy on the device), once no call that uses it is in flight (:meth:`use`
pins it), so what the model holds is what is held here plus what running calls use.
"""

from __future__ import annotations

import collections
import threading

#: a dictionary's weights, as :func:`interp_engine.features.transfer.dictionary_for_worker` sends them
TENSORS = ("W_enc", "b_enc", "W_dec", "b_dec", "threshold", "W_skip")


def dictionary_bytes(dictionary) -> int:
    """Bytes of a dictionary's weights (what holding it costs)."""
    return sum(t.numel() * t.element_size() for t in (getattr(dictionary, n, None) for n in TENSORS)
               if t is not None)


class HeldDictionaries:
    """Dictionaries by content key, least recently used first, their weights within ``limit``
    bytes. Thread-safe: captures run on worker threads."""

    def __init__(self, limit: int, on_drop=None):
        self.limit = limit
        self._held: collections.OrderedDict[str, tuple[object, int]] = collections.OrderedDict()
        self._lock = threading.Lock()
        #: called with a key once its dictionary is neither held nor used by a call in flight
        self.on_drop = on_drop
        self._pins: collections.Counter[str] = collections.Counter()
        self._pending: set[str] = set()  # dropped here while a call still used them
        #: bytes of the weights held now
        self.nbytes = 0
        #: dictionaries dropped to stay within the bound so far
        self.dropped = 0

    def get(self, key: str):
        """The dictionary held under ``key`` (now the most recently used), or None."""
        with self._lock:
            entry = self._held.get(key)
            if entry is None:
                return None
            self._held.move_to_end(key)
            return entry[0]

    def keep(self, key: str, dictionary):
        """Hold ``dictionary`` under ``key`` and drop the least recently used beyond the bound (the
        new one too, where it alone is over it: the caller still has it for its call). Returns the
        dictionary held under ``key``."""
        gone = []
        with self._lock:
            if key in self._held:
                self._held.move_to_end(key)
                return self._held[key][0]
            size = dictionary_bytes(dictionary)
            self._held[key] = (dictionary, size)
            self._pending.discard(key)
            self.nbytes += size
            while self.nbytes > self.limit:
                old, (_, freed) = self._held.popitem(last=False)
                self.nbytes -= freed
                self.dropped += 1
                (self._pending.add if self._pins[old] else gone.append)(old)
        self._drop(gone)
        return dictionary

    def pin(self, keys) -> None:
        """Mark ``keys`` used by a call in flight: dropped here meanwhile, they stay in the model
        until :meth:`unpin`."""
        with self._lock:
            self._pins.update(keys)

    def unpin(self, keys) -> None:
        """The call that pinned ``keys`` is over: drop from the model those no longer held here."""
        gone = []
        with self._lock:
            self._pins.subtract(keys)
            for key in set(keys):
                if self._pins[key] <= 0:
                    del self._pins[key]
                    if key in self._pending:
                        self._pending.discard(key)
                        gone.append(key)
        self._drop(gone)

    def _drop(self, keys: list[str]) -> None:
        if self.on_drop is not None:
            for key in keys:
                self.on_drop(key)

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._held)

    def stats(self) -> dict:
        with self._lock:
            return {"held": len(self._held), "bytes": self.nbytes, "limit": self.limit, "dropped": self.dropped}

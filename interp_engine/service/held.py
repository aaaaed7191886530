"""The dictionaries one service replica keeps for its clients, within a byte bound.

A client's sparse dictionary reaches a replica once (over HTTP, when the replica asks for it with a
409; through Ray, as an object in the store) and is kept by its content key for the calls after.
Kept forever, distinct uploads would grow the replica without end: :class:`HeldDictionaries` keeps
them in least-recently-used order and drops the oldest once their weights pass the bound
(``Limits.max_dictionary_memory_bytes``). A dropped dictionary costs one round trip: the next call
that names it is answered 409 and its client sends it again (through Ray, the replica fetches the
object again).
"""

from __future__ import annotations

import collections
import threading

#: a dictionary's weights, as :func:`interp_engine.wire.dictionary_for_worker` sends them
TENSORS = ("W_enc", "b_enc", "W_dec", "b_dec", "threshold", "W_skip")


def dictionary_bytes(dictionary) -> int:
    """Bytes of a dictionary's weights (what holding it costs)."""
    return sum(t.numel() * t.element_size() for t in (getattr(dictionary, n, None) for n in TENSORS)
               if t is not None)


class HeldDictionaries:
    """Dictionaries by content key, least recently used first, their weights within ``limit``
    bytes. Thread-safe: captures run on worker threads."""

    def __init__(self, limit: int):
        self.limit = limit
        self._held: collections.OrderedDict[str, tuple[object, int]] = collections.OrderedDict()
        self._lock = threading.Lock()
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
        with self._lock:
            if key in self._held:
                self._held.move_to_end(key)
                return self._held[key][0]
            size = dictionary_bytes(dictionary)
            self._held[key] = (dictionary, size)
            self.nbytes += size
            while self.nbytes > self.limit:
                _, (_, freed) = self._held.popitem(last=False)
                self.nbytes -= freed
                self.dropped += 1
            return dictionary

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._held)

    def stats(self) -> dict:
        with self._lock:
            return {"held": len(self._held), "bytes": self.nbytes, "limit": self.limit, "dropped": self.dropped}

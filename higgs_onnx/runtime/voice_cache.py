"""`VoiceCache`: the voices `HiggsTTS` made from references, kept for reuse, bounded by bytes (least recently used
first out).

A voice holds its reference's delayed rows and the KV cache of its prompt prefix: ~80 MB on the real 4b geometry
for a 10 s clip with a transcript, so an unbounded cache grows with every distinct reference a server sees. The
cache counts each voice's array bytes, evicts the least recently used past `max_bytes` (a voice larger than the
whole budget is used but not kept), and `forget` drops a voice at once (the server calls it when a voice is
deleted), so its memory is freed as soon as no request still uses it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable

DEFAULT_VOICE_CACHE_BYTES = 512 << 20  # ~6 real-model voices


def voice_bytes(voice) -> int:
    return int(voice.rows.nbytes + sum(a.nbytes for a in voice.state.values()))


class VoiceCache:
    """Thread-safe LRU of voices by key, bounded by the bytes of their arrays."""

    def __init__(self, max_bytes: int = DEFAULT_VOICE_CACHE_BYTES):
        if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 0:
            raise ValueError(f"the voice cache size must be a number of bytes >= 0, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self._items: OrderedDict[Hashable, tuple[object, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.evictions = 0
        self.hits = self.misses = 0  # lookups answered from memory, and not (the metrics' voice-cache hits)

    def get(self, key: Hashable):
        with self._lock:
            hit = self._items.get(key)
            if hit is None:
                self.misses += 1
                return None
            self.hits += 1
            self._items.move_to_end(key)
            return hit[0]

    def put(self, key: Hashable, voice):
        """Keep `voice` under `key` (or return the one another thread kept first); evict past the budget."""
        size = voice_bytes(voice)
        with self._lock:
            hit = self._items.get(key)
            if hit is not None:
                self._items.move_to_end(key)
                return hit[0]
            if size > self.max_bytes:
                return voice  # used by its caller, not kept
            self._items[key] = (voice, size)
            self._bytes += size
            while self._bytes > self.max_bytes:
                _, (_, freed) = self._items.popitem(last=False)
                self._bytes -= freed
                self.evictions += 1
            return voice

    def forget(self, voice) -> int:
        """Drop every entry holding this voice object; the number dropped."""
        with self._lock:
            keys = [k for k, (v, _) in self._items.items() if v is voice]
            for k in keys:
                self._bytes -= self._items.pop(k)[1]
            return len(keys)

    def stats(self) -> dict:
        with self._lock:
            return {"voices": len(self._items), "bytes": self._bytes, "max_bytes": self.max_bytes,
                    "evictions": self.evictions, "hits": self.hits, "misses": self.misses}

    def __len__(self) -> int:
        return len(self._items)

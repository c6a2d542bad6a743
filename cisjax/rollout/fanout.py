"""One pass over a mapping's items handed to several readers at once (a fleet's streamed weight update)."""

from __future__ import annotations

import queue
from collections.abc import Hashable, Iterator, Mapping

_END = object()  # end of a reader's stream


class Fanout:
    """`run()` reads `source.items()` once and hands each item to every reader (`view(key)`, one per key) through a
    queue of its own holding at most `depth` items: at most a few items in memory per reader. A reader that stops
    (`stop(key)`: done, or failed part-way) is skipped from then on, never waited for."""

    def __init__(self, source: Mapping, keys: list[Hashable], depth: int = 2):
        self._source = source
        self._feeds = {k: queue.Queue(maxsize=depth) for k in keys}
        self._stopped: set = set()

    def run(self) -> None:
        """The producer: every item to every reader still reading, then the end of each stream."""
        try:
            for item in self._source.items():
                for k in self._feeds:
                    self._put(k, item)
        finally:
            for k in self._feeds:
                self._put(k, _END)

    def view(self, key: Hashable) -> _View:
        """What reader `key` reads: a Mapping-like object whose `items()` yields the source's items as they come."""
        return _View(self._stream(key))

    def stop(self, key: Hashable) -> None:
        """Reader `key` reads no more: stop feeding it, and unblock the producer if it waits on its queue."""
        self._stopped.add(key)
        while True:
            try:
                self._feeds[key].get_nowait()
            except queue.Empty:
                break

    def _stream(self, key: Hashable) -> Iterator:
        while (item := self._feeds[key].get()) is not _END:
            yield item

    def _put(self, key: Hashable, item) -> None:
        while key not in self._stopped:  # a reader that stopped reading is skipped, not waited for
            try:
                return self._feeds[key].put(item, timeout=0.5)
            except queue.Full:
                pass


class _View:
    """The Mapping-like view a reader gets (`items()`, as RolloutClient.update_weights_from_tensors reads it)."""

    def __init__(self, items: Iterator):
        self._items = items

    def items(self) -> Iterator:
        return self._items

"""Adapter folders read on a host thread ahead of their load into a GPU slot.

A request whose adapter is neither in a slot nor in host memory needs its folder read (safetensors
read, checked, packed in pinned memory): tens of milliseconds to seconds. Read in the engine's
loop, that read stalls every running request's next step. Instead the engine's scheduler leaves
such a request waiting, `ReadAhead` reads the folder on a worker thread while the steps go on, and
the request is admitted at the first step after its image is ready, whose load is then one copy
(`AdapterBank.write`) that overlaps the step. At most `READ_AHEAD` images are read or held ahead;
the oldest unclaimed one (its request may be gone) makes room for a new read.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections import OrderedDict

from ..lora.types import AdapterError

# Adapters read from disk ahead of their load, at most (each holds one slot image in host memory).
READ_AHEAD = 8


class ReadAhead:
    """Reads on a worker thread, `read(source) -> SlotImage`; the engine's thread collects them."""

    def __init__(self, read, limit: int = READ_AHEAD):
        self._read = read
        self.limit = limit
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.reading: dict[str, tuple[object, concurrent.futures.Future]] = {}
        self.ready: OrderedDict[str, tuple[object, object, float]] = OrderedDict()  # name -> (source, image, s)

    def start(self, name: str, source) -> None:
        """Start reading `name`'s folder, unless it is being read or read already, or `limit` reads
        are in flight."""
        if name in self.reading or name in self.ready:
            return
        while len(self.reading) + len(self.ready) >= self.limit and self.ready:
            self.ready.popitem(last=False)
        if len(self.reading) >= self.limit:
            return
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="lorazor-adapter-read")
        self.reading[name] = (source, self._pool.submit(self._timed, source))

    def _timed(self, source):
        start = time.perf_counter()
        image = self._read(source)
        return image, time.perf_counter() - start

    def collect(self) -> dict[str, str]:
        """Move finished reads to `ready`; returns {name: reason} for those that failed."""
        failed = {}
        for name, (source, future) in list(self.reading.items()):
            if not future.done():
                continue
            del self.reading[name]
            try:
                image, seconds = future.result()
            except AdapterError as err:
                failed[name] = str(err)
            except (OSError, RuntimeError) as err:  # the folder changed or vanished since registration
                failed[name] = f"{type(err).__name__}: {err}"
            else:
                self.ready[name] = (source, image, seconds)
        return failed

    def take(self, name: str, source):
        """(image, read seconds) read ahead for `name` from this very `source` (a name registered again
        since reads anew), or None."""
        found = self.ready.pop(name, None)
        return None if found is None or found[0] is not source else found[1:]

    def forget(self, name: str) -> None:
        self.ready.pop(name, None)
        self.reading.pop(name, None)  # a read in flight finishes unclaimed

    def wait(self, timeout: float) -> bool:
        """Wait up to `timeout` s for a read in flight to finish; False when none is in flight."""
        if not self.reading:
            return False
        concurrent.futures.wait([future for _, future in self.reading.values()], timeout=timeout,
                                return_when=concurrent.futures.FIRST_COMPLETED)
        return True

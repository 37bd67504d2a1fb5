"""The concurrency contract of a LoRazorModel: one operation at a time, never a change mid-batch.

A model's forwards share state: the step metadata, the KV caches and CUDA graphs of each batch
bucket, and the adapter slots. So every public operation (`generate`, `forward`, adapter
changes, `reconfigure`, `unpatch`) holds the model's lock for its whole duration:
- from another thread, an operation waits until the running one ends (calls are serialized, and
  each sees a consistent model);
- from inside a running operation on the same thread (a logits processor, a stopping criterion
  or a streamer that calls back into the model), it raises `ModelBusyError` instead of changing
  slots or buffers under the rows in flight;
- after `unpatch()`, every operation raises `ModelClosedError`.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager


class ModelBusyError(RuntimeError):
    """An operation on a LoRazorModel was started from inside another one on the same thread."""


class ModelClosedError(RuntimeError):
    """The LoRazorModel was unpatched; build a new one with `from_peft` / `from_pretrained`."""


class ModelGuard:
    """Serializes a model's operations across threads and refuses re-entrant ones."""

    def __init__(self, threads: int | None = None):
        self._lock = threading.Lock()
        self._owner: int | None = None
        self._running: str | None = None
        self.closed = False
        # torch intra-op threads while an operation runs (None: unchanged). A small model on the CPU
        # runs many tiny matmuls, each an OpenMP region whose barrier waits for every thread: with a
        # second busy core, two threads made the testbed demo 4x slower than one.
        self.threads = threads

    @contextmanager
    def hold(self, action: str):
        """Run `action` (a description for error messages) with the model to itself."""
        me = threading.get_ident()
        if self._owner == me:
            raise ModelBusyError(
                f"cannot {action} while {self._running} is running on this model (called from inside it, e.g. "
                "from a logits processor, stopping criterion or streamer); do it before or after that call")
        with self._lock:
            if self.closed:
                raise ModelClosedError(f"cannot {action}: this LoRazorModel was unpatched; build a new one with "
                                       "LoRazorModel.from_peft(...) or from_pretrained(...)")
            self._owner, self._running = me, action
            previous = None
            if self.threads is not None:
                import torch

                previous = torch.get_num_threads()
                if previous != self.threads:
                    torch.set_num_threads(self.threads)
            try:
                yield
            finally:
                if previous is not None and previous != self.threads:
                    torch.set_num_threads(previous)
                self._owner = self._running = None

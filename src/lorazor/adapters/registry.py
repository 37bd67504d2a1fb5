"""AdapterRegistry: every adapter a model knows, and its GPU slots as an LRU cache over them.

An adapter is registered from a folder (config and weights' header read and checked, no weights
moved) or arrives in a slot from a `PeftModel`. Before a batch runs, `slots_for` makes each of its
adapters resident: a free slot first, else the least recently used slot whose adapter the batch
does not use. Weights come from the host cache (`max_cpu_loras` images, pinned on a GPU machine)
or are read from the folder; an evicted adapter that has no folder keeps a host copy. Slots are
data, never graph keys: loads and evictions never invalidate a captured CUDA graph.
"""

from __future__ import annotations

import bisect
import time
import warnings
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

import torch

from ..lora.bank import AdapterBank, SlotImage
from .folder_reader import FolderReader
from .loader import (MAX_SCALING, AdapterSource, check_adapter_name, check_finite, check_source, read_adapter,
                     weights_digest)
from .read_ahead import ReadAhead
from ..lora.types import AdapterError, AdapterWeights


@dataclass(frozen=True)
class AdapterStatus:
    """Where an adapter is now.

    Attributes:
        location: "gpu" (in a slot), "host" (a host copy, no slot) or "disk" (its folder only).
        slot: its GPU slot, or None.
        rank: its largest rank; targets: the module kinds it targets (e.g. ("q_proj", "v_proj")).
        path: its folder (None for adapters that came from a PeftModel).
    """

    name: str
    location: str
    slot: int | None
    rank: int
    targets: tuple[str, ...]
    path: Path | None


@dataclass
class _Entry:
    source: AdapterSource | None  # None: came from a PeftModel, no folder to reload from
    image: SlotImage | None  # host copy
    rank: int
    targets: tuple[str, ...]
    digest: bytes = b""  # of its config and weights (`loader.weights_digest`)


# Upper bounds (seconds) of the load-time histogram's buckets: a host copy into a slot takes about a
# millisecond, a read from disk tens of milliseconds to seconds.
LOAD_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# Load durations kept one by one (for exporters that observe each load, such as Ray's metrics).
RECENT_LOADS = 1024


@dataclass
class LoadTimes:
    """Host time of every load into a GPU slot by source ("disk": the folder read, checked and
    packed; "cpu": from the host copy): per-bucket counts over `LOAD_BUCKETS` (the last one past
    the largest bound), their sum and count, and the latest loads as (number, source, seconds)."""

    counts: dict = field(default_factory=dict)
    sums: dict = field(default_factory=dict)
    recent: deque = field(default_factory=lambda: deque(maxlen=RECENT_LOADS))
    total: int = 0

    def record(self, source: str, seconds: float) -> None:
        counts = self.counts.setdefault(source, [0] * (len(LOAD_BUCKETS) + 1))
        counts[bisect.bisect_left(LOAD_BUCKETS, seconds)] += 1
        self.sums[source] = self.sums.get(source, 0.0) + seconds
        self.total += 1
        self.recent.append((self.total, source, seconds))

    def snapshot(self) -> dict:
        """A plain copy (for another thread or process): buckets, counts, sums, recent, total."""
        return dict(buckets=list(LOAD_BUCKETS), counts={k: list(v) for k, v in self.counts.items()},
                    sums=dict(self.sums), recent=list(self.recent), total=self.total)


class SlotsFullError(AdapterError):
    """Every GPU slot holds an adapter that the step in flight uses."""


def _kinds(modules) -> tuple[str, ...]:
    return tuple(sorted({m.rsplit(".", 1)[-1] for m in modules}))


class AdapterRegistry:
    """Registered adapters and their residency in `bank`'s slots.

    Args:
        bank: the GPU slots.
        max_cpu_loras: host copies of folder adapters kept for fast reloads (None: no limit).
    """

    def __init__(self, bank: AdapterBank, max_cpu_loras: int | None = None):
        self.bank = bank
        self.max_cpu_loras = max_cpu_loras
        self.entries: dict[str, _Entry] = {}
        self._host_lru: OrderedDict[str, None] = OrderedDict()  # folder adapters with a host copy
        self._last_used = [0] * bank.num_slots
        self._tick = 0
        self.loads = 0  # slot writes so far (for tests and benchmarks)
        self.load_times = LoadTimes()
        self.in_use: Counter[str] = Counter()  # unfinished engine requests per adapter
        # Adapters whose weights failed to load, with the reason: requests for them are refused
        # until the adapter is unregistered (and registered again, fixed).
        self.broken: dict[str, str] = {}
        self.reader = FolderReader(bank)
        self.read_ahead = ReadAhead(self.reader.read)
        self.snapshot: MappingProxyType[str, bytes] = MappingProxyType({})  # see `_publish`

    # ---- registration ---------------------------------------------------------------------------
    def read(self, name: str, path, allow_hub: bool = False, root: Path | None = None) -> AdapterSource:
        """Read and check an adapter folder against this bank (`loader.read_adapter`: names, shapes
        and size before values) without registering it: safe on any thread, so a server reads here,
        off its engine's loop, and registers the result there (`register(..., source=...)`)."""
        return read_adapter(name, path, allow_hub, root, self.bank.module_sizes, self.bank.r_max)

    def register(self, name: str, path, source: AdapterSource | None = None, allow_hub: bool = False,
                 replace: bool = False) -> AdapterStatus:
        """Check an adapter folder against the bank and remember it; no weights are moved to a slot.
        `source`: the folder already read by `read`; `allow_hub`: a Hub repo id may be fetched;
        `replace`: in place of a registered adapter of that name, swapped only once the new folder
        passed every check (refused while requests use the old one), so a bad folder leaves the old
        adapter serving and no reader ever sees the name missing."""
        check_adapter_name(name)
        if name in self.entries and not replace:
            raise AdapterError(f"adapter {name!r} is already registered ({self.status(name).location})")
        source = source or self.read(name, path, allow_hub)
        warn_if_other_base(name, source.config.get("base_model_name_or_path"), self.base_model)
        check_source(source, self.bank.module_sizes, self.bank.r_max)
        targets = _kinds(source.shapes) if source.shapes is not None else tuple(
            sorted(source.config.get("target_modules") or ()))
        if name in self.entries:
            self._forget(name)
        self.entries[name] = _Entry(source, None, source.max_rank, targets, source.digest)
        self._publish()
        return self.status(name)

    def _publish(self) -> None:
        """Replace `snapshot` (name -> digest) after a change: readers on other threads (a server's
        event loop) see one consistent registry, never one changing under them."""
        self.snapshot = MappingProxyType({name: entry.digest for name, entry in self.entries.items()})

    def acquire(self, name: str, digest: bytes | None = None) -> None:
        """Count one more unfinished request of `name` (on the engine's thread, when it is queued),
        once `name` is registered, usable, and still has the `digest` the request was checked with:
        a request checked before a re-registration never runs with weights it was not checked
        against, nor files its KV under the other weights' identity."""
        entry = self.entries.get(name)
        if entry is None:
            raise AdapterError(f"adapter {name!r} was unregistered after this request was checked; registered "
                               f"adapters: {list(self.entries)}")
        if digest is not None and entry.digest != digest:
            raise AdapterError(f"adapter {name!r} was registered again with other weights after this request was "
                               "checked: send the request again to run it on the new weights")
        self.check_usable(name)
        self.in_use[name] += 1

    def release(self, name: str) -> None:
        """One unfinished request of `name` fewer (it finished)."""
        self.in_use[name] -= 1
        if self.in_use[name] <= 0:
            del self.in_use[name]

    # The served model's name or path (set by LoRazorModel), compared with each adapter's base model.
    base_model: str | None = None

    def add_loaded(self, name: str, weights: AdapterWeights) -> int:
        """Register an adapter given as weights (from a PeftModel) and put it in a slot now."""
        check_adapter_name(name)
        if name in self.entries:
            raise AdapterError(f"adapter {name!r} is already registered")
        tensors = {f"{m}.lora_{k}": t for m, (a, b, _) in weights.modules.items() for k, t in (("A", a), ("B", b))}
        check_finite(name, tensors)
        bad = [m for m, (_, _, scale) in weights.modules.items() if not abs(scale) <= MAX_SCALING]
        if bad:
            raise AdapterError(f"adapter {name!r}: {bad[0]} has a scaling (lora_alpha / r) of "
                               f"{weights.modules[bad[0]][2]!r}, not a finite number <= {MAX_SCALING:g}")
        ranks = [a.shape[0] for a, _, _ in weights.modules.values()]
        if max(ranks, default=0) > self.bank.r_max:
            raise AdapterError(f"adapter {name!r} has rank {max(ranks)} > max_lora_rank={self.bank.r_max}")
        tensors.update({f"{m}.scale": torch.tensor(float(scale), dtype=torch.float64)
                        for m, (_, _, scale) in weights.modules.items()})
        self.entries[name] = _Entry(None, self.bank.pack(weights), max(ranks, default=0), _kinds(weights.modules),
                                    weights_digest({}, tensors))
        self._publish()
        self.make_resident([name])
        # Its host copy is kept only once it is evicted (`_evict`): the slot holds it now.
        self.entries[name].image = None
        return self.bank.slot_of[name]

    def unregister(self, name: str) -> None:
        """Forget an adapter and free its slot."""
        if name not in self.entries:
            raise KeyError(f"unknown adapter {name!r}; registered adapters: {list(self.entries)}")
        self._forget(name)
        self._publish()

    def _forget(self, name: str) -> None:
        if self.in_use[name] > 0:
            raise AdapterError(f"adapter {name!r} is used by {self.in_use[name]} unfinished requests: abort them "
                               "or let them finish first")
        slot = self.bank.slot_of.get(name)
        if slot is not None:
            self.bank.clear(slot)
        del self.entries[name]
        self._host_lru.pop(name, None)
        self.broken.pop(name, None)
        self.read_ahead.forget(name)

    def check_usable(self, name: str) -> None:
        """Raise AdapterError when `name` is marked broken (its weights failed to load)."""
        if name in self.broken:
            raise AdapterError(f"adapter {name!r} failed to load and is out of service ({self.broken[name]}); "
                               "unload it and load it again once its files are fixed")

    def load_each(self, names, protected=()) -> dict[str, str]:
        """`prefetch` one adapter at a time, so one whose weights fail to load does not stop the
        others: each failure marks the adapter broken. Returns {name: reason} for the failures
        (adapters already broken included, not retried)."""
        failed = {name: self.broken[name] for name in names if name in self.broken}
        for name in dict.fromkeys(names):
            if name in failed or name in self.bank.slot_of:
                continue
            try:
                self.prefetch([name], protected=set(protected) | set(names))
            except SlotsFullError:  # a capacity question, not the adapter's fault
                raise
            except AdapterError as err:
                failed[name] = self.broken[name] = str(err)
            except (OSError, RuntimeError) as err:  # the folder changed or vanished since registration
                failed[name] = self.broken[name] = f"{type(err).__name__}: {err}"
        return failed

    def host_ready(self, name: str, read: bool = True) -> bool:
        """Whether loading `name` into a slot needs no disk read now (it is in a slot, has a host copy
        or a read-ahead image, has no folder, is broken or unknown). If it does, start reading its
        folder on a host thread (`read_ahead.py`) when `read`, and return False."""
        entry = self.entries.get(name)
        if entry is None or entry.source is None or entry.image is not None or name in self.bank.slot_of:
            return True
        for failed, reason in self.read_ahead.collect().items():
            if failed in self.entries:
                self.broken[failed] = reason
        if name in self.broken or name in self.read_ahead.ready:
            return True
        if read:
            self.read_ahead.start(name, entry.source)
        return False

    # ---- residency ------------------------------------------------------------------------------
    def slots_for(self, adapter_ids, device: torch.device | None = None) -> torch.Tensor:
        """Per-row adapter names (None: backbone) -> `[B]` int32 slots, loading what is not resident."""
        for i, a in enumerate(adapter_ids):
            if a is not None and a not in self.entries:
                raise KeyError(f"unknown adapter {a!r} at row {i}; registered adapters: {list(self.entries)}")
        self.make_resident([a for a in adapter_ids if a is not None])
        return self.bank.slots_for(adapter_ids, device=device)

    def make_resident(self, names) -> None:
        """Put every adapter of `names` in a slot, evicting least recently used slots that `names`
        does not use, and make the compute stream wait for their loads. Raises AdapterError when
        `names` holds more distinct adapters than slots."""
        wanted = list(dict.fromkeys(names))
        if len(wanted) > self.bank.num_slots:
            raise AdapterError(f"this batch uses {len(wanted)} distinct adapters but there are only "
                               f"max_loras={self.bank.num_slots} GPU slots: split the batch or raise max_loras")
        self.prefetch(wanted, protected=wanted)
        self.bank.wait_ready([self.bank.slot_of[name] for name in wanted])

    def prefetch(self, names, protected=()) -> None:
        """Start loading `names` into slots without making the compute stream wait (on the GPU the
        copies overlap the steps queued after them). Evicts only slots of adapters outside
        `names` and `protected` (the batch in flight); marks `names` most recently used."""
        wanted = list(dict.fromkeys(names))
        keep = set(wanted) | set(protected)
        for name in wanted:
            if name not in self.bank.slot_of:
                self._load(name, self._victim(keep))
        self._tick += 1
        for name in wanted:
            self._last_used[self.bank.slot_of[name]] = self._tick

    def _victim(self, protected: set[str]) -> int:
        free = self.bank.free_slots()
        if free:
            return free[0]
        candidates = [s for s, n in enumerate(self.bank.names) if n not in protected]
        if not candidates:
            raise SlotsFullError(f"no GPU slot to load into: all max_loras={self.bank.num_slots} hold adapters in use")
        return min(candidates, key=self._last_used.__getitem__)

    def _load(self, name: str, slot: int) -> None:
        start = time.perf_counter()
        entry = self.entries[name]
        source, read_seconds = ("disk" if entry.image is None else "cpu"), 0.0
        ahead = self.read_ahead.take(name, entry.source) if entry.image is None else None
        if ahead is not None:  # read on the host thread: this disk load took that read plus the copy below
            entry.image, read_seconds = ahead
        image = self._image(name)  # first: a load that fails leaves the slot's adapter in place
        old = self.bank.names[slot]
        if old is not None and self.entries[old].source is None:
            self.entries[old].image = self.bank.read(slot)  # no folder: keep it on the host
        self.bank.write(slot, name, image)
        self.loads += 1
        # The host's part: the read and pack, and queueing the copy (which then overlaps the step).
        self.load_times.record(source, time.perf_counter() - start + read_seconds)
        if entry.source is not None and name not in self._host_lru:
            entry.image = None  # max_cpu_loras=0: no host copy outlives the load

    def _image(self, name: str) -> SlotImage:
        entry = self.entries[name]
        if entry.image is None:
            entry.image = self.reader.read(entry.source)
        if entry.source is not None:
            self._host_lru[name] = None
            self._host_lru.move_to_end(name)
            while self.max_cpu_loras is not None and len(self._host_lru) > self.max_cpu_loras:
                dropped, _ = self._host_lru.popitem(last=False)
                if dropped != name:
                    self.entries[dropped].image = None
        return entry.image

    # ---- status ---------------------------------------------------------------------------------
    def status(self, name: str) -> AdapterStatus:
        entry = self.entries[name]
        slot = self.bank.slot_of.get(name)
        location = "gpu" if slot is not None else ("host" if entry.image is not None else "disk")
        return AdapterStatus(name, location, slot, entry.rank, entry.targets,
                             entry.source.path if entry.source is not None else None)

    def statuses(self) -> dict[str, AdapterStatus]:
        return {name: self.status(name) for name in self.entries}

    def residency(self) -> dict[str, tuple[bool, bool]]:
        """Adapter name -> (in a GPU slot, has a host copy): the levels a router reads."""
        slot_of = self.bank.slot_of
        return {name: (name in slot_of, entry.image is not None) for name, entry in self.entries.items()}


def warn_if_other_base(name: str, trained_on, served) -> None:
    """Warn, naming both, when an adapter's config says it was trained on another base model than
    the one served (the same folder name counts as the same model: a local copy of a Hub model)."""
    if not trained_on or not served:
        return
    same = str(trained_on).rstrip("/") == str(served).rstrip("/") or (
        Path(str(trained_on)).name == Path(str(served)).name)
    if not same:
        warnings.warn(f"adapter {name!r} was trained on base model {trained_on!r}, but the served model is "
                      f"{served!r}: its outputs may be wrong even though its shapes fit", UserWarning, stacklevel=3)

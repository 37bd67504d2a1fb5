"""A launched engine step: its next tokens and release decisions, picked on the device, read back later.

Right after a step's forward is queued, `launch_picks` queues what picks from its outputs, all on
the device: the argmax of plain greedy rows, batched sampling of rows with batchable settings
(`runner/sampling.py`), the release decisions of each policy's rows for their next decode
forward (`runner/release.py`), and whether each row's logits are finite (a row with NaN or
infinite logits, from a broken adapter say, ends alone with an error). Their values go to the host
in one non-blocking copy, which `LaunchedStep.read` waits for: the step's one host sync.

With async scheduling (`LoRazorEngine(async_scheduling=...)`, on by default on a GPU) the engine queues step
n+1 before it reads step n back, so the GPU does not wait while the host post-processes step n and
prepares step n+2. Step n+1 takes the decode rows' input tokens and release decisions from
`values` on the device (`PendingTokens`). A step with a row the host must sample (HF logits
processors, log-probabilities) is read back at once: its logits are graph buffers that the next
step overwrites.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from .paged_graphs import PendingTokens
from .release import decide_group
from .sampling import finite_rows, sample
from .uploads import to_device

log = logging.getLogger("lorazor.engine")


@dataclass
class Picks:
    """What a step's producing rows need picked, as plain lists (built by the engine from its requests).

    Attributes:
        rows: the index, among the step's chunks, of each row that produces a token.
        owners: the caller's object for each row (the engine's requests): keys of the launched
            step's maps, never called here.
        greedy: positions (in `rows`) of plain greedy rows; `sampled`: of rows sampled on the
            device, with their `sampling` settings (`sampling.SamplingParams`). Rows in neither are
            sampled on the host after the read-back.
        decisions: release policy (None: fixed lengths only) -> per row that needs a decision for its
            next decode forward: (position in `rows`, its slot, the forward d decided, its override).
        constraints, constrained_rows: grammar matchers and the chunk index of the row each masks.
    """

    rows: list[int]
    owners: list
    greedy: list[int]
    sampled: list[int]
    sampling: list
    decisions: dict
    constraints: list = field(default_factory=list)
    constrained_rows: list[int] = field(default_factory=list)


@dataclass(eq=False)
class LaunchedStep:
    """One step whose forward and picks are queued.

    Attributes:
        rows: indices of the step's chunks that produce a token (a prefill chunk short of its
            prompt's end produces none); `requests`: their owners (`Picks.owners`).
        values: device `[m]` long: the picked tokens, the release decisions (1: keep), then one flag
            per row (1: its logits are finite).
        token_at: owner -> index of its token in `values` (rows the host samples are absent).
        decision_at: owner -> (index of its decision in `values`, the decode forward it decides).
        logits, hidden: the step's outputs per chunk (graph buffers: valid until the next step runs).
        overlappable: whether the next step may run before this one is read back (every token is on
            the device).
        failures: (owner, what failed, the exception) of rows whose release policy raised: their
            owners end after this token.
    """

    rows: list[int]
    requests: list
    values: torch.Tensor
    token_at: dict
    decision_at: dict
    logits: torch.Tensor
    hidden: torch.Tensor
    overlappable: bool = False
    failures: list = field(default_factory=list)
    host: torch.Tensor | None = None
    done: torch.cuda.Event | None = None

    finite: list | None = None  # per row, after `read`: whether its logits were finite
    values_host: list | None = None  # `values` on the host, after `read`

    def pending_for(self, inputs) -> PendingTokens | None:
        """Where the next step's `inputs.pending` tokens are in `values` (None: it has none)."""
        if not inputs.pending:
            return None
        index = [[], [], []]
        for position, request in inputs.pending:
            index[0].append(position)
            index[1].append(self.token_at[request])
            index[2].append(self.decision_at.get(request, (-1, 0))[0])
        return PendingTokens(to_device(index, self.values.device), self.values)

    def read(self) -> list:
        """Wait for the values (`values_host` afterwards) and each row's finite flag (`finite`);
        returns the token of each row (None where the host samples it). `outputs.postprocess`
        turns them into outputs."""
        if self.done is not None:
            # Waits with the GIL released: a server's event loop runs meanwhile.
            self.done.synchronize()
        values = self.values_host = self.host.tolist()
        self.finite = [bool(flag) for flag in values[len(values) - len(self.rows):]]
        return [None if r not in self.token_at else values[self.token_at[r]] for r in self.requests]


def launch_picks(picks: Picks, logits: torch.Tensor, hidden: torch.Tensor, policies, mask=None) -> LaunchedStep:
    """Queue the step's device picks (see the module docstring) and their copy to the host.
    `mask(logits)`: applies the constrained rows' grammar bitmasks in place, after the finite check
    (a masked logit is -inf on purpose) and before any pick.

    A release policy that raises fails only its own rows (`LaunchedStep.failures`)."""
    rows, owners = picks.rows, picks.owners
    device = logits.device
    finite = finite_rows(logits).index_select(0, to_device(rows, device)).long() if rows else None
    if mask is not None:
        mask(logits)
    pick = lambda tensor, js: tensor.index_select(0, to_device([rows[j] for j in js], device))  # noqa: E731
    parts = []
    if picks.greedy:
        parts.append(pick(logits, picks.greedy).argmax(-1))
    if picks.sampled:
        parts.append(sample(pick(logits, picks.sampled), picks.sampling))
    token_at = {owners[j]: i for i, j in enumerate(picks.greedy + picks.sampled)}
    decision_at, failures = {}, []
    offset = len(token_at)
    for policy, members in picks.decisions.items():
        try:
            parts.append(decide_group(policy, [(rows[j], slot, d, release) for j, slot, d, release in members],
                                      hidden, policies))
        except Exception as err:
            log.error("release policy %s failed: %s; ending its %d requests", type(policy).__name__, err,
                      len(members))
            failures += [(owners[j], f"release policy {type(policy).__name__}", err) for j, *_ in members]
            continue
        for j, _, d, _ in members:
            decision_at[owners[j]] = (offset, d)
            offset += 1
    if finite is not None:
        parts.append(finite)
    values = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long, device=device)
    launched = LaunchedStep(rows, owners, values, token_at, decision_at, logits, hidden,
                            overlappable=len(token_at) == len(owners), failures=failures)
    if values.is_cuda:
        launched.host = values.to("cpu", non_blocking=True)
        launched.done = torch.cuda.Event()
        launched.done.record()
    else:
        launched.host = values
    return launched

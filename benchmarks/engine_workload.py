"""The serving workload of the engine and server benchmarks (paper section 4 and appendix A.2).

Four task-like groups, equal in size, each with its own prompt and output length distributions
(prompts of a few hundred tokens; outputs log-normal with a long tail, means about 50-65 tokens,
capped per group as in the paper: 256, 256, 128, 320). EOS is ignored: every request generates
exactly its drawn length, so every system does the same work. Adapter identities: with L adapters,
group g owns identities g, g + 4, ...; uniform traffic spreads each group's requests evenly over
its identities, skewed traffic gives 6 of every 32 identities ~80% of the group (appendix A.2).
StepTrim for the release rows: one profiled k per group, the largest k whose decode-LoRA skip on
the group's own lengths is at least 50%.

The decode-heavy shape (issue #37's StepTrim trace) keeps the groups and prompts of about 200
tokens but draws outputs three times longer (median about 150 tokens, cap 512), and releases for
at least 73% of decode-LoRA steps skipped: the workload where StepTrim has the most to save.

The shared-prefix shape (`build_shared_prefix`, the prefix cache's trace): each of 128 adapters comes
with its own system prompt of about 1,000 tokens (a tenant's instructions); a request is its
adapter's system prompt and a user part of 50-300 tokens, output about 100 tokens (cap 256);
adapters are drawn with Zipf(1.1) popularity.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

# name: (prompt mean, prompt sd, prompt min, prompt max, output mean, output cap)
GROUPS = {
    "math": (160, 50, 48, 400, 62, 256),
    "sql": (300, 90, 96, 640, 48, 256),
    "med": (240, 60, 96, 480, 50, 128),
    "science": (200, 60, 64, 440, 64, 320),
}
# The decode-heavy shape: prompts about 200 tokens, outputs with a mean of 186 (median about 151).
DECODE_HEAVY = {
    "math": (190, 50, 48, 400, 186, 512),
    "sql": (210, 60, 96, 440, 186, 512),
    "med": (200, 60, 96, 440, 186, 512),
    "science": (200, 60, 64, 440, 186, 512),
}
SHAPES = {"mixed": GROUPS, "decode-heavy": DECODE_HEAVY}
OUTPUT_SIGMA = 0.65  # log-normal shape of the output lengths: a long tail up to the cap
TARGET_SKIP = 0.5
TARGET_SKIPS = {"mixed": TARGET_SKIP, "decode-heavy": 0.73}


@dataclass
class Request:
    group: str
    prompt: list[int]
    max_new_tokens: int
    identity: int  # adapter identity (group index + 4 * i)


def _output_lengths(rng, mean: float, cap: int, n: int) -> np.ndarray:
    mu = math.log(mean) - OUTPUT_SIGMA**2 / 2
    return np.clip(np.round(rng.lognormal(mu, OUTPUT_SIGMA, n)), 2, cap).astype(int)


def build(num_requests: int, vocab: int, seed: int = 0, shape: str = "mixed") -> list[Request]:
    """`num_requests` requests (a multiple of 4) of `shape` ("mixed" or "decode-heavy"), groups
    interleaved in a shuffled order."""
    if shape not in SHAPES:
        raise ValueError(f"unknown workload shape {shape!r}; choose from {sorted(SHAPES)}")
    rng = np.random.default_rng(seed)
    per = num_requests // len(GROUPS)
    requests = []
    for g, (name, (p_mean, p_sd, p_min, p_max, o_mean, cap)) in enumerate(SHAPES[shape].items()):
        prompt_lens = np.clip(np.round(rng.normal(p_mean, p_sd, per)), p_min, p_max).astype(int)
        outputs = _output_lengths(rng, o_mean, cap, per)
        for n, out in zip(prompt_lens, outputs):
            requests.append(Request(name, rng.integers(3, vocab, n).tolist(), int(out), g))
    order = rng.permutation(len(requests))
    return [requests[i] for i in order]


# (system prompt mean, sd, min, max), user part (min, max), output (mean, cap), Zipf exponent
SHARED_PREFIX = dict(system=(1000, 100, 800, 1200), user=(50, 300), output=(100, 256), zipf=1.1)


def build_shared_prefix(num_requests: int, vocab: int, num_adapters: int = 128, seed: int = 0
                        ) -> tuple[list[Request], list[int]]:
    """(requests, adapter identity of each) of the shared-prefix shape (module docstring)."""
    spec = SHARED_PREFIX
    rng = np.random.default_rng(seed)
    mean, sd, low, high = spec["system"]
    systems = [rng.integers(3, vocab, int(np.clip(round(rng.normal(mean, sd)), low, high))).tolist()
               for _ in range(num_adapters)]
    popularity = np.arange(1, num_adapters + 1, dtype=float) ** -spec["zipf"]
    identities = rng.choice(num_adapters, size=num_requests, p=popularity / popularity.sum()).tolist()
    outputs = _output_lengths(rng, *spec["output"], num_requests)
    requests = []
    for identity, output in zip(identities, outputs):
        user = rng.integers(3, vocab, int(rng.integers(spec["user"][0], spec["user"][1] + 1))).tolist()
        requests.append(Request("shared", systems[identity] + user, int(output), identity))
    return requests, identities


def assign(requests: list[Request], num_adapters: int, skewed: bool = False, seed: int = 0) -> list[int]:
    """Adapter identity per request: group g's requests go to identities g, g + 4, ... < L."""
    rng = np.random.default_rng(seed + 1)
    groups = list(GROUPS)
    per_group = max(num_adapters // len(groups), 1)
    out = []
    hot = {g: rng.choice(per_group, size=max(round(0.2 * per_group), 1), replace=False) for g in groups}
    counters = {g: 0 for g in groups}
    for r in requests:
        if skewed and rng.random() < 0.8:
            j = int(rng.choice(hot[r.group]))
        elif skewed:
            cold = [j for j in range(per_group) if j not in set(hot[r.group].tolist())]
            j = int(rng.choice(cold)) if cold else int(rng.integers(per_group))
        else:
            j = counters[r.group] % per_group  # round robin: equal shares
            counters[r.group] += 1
        out.append(groups.index(r.group) + len(groups) * j)
    return out


def release_lengths(requests: list[Request], target: float = TARGET_SKIP) -> dict[str, int]:
    """Per group, the largest k that still skips at least `target` of its decode-LoRA steps."""
    out = {}
    for name in GROUPS:
        steps = np.array([r.max_new_tokens - 1 for r in requests if r.group == name])
        for k in range(int(steps.max()) + 1):
            if 1 - np.minimum(steps, k).sum() / steps.sum() < target:
                out[name] = max(k - 1, 0)
                break
    return out


def skip_fraction(requests: list[Request], ks: dict[str, int]) -> float:
    steps = np.array([r.max_new_tokens - 1 for r in requests])
    kept = np.array([min(r.max_new_tokens - 1, ks[r.group]) for r in requests])
    return float(1 - kept.sum() / steps.sum())


def percentiles(values, qs=(50, 90, 99)) -> dict[str, float]:
    values = [v for v in values if v is not None]
    if not values:
        return {f"p{q}": float("nan") for q in qs}
    return {f"p{q}": float(np.percentile(values, q)) for q in qs}


def poisson_arrivals(rate: float, duration: float, seed: int) -> np.ndarray:
    """Arrival offsets (s) of a Poisson process of `rate` req/s over `duration` seconds."""
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1 / rate, int(rate * duration * 1.5) + 16)
    t = np.cumsum(gaps)
    return t[t < duration]


def run_open_loop(engine, requests: list[dict], offsets: np.ndarray) -> dict:
    """In-process open loop: request i joins at `start + offsets[i]` (its TTFT counts from then);
    steps run back to back while any request is in flight. Returns achieved req/s and percentiles.
    Starts from a cold prefix cache: a process's runs replay the same prompts."""
    engine.pool.reset_cache()
    start = time.monotonic()
    pending = list(zip(offsets, requests))
    outs = []
    i = 0
    while i < len(pending) or engine.has_unfinished():
        now = time.monotonic()
        while i < len(pending) and start + pending[i][0] <= now:
            engine.add_request(arrival_time=start + pending[i][0], **pending[i][1])
            i += 1
        if not engine.has_unfinished():
            time.sleep(max(start + pending[i][0] - time.monotonic(), 0))
            continue
        outs.extend(o for o in engine.step() if o.finished)
    return summarize(outs, start)


def summarize(outs, start: float) -> dict:
    end = max(o.finish_time for o in outs)
    return dict(completed=len(outs), achieved_req_s=len(outs) / (end - start),
                **{f"ttft_{k}": v for k, v in percentiles([o.ttft for o in outs]).items()},
                **{f"tpot_{k}": v for k, v in percentiles([o.tpot for o in outs]).items()})


def knee(points, slo: float) -> tuple[float, bool]:
    """(offered rate where P90 TTFT crosses `slo`, linearly interpolated between the tested rates;
    whether it crossed at all: if not, the highest tested rate, a lower bound). `points` holds
    (rate, P90 TTFT) pairs."""
    pts = sorted(points)
    if not pts or pts[0][1] > slo:
        return 0.0, True
    for (r0, t0), (r1, t1) in zip(pts, pts[1:]):
        if t1 > slo:
            return r0 + (r1 - r0) * (slo - t0) / (t1 - t0), True
    return pts[-1][0], False

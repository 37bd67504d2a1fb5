"""The one place a launched step becomes outputs: its values read back (the step's one host sync),
each row's release decision recorded, its token taken (or sampled on the host for rows the device
did not sample), its logits checked finite, its stop checks, and a `RequestOutput` per request.

A request that finished or was aborted while a step was in flight drops that step's token. A
request whose own code raises (its logits processors, its stopping criteria) or whose logits are
not finite ends with finish reason "error"; the others go on.

Stop checks: EOS and length per request. Stop strings (OpenAI's `stop`) use HF's
`StopStringCriteria` on the last tokens only, and only for requests whose new token can end one of
their strings; those that share the same strings (and tokenizer) are checked together in one call.
One call per request costs about a hundred microseconds of small torch ops, which at batch 256
would outlast the GPU's step. Any other criterion is checked per request, as HF would
(`GenerationPlan.stop_reason`).
"""

from __future__ import annotations

import logging
import time

import torch

from ..runner import float_scores, next_tokens
from .request import Request, RequestOutput, Status

log = logging.getLogger("lorazor.engine")


def postprocess(step, finish) -> list[RequestOutput]:
    """The outputs of launched `step` (`launched.LaunchedStep`); `finish(request, reason)` ends a
    request (the engine's)."""
    tokens = step.read()
    for request, (index, forward) in step.decision_at.items():
        request.record_decision(forward, bool(step.values_host[index]))
    now = time.monotonic()
    outputs, appended = [], []
    for i, token, request, finite in zip(step.rows, tokens, step.requests, step.finite):
        request.pending -= 1
        if request.status is not Status.RUNNING:
            continue
        if not finite:  # NaN or infinite logits: this request's token is garbage
            log.error("request %s: non-finite logits (adapter %r)", request.request_id, request.adapter)
            request.error = (f"the model computed non-finite logits (NaN or infinity) for this request "
                             f"(adapter {request.adapter!r}); it was stopped")
            finish(request, "error")
            outputs.append(request.report([]))
            continue
        if token is None:
            try:
                token = sample_on_host(request, step.logits[i])
            except Exception as err:  # its own logits processor: it ends this request only
                log.error("request %s: sampling failed: %s", request.request_id, err)
                request.fail("sampling", err)
                finish(request, "error")
                outputs.append(request.report([]))
                continue
        request.append(token)
        constraint = request.constraint
        if constraint is not None and token not in request.plan.eos and not constraint.accept(token):
            request.error = f"the grammar refused token {token} (structured output); it was stopped"
        if request.first_token_time is None:
            request.first_token_time = now
        appended.append((request, token))
    for (request, token), reason in zip(appended, stop_reasons(appended)):
        if reason is not None:
            finish(request, reason)
        outputs.append(request.report([token], None if request.logprobs is None else [request.last_logprobs]))
    return outputs


def sample_on_host(request: Request, logits: torch.Tensor) -> int:
    """The next token of a request the device did not sample: its own HF processors, and the
    log-probabilities it asked for."""
    seq = torch.tensor([request.tokens], dtype=torch.long, device=logits.device)
    raw = float_scores(logits[None])
    if request.logprobs is not None:
        # As vLLM reports them: the model's distribution after the request's own processors
        # (OpenAI's penalties and logit bias), before temperature and top-k/top-p.
        adjusted = request.logprob_processors(seq, raw.clone()) if request.logprob_processors else raw.clone()
        logprobs = torch.log_softmax(adjusted[0], dim=-1)
    scores = request.plan.processors(seq, raw)
    request.last_scores = scores
    token = int(next_tokens(scores, request.plan.config.do_sample, request.generator)[0])
    if request.logprobs is not None:
        top = logprobs.topk(request.logprobs) if request.logprobs else None
        request.last_logprobs = (float(logprobs[token]), [] if top is None else list(
            zip(top.indices.tolist(), top.values.tolist())))
    return token


def _can_end(criterion) -> list[bool]:
    """Whether each token id can end one of the criterion's stop strings (HF's criterion matches only
    when the last token can, so the others need no call at all). Computed once per embedding, which
    HF shares between requests with the same strings, and kept on that tensor: it goes with it."""
    vec = criterion.embedding_vec
    flags = getattr(vec, "_lorazor_can_end", None)
    if flags is None:
        start = criterion.max_valid_positions * criterion.num_stop_strings
        flags = vec._lorazor_can_end = (vec[:, start:-1] > 0).any(1).tolist()
    return flags


def stop_reasons(appended: list) -> list[str | None]:
    """Why each (request, token) pair, its token just appended, stops ("error", "eos", "length",
    "stop") or None."""
    reasons: list[str | None] = []
    groups: dict = {}
    for k, (request, token) in enumerate(appended):
        plan = request.plan
        if request.error:
            reasons.append("error")
            continue
        if request.constraint is not None and request.constraint.done:  # the grammar is complete
            reasons.append(plan.builtin_reason(token, len(request.output)) or "stop")
            continue
        criterion = plan.stop_string_criterion
        if criterion is None:
            try:
                reasons.append(plan.stop_reason(request.tokens, token, len(request.output), request.last_scores))
            except Exception as err:  # the request's own criteria: it ends this request only
                reasons.append(failed(request, err))
            continue
        reason = plan.builtin_reason(token, len(request.output))
        reasons.append(reason)
        can_end = _can_end(criterion)
        if reason is None and token < len(can_end) and can_end[token]:
            tail = request.tokens[-criterion.maximum_token_len:]
            # HF caches the vocabulary's embedding per (tokenizer, strings): requests with the same
            # strings share it, and so one call.
            key = (id(criterion.embedding_vec), len(tail))
            group = groups.setdefault(key, (criterion, [], []))
            group[1].append(k)
            group[2].append(tail)
    for criterion, indices, tails in groups.values():
        try:
            hits = criterion(torch.tensor(tails, dtype=torch.long), None).tolist()
        except Exception as err:  # ends the requests that share these strings, no others
            for k in indices:
                reasons[k] = failed(appended[k][0], err)
            continue
        for k, hit in zip(indices, hits):
            if hit:
                reasons[k] = "stop"
    return reasons


def failed(request, err: Exception) -> str:
    """Record why a request's stop check raised; its finish reason ("error")."""
    log.error("request %s: stop check failed: %s", request.request_id, err)
    request.fail("stop check", err)
    return "error"

"""The stop checks of a step's tokens, on the host after the read-back.

EOS and length are checked per request. Stop strings (OpenAI's `stop`) use HF's
`StopStringCriteria` on the last tokens only, and only for requests whose new token can end one of
their strings; those that share the same strings (and tokenizer) are checked together in one call.
One call per request costs about a hundred microseconds of small torch ops, which at batch 256
would outlast the GPU's step. Any other criterion is checked per request, as HF would
(`GenerationPlan.stop_reason`).
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import torch

log = logging.getLogger("lorazor.engine")

# Per stop-string vocabulary embedding (HF's, shared by requests with the same strings): whether each
# token id can end a stop string. HF's criterion matches only when the last token can, so the others
# need no call at all. The few most recent sets of strings are kept (each holds HF's embedding).
_CAN_END: OrderedDict = OrderedDict()
_CAN_END_KEPT = 32


def _can_end(criterion) -> list[bool]:
    vec = criterion.embedding_vec
    entry = _CAN_END.get(id(vec))
    if entry is None or entry[0] is not vec:  # kept by id, with the tensor itself to rule out a reused id
        start = criterion.max_valid_positions * criterion.num_stop_strings
        entry = _CAN_END[id(vec)] = (vec, (vec[:, start:-1] > 0).any(1).tolist())
        if len(_CAN_END) > _CAN_END_KEPT:
            _CAN_END.popitem(last=False)
    return entry[1]


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

"""StepTrim calibration on validation data: profiled release lengths (paper 3.2.1) and learned
release heads trained from paired ON/OFF continuations (3.2.2)."""

from .heads import (
    RELEASE_POSITIONS,
    ReleaseExamples,
    calibrate_learned,
    collect_release_examples,
    train_risk_head,
)
from .lengths import (
    DEFAULT_RELEASE_LENGTHS,
    ReleasePoint,
    ValidationSet,
    calibrate_profiled,
    evaluate_policy,
    evaluate_release,
    generate_answers,
    pareto_front,
    policy_outcomes,
    profile_release_lengths,
    select_point,
    select_release_length,
)

__all__ = [
    "DEFAULT_RELEASE_LENGTHS",
    "RELEASE_POSITIONS",
    "ReleaseExamples",
    "ReleasePoint",
    "ValidationSet",
    "calibrate_learned",
    "calibrate_profiled",
    "collect_release_examples",
    "evaluate_policy",
    "evaluate_release",
    "generate_answers",
    "pareto_front",
    "policy_outcomes",
    "profile_release_lengths",
    "select_point",
    "select_release_length",
    "train_risk_head",
]

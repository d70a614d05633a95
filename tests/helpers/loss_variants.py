"""The acceptance-aware loss's variants (LossSpec fields), each checked against the float64 reference
(tests/test_losses.py) and through the learner's hidden-state path (tests/test_step_loss.py)."""

from __future__ import annotations

VARIANTS = {
    "mixed": {},
    "all_forward": {"kl_mode": "all_forward"},
    "all_reverse": {"kl_mode": "all_reverse"},
    "no_decay": {"rejected_decay": False},
    "first_rejected_only": {"first_rejected_only": True},
    "accepted_decay": {"accepted_decay": True},
    "unequal_lambdas": {"lambda_acc": 0.3, "lambda_rej": 1.7, "gamma": 0.6},
    "rejected_only": {"lambda_acc": 0.0},
    "acceptance_term": {"acceptance_weight": 0.5},
    "acceptance_term_forward_first_rejected": {"acceptance_weight": 2.0, "kl_mode": "all_forward",
                                               "first_rejected_only": True},
}

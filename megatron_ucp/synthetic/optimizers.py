"""The optimizers a synthetic save can be of, as their rank files show them (torch-free: the CLI lists them)."""

from __future__ import annotations

BASE_OPTIMIZERS: dict[str, tuple[tuple[str, ...], dict[str, object]]] = {
    "adam": (("exp_avg", "exp_avg_sq"), {}),
    "nadam": (("exp_avg", "exp_avg_sq"), {"mu_product": 0.203125}),
    "muon": (("moment1", "moment2"), {"use_muon": False}),
    "sophiag": (("exp_avg", "hessian"), {}),
}
"""The optimizer DeepSpeed wraps, as its rank files show it: its states of one number per element, and its states
of one value per partition (besides ``step``) with the value every partition holds (torch's Adam/AdamW and NAdam,
the fork's Muon on a flat partition and SophiaG)."""
SECOND_MOMENTS = ("exp_avg_sq", "moment2", "hessian")
"""Per-element states that are non-negative."""

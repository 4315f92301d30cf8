"""Decide: the cost model over a profile, the search space and its Optuna study, and the typed plan record."""

from specdec_tune import lazy_entry_points

_ENTRY_POINTS = {
    "search": "search",
    "Plan": "plan_schema",
    "load_plan": "plan_schema",
    "CostModel": "cost_model",
    "cost_model_of": "plan",
}
__all__ = sorted(_ENTRY_POINTS)
__getattr__ = lazy_entry_points(__name__, _ENTRY_POINTS)

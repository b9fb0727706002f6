"""Searched artifacts against one-size baselines: quality vs attention cost (``sparsesearch pareto``)."""

from .baselines import DEFAULT_BUDGETS, FAMILIES, Point, baseline_points
from .dominance import verdicts
from .run import ParetoConfig, Progress, pareto, preflight

__all__ = ["DEFAULT_BUDGETS", "FAMILIES", "ParetoConfig", "Point", "Progress", "baseline_points", "pareto", "preflight", "verdicts"]

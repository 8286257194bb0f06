"""Held-out curves of the GRPO studies (study_recipe.py, study_vs_trl.py): a curve is a list
of (step, pass@1) in step order; a run is a dict with its "curve"."""

import statistics


def first_reach(curve: list[tuple[int, float]], level: float) -> int | None:
  """The first step at which the curve is at `level` or above; None if never."""
  return next((step for step, p in curve if p >= level), None)


def mean_curve(runs: list[dict]) -> list[tuple[int, float]]:
  """Held-out pass@1 averaged over the runs (seeds) at each evaluation step they all have."""
  curves = [dict(r["curve"]) for r in runs]
  steps = sorted(set.intersection(*(set(c) for c in curves)))
  return [(step, statistics.mean(c[step] for c in curves)) for step in steps]

"""The external-start study's per-run figures and its verdict against TRL."""

from experiments import study_vs_trl as study


def _run(setting, seed, curve):
  return {"setting": setting, "seed": seed, "curve": curve}


def test_summarize_run_measures_the_fall_below_the_start_and_from_the_best():
  r = study.summarize_run(_run("a", 0, [(0, 0.4), (10, 0.7), (20, 0.3), (30, 0.65)]))
  assert r["start"] == 0.4 and r["best"] == 0.7 and r["final"] == 0.65
  assert abs(r["max_fall_below_start"] - 0.1) < 1e-9
  assert abs(r["max_fall_from_best"] - 0.4) < 1e-9
  assert r["reach"] == {"0.6": 10, "0.7": 10, "0.8": None, "0.9": None}
  # a run that never goes below its start has no fall below it
  assert study.summarize_run(_run("a", 0, [(0, 0.4), (10, 0.5)]))["max_fall_below_start"] == 0


def test_verdict_reads_the_seed_mean_curve_and_every_seeds_fall():
  trl = [_run("trl", s, [(0, 0.5), (10, 0.6), (20, 0.7)]) for s in range(2)]
  same = [_run("same", s, [(0, 0.5), (10, 0.6), (20, 0.7)]) for s in range(2)]
  # seed 0 reaches 0.7 at step 10, seed 1 never: the mean curve (0.57 at 10, 0.65 at 20)
  # reaches 0.6 at 20, after TRL's 10, and 0.7 never, where TRL's does at 20
  late = [_run("late", 0, [(0, 0.5), (10, 0.7), (20, 0.7)]),
          _run("late", 1, [(0, 0.5), (10, 0.44), (20, 0.6)])]
  v = study.verdicts(trl + same + late, ["trl", "same", "late"], "trl")
  assert all(v["same"]["no_later_than_reference"].values())
  assert v["same"]["never_below_start_by_0.05"]
  assert v["late"]["mean_curve_reach"] == {"0.6": 20, "0.7": None, "0.8": None, "0.9": None}
  assert v["late"]["no_later_than_reference"] == {"0.6": False, "0.7": False, "0.8": True,
                                                  "0.9": True}
  # seed 1 fell 0.06 below its start: the worst seed decides
  assert not v["late"]["never_below_start_by_0.05"]
  assert abs(v["late"]["max_fall_below_start"] - 0.06) < 1e-9

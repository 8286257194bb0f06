"""The recipe study's verdict: levels reached on the seed-mean curve against a reference."""

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("study_recipe",
                                               ROOT / "experiments" / "study_recipe.py")
study = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(study)


def _run(setting, seed, curve, start="0.25"):
  return {"setting": setting, "start": start, "seed": seed, "curve": curve}


def test_mean_curve_averages_seeds_at_the_steps_they_share():
  runs = [_run("a", "0", [(0, 0.2), (25, 0.4), (50, 0.6)]),
          _run("a", "1", [(0, 0.4), (25, 0.6)])]  # a run cut short has no step 50
  assert study.mean_curve(runs) == [(0, 0.30000000000000004), (25, 0.5)]


def test_a_setting_must_reach_every_level_the_reference_reaches_no_later():
  ref = [_run("trl", "0", [(0, 0.3), (25, 0.5), (50, 0.7), (75, 0.8)]),
         _run("trl", "1", [(0, 0.3), (25, 0.5), (50, 0.7), (75, 0.8)])]
  # same steps as the reference: equal is no later
  same = [_run("same", s, r["curve"]) for s, r in zip("01", ref)]
  # seed 0 reaches 0.9 alone: its mean curve does not, and neither does the reference's
  early = [_run("early", "0", [(0, 0.5), (25, 0.7), (50, 0.8), (75, 0.95)]),
           _run("early", "1", [(0, 0.5), (25, 0.7), (50, 0.8), (75, 0.8)])]
  # one seed never gets past 0.7, so the mean curve never reaches 0.8
  stalls = [_run("stalls", "0", [(0, 0.3), (25, 0.5), (50, 0.7), (75, 0.9)]),
            _run("stalls", "1", [(0, 0.3), (25, 0.5), (50, 0.7), (75, 0.6)])]
  late = [_run("late", s, [(0, 0.3), (25, 0.4), (50, 0.7), (75, 0.8)]) for s in "01"]
  settings = ["trl", "same", "early", "stalls", "late"]
  v = study.compare_to_reference(ref + same + early + stalls + late, settings, ["0.25"],
                                 "trl")["0.25"]
  assert v["trl"]["mean_curve_reach"] == {"0.5": 25, "0.7": 50, "0.8": 75, "0.9": None}
  assert all(v["same"]["no_later_than_reference"].values())
  assert v["early"]["mean_curve_reach"] == {"0.5": 0, "0.7": 25, "0.8": 50, "0.9": None}
  assert all(v["early"]["no_later_than_reference"].values())
  assert v["stalls"]["mean_curve_reach"]["0.8"] is None
  assert v["stalls"]["no_later_than_reference"] == {"0.5": True, "0.7": True, "0.8": False,
                                                     "0.9": True}
  assert v["late"]["no_later_than_reference"]["0.5"] is False
  assert v["late"]["mean_final_pass1"] == 0.8
  per_run = dict(reach={str(lv): None for lv in study.LEVELS}, max_fall_from_best=0.0,
                 sampled_nll_first10=0.0, sampled_nll_last10=0.0)
  runs = [r | per_run for r in ref + stalls]
  table = study.tables(runs, ["trl", "stalls"], ["0.25"], "trl",
                       study.compare_to_reference(runs, ["trl", "stalls"], ["0.25"], "trl"))
  assert "| stalls | 25 | 50 | None | None | 0.750 | no |" in table
  assert "| trl | 25 | 50 | 75 | None | 0.800 | yes |" in table

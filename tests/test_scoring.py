"""scoring's comparison helpers: a NaN anywhere must make the figure NaN."""

import math

import numpy as np
import pytest

from rljax.model import scoring


def test_nan_max_sees_a_nan_in_any_position():
  for pos in range(3):
    values = [np.zeros(4), np.ones(3), np.full(2, 0.5)]
    values[pos] = np.array([0.0, np.nan])
    assert math.isnan(scoring.nan_max(values))
    assert math.isnan(scoring.nan_max(float(np.max(v)) for v in values))
  assert scoring.nan_max([np.zeros(2), np.array([]), 3.0]) == 3.0
  with pytest.raises(ValueError, match="nothing"):
    scoring.nan_max([])


def test_max_abs_diff_fails_a_bitwise_check_on_a_nan_in_any_sequence():
  a = [np.zeros(3, np.float32), np.full(5, -2.0, np.float32), np.array([-np.inf, 1.0])]
  b = [x.copy() for x in a]
  assert scoring.max_abs_diff(a, b) == 0.0  # equal infinities are equal
  b[1][2] += 0.25
  assert scoring.max_abs_diff(a, b) == 0.25
  for i in range(3):
    bad = [x.copy() for x in b]
    bad[i][-1] = np.nan
    d = scoring.max_abs_diff(a, bad)
    assert math.isnan(d) and not d == 0.0 and not d < 1e-5  # pylint: disable=unneeded-not
  assert math.isnan(scoring.max_abs_diff([np.array([np.nan])], [np.array([np.nan])]))


def test_max_abs_diff_rejects_mismatched_inputs():
  with pytest.raises(ValueError, match="shape"):
    scoring.max_abs_diff([np.zeros(3)], [np.zeros(4)])
  with pytest.raises(ValueError, match="arrays"):
    scoring.max_abs_diff([np.zeros(3)], [np.zeros(3), np.zeros(3)])

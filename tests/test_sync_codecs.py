"""Codecs of the weight stream: lossless bit for bit on every kind of change."""


from hypothesis import given, settings, strategies as st
import ml_dtypes
import numpy as np
import pytest

from rljax.sync import codecs

DELTAS = [n for n in codecs.names() if not codecs.get(n).keyframe]
KEYFRAMES = [n for n in codecs.names() if codecs.get(n).keyframe]
BF16 = ml_dtypes.bfloat16


def _roundtrip(name, old, new):
  codec = codecs.get(name)
  data = codec.encode(new, None if codec.keyframe else old)
  patch = codec.decode(data, new.size, new.dtype.itemsize)
  target = old.copy()
  codecs.apply_patch(patch, target)
  np.testing.assert_array_equal(target, new)
  if not codec.keyframe:  # deltas are invertible: that is how a bad apply is rolled back
    codecs.apply_patch(patch.inverse(), target)
    np.testing.assert_array_equal(target, old)
  return data


def _rl_like_update(n, frac, rng, dtype=BF16):
  w = (0.02 * rng.standard_normal(n)).astype(np.float32)
  step = np.where(rng.random(n) < frac, 1e-2 * np.abs(w) * rng.standard_normal(n), 0)
  return (codecs.bits_view(w.astype(dtype)).copy(),
          codecs.bits_view((w + step).astype(dtype)).copy())


@pytest.mark.parametrize("name", codecs.names())
def test_roundtrip_sparse_update(name):
  old, new = _rl_like_update(100_003, 0.01, np.random.default_rng(0))
  data = _roundtrip(name, old, new)
  if name in ("rice", "rice-zstd", "sparse-zstd"):
    assert len(data) < new.nbytes / 40


SPECIAL = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-38, -1e-38, 3.0e38, 1.0, -1.0],
                   np.float32)


@pytest.mark.parametrize("name", codecs.names())
@pytest.mark.parametrize("dtype", [BF16, np.float32, np.float16, np.uint8])
def test_roundtrip_special_values_and_far_jumps(name, dtype):
  """NaN payloads, signed zeros, infinities, sign flips and jumps across the whole
  range (the rice escape path), on every supported itemsize."""
  rng = np.random.default_rng(1)
  with np.errstate(over="ignore", invalid="ignore"):  # inf/nan into float16 and uint8
    old = codecs.bits_view(np.resize(SPECIAL, 4099).astype(dtype)).copy()
  new = old.copy()
  idx = rng.choice(old.size, 700, replace=False)
  new[idx] = rng.integers(0, np.iinfo(old.dtype).max, idx.size, dtype=old.dtype)
  new[:8] = old[:8] ^ (1 << (8 * old.itemsize - 1))  # sign flips, -0 <-> +0
  new[-1] = old[-1] ^ 1  # the last element (the tail of the 8-byte scan)
  _roundtrip(name, old, new)


@pytest.mark.parametrize("name", codecs.names())
@pytest.mark.parametrize("n", [0, 1, 3, 8, 9])
def test_roundtrip_tiny_and_empty(name, n):
  rng = np.random.default_rng(n)
  old = rng.integers(0, 2**16, n, dtype=np.uint16)
  _roundtrip(name, old, old.copy())  # nothing changed
  _roundtrip(name, old, rng.integers(0, 2**16, n, dtype=np.uint16))  # everything


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 2**16 - 1), min_size=1, max_size=200),
       st.lists(st.integers(0, 2**16 - 1), min_size=1, max_size=200))
def test_rice_roundtrip_property(a, b):
  n = min(len(a), len(b))
  old, new = np.array(a[:n], np.uint16), np.array(b[:n], np.uint16)
  new[::2] = old[::2]  # mix unchanged and changed positions
  for name in DELTAS:
    _roundtrip(name, old, new)


def test_ordered_is_the_float_order():
  u = np.arange(2**16, dtype=np.uint16)
  f = u.view(BF16).astype(np.float32)
  keep = ~np.isnan(f)
  o = codecs.ordered(u)
  np.testing.assert_array_equal(codecs.unordered(o), u)
  by_order = np.argsort(o[keep])
  assert np.all(np.diff(f[keep][by_order]) >= 0)  # ordered ints sort the floats
  assert int(codecs.ordered(np.array([0x0000], np.uint16))[0]) == int(
      codecs.ordered(np.array([0x8000], np.uint16))[0]) + 1  # -0 just below +0


def test_one_ulp_steps_cost_about_two_bits_plus_the_gap():
  rng = np.random.default_rng(2)
  old = codecs.bits_view(rng.standard_normal(1_000_000).astype(BF16)).copy()
  new = old.copy()
  idx = np.sort(rng.choice(old.size, 10_000, replace=False))
  new[idx] = codecs.unordered(codecs.ordered(old[idx]) + rng.choice(
      np.array([1, 0xFFFF], np.uint16), idx.size))
  bits_per_change = 8 * len(codecs.get("rice").encode(new, old)) / idx.size
  rice, rice_zstd = (len(codecs.get(n).encode(new, old)) for n in ("rice", "rice-zstd"))
  assert rice_zstd <= rice + 40  # zstd frames cost a few bytes where nothing compresses
  # entropy of a gap with p = 1% is 8.1 bits; a Rice code is within ~0.1 of it; +1 sign
  # bit + 1 magnitude bit
  assert bits_per_change < 10.5, bits_per_change


@pytest.mark.parametrize("name", DELTAS + KEYFRAMES)
def test_corrupt_objects_raise_or_decode_differently(name):
  """A truncated object never decodes silently to the right bits (the stream's object
  checksum catches it first; this is the codec's own line of defence)."""
  old, new = _rl_like_update(10_000, 0.05, np.random.default_rng(3))
  codec = codecs.get(name)
  data = codec.encode(new, None if codec.keyframe else old)
  for bad in (data[:-1], data[: len(data) // 2]):
    try:
      patch = codec.decode(bad, new.size, 2)
      target = old.copy()
      codecs.apply_patch(patch, target)
    except Exception:
      continue
    assert not np.array_equal(target, new)


def test_changed_positions_matches_flatnonzero():
  rng = np.random.default_rng(4)
  for n, itemsize in ((1, 2), (17, 2), (4096, 2), (1001, 4), (13, 1)):
    dt = {1: np.uint8, 2: np.uint16, 4: np.uint32}[itemsize]
    old = rng.integers(0, 200, n).astype(dt)
    new = np.where(rng.random(n) < 0.1, old + 1, old).astype(dt)
    np.testing.assert_array_equal(codecs.changed_positions(old, new), np.flatnonzero(old != new))


def test_bad_inputs_have_clear_errors():
  with pytest.raises(ValueError, match="itemsize"):
    codecs.bits_view(np.zeros(3, np.float64))
  with pytest.raises(ValueError, match="parent"):
    codecs.get("rice").encode(np.zeros(3, np.uint16), None)
  with pytest.raises(KeyError, match="unknown codec"):
    codecs.get("nope")
  with pytest.raises(ValueError, match="does not fit"):
    codecs.apply_patch(codecs.Patch("xor", None, np.zeros(3, np.uint16), 3),
                       np.zeros(4, np.uint16))

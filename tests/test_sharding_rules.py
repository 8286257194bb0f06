"""The logical-axis rules table and its decode variant (on a 1-device mesh)."""

import jax
from jax.sharding import PartitionSpec as P
import pytest

from rljax import sharding as sharding_lib
from rljax.model import ModelConfig, logical_axes
from tests.shapes import TINY


class _FakeMesh:
  """Just enough of a Mesh for `Sharding.spec` (axis sizes), to check the table's logic."""
  shape = {"data": 2, "fsdp": 4, "expert": 8, "model": 2}


def _spec(rules, logical, **kw):
  return sharding_lib.Sharding(_FakeMesh(), rules).spec(logical, **kw)


def test_training_rules_map_roles_to_mesh_axes():
  assert _spec(sharding_lib.RULES, ("embed", "expert", "mlp")) == P("fsdp", "expert", "model")
  assert _spec(sharding_lib.RULES, ("batch", "length", None)) == P(("data", "fsdp", "expert"),
                                                                    None, None)
  assert _spec(sharding_lib.RULES, ("vocab", "embed")) == P("model", "fsdp")
  # weights at use: fsdp gathered, everything else kept
  assert _spec(sharding_lib.RULES, ("embed", "expert", "mlp"), gathered=True) == P(
      None, "expert", "model")


def test_decode_rules_replicate_weights_over_fsdp():
  assert _spec(sharding_lib.DECODE_RULES, ("embed", "heads")) == P(None, "model")
  assert _spec(sharding_lib.DECODE_RULES, ("embed", "expert", "mlp")) == P(None, "expert", "model")
  assert dict(sharding_lib.DECODE_RULES)["batch"] == dict(sharding_lib.RULES)["batch"]


def test_every_param_axis_has_a_rule():
  cfg = ModelConfig(**TINY)
  s = sharding_lib.Sharding(_FakeMesh())
  for axes in jax.tree.leaves(logical_axes(cfg), is_leaf=lambda x: isinstance(x, tuple)):
    s.spec(axes)  # raises KeyError on a missing rule


def test_unknown_axes_and_bad_meshes_are_rejected():
  with pytest.raises(KeyError, match="no rule"):
    _spec(sharding_lib.RULES, ("embedding",))
  with pytest.raises(ValueError, match="unknown mesh axes"):
    sharding_lib.make_mesh({"tensor": 1})
  with pytest.raises(ValueError, match="needs"):
    sharding_lib.make_mesh({"data": 2})  # one CPU device here
  mesh = sharding_lib.make_mesh(None)
  assert dict(mesh.shape) == {"data": jax.device_count(), "fsdp": 1, "expert": 1, "model": 1}


def test_a_mesh_axis_shards_one_dimension_the_first_rule_claims_it():
  # flax's logical partitioning: rules are claimed in table order ("vocab" before "heads"),
  # and a mesh axis shards at most one dimension of an array
  assert _spec(sharding_lib.RULES, ("heads", "vocab")) == P(None, "model")
  assert _spec(sharding_lib.RULES, ("batch", "expert")) == P(("data", "fsdp", "expert"), None)

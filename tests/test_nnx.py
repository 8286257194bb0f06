"""The nnx view of the policy: the same params, the same function, the same bits."""

import chex
from flax import nnx
import jax
import numpy as np
import pytest

from rljax.model import forward, logical_axes
from rljax.model.nnx import Policy
from rljax.numerics import Numerics

DET = Numerics("deterministic")


def test_policy_module_is_forward_bitwise_and_carries_logical_axes(tiny_cfg, tiny_params):
  rng = np.random.default_rng(0)
  tokens = rng.integers(1, tiny_cfg.vocab_size, size=(2, 32)).astype(np.int32)
  positions = np.tile(np.arange(32, dtype=np.int32), (2, 1))
  targets = np.roll(tokens, -1, axis=1)

  @jax.jit
  def reference(params):
    out = forward(params, tokens, positions, cfg=tiny_cfg, numerics=DET)
    replayed = forward(params, tokens, positions, cfg=tiny_cfg, numerics=DET,
                       routing=out.routing, targets=targets)
    return out.logits, replayed.logprobs

  @nnx.jit
  def through_module(policy):
    out = policy(tokens, positions)
    return out.logits, policy(tokens, positions, routing=out.routing, targets=targets).logprobs

  policy = Policy(tiny_cfg, tiny_params, numerics=DET)
  chex.assert_trees_all_equal(policy.raw_params(), tiny_params)
  graphdef, state = nnx.split(policy)  # flax tooling round trip
  chex.assert_trees_all_equal(through_module(nnx.merge(graphdef, state)),
                              reference(tiny_params))
  specs = nnx.get_partition_spec(state)  # the metadata is each param's logical axes
  axes = jax.tree.leaves(logical_axes(tiny_cfg), is_leaf=lambda x: isinstance(x, tuple))
  assert [tuple(s) for s in jax.tree.leaves(specs)] == [tuple(a) for a in axes]


def test_policy_refuses_params_of_another_config(tiny_cfg, tiny_params):
  broken = dict(tiny_params)
  del broken["final_norm"]
  with pytest.raises(ValueError, match="do not have this config's tree"):
    Policy(tiny_cfg, broken)

"""The policy as a flax `nnx.Module`, for users of flax tooling (nnx.split/merge, nnx.jit,
nnx.state, checkpointing libraries that speak nnx).

A thin holder around the pure model: `Policy.__call__` is `forward` on the held params,
with the same arguments and the same bits. Every param is an `nnx.Param` whose
`out_sharding` metadata is its logical axes (`nnx.get_partition_spec(nnx.state(policy))`
gives them; `rljax.sharding.Sharding.tree_shardings` maps them to a mesh). The model
itself stays pure functions: trainer and engine keep calling `forward` on a params tree.
"""

from __future__ import annotations

from typing import Any

from flax import nnx
import jax

from rljax.model.config import ModelConfig
from rljax.model.params import logical_axes
from rljax.model.transformer import ForwardOutput, forward
from rljax.numerics import FAST, Numerics


def _is_axes(x: Any) -> bool:
  return isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)


class Policy(nnx.Module):
  """`Policy(cfg, params)`; `policy(tokens, positions, **forward_kwargs)` = `forward`."""

  def __init__(self, cfg: ModelConfig, params: Any, *, numerics: Numerics = FAST):
    self.cfg, self.numerics = cfg, numerics
    axes = logical_axes(cfg)
    if jax.tree.structure(axes, is_leaf=_is_axes) != jax.tree.structure(params):
      raise ValueError("params do not have this config's tree (rljax.model.param_specs)")
    # eager_sharding=False: the arrays keep the placement they came with
    self.params = nnx.data(jax.tree.map(
        lambda a, x: nnx.Param(x, out_sharding=a, eager_sharding=False), axes, params,
        is_leaf=_is_axes))

  def raw_params(self) -> Any:
    """The params tree of arrays that `forward` takes."""
    return jax.tree.map(lambda v: v.get_value(), self.params,
                        is_leaf=lambda v: isinstance(v, nnx.Variable))

  def __call__(self, tokens: jax.Array, positions: jax.Array, **kwargs) -> ForwardOutput:
    return forward(self.raw_params(), tokens, positions, cfg=self.cfg, numerics=self.numerics,
                   **kwargs)

"""The functional MoE policy: params are a pytree, the model is pure functions."""

from rljax.model.attention import PagedKV
from rljax.model.config import ModelConfig
from rljax.model.params import (abstract_params, active_params, count_params, init_params,
                                init_sharded, logical_axes, param_shardings, param_specs)
from rljax.model.transformer import ForwardOutput, forward, token_logprobs

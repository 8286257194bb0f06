"""Token sampling inside the jitted decode step.

Per-slot parameters are arrays, so changing them never recompiles. The PRNG key of a
token is derived from (seed, request id, sample index, position) only, so a request's
tokens do not depend on its batch slot or its companions.

The recorded behaviour log-prob is that of the sampled token under the distribution it
was actually drawn from: logits / temperature, truncated by top-k and top-p and
renormalised. With temperature 1 and no truncation that is `log_softmax(logits)[token]`
computed by the same `Numerics` as the trainer's forward, so the two are the same bits in
deterministic mode. Greedy slots (temperature 0) record the temperature-1 log-prob.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from rljax.numerics import Numerics

NEG_INF = -jnp.inf


def token_keys(seed: jax.Array, request_id: jax.Array, sample_index: jax.Array,
               position: jax.Array) -> jax.Array:
  """[S] keys from [S] int arrays."""
  def one(s, r, i, p):
    k = jax.random.key(s)
    for x in (r, i, p):
      k = jax.random.fold_in(k, x)
    return k
  return jax.vmap(one)(seed, request_id, sample_index, position)


def sample(logits: jax.Array, keys: jax.Array, temperature: jax.Array, top_k: jax.Array,
           top_p: jax.Array, numerics: Numerics) -> tuple[jax.Array, jax.Array]:
  """logits [S, V] f32 -> (tokens [S] int32, behaviour log-probs [S] f32).

  temperature [S] (0 = greedy), top_k [S] (0 = off), top_p [S] (1 = off).
  """
  greedy = temperature <= 0
  t = jnp.where(greedy, 1.0, temperature)[:, None]
  logp = numerics.log_softmax(logits / t)  # the policy at this temperature
  truncates = ~greedy & ((top_k > 0) | (top_p < 1.0))
  # sorting the vocabulary is the costly part on CPU: only a batch that truncates pays it;
  # an all-greedy batch draws nothing (its tokens are the argmax either way)
  branch = jnp.where(jnp.any(truncates), 2, jnp.where(jnp.all(greedy), 0, 1))
  return jax.lax.switch(branch, (_sample_greedy, _sample_full, functools.partial(
      _sample_truncated, numerics=numerics)), logp, keys, greedy, top_k, top_p)


def first_argmax(x: jax.Array) -> jax.Array:
  """`jnp.argmax(x, axis=-1)` as int32 (the first maximum; the first NaN if any) by two
  plain reductions: XLA:CPU's two-operand (value, index) reduce took 73 us on [256, 128]
  logits, these 24 (AMD EPYC, 2 cores)."""
  top = jnp.max(x, axis=-1, keepdims=True)
  index = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
  return jnp.min(jnp.where((x == top) | jnp.isnan(x), index, x.shape[-1]), axis=-1)


def _sample_greedy(logp, keys, greedy, top_k, top_p):
  del keys, greedy, top_k, top_p
  tokens = first_argmax(logp)
  return tokens, jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]


def _sample_full(logp, keys, greedy, top_k, top_p):
  del top_k, top_p
  drawn = jax.vmap(jax.random.categorical)(keys, logp)
  tokens = jnp.where(greedy, first_argmax(logp), drawn).astype(jnp.int32)
  return tokens, jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]


def _sample_truncated(logp, keys, greedy, top_k, top_p, *, numerics):
  v = logp.shape[-1]
  order = jnp.argsort(-logp, axis=-1, stable=True)
  sorted_logp = jnp.take_along_axis(logp, order, axis=-1)
  rank = jnp.arange(v)[None, :]
  keep_sorted = (top_k[:, None] <= 0) | (rank < top_k[:, None])
  # top-p: keep the smallest prefix whose mass reaches top_p (the first token always).
  # top_p >= 1 is off outright: a rounded cumsum can pass 1.0 before the last tokens, and
  # dropping them would renormalise the behaviour log-prob away from the trainer's.
  mass_before = jnp.cumsum(numerics.exp(sorted_logp), axis=-1) - numerics.exp(sorted_logp)
  keep_sorted &= (top_p[:, None] >= 1.0) | (mass_before < top_p[:, None]) | (rank == 0)
  keep = jnp.zeros_like(keep_sorted).at[jnp.arange(len(order))[:, None], order].set(keep_sorted)
  truncated = jnp.where(keep, logp, NEG_INF)
  drawn = jax.vmap(jax.random.categorical)(keys, truncated)
  tokens = jnp.where(greedy, first_argmax(logp), drawn).astype(jnp.int32)
  chosen = jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
  full = jnp.all(keep, axis=-1) | greedy
  kept_mass = numerics.sum(jnp.where(keep, numerics.exp(logp), 0.0))
  behaviour = jnp.where(full, chosen, chosen - numerics.log(kept_mass))
  return tokens, behaviour

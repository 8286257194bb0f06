"""`forward`: the one model function, for training, scoring, prefill and decode."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import paged_attention as decode_kernel
from rljax import block_attention
from rljax import sharding as sharding_lib
from rljax.model import attention, moe
from rljax.model.config import ModelConfig
from rljax.numerics import FAST, Numerics, round_to

ACT = ("batch", "length", None)  # activations: batch-sharded, features replicated


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ForwardOutput:
  logits: jax.Array | None  # [B, T, V] f32, unless targets were given
  logprobs: jax.Array | None  # [B, T] f32 log p(targets), when targets were given
  routing: jax.Array | None  # [B, T, num_moe_layers, k] int32 chosen expert ids
  kv: attention.PagedKV | None  # the updated cache, when one was given
  # [B, T] f32 entropy of softmax(logits / temperature) per position, when asked for
  entropy: jax.Array | None = None


def rms_norm(x: jax.Array, scale: jax.Array, eps: float, numerics: Numerics) -> jax.Array:
  """RMSNorm over the last axis, statistics in f32 (as Hugging Face Qwen3)."""
  xf = x.astype(jnp.float32)
  mean_sq = numerics.sum(xf * xf) * (1.0 / x.shape[-1])
  y = (xf * lax.rsqrt(mean_sq + eps)[..., None]).astype(x.dtype)
  # HF multiplies in the model dtype; a bf16 x bf16 product is exact in f32, so doing it
  # in f32 and rounding once gives the same bits, and an f32 gradient for the scale. An
  # f32 master scale is rounded to the model dtype first: the serving params' bits.
  scale = round_to(scale.astype(jnp.float32), x.dtype)
  return (y.astype(jnp.float32) * scale).astype(x.dtype)


@functools.lru_cache(maxsize=8)
def rope_table(max_len: int, head_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
  """cos, sin [max_len, head_dim // 2] (f32 angles as Hugging Face computes them)."""
  inv_freq = (1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32)
                               / head_dim))).astype(np.float32)
  angles = np.arange(max_len, dtype=np.float32)[:, None] * inv_freq[None, :]
  return np.cos(angles.astype(np.float64)).astype(np.float32), np.sin(
      angles.astype(np.float64)).astype(np.float32)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """x [B, T, heads, D]; cos/sin [B, T, D/2]; rotate-half convention."""
  half = x.shape[-1] // 2
  xf = x.astype(jnp.float32)
  x1, x2 = xf[..., :half], xf[..., half:]
  c, s = cos[:, :, None, :], sin[:, :, None, :]
  return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


def _weight(sharding, w, axes):
  return sharding_lib.constrain(sharding, w, axes, gathered=True)


def _attention_block(p, x, cos, sin, layer_kv, ctx):
  cfg, numerics, sharding = ctx["cfg"], ctx["numerics"], ctx["sharding"]
  b, t, _ = x.shape
  hd, h, hkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
  dt = cfg.compute_dtype

  def project(name, axes, heads):
    y = numerics.matmul(x, _weight(sharding, p[name], axes)).astype(dt)
    return y.reshape(b, t, heads, hd)

  q = project("q", ("embed", "heads"), h)
  k = project("k", ("embed", "kv_heads"), hkv)
  v = project("v", ("embed", "kv_heads"), hkv)
  q = apply_rope(rms_norm(q, p["q_norm"], cfg.rms_norm_eps, numerics), cos, sin)
  k = apply_rope(rms_norm(k, p["k_norm"], cfg.rms_norm_eps, numerics), cos, sin)

  if layer_kv is None:  # training: the row's own keys, identity page table
    n = -(-t // cfg.page_size) * cfg.page_size
    pad = ((0, 0), (0, n - t), (0, 0), (0, 0))
    keys, values = jnp.pad(k, pad), jnp.pad(v, pad)
    q_index = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    segs = ctx["segment_ids"]
    kv_segs = None if segs is None else jnp.pad(segs, ((0, 0), (0, n - t)), constant_values=-1)
    new_pools = None
  else:  # engine: write this step's keys into the pages, then read the row's blocks
    k_pool, v_pool, table, layer = layer_kv  # all layers' pools, updated in place
    k_pool = attention.write_pages(k_pool, k, table, ctx["positions"], layer)
    v_pool = attention.write_pages(v_pool, v, table, ctx["positions"], layer)
    q_index = ctx["positions"]
    new_pools = (k_pool, v_pool)

  per_kv_head = sharding is None or sharding.axis_size("model") == 1  # heads not split
  det_kernel = numerics.deterministic and cfg.det_attention != "jnp"
  on_mesh = sharding is not None and sharding.mesh.size > 1
  if det_kernel and layer_kv is not None and not on_mesh:  # the kernel reads the pages
    out = attention.attend_paged_det_kernel(q, *new_pools, table, q_index, layer=layer,
                                            dtype=dt, scale=hd ** -0.5,
                                            kernel=cfg.det_attention)
  elif det_kernel and layer_kv is not None:  # a slot's pages may be on other devices
    out = attention.attend_paged(q, *new_pools, table, q_index, layer=layer, dtype=dt,
                                 numerics=numerics, scale=hd ** -0.5,
                                 kernel=cfg.det_attention, sharding=sharding)
  elif det_kernel:
    out = attention.attend_det_kernel(q, keys, values, q_index, segs, kv_segs,
                                      cfg.page_size, hd ** -0.5, cfg.det_attention, sharding)
  elif layer_kv is not None and t == 1 and cfg.decode_attention != "reference":
    lengths = jnp.maximum(ctx["positions"][:, 0] + 1, 0)
    k_layer, v_layer = (block_attention.as_values(pool[layer], dt) for pool in new_pools)
    out = decode_kernel.paged_attention(q[:, 0], k_layer, v_layer, table, lengths,
                                 scale=hd ** -0.5,
                                 interpret=cfg.decode_attention == "pallas_interpret")[:, None]
  elif layer_kv is not None:
    out = attention.attend_paged(q, *new_pools, table, q_index, layer=layer, dtype=dt,
                                 numerics=numerics, scale=hd ** -0.5,
                                 per_kv_head=per_kv_head)
  else:
    out = block_attention.attend(q, keys, values, q_index, page_size=cfg.page_size,
                                 numerics=numerics, scale=hd ** -0.5, q_segments=segs,
                                 kv_segments=kv_segs, per_kv_head=per_kv_head)
  out = numerics.matmul(out.reshape(b, t, h * hd), _weight(sharding, p["o"], ("heads", "embed")))
  return out.astype(dt), new_pools


def _mlp_block(p, x, ctx):
  cfg, numerics, sharding = ctx["cfg"], ctx["numerics"], ctx["sharding"]
  dt = cfg.compute_dtype
  g = numerics.matmul(x, _weight(sharding, p["gate"], ("embed", "mlp"))).astype(dt)
  u = numerics.matmul(x, _weight(sharding, p["up"], ("embed", "mlp"))).astype(dt)
  hidden = numerics.silu(g).astype(dt) * u
  return numerics.matmul(hidden, _weight(sharding, p["down"], ("mlp", "embed"))).astype(dt)


def _layer(p, x, cos, sin, layer_kv, replay, ctx):
  cfg = ctx["cfg"]
  sharding = ctx["sharding"]
  h = rms_norm(x, p["attn_norm"]["scale"], cfg.rms_norm_eps, ctx["numerics"])
  attn_out, new_pools = _attention_block(p["attn"], h, cos, sin, layer_kv, ctx)
  x = sharding_lib.constrain(sharding, x + attn_out, ACT)
  h = rms_norm(x, p["mlp_norm"]["scale"], cfg.rms_norm_eps, ctx["numerics"])
  ids = None
  if "moe" in p:
    b, t, d = h.shape
    y, ids = moe.moe_block(h.reshape(b * t, d), p["moe"], top_k=cfg.num_experts_per_tok,
                           norm_topk_prob=cfg.norm_topk_prob, numerics=ctx["numerics"],
                           sharding=sharding,
                           replay=None if replay is None else replay.reshape(b * t, -1),
                           path=cfg.train_experts if layer_kv is None else cfg.engine_experts,
                           row_tile=cfg.expert_row_tile, kernel=cfg.expert_kernel)
    y, ids = y.reshape(b, t, d), ids.reshape(b, t, -1)
  else:
    y = _mlp_block(p["mlp"], h, ctx)
  x = sharding_lib.constrain(sharding, x + y, ACT)
  return x, ids, new_pools


def forward(params: dict[str, Any], tokens: jax.Array, positions: jax.Array, *,
            cfg: ModelConfig, numerics: Numerics = FAST,
            segment_ids: jax.Array | None = None, kv: attention.PagedKV | None = None,
            routing: jax.Array | None = None, targets: jax.Array | None = None,
            temperature: float = 1.0, entropy: bool = False,
            logits_at: jax.Array | None = None,
            sharding: sharding_lib.Sharding | None = None) -> ForwardOutput:
  """The model, for every caller.

  tokens, positions: [B, T] int32. Training and scoring (kv=None) take packed rows:
  `segment_ids` [B, T] (tokens attend within their segment; 0 may mark padding) and
  every segment must start at a multiple of `cfg.page_size` in its row, with positions
  counting from 0 there. The engine passes `kv` (a PagedKV for all layers) and the
  absolute positions of the new tokens (-1 for padding); their K/V are written into the
  pages and the updated cache is returned.

  routing: [B, T, num_moe_layers, k] expert ids to replay instead of the router's top-k.
  cfg must be resolved (`cfg.resolved(backend, numerics)`: no "auto" backend choice).
  targets: [B, T] token ids; when given, returns their log-probs under logits / temperature
  (the engine's sampling temperature) instead of logits.
  entropy: also return the per-position entropy [B, T] of softmax(logits / temperature)
  (`ForwardOutput.entropy`, f32), from the same f32 log-softmax the log-probs are taken
  from (the numerics' exp and sum): one more elementwise pass over [B, T, V], and the
  log-probs' bits do not change (tested bitwise).
  logits_at: [B] int32, one column per row: only those positions go through the final norm
  and the head (logits [B, 1, V]; a prefill needs its last token's: the head over every
  position of 64 rows x 4,096 tokens of a 152k vocabulary would be 160 GB of f32). Each
  position's norm and row of the head are computed alone, so deterministic numerics gives
  the bits the whole row's logits have there, on a mesh too (tested).
  """
  cfg.check_resolved()
  dt = cfg.compute_dtype
  ctx = {"cfg": cfg, "numerics": numerics, "sharding": sharding, "positions": positions,
         "segment_ids": segment_ids}
  table = jnp.take(params["embed"]["embedding"], tokens, axis=0).astype(dt)
  x = sharding_lib.constrain(sharding, table, ACT)
  cos_table, sin_table = rope_table(cfg.max_position_embeddings, cfg.head_dim, cfg.rope_theta)
  pos = jnp.clip(positions, 0, cfg.max_position_embeddings - 1)
  cos, sin = jnp.asarray(cos_table)[pos], jnp.asarray(sin_table)[pos]

  pools = None if kv is None else (kv.k, kv.v)
  layers_fn = _scanned_layers if cfg.scan_layers else _unrolled_layers
  x, pools, routes = layers_fn(params["layers"], x, cos, sin, pools,
                               None if kv is None else kv.page_table, routing, ctx)

  if logits_at is not None:
    # deterministic numerics: a whole row tile per row (the position, then zeros), so on a
    # mesh every device's head dot keeps the tile shape it has in training
    x = jnp.take_along_axis(x, logits_at[:, None, None], axis=1)
    x = jnp.pad(x, ((0, 0), (0, numerics.pad_rows(1) - 1), (0, 0)))
    x = sharding_lib.constrain(sharding, x, ACT)
  x = rms_norm(x, params["final_norm"]["scale"], cfg.rms_norm_eps, numerics)
  head = (params["embed"]["embedding"].T if cfg.tie_word_embeddings
          else params["lm_head"]["kernel"])
  logits = numerics.matmul(x, _weight(sharding, head, ("embed", "vocab")))
  if logits_at is not None:
    logits = logits[:, :1]
  logprobs = ent = None
  if targets is not None or entropy:
    logp = numerics.log_softmax(logits / temperature)
    if entropy:
      ent = token_entropy(logp, numerics)
    if targets is not None:
      logprobs = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
      logits = None
  new_kv = None if kv is None else attention.PagedKV(*pools, kv.page_table)
  return ForwardOutput(logits=logits, logprobs=logprobs, routing=routes, kv=new_kv,
                       entropy=ent)


def token_entropy(logp: jax.Array, numerics: Numerics = FAST) -> jax.Array:
  """-sum_v p_v log p_v over the last axis of f32 log-probs [..., V] (a -inf log-prob,
  p = 0, adds nothing)."""
  finite = jnp.isfinite(logp)
  logp = jnp.where(finite, logp, 0.0)
  return -numerics.sum(jnp.where(finite, numerics.exp(logp) * logp, 0.0))


def _scanned_layers(stacks, x, cos, sin, pools, page_table, routing, ctx):
  """The layers as one `lax.scan` per run of same-kind layers (`cfg.layer_runs()`), in
  layer order. The carry is (x, pools): the engine's KV pools [L, ...] are written in
  place at the traced layer index. Returns (x, pools, routing [B, T, num_moe_layers, k]
  or None)."""
  routes = []
  for kind, first, start, n in ctx["cfg"].layer_runs():
    stack = stacks[kind]
    if jax.tree.leaves(stack)[0].shape[0] != n:  # a run of a mixed model: its slice
      stack = jax.tree.map(lambda w: w[start:start + n], stack)
    replay = None
    if routing is not None and kind == "moe":
      replay = jnp.moveaxis(routing[:, :, start:start + n], 2, 0)  # [n, B, T, k]

    def body(carry, xs):
      x, pools = carry
      p, layer, replay = xs
      layer_kv = None if pools is None else (*pools, page_table, layer)
      x, ids, new_pools = _run_layer(p, x, cos, sin, layer_kv, replay, ctx)
      return (x, pools if new_pools is None else new_pools), ids

    layers = jnp.arange(first, first + n, dtype=jnp.int32)
    (x, pools), ids = lax.scan(body, (x, pools), (stack, layers, replay))
    if ids is not None:
      routes.append(ids)  # [n, B, T, k]
  routing_out = jnp.moveaxis(jnp.concatenate(routes), 0, 2) if routes else None
  return x, pools, routing_out


def _unrolled_layers(stacks, x, cos, sin, pools, page_table, routing, ctx):
  """The same layers as `_scanned_layers`, one Python iteration each (static layer
  index): the reference the scan is tested against, bitwise."""
  cfg = ctx["cfg"]
  routes = []
  for i in range(cfg.num_hidden_layers):
    kind, j = cfg.layer_kind(i)
    p = jax.tree.map(lambda w, j=j: w[j], stacks[kind])
    replay = routing[:, :, j] if routing is not None and kind == "moe" else None
    layer_kv = None if pools is None else (*pools, page_table, i)
    x, ids, new_pools = _run_layer(p, x, cos, sin, layer_kv, replay, ctx)
    if ids is not None:
      routes.append(ids)
    if new_pools is not None:
      pools = new_pools
  return x, pools, jnp.stack(routes, axis=2) if routes else None


def _run_layer(p, x, cos, sin, layer_kv, replay, ctx):
  if not ctx["cfg"].remat:
    return _layer(p, x, cos, sin, layer_kv, replay, ctx)
  # ctx mixes static config with arrays: close over it rather than pass it through remat
  return jax.checkpoint(lambda *args: _layer(*args, layer_kv, replay, ctx))(p, x, cos, sin)


def token_logprobs(params, tokens, positions, targets, **kwargs) -> jax.Array:
  """Per-token log p(targets) [B, T] f32: the quantity trainer and engine must agree on."""
  return forward(params, tokens, positions, targets=targets, **kwargs).logprobs

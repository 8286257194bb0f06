"""Scanned layers (one `lax.scan` per run of same-kind layers) are the unrolled layer loop:
the same bits in deterministic mode, for the training forward (with and without router
replay) and for paged prefill + decode steps, on a mixed dense/MoE config (tiny: layer 0
dense, 1-2 MoE) and on a uniform MoE one; plus the stacked param layout."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax.model import config as config_lib
from rljax.model import ModelConfig, PagedKV, forward, init_params
from rljax.model.packing import pack
from rljax.model.params import cast, layer_params, param_specs, scale_matrices
from rljax.numerics import Numerics

from tests.shapes import TINY

DET = Numerics("deterministic")


def _configs(tiny_cfg):
  mixed = tiny_cfg  # runs: dense [0], moe [1, 2]
  uniform = dataclasses.replace(tiny_cfg, mlp_only_layers=(), num_hidden_layers=3)
  # dense, moe, dense, moe: a run per layer, and stack slices in the middle of each stack
  alternating = dataclasses.replace(tiny_cfg, mlp_only_layers=(), decoder_sparse_step=2,
                                    num_hidden_layers=4)
  return {"mixed": mixed, "uniform": uniform, "alternating": alternating}


def _params(cfg):
  # large weights: sharp routing and attention, so a one-ulp difference would show
  return cast(scale_matrices(init_params(cfg, jax.random.key(1), "float32"), 10.0), "bfloat16")


def _both(cfg, fn):
  """fn(cfg) with scanned layers and with the unrolled loop; checks the scan is used."""
  return fn(dataclasses.replace(cfg, scan_layers=True)), fn(
      dataclasses.replace(cfg, scan_layers=False))


@pytest.mark.parametrize("name", ["mixed", "uniform", "alternating"])
def test_scanned_training_forward_equals_unrolled(tiny_cfg, name):
  cfg = _configs(tiny_cfg)[name]
  params = _params(cfg)
  rng = np.random.default_rng(0)
  seqs = [rng.integers(1, cfg.vocab_size, size=n).astype(np.int32) for n in (37, 20, 9, 30)]
  p = pack(seqs, 64, cfg.page_size)
  targets = np.roll(p.tokens, -1, axis=1)

  def run(c, routing=None):
    return jax.jit(lambda prm: forward(prm, p.tokens, p.positions, cfg=c, numerics=DET,
                                       segment_ids=p.segment_ids, targets=targets,
                                       routing=routing))(params)

  scanned, unrolled = _both(cfg, run)
  assert scanned.routing.shape == p.tokens.shape + (len(cfg.moe_layers()),
                                                    cfg.num_experts_per_tok)
  chex.assert_trees_all_equal(scanned.logprobs, unrolled.logprobs)
  chex.assert_trees_all_equal(scanned.routing, unrolled.routing)
  # replaying other routing (rolled over layers and experts) goes to the same layers
  other = (jnp.roll(scanned.routing, 1, axis=2) + 1) % cfg.num_experts
  replay_scanned, replay_unrolled = _both(cfg, lambda c: run(c, other))
  chex.assert_trees_all_equal(replay_scanned.routing, other)
  chex.assert_trees_all_equal(replay_scanned.logprobs, replay_unrolled.logprobs)
  assert not np.array_equal(replay_scanned.logprobs, scanned.logprobs)


@pytest.mark.parametrize("name", ["mixed", "uniform"])
def test_scanned_paged_prefill_and_decode_equal_unrolled(tiny_cfg, name):
  cfg = _configs(tiny_cfg)[name]
  params = _params(cfg)
  rng = np.random.default_rng(1)
  tokens = rng.integers(1, cfg.vocab_size, size=(2, 22)).astype(np.int32)
  tables = jnp.asarray([[5, 2], [1, 7]], jnp.int32)
  shape = (cfg.num_hidden_layers, 8, cfg.page_size, cfg.num_key_value_heads, cfg.head_dim)
  raw = jnp.uint16  # the engine keeps its pools as raw bits

  def run(c):
    kv = PagedKV(jnp.zeros(shape, raw), jnp.zeros(shape, raw), tables)
    step = jax.jit(lambda prm, t, pos, kv: forward(prm, t, pos, cfg=c, numerics=DET, kv=kv,
                                                   targets=jnp.roll(t, -1, axis=1)))
    outs = []
    for lo, hi in [(0, 19)] + [(i, i + 1) for i in range(19, 22)]:  # prefill, 3 decode steps
      pos = np.broadcast_to(np.arange(lo, hi, dtype=np.int32), (2, hi - lo))
      res = step(params, tokens[:, lo:hi], pos, kv)
      kv = res.kv
      outs.append((res.logprobs, res.routing))
    return outs, kv

  (scanned, kv_s), (unrolled, kv_u) = _both(cfg, run)
  chex.assert_trees_all_equal(scanned, unrolled)
  chex.assert_trees_all_equal(kv_s, kv_u)  # every layer's pages written alike
  assert np.any(np.asarray(kv_s.k[-1]) != 0)


def test_stacked_layout(tiny_cfg):
  tiny_cfg = dataclasses.replace(tiny_cfg, num_hidden_layers=3)  # two MoE layers to stack
  specs = param_specs(tiny_cfg)
  assert set(specs["layers"]) == {"dense", "moe"}
  gate = specs["layers"]["moe"]["moe"]["gate"]
  assert gate.shape[0] == 2 and gate.axes[0] == "layers" and gate.stack_layers == (1, 2)
  assert specs["layers"]["dense"]["mlp"]["down"].stack_layers == (0,)
  params = init_params(tiny_cfg, jax.random.key(0))
  np.testing.assert_array_equal(layer_params(tiny_cfg, params, 2)["moe"]["router"],
                                params["layers"]["moe"]["moe"]["router"][1])
  assert tiny_cfg.layer_runs() == (("dense", 0, 0, 1), ("moe", 1, 0, 2))
  uniform = dataclasses.replace(tiny_cfg, mlp_only_layers=(), num_hidden_layers=48)
  assert uniform.layer_runs() == (("moe", 0, 0, 48),)


def test_uniform_model_lowers_to_one_scan_whatever_its_depth(tiny_cfg):
  # the lowered program does not grow with depth: one while loop for all the layers
  # (depths of one digit each, so the shapes in the text have the same length)
  def text(n):
    cfg = dataclasses.replace(tiny_cfg, mlp_only_layers=(), num_hidden_layers=n)
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    tokens = jax.ShapeDtypeStruct((1, 16), jnp.int32)
    return jax.jit(lambda p, t: forward(p, t, t, cfg=cfg, numerics=DET).logits).lower(
        params, tokens).as_text()

  assert len(text(3)) == len(text(9))


def test_forward_refuses_an_unresolved_config(tiny_cfg):
  params = init_params(tiny_cfg, jax.random.key(0))
  tokens = jnp.zeros((1, 16), jnp.int32)
  for field in ("decode_attention", "det_attention", "expert_kernel"):
    raw = dataclasses.replace(tiny_cfg, **{field: "auto"})
    with pytest.raises(ValueError, match=f"{field} is 'auto'"):
      forward(params, tokens, tokens, cfg=raw)


@pytest.mark.parametrize("backend,numerics,attention,train_experts,engine_experts,kernels", [
    ("cpu", "fast", "reference", "tiled", "by_tokens", "jnp"),
    ("cpu", "deterministic", "reference", "tiled", "tiled", "jnp"),
    ("gpu", "fast", "pallas", "ragged", "ragged", "jnp"),
    ("cuda", "deterministic", "reference", "tiled", "tiled", "jnp"),
    ("tpu", "fast", "reference", "ragged", "ragged", "pallas_tpu"),
    ("tpu", "deterministic", "reference", "tiled", "tiled", "pallas_tpu")])
def test_resolved_makes_todays_choices(backend, numerics, attention, train_experts,
                                       engine_experts, kernels):
  cfg = ModelConfig(**TINY).resolved(backend, Numerics(numerics))
  assert (cfg.decode_attention, cfg.train_experts, cfg.engine_experts) == (
      attention, train_experts, engine_experts)
  # the kernels: the expert kernel on TPU (fast mode: the ragged path's weight gradients);
  # deterministic attention's in det mode on TPU, where Mosaic takes the blocks (TINY's
  # head_dim of 16 it does not; a head_dim of 128 it does)
  assert (cfg.det_attention, cfg.expert_kernel) == ("jnp", kernels)
  wide = ModelConfig(**{**TINY, "head_dim": 128}).resolved(backend, Numerics(numerics))
  det_tpu = backend == "tpu" and numerics == "deterministic"
  assert wide.det_attention == ("pallas_tpu" if det_tpu else "jnp")
  kept = ModelConfig(**TINY, decode_attention="pallas_interpret", train_experts="tiled",
                     engine_experts="ragged", dtype="float32", det_attention="jnp",
                     expert_kernel="pallas_interpret")
  assert kept.resolved(backend, numerics) == kept
  # deterministic: the dense path's bits are not the tiles', so both forwards or neither
  mixed = ModelConfig(**TINY, train_experts="dense", engine_experts="ragged")
  if numerics == "deterministic":
    with pytest.raises(ValueError, match="both be 'dense' or neither"):
      mixed.resolved(backend, numerics)
  else:
    assert mixed.resolved(backend, numerics).engine_experts == "ragged"
  with pytest.raises(ValueError, match="backend"):
    cfg.resolved("metal", numerics)


@pytest.mark.parametrize("native_bf16", [True, False])
def test_auto_dtype_is_bf16_but_f32_for_fast_mode_on_a_cpu_without_bf16_dots(
    monkeypatch, native_bf16):
  monkeypatch.setattr(config_lib, "cpu_has_native_bf16", lambda: native_bf16)
  fast_cpu = "bfloat16" if native_bf16 else "float32"
  for backend, mode, want in [("cpu", "fast", fast_cpu), ("cpu", "deterministic", "bfloat16"),
                              ("gpu", "fast", "bfloat16"), ("tpu", "fast", "bfloat16")]:
    assert ModelConfig(**TINY).resolved(backend, mode).dtype == want, (backend, mode)
  with pytest.raises(ValueError, match="resolve"):
    ModelConfig(**TINY).compute_dtype  # pylint: disable=expression-not-assigned

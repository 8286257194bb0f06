"""Every config loads, builds its model config, and has a tiny variant that runs."""

import importlib
import inspect
import pathlib
import re

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from configs import arith_tiny
from rljax.model import ModelConfig, abstract_params, active_params, count_params, forward
from rljax.model.params import init_params
from rljax.pipeline import async_loop, core, lockstep
from rljax.pipeline.run import (ASYNC_TRAINER, BLOCKS, MODEL_ONLY, RECIPE_DEFAULTS,
                                ConfigError, block_optimizer, build, lr_schedule,
                                validate)
from rljax.rl import learner

CONFIG_DIR = pathlib.Path(__file__).parent.parent / "configs"
CONFIGS = sorted(p.stem for p in CONFIG_DIR.glob("*.py") if p.stem != "__init__")


def _load(name, variant=None):
  module = importlib.import_module(f"configs.{name}")
  if variant is not None and "variant" in inspect.signature(module.get_config).parameters:
    return module.get_config(variant)
  return module.get_config()


@pytest.mark.parametrize("name", CONFIGS)
def test_config_loads_and_builds(name):
  cfg = _load(name)
  model = ModelConfig.from_dict(cfg.model.to_dict())
  assert count_params(abstract_params(model)) > 0
  assert cfg.numerics in ("fast", "deterministic")


@pytest.mark.parametrize("name", CONFIGS)
def test_tiny_variant_runs_a_forward(name):
  cfg = _load(name, "tiny")
  if cfg.get("init_from"):  # the architecture is a checkpoint's: its random-init twin's
    cfg = _load(name, "tiny_random")
  model = ModelConfig.from_dict(cfg.model.to_dict()).resolved(jax.default_backend(),
                                                              cfg.numerics)
  assert count_params(abstract_params(model)) < 5_000_000, "tiny variants must fit a laptop"
  params = init_params(model, jax.random.key(0))
  tokens = np.ones((1, 16), np.int32)
  out = forward(params, tokens, np.arange(16, dtype=np.int32)[None], cfg=model)
  assert np.all(np.isfinite(np.asarray(out.logits)))


def test_qwen3_30b_a3b_parameter_counts():
  """Model card: 30.5B total, 3.3B activated, 29.9B non-embedding.

  The card gives one decimal and truncates: the exact active count (embedding, LM head,
  attention, routers and 8 of 128 experts per layer) is 3.353B, i.e. "3.3B", 1.6% above
  3.3e9. The total is within 1%; the active count is checked against the card's own
  rounding and pinned exactly as a golden value.
  """
  model = ModelConfig.from_dict(_load("qwen3_30b_a3b").model.to_dict())
  total = count_params(abstract_params(model))
  active = active_params(model)
  embed = 2 * model.vocab_size * model.hidden_size
  assert abs(total / 30.5e9 - 1) < 0.01, total
  assert abs((total - embed) / 29.9e9 - 1) < 0.01, total - embed
  assert 3.3e9 <= active < 3.4e9, active
  assert (total, active) == (30_532_122_624, 3_353_032_704)


def test_qwen3_235b_a22b_parameter_counts():
  """Model card: 235B total, 22B activated (pinned exactly as golden values)."""
  model = ModelConfig.from_dict(_load("qwen3_235b_a22b").model.to_dict())
  total = count_params(abstract_params(model))
  active = active_params(model)
  assert abs(total / 235e9 - 1) < 0.01, total
  assert 22e9 <= active < 23e9, active
  assert (total, active) == (235_093_634_560, 22_190_763_520)


def test_unknown_model_key_is_rejected():
  with pytest.raises(ValueError, match="unknown model config keys"):
    ModelConfig.from_dict({**_load("tiny_moe").model.to_dict(), "num_expert": 4})


def test_deterministic_tpu_runs_take_the_kernels():
  # "auto" for a TPU in deterministic mode: the grouped matmul kernel, on one device or per
  # device on a mesh; the attention kernel where Mosaic takes its blocks (arith_tiny's
  # head_dim of 16 it does not, 128 it does)
  config = arith_tiny.get_config()
  config.numerics = "deterministic"

  def kernels(config):
    cfg = build(config, MODEL_ONLY, devices=False, platform="tpu").cfg
    return cfg.det_attention, cfg.expert_kernel

  assert kernels(config) == ("jnp", "pallas_tpu")
  sharded = arith_tiny.get_config()
  sharded.numerics = "deterministic"
  sharded.mesh.fsdp = 2
  sharded.engine.mesh = ml_collections.ConfigDict({"expert": 2})
  assert kernels(sharded) == ("jnp", "pallas_tpu")  # per device on a mesh
  sharded.model.head_dim = 128
  assert kernels(sharded) == ("pallas_tpu", "pallas_tpu")
  config.model.det_attention = "pallas_tpu"
  config.model.expert_kernel = "jnp"
  assert kernels(config) == ("pallas_tpu", "jnp")


def test_build_names_a_missing_misspelled_or_short_block():
  config = arith_tiny.get_config()
  built = build(config, ASYNC_TRAINER)
  assert built.env.name == "arithmetic" and built.loss.tis and built.sampling.max_new_tokens == 6
  assert built.cfg.decode_attention != "auto"  # backend choices resolved once, here
  misspelled = arith_tiny.get_config()
  misspelled.async_lr = misspelled.async_rl
  with pytest.raises(ConfigError, match=r"unknown config block\(s\) \['async_lr'\]"):
    build(misspelled)
  missing = arith_tiny.get_config()
  del missing["async_rl"]
  build(missing)  # the lockstep loop does not need it
  with pytest.raises(ConfigError, match="no 'async_rl' block"):
    build(missing, ASYNC_TRAINER)
  short = arith_tiny.get_config()
  del short.rl["dynamic_sampling_rounds"]
  with pytest.raises(ConfigError, match=r"config.rl is missing \['dynamic_sampling_rounds'\]"):
    build(short)
  bad_loss = arith_tiny.get_config()
  bad_loss.rl.loss.aggregation = "mean"
  with pytest.raises(ConfigError, match="config.rl.loss: aggregation must be"):
    build(bad_loss)
  bad_mesh = arith_tiny.get_config()
  bad_mesh.mesh.tensor = 2
  with pytest.raises(ConfigError, match=r"config.mesh has unknown axes \['tensor'\]"):
    build(bad_mesh)
  bad_engine_mesh = arith_tiny.get_config()
  bad_engine_mesh.engine.mesh = {"tensor": 2}
  with pytest.raises(ConfigError, match=r"config.engine.mesh has unknown axes \['tensor'\]"):
    build(bad_engine_mesh)
  short_lora = arith_tiny.get_config()  # an optional block, checked for every caller
  short_lora.lora = {"rank": 8, "alpha": 16.0}
  with pytest.raises(ConfigError, match=r"config.lora is missing \['targets'\]"):
    build(short_lora, ("model", "mesh"))
  not_a_block = arith_tiny.get_config()
  not_a_block.lora = 8
  with pytest.raises(ConfigError, match=r"config.lora must be a block \(rank, alpha, targets\)"):
    build(not_a_block)
  big_engine_mesh = arith_tiny.get_config()
  big_engine_mesh.engine.mesh = {"expert": jax.local_device_count() + 1}
  with pytest.raises(ConfigError, match=r"config.engine.mesh .* needs \d+ devices, this "
                     "process has .*xla_force_host_platform_device_count"):
    build(big_engine_mesh).engine_sharding()
  small_vocab = arith_tiny.get_config()
  small_vocab.model.vocab_size = 8
  with pytest.raises(ConfigError, match="tokenizer has .* ids"):
    build(small_vocab)


# (field, bad value, the ConfigError's message): values that would otherwise fail a run
# only after its model is loaded (at the first update, evaluation or checkpoint)
BAD_VALUES = [
    ("rl.advantage", "ppo", r"config.rl.advantage must be one of \['grpo', 'drgrpo', 'rloo'\], "
     "not 'ppo'"),
    ("rl.group_size", 1, r"config.rl.group_size must be >= 2"),
    ("rl.overlong", "truncate", r"config.rl.overlong must be one of \['score', 'mask', "
     r"'drop'\] \(what training does with an episode cut by the context\), not 'truncate'"),
    ("rl.loss.kl_coef", -0.1, r"config.rl.loss.kl_coef must be >= 0"),
    ("rl.loss.entropy_coef", 0.01, r"config.rl.loss.entropy_coef must be 0"),
    ("rl.step_clip_norm", -1.0, r"config.rl.step_clip_norm must be a number >= 0 \(0 = off\), "
     "not -1.0"),
    ("rl.step_clip_norm", float("nan"), r"config.rl.step_clip_norm must be a number >= 0"),
    ("rl.microbatches", 0, r"config.rl.prompts_per_step and config.rl.microbatches must be >= 1"),
    ("rl.microbatches", 3, r"config.rl.microbatches=3 does not divide the 256 packed rows"),
    ("sft.microbatches", 3, r"config.sft.microbatches=3 does not divide the 64 packed rows"),
    ("train.row_len", 8, r"config.train.row_len: row_len 8 cannot hold a sequence of 16"),
    ("engine.max_seq_len", 80, r"config.engine.max_seq_len 80 exceeds the model's "
     "max_position_embeddings 64"),
    ("eval.k", 9, r"config.eval.k must be in \[1, config.eval.n\]"),
    ("async_rl.weight_update", "reload", r"config.async_rl.weight_update must be one of "
     r"\['keep', 'recompute'\], not 'reload'"),
    ("async_rl.checkpoint_every", 0, r"config.async_rl.checkpoint_every must be >= 1"),
    ("async_rl.max_staleness", -1, r"config.async_rl.max_staleness must be >= 0"),
    ("sft.warmup_steps", -1, r"config.sft.warmup_steps must be an int >= 0 \(0: the full "
     r"rate from the first update\), not -1"),
    ("rl.final_lr_frac", 1.5, r"config.rl.final_lr_frac must be a number in \[0, 1\], not 1.5"),
    ("sft.schedule_steps", -1, r"config.sft.schedule_steps must be an int >= 1 \(the cosine "
     r"horizon\), or 0 / None \(the block's steps\), not -1"),
    ("rl.schedule_steps", -5, r"config.rl.schedule_steps must be an int >= 1"),
    ("sft.adam_b1", 1.0, r"config.sft.adam_b1 must be a number in \[0, 1\), not 1.0"),
    ("rl.adam_b1", -0.1, r"config.rl.adam_b1 must be a number in \[0, 1\), not -0.1"),
    ("sft.adam_b2", 1.0, r"config.sft.adam_b2 must be a number in \[0, 1\), not 1.0"),
    ("rl.adam_b2", float("nan"), r"config.rl.adam_b2 must be a number in \[0, 1\), not nan"),
    ("sft.adam_eps", 0.0, r"config.sft.adam_eps must be a number > 0, not 0.0"),
    ("rl.adam_eps", -1e-8, r"config.rl.adam_eps must be a number > 0"),
    ("sft.clip_norm", 0.0, r"config.sft.clip_norm must be a number > 0, not 0.0"),
    ("rl.clip_norm", float("inf"), r"config.rl.clip_norm must be a number > 0, not inf"),
]


@pytest.mark.parametrize("field, value, message", BAD_VALUES,
                         ids=[f"{f}={v}" for f, v, _ in BAD_VALUES])
def test_build_names_a_bad_value_before_any_model_work(field, value, message):
  config = arith_tiny.get_config()
  *blocks, key = field.split(".")
  node = config
  for block in blocks:
    node = node[block]
  node[key] = value
  with pytest.raises(ConfigError, match=message):
    build(config, ASYNC_TRAINER)


def test_engine_prefill_buckets_must_be_a_bool():
  # a config that sets it to another type (arith_tiny's bool field refuses one itself)
  config = arith_tiny.get_config()
  config.engine = ml_collections.ConfigDict(dict(num_slots=64, max_seq_len=16,
                                                 prefill_buckets="no"))
  with pytest.raises(ConfigError, match="config.engine.prefill_buckets must be True or "
                     "False, got 'no'"):
    build(config, ASYNC_TRAINER)


@pytest.mark.parametrize("value", ["true", 1, 0.0])
def test_engine_serving_layout_must_be_a_bool_or_none(value):
  config = arith_tiny.get_config()
  config.engine = ml_collections.ConfigDict(dict(num_slots=64, max_seq_len=16,
                                                 serving_layout=value))
  with pytest.raises(ConfigError, match=r"config.engine.serving_layout must be True, False "
                     r"or None \(off CPU\), got " + re.escape(repr(value))):
    build(config, ASYNC_TRAINER)


def test_kl_coef_needs_the_reference_policy_of_kl_to_start():
  fix = (r"config.rl.loss.kl_coef must be 0 without a reference policy: set "
         r"config.rl.kl_to_start = True")
  for absent in (False, True):  # rl.kl_to_start False, or not in the config at all
    config = arith_tiny.get_config()
    config.rl.loss.kl_coef = 0.05
    if absent:
      del config.rl["kl_to_start"]
    else:
      config.rl.kl_to_start = False
    with pytest.raises(ConfigError, match=fix):
      build(config, ASYNC_TRAINER)
  config = arith_tiny.get_config()
  config.rl.loss.kl_coef = 0.05
  assert config.rl.kl_to_start
  built = build(config, ASYNC_TRAINER)
  assert built.kl_to_start and built.loss.kl_coef == 0.05
  del config.rl["kl_to_start"]  # absent: off
  config.rl.loss.kl_coef = 0.0
  assert not build(config, ASYNC_TRAINER).kl_to_start


@pytest.mark.parametrize("loop", ["lockstep", "async"])
def test_both_loops_build_the_config_before_any_model_work(loop, tmp_path, monkeypatch):
  monkeypatch.setattr(core, "setup", lambda *a, **k: pytest.fail("model work before build"))
  config = arith_tiny.get_config()
  config.rl.advantage = "ppo"
  with pytest.raises(ConfigError, match="config.rl.advantage"):
    if loop == "lockstep":
      lockstep.run_experiment(config, str(tmp_path))
    else:
      async_loop.run_async(config, str(tmp_path), f"file://{tmp_path}/root/")
  assert not any(tmp_path.iterdir()), "nothing written before the config is checked"


@pytest.mark.parametrize("name", CONFIGS)
def test_every_config_builds_what_it_has_blocks_for(name):
  config = _load(name)
  needs = [b for b in BLOCKS if b in config]
  if config.get("init_from"):  # a placeholder directory: config.model's shape, and no env
    config.init_from = ""  # (its tokenizer is the checkpoint's; test_own_checkpoint_e2e
    needs.remove("env")  # builds it from a real directory)
  built = build(config, needs, devices=False)
  assert built.cfg.num_hidden_layers == config.model.num_hidden_layers


@pytest.mark.parametrize("variant", ["full", "tiny"])
def test_qwen3_30b_a3b_has_every_block_and_names_its_placeholder_checkpoint(variant):
  config = _load("qwen3_30b_a3b", variant)
  validate(config, ASYNC_TRAINER + ("tokenizer",))
  assert config.sft.steps == 0 and config.tokenizer.kind == "hf"
  with pytest.raises(ConfigError, match=r"config.init_from: there is no /path/to/.*/config.json "
                     r"\(give --config.init_from=hf:DIR"):
    build(config, ASYNC_TRAINER)


def test_no_pipeline_module_imports_one_above_it():
  import ast  # pylint: disable=import-outside-toplevel
  from rljax import pipeline  # pylint: disable=import-outside-toplevel
  folder = pathlib.Path(pipeline.__file__).parent
  modules = {p.stem for p in folder.glob("*.py")} - {"__init__"}
  assert modules == set(pipeline.LAYERS), "every pipeline module has its place in LAYERS"
  for name in pipeline.LAYERS:
    tree = ast.parse((folder / f"{name}.py").read_text())
    imported = set()
    for node in ast.walk(tree):
      if isinstance(node, ast.ImportFrom) and node.module == "rljax.pipeline":
        imported |= {a.name for a in node.names}
      elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("rljax.pipeline."):
        imported.add(node.module.split(".")[2])
    above = {m for m in imported if pipeline.LAYERS.index(m) >= pipeline.LAYERS.index(name)}
    assert not above, f"rljax/pipeline/{name}.py imports {sorted(above)} (above it)"


def test_lr_schedule_without_warmup_starts_at_the_learning_rate():
  """warmup_steps 0: the first update has the full rate (a constant-lr recipe such as
  TRL's can be matched), with or without the cosine decay; a warmup starts from 0."""
  block = lambda warmup, final: ml_collections.ConfigDict(dict(  # noqa: E731
      learning_rate=2e-4, warmup_steps=warmup, final_lr_frac=final))
  constant = lr_schedule(block(0, 1.0), 100)
  assert [float(constant(i)) for i in (0, 1, 99, 500)] == pytest.approx([2e-4] * 4)
  decayed = lr_schedule(block(0, 0.05), 100)
  assert float(decayed(0)) == pytest.approx(2e-4) and float(decayed(100)) == pytest.approx(1e-5)
  warm = lr_schedule(block(20, 0.05), 100)
  assert float(warm(0)) == 0.0 and float(warm(20)) == pytest.approx(2e-4)
  assert float(warm(100)) == pytest.approx(1e-5)


def test_recipe_keys_of_the_wrong_type_or_left_out():
  config = arith_tiny.get_config()
  del config.sft["adam_eps"]  # a config's own key may have any type
  config.sft.adam_eps = "1e-8"
  with pytest.raises(ConfigError, match=r"config.sft.adam_eps must be a number > 0, not '1e-8'"):
    build(config, ASYNC_TRAINER)
  config = arith_tiny.get_config()
  del config.rl["warmup_steps"]
  config.rl.warmup_steps = 2.5
  with pytest.raises(ConfigError, match=r"config.rl.warmup_steps must be an int >= 0"):
    validate(config, ASYNC_TRAINER)
  config = arith_tiny.get_config()  # the optional keys left out: their defaults
  for block, key in [("sft", k) for k in RECIPE_DEFAULTS] + [("rl", "schedule_steps"),
                                                             ("rl", "adam_b1"),
                                                             ("rl", "adam_eps")]:
    del config[block][key]
  config.sft.schedule_steps = None  # None: the block's steps, as 0
  validate(config, ASYNC_TRAINER)


def _updates(optimizer, grads, n):
  """The first `n` updates of `optimizer` for the same gradient, from zero params."""
  params = jnp.zeros_like(grads)

  def step(state, _):
    updates, state = optimizer.update(grads, state, params)
    return state, updates

  return jax.lax.scan(step, optimizer.init(params), length=n)[1]


def _first_updates(c, grads, n=1):
  return _updates(block_optimizer(c), grads, n)


@pytest.mark.parametrize("block", ["sft", "rl"])
def test_warmup_zero_gives_the_full_rate_at_the_first_update(block):
  c = arith_tiny.get_config()[block]
  c.update(dict(warmup_steps=0, final_lr_frac=0.05))
  lr = c.learning_rate
  # Adam's first direction for a unit gradient is 1 up to f32 rounding of its bias
  # corrections (1 - b2 = 0.001 has a relative error of 1.3e-5 in f32)
  np.testing.assert_allclose(_first_updates(c, jnp.ones(1)), [[-lr]], rtol=1e-5)
  c.warmup_steps = 20  # a warmup starts from 0
  assert float(_first_updates(c, jnp.ones(1))[0, 0]) == 0.0


@pytest.mark.parametrize("block", ["sft", "rl"])
def test_a_horizon_longer_than_the_run_leaves_the_rate_above_the_final_one(block):
  c = arith_tiny.get_config()[block]
  c.update(dict(steps=100, warmup_steps=20, final_lr_frac=0.05))
  lr, final = c.learning_rate, c.learning_rate * c.final_lr_frac
  for horizon in (0, 400):  # 0: the run's steps
    c.schedule_steps = horizon
    # the last of 100 updates has count 99; a unit gradient's update is -(its rate), as above
    last = -float(_first_updates(c, jnp.ones(1), 100)[-1, 0])
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, 20, horizon or 100, final)
    assert last == pytest.approx(float(schedule(99)), rel=1e-5)
    assert last < 1.01 * final if horizon == 0 else last > 10 * final
  assert float(lr_schedule(c, c.steps)(400)) == pytest.approx(final)


@pytest.mark.parametrize("block", ["sft", "rl"])
def test_adam_betas_and_eps_reach_scale_by_adam(block):
  c = arith_tiny.get_config()[block]
  c.update(dict(warmup_steps=0, final_lr_frac=1.0, adam_b1=0.8, adam_b2=0.98, adam_eps=1e-3,
                clip_norm=100.0))
  grads = jnp.asarray([0.3, -2.0, 1e-4, 5.0], jnp.float32)
  reference = optax.chain(optax.clip_by_global_norm(100.0),
                          optax.adamw(c.learning_rate, b1=0.8, b2=0.98, eps=1e-3,
                                      weight_decay=c.weight_decay))
  got = np.asarray(_first_updates(c, grads, 3))
  np.testing.assert_array_equal(got, np.asarray(_updates(reference, grads, 3)))  # bitwise
  c.update(dict(adam_b1=0.9, adam_b2=0.999, adam_eps=1e-8))
  assert not np.array_equal(np.asarray(_first_updates(c, grads, 3)), got)


def _old_schedule(c, steps, block):
  """The schedules before schedule_steps: SFT's warmup_cosine_decay_schedule, RL's
  lr_schedule."""
  if block == "sft" or (c.warmup_steps > 0 and c.final_lr_frac != 1.0):
    return optax.warmup_cosine_decay_schedule(0.0, c.learning_rate, c.warmup_steps,
                                              max(steps, c.warmup_steps + 1),
                                              end_value=c.learning_rate * c.final_lr_frac)
  if c.warmup_steps <= 0:
    if c.final_lr_frac == 1.0:
      return optax.constant_schedule(c.learning_rate)
    return optax.cosine_decay_schedule(c.learning_rate, max(steps, 1), alpha=c.final_lr_frac)
  return optax.linear_schedule(0.0, c.learning_rate, c.warmup_steps)


def _values(schedule, counts):
  """A schedule's rates at `counts`, as the f32 the updates use (a constant one: a float)."""
  return np.broadcast_to(np.asarray(schedule(counts), np.float32), counts.shape)


@pytest.mark.parametrize("warmup, final", [(0, 1.0), (0, 0.05), (50, 1.0), (50, 0.05)])
def test_sft_schedules_are_the_old_warmup_cosine_ones(warmup, final):
  c = arith_tiny.get_config().sft
  c.update(dict(steps=300, warmup_steps=warmup, final_lr_frac=final))
  counts = jnp.arange(400)
  np.testing.assert_array_equal(_values(lr_schedule(c, c.steps), counts),
                                _values(_old_schedule(c, c.steps, "sft"), counts))


@pytest.mark.parametrize("name", CONFIGS)
def test_existing_configs_keep_their_schedules_and_optimizers(name, monkeypatch):
  made = []
  monkeypatch.setattr(learner, "make_optimizer", lambda lr, **kw: made.append((lr, kw)))
  configs = [_load(name)] + ([_load(name, "tiny")] if name.startswith("qwen3") else [])
  for config, block in [(cf, b) for cf in configs for b in ("sft", "rl") if b in cf]:
    c = config[block]
    block_optimizer(c)
    schedule, kwargs = made.pop()
    counts = jnp.arange(c.steps + 100)
    np.testing.assert_array_equal(_values(schedule, counts),
                                  _values(_old_schedule(c, c.steps, block), counts))
    clip_b2 = (c.clip_norm, c.adam_b2) if block == "rl" else (1.0, 0.999)
    assert kwargs == dict(weight_decay=c.weight_decay, clip_norm=clip_b2[0], b1=0.9,
                          b2=clip_b2[1], eps=1e-8, skip_empty=False)


# ------------------------------------------------------------- an env's own tokenizer
OWN = "tests.own_tokenizer_env"


def _env_config(name: str, **kwargs) -> ml_collections.ConfigDict:
  config = arith_tiny.get_config()  # model vocab_size 64; the char tokenizer has 55 ids
  config.env.name = f"{OWN}:{name}"
  config.env.kwargs.update(kwargs)
  return config


def test_an_env_with_its_own_tokenizer_builds_without_a_tokenizer_block():
  from tests import own_tokenizer_env  # pylint: disable=import-outside-toplevel
  env = build(_env_config("own"), ("model", "env"), devices=False).env
  assert isinstance(env.tokenizer, own_tokenizer_env.WideCharTokenizer)
  assert env.tokenizer.vocab_size == 59 and env.stop_ids == (2,)
  # kind "env": a factory that takes no tokenizer= and does not declare it
  config = _env_config("undeclared", extra_ids=9)
  config.tokenizer = ml_collections.ConfigDict(dict(kind="env"))
  env = build(config, ("model", "env"), devices=False).env
  assert isinstance(env.tokenizer, own_tokenizer_env.WideCharTokenizer)
  assert env.tokenizer.vocab_size == 64
  # a registered env with kind "env": its own default, the char tokenizer
  config = arith_tiny.get_config()
  config.tokenizer = ml_collections.ConfigDict(dict(kind="env"))
  assert build(config, ("model", "env"), devices=False).env.tokenizer.vocab_size == 55


def test_export_asks_for_the_tokenizer_of_an_env_that_brings_its_own(tmp_path):
  """An export builds no env, so it cannot write an env's own tokenizer: it refuses before
  reading any weights, instead of writing the char tokenizer beside them."""
  from rljax.pipeline import export  # pylint: disable=import-outside-toplevel
  with pytest.raises(export.ExportError, match="brings its own tokenizer: name its Hugging "
                     "Face files with --tokenizer_dir"):
    export.export_model(_env_config("own"), str(tmp_path / "out"),
                        params_dir=str(tmp_path / "none"))


def test_the_vocabulary_check_runs_on_the_env_s_own_tokenizer():
  with pytest.raises(ConfigError, match=r"the env's own tokenizer \(WideCharTokenizer of "
                     r"config.env.name='tests.own_tokenizer_env:own'\) has 75 ids, the model "
                     r"\(config.model.vocab_size\) only 64"):
    build(_env_config("own", extra_ids=20), ("model", "env"), devices=False)
  config = _env_config("undeclared", extra_ids=10)
  config.tokenizer = ml_collections.ConfigDict(dict(kind="env"))
  with pytest.raises(ConfigError, match=r"the env's own tokenizer .* has 65 ids"):
    build(config, ("model", "env"), devices=False)
  # the config's tokenizer is still checked before the env is made: its name, as before
  config = arith_tiny.get_config()
  config.model.vocab_size = 50
  with pytest.raises(ConfigError, match=r"^the char tokenizer has 55 ids"):
    build(config, ("model", "env"), devices=False)


@pytest.mark.parametrize("name,tokenizer,message", [
    ("undeclared", None, r"config.env.name='tests.own_tokenizer_env:undeclared' takes no "
     r"tokenizer=: .*config.tokenizer.kind = 'env'"),
    ("undeclared", "char", r"config.env.name='tests.own_tokenizer_env:undeclared' takes no "
     r"tokenizer="),
    ("forwarding", None, r"config.env \(tests.own_tokenizer_env:forwarding\): .*'tokenizer' "
     r"\(an env that makes its own tokenizer: config.tokenizer.kind = 'env'"),
    ("no_tokenizer", None, r"the env's own tokenizer \(NoneType of config.env.name="
     r"'tests.own_tokenizer_env:no_tokenizer'\) is None, not a tokenizer"),
    ("own", "char", r"config.env.name='tests.own_tokenizer_env:own' brings its own "
     r"tokenizer .*kind='char' names another"),
    ("nowhere", None, r"config.env \(tests.own_tokenizer_env:nowhere\): .*has no attribute"),
])
def test_a_factory_that_refuses_or_lacks_a_tokenizer_is_a_config_error(name, tokenizer, message):
  config = _env_config(name)
  if tokenizer is not None:
    config.tokenizer = ml_collections.ConfigDict(dict(kind=tokenizer))
  with pytest.raises(ConfigError, match=message):
    build(config, ("model", "env"), devices=False)
  config.env.kwargs.tokenizer = "mine"
  config.tokenizer = ml_collections.ConfigDict(dict(kind="env"))
  if name != "nowhere":
    with pytest.raises(ConfigError, match=r"config.env.kwargs.tokenizer: the tokenizer is "):
      build(config, ("model", "env"), devices=False)

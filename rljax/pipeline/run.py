"""`build(config)`: the one place a config becomes the objects of a run.

Every entry point, the rollout host and the AOT check call it. A config is an
`ml_collections.ConfigDict` of blocks (see configs/arith_tiny.py for a complete one);
each caller names the blocks it needs, and a block that is missing, misspelled or short
of a key is a `ConfigError` naming it, before any model work. Defaults live in the config
files, never here.

The env is built with the config's tokenizer: the char tokenizer when the config has no
`tokenizer` block (or `kind="char"`), or a local Hugging Face tokenizer directory:

  config.tokenizer = ConfigDict(dict(kind="hf", path="/ckpt", chat_template=True,
                                     stop_tokens=("<|im_end|>", "<|endoftext|>")))

(`rljax.envs.TransformersTokenizer`: text prompts rendered through its chat template when
`chat_template`, the first stop token is EOS, every stop token ends an answer; () = the
tokenizer's eos token and the `eos_token_id`(s) of the checkpoint's
`generation_config.json`, if any; `path=""`: the directory of `init_from = "hf:DIR"`,
where a checkpoint keeps its tokenizer). `env.name` is a registered env or an import path
"package.module:factory", called with env.kwargs and `tokenizer=`.

An env may bring its own tokenizer instead: `config.tokenizer = ConfigDict(dict(kind="env"))`,
or a factory that declares it (`factory.own_tokenizer = True`; its config then needs no
tokenizer block, and a char or hf one is an error). Either way the factory is called
without `tokenizer=` and the run uses `env.tokenizer` (the engine's EOS, the vocabulary
check). A config's missing tokenizer block still means the char tokenizer for every other
env. The tokenizer used must fit the model: ids beyond `config.model.vocab_size` are a
ConfigError naming it (config.tokenizer, the char tokenizer, or the env's own); a factory
that takes no `tokenizer=` when given one, or whose own tokenizer is not one, is a
ConfigError naming config.env.name.

`init_from = "hf:DIR"`: the model's architecture is DIR/config.json's; config.model sets
only backend fields (BACKEND_FIELDS), and an architecture field it sets (not None) is an
override that must agree with the checkpoint (`model_config`).

Optional keys, read with defaults: `rl.max_all_infra_updates` (3: consecutive updates of
nothing but infra failures that stop a run; 0: never), `rl.kl_to_start`,
`rl.signal_scaled_updates` (False), `rl.collapse_fall` / `rl.collapse_window`,
`eval.collapse_fall`, `engine.prefill_buckets` (True; `DecodeEngine`'s),
`engine.max_prefill_tokens` (0: no limit; `DecodeEngine`'s), `engine.serving_layout` (None:
off CPU; `DecodeEngine`'s), `rl.checkpoint_every` (0: the
lockstep loop saves no checkpoints; experiments/grpo.py --resume goes on from the latest).
The optimizer recipe of `sft` and `rl` (`recipe.block_optimizer`): `schedule_steps` (0 or None: the block's `steps`; the
cosine decay's horizon, so a longer one leaves the rate above the final one at the run's
end), `adam_b1` (0.9), `adam_b2` (0.999; required in `rl`), `adam_eps` (1e-8) and
`clip_norm` (1.0; required in `rl`).

Values a run would only trip over later (at its first update, evaluation or checkpoint,
after the model is loaded) are checked here too: the advantage estimator, the loss's
KL coefficient (needs `rl.kl_to_start`: the GRPO step's reference policy) and entropy
coefficient (the step logs the entropy, never differentiates it), the engine's
weight-update policy, group and microbatch sizes against the packed rows, eval.k <= eval.n,
engine.max_seq_len against the model's positions.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import typing
from typing import Any, Iterable, Mapping

import jax
import ml_collections
import optax

from rljax import sharding as sharding_lib
from rljax.engine.engine import DecodeEngine, SamplingParams, WeightUpdatePolicy, check_slots
from rljax.envs.base import Env
from rljax.model import ModelConfig
from rljax.model import lora as lora_lib
from rljax.model.hf_import import config_from_hf
from rljax.model.packing import aligned_length
from rljax.numerics import Numerics
# the config's error, its recipe and its tokenizer and env live beside this module; run's
# callers reach them here too
from rljax.pipeline.config_error import ConfigError, init_from_hf
from rljax.pipeline.env_setup import (TOKENIZER_KEYS, check_sft_targets,  # noqa: F401
                                      check_vocabulary, default_stop_tokens,
                                      env_brings_tokenizer, hf_tokenizer_dir, make_env,
                                      make_tokenizer, takes_tokenizer, tokenizer_kind)
from rljax.pipeline.recipe import (RECIPE_DEFAULTS, RECIPE_RULES, block_optimizer,  # noqa: F401
                                   check_recipe, lr_schedule, recipe)
from rljax.rl import advantages, learner
from rljax.rl.losses import LossConfig

TOP_LEVEL = ("name", "seed", "numerics", "init_from")
# ModelConfig fields a config sets beside `init_from` (how to run the model, not what it
# is); the checkpoint's config.json sets the rest
BACKEND_FIELDS = ("page_size", "decode_attention", "det_attention", "train_experts",
                  "engine_experts", "expert_row_tile", "expert_kernel", "dtype",
                  "param_dtype", "remat", "scan_layers")
# block -> the keys it must have (model: ModelConfig's own fields, checked by from_dict)
BLOCKS: dict[str, tuple[str, ...]] = {
    "model": (),
    "mesh": (),
    "env": ("name", "kwargs"),
    "tokenizer": ("kind",),  # optional (the char tokenizer); more keys per kind below
    "engine": ("num_slots", "max_seq_len"),
    "sft": ("load", "steps", "target_pass1", "probe_every", "slow_down_at", "slow_down_factor",
            "probe_every_slow", "probe_tasks", "batch_size", "microbatches", "learning_rate",
            "warmup_steps", "final_lr_frac", "weight_decay", "num_tasks", "log_every"),
    "rl": ("steps", "prompts_per_step", "group_size", "num_tasks", "max_new_tokens",
           "temperature", "top_k", "top_p", "advantage", "dynamic_sampling_rounds",
           "learning_rate", "warmup_steps", "final_lr_frac", "adam_b2", "weight_decay",
           "clip_norm", "microbatches", "router_replay", "overlong", "loss"),
    "train": ("row_len",),
    "eval": ("num_tasks", "k", "n", "temperature", "seed", "every"),
    "log": ("tensorboard",),
    "lora": ("rank", "alpha", "targets"),  # optional: GRPO trains adapters on a frozen base
    "async_rl": ("hosts", "host_groups", "max_staleness", "lease_s", "lease_ttl_s", "poll_s",
                 "keyframe_every", "checkpoint_every", "check_versions_groups",
                 "weight_update", "batch_timeout_s"),
}
# what each kind of caller needs
LOCKSTEP = ("model", "mesh", "env", "engine", "sft", "rl", "train", "eval", "log")
ASYNC_TRAINER = LOCKSTEP + ("async_rl",)
ROLLOUT_HOST = ("model", "env", "engine", "rl", "async_rl")
MODEL_ONLY = ("model", "mesh")
OPTIONAL = ("lora",)  # checked whenever present, by any caller


def validate(config: ml_collections.ConfigDict, needs: Iterable[str]) -> None:
  needs = tuple(needs)
  unknown = set(config.keys()) - set(BLOCKS) - set(TOP_LEVEL)
  if unknown:
    raise ConfigError(f"unknown config block(s) {sorted(unknown)}; known blocks: "
                      f"{sorted(BLOCKS)} and top-level keys {list(TOP_LEVEL)}")
  for key in ("seed", "numerics"):
    if key not in config:
      raise ConfigError(f"the config has no top-level {key!r}")
  optional = tuple(b for b in OPTIONAL if b in config and b not in needs)
  for block in needs + optional:
    if block not in config or not isinstance(config[block], ml_collections.ConfigDict):
      if block in optional:
        raise ConfigError(f"config.{block} must be a block ({', '.join(BLOCKS[block])})")
      raise ConfigError(f"the config has no {block!r} block (needed here: {list(needs)}; "
                        "configs/arith_tiny.py has every block)")
    missing = [k for k in BLOCKS[block] if k not in config[block]]
    if missing:
      raise ConfigError(f"config.{block} is missing {missing}")
  if "lora" in config:
    try:
      lora_lib.LoraConfig.from_dict(config.lora.to_dict())
    except (TypeError, ValueError) as e:
      raise ConfigError(f"config.lora: {e}") from None
  if "mesh" in needs:
    check_mesh_axes(config.mesh, "config.mesh")
  if "engine" in needs and "mesh" in config.engine:
    check_mesh_axes(config.engine.mesh, "config.engine.mesh")
  if "engine" in needs and not isinstance(config.engine.get("prefill_buckets", True), bool):
    raise ConfigError("config.engine.prefill_buckets must be True or False, got "
                      f"{config.engine.prefill_buckets!r}")
  layout = config.engine.get("serving_layout", None) if "engine" in needs else None
  if not any(layout is ok for ok in (None, True, False)):
    raise ConfigError("config.engine.serving_layout must be True, False or None (off CPU), got "
                      f"{config.engine.serving_layout!r}")
  max_prefill = config.engine.get("max_prefill_tokens", 0) if "engine" in needs else 0
  if isinstance(max_prefill, bool) or not isinstance(max_prefill, int) or max_prefill < 0:
    raise ConfigError("config.engine.max_prefill_tokens must be an int >= 0 (0: no limit), "
                      f"got {max_prefill!r}")
  if "rl" in needs:
    try:
      LossConfig(**config.rl.loss.to_dict())
    except (TypeError, ValueError) as e:
      raise ConfigError(f"config.rl.loss: {e}") from None
  check_values(config, needs)


def check_mesh_axes(mesh: Mapping[str, Any], field: str) -> None:
  bad = set(mesh.keys()) - set(sharding_lib.MESH_AXES)
  if bad:
    raise ConfigError(f"{field} has unknown axes {sorted(bad)}; mesh axes are "
                      f"{list(sharding_lib.MESH_AXES)}")


def check_engine_slots(sharding: sharding_lib.Sharding, numerics: Numerics, num_slots: int,
                       field: str) -> None:
  """`engine.check_slots` (deterministic numerics: >= 8 slots per device) as a ConfigError
  naming `field`."""
  try:
    check_slots(sharding, numerics, num_slots)
  except ValueError as e:
    raise ConfigError(f"{field}: {e}") from None


def check_values(config: ml_collections.ConfigDict, needs: tuple[str, ...]) -> None:
  """Values of the needed blocks that would fail a run only after its model is loaded."""
  for block in ("sft", "rl"):
    if block in needs:
      check_recipe(config[block], f"config.{block}")
  every = config.rl.get("checkpoint_every", 0) if "rl" in needs else 0
  if isinstance(every, bool) or not isinstance(every, int) or every < 0:
    raise ConfigError("config.rl.checkpoint_every must be an int >= 0 (0: no lockstep "
                      f"checkpoints), got {every!r}")
  if "rl" in needs:
    rl = config.rl
    if rl.advantage not in advantages.KINDS:
      raise ConfigError(f"config.rl.advantage must be one of {list(advantages.KINDS)}, not "
                        f"{rl.advantage!r}")
    if rl.overlong not in advantages.OVERLONG:
      raise ConfigError(f"config.rl.overlong must be one of {list(advantages.OVERLONG)} (what "
                        f"training does with an episode cut by the context), not "
                        f"{rl.overlong!r}")
    if rl.group_size < 2:
      raise ConfigError(f"config.rl.group_size must be >= 2 (a group's baseline needs two "
                        f"samples), not {rl.group_size}")
    kl_coef = rl.loss.get("kl_coef", 0.0)
    if kl_coef and not kl_to_start(config):
      raise ConfigError(f"config.rl.loss.kl_coef must be 0 without a reference policy: set "
                        f"config.rl.kl_to_start = True (the KL to the policy GRPO starts "
                        f"from), or kl_coef = 0 (not {kl_coef})")
    if kl_coef < 0:
      raise ConfigError(f"config.rl.loss.kl_coef must be >= 0, not {kl_coef}")
    step_clip_norm(config)  # >= 0
    if rl.loss.get("entropy_coef", 0.0):
      raise ConfigError("config.rl.loss.entropy_coef must be 0: the GRPO step logs the "
                        "policy's entropy but computes no gradient through it")
    stop = rl.get("max_all_infra_updates", 3)
    if isinstance(stop, bool) or not isinstance(stop, int) or stop < 0:
      raise ConfigError(f"config.rl.max_all_infra_updates must be an int >= 0 (consecutive "
                        f"updates of nothing but infra failures that stop the run; 0: never), "
                        f"not {stop!r}")
    if rl.prompts_per_step < 1 or rl.microbatches < 1:
      raise ConfigError("config.rl.prompts_per_step and config.rl.microbatches must be >= 1, "
                        f"not {rl.prompts_per_step} and {rl.microbatches}")
  if "eval" in needs and not 1 <= config.eval.k <= config.eval.n:
    raise ConfigError(f"config.eval.k must be in [1, config.eval.n]: pass@k from n samples "
                      f"(k={config.eval.k}, n={config.eval.n})")
  if "async_rl" in needs:
    a = config.async_rl
    policies = typing.get_args(WeightUpdatePolicy)
    if a.weight_update not in policies:
      raise ConfigError(f"config.async_rl.weight_update must be one of {list(policies)}, not "
                        f"{a.weight_update!r}")
    for key in ("checkpoint_every", "keyframe_every", "host_groups"):
      if a[key] < 1:
        raise ConfigError(f"config.async_rl.{key} must be >= 1, not {a[key]}")
    if a.max_staleness < 0:
      raise ConfigError(f"config.async_rl.max_staleness must be >= 0, not {a.max_staleness}")


def signal_scaled(config: ml_collections.ConfigDict) -> bool:
  """`config.rl.signal_scaled_updates` (optional, absent = False): each GRPO update times
  the share of its samples that have an advantage, and none (params and Adam's moments
  untouched) when no sample has one (rljax.rl.learner.make_optimizer / make_grpo_step)."""
  return bool(config.rl.get("signal_scaled_updates", False)) if "rl" in config else False


def step_clip_norm(config: ml_collections.ConfigDict) -> float | None:
  """`config.rl.step_clip_norm` (optional; absent, None or 0 = off): each GRPO update (Adam's
  step) times min(1, step_clip_norm / the raw gradient's global norm)
  (rljax.rl.learner.make_grpo_step)."""
  value = config.rl.get("step_clip_norm", 0.0) if "rl" in config else 0.0
  if value is None:
    return None
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
    raise ConfigError(f"config.rl.step_clip_norm must be a number >= 0 (0 = off), not "
                      f"{value!r}")
  return float(value) or None


def kl_to_start(config: ml_collections.ConfigDict) -> bool:
  """`config.rl.kl_to_start` (optional, absent = False): the GRPO step also scores each
  batch with the frozen params it started from (logged `kl`; `rl.loss.kl_coef` > 0
  penalises it)."""
  return bool(config.rl.get("kl_to_start", False)) if "rl" in config else False


def rows_for(num_seqs: int, max_seq_len: int, row_len: int, page_size: int) -> int:
  """Rows that always hold num_seqs sequences of <= max_seq_len tokens under first-fit
  packing: a row that refuses a sequence already holds >= row_len // aligned_max of them."""
  per_row = row_len // aligned_length(max_seq_len, page_size)
  if per_row < 1:
    raise ValueError(f"row_len {row_len} cannot hold a sequence of {max_seq_len} tokens")
  return -(-num_seqs // per_row)


def check_shapes(config: ml_collections.ConfigDict, needs: set[str], cfg: ModelConfig) -> None:
  """The engine's sequence length fits the model; every update's packed rows (one longest
  sequence per row with train.row_len 0) split into its microbatches."""
  if "engine" in needs and config.engine.max_seq_len > cfg.max_position_embeddings:
    raise ConfigError(f"config.engine.max_seq_len {config.engine.max_seq_len} exceeds the "
                      f"model's max_position_embeddings {cfg.max_position_embeddings}")
  if not {"engine", "train", "rl"} <= needs:
    return
  max_len = config.engine.max_seq_len
  row_len = config.train.row_len or aligned_length(max_len, cfg.page_size)
  batches = [("rl", config.rl.prompts_per_step * config.rl.group_size)]
  if "sft" in needs and config.sft.steps and not config.sft.load:
    batches.append(("sft", config.sft.batch_size))
  for block, num_seqs in batches:
    try:
      rows = rows_for(num_seqs, max_len, row_len, cfg.page_size)
    except ValueError as e:
      raise ConfigError(f"config.train.row_len: {e} (config.engine.max_seq_len)") from None
    micro = config[block].microbatches
    if rows % micro:
      raise ConfigError(f"config.{block}.microbatches={micro} does not divide the {rows} packed "
                        f"rows of an update's {num_seqs} sequences (row_len {row_len})")


def model_config(config: ml_collections.ConfigDict) -> ModelConfig:
  """config.model, or with `init_from`: the checkpoint's config.json plus config.model's
  backend fields (BACKEND_FIELDS). An architecture field config.model leaves unset (absent,
  or None: a config's placeholder) is the checkpoint's; one it sets is an override that
  must agree with the checkpoint, and every one that does not is named in one error.
  Without init_from config.model is the whole architecture (its unset fields are named)."""
  path = init_from_hf(config)
  given = config.model.to_dict() if "model" in config else {}
  if path is None:
    unset = [k for k, v in given.items() if v is None]
    if unset:
      raise ConfigError(f"config.model.{{{', '.join(unset)}}} unset: without init_from, "
                        "config.model is the whole architecture; give "
                        "--config.init_from=hf:DIR to take it from a checkpoint's "
                        "config.json, or set them")
    return ModelConfig.from_dict(given)
  config_json = os.path.join(path, "config.json")
  if not os.path.isfile(config_json):
    raise ConfigError(f"config.init_from: there is no {config_json} (give "
                      "--config.init_from=hf:DIR, a Hugging Face checkpoint directory; "
                      "--config.init_from= builds config.model's architecture, randomly "
                      "initialised)")
  with open(config_json) as f:
    hf = config_from_hf(json.load(f))
  fields = {f.name for f in dataclasses.fields(ModelConfig)}
  unknown = sorted(set(given) - fields)
  if unknown:
    raise ConfigError(f"config.model has unknown keys {unknown}; ModelConfig's fields: "
                      f"{sorted(fields)}")
  differ = []
  for key, value in given.items():
    if key in BACKEND_FIELDS or value is None:
      continue
    theirs = getattr(hf, key)
    if isinstance(theirs, tuple):
      value = tuple(value)
    if theirs != value:
      differ.append(f"{key}={value!r} (the checkpoint's: {theirs!r})")
  if differ:
    raise ConfigError(
        f"config.model sets {len(differ)} architecture field(s) that {path}/config.json "
        f"does not have: {'; '.join(differ)}. init_from sets the architecture: leave them "
        "out of config.model (or None), or set each to the checkpoint's")
  return dataclasses.replace(hf, **{k: v for k, v in given.items()
                                    if k in BACKEND_FIELDS and v is not None})


def make_sharding(mesh_shape: dict[str, int]) -> sharding_lib.Sharding | None:
  """None for a 1-device mesh (plain jit); otherwise a mesh of the first devices."""
  size = math.prod(int(v) for v in mesh_shape.values())
  if size == 1:
    return None
  if size > jax.device_count():
    raise ConfigError(f"config.mesh {mesh_shape} needs {size} devices, have "
                      f"{jax.device_count()}")
  return sharding_lib.Sharding(sharding_lib.make_mesh(dict(mesh_shape), jax.devices()[:size]))


@dataclasses.dataclass(frozen=True)
class Built:
  """The objects of one run, made from its config by `build`."""

  config: ml_collections.ConfigDict
  cfg: ModelConfig
  numerics: Numerics
  sharding: sharding_lib.Sharding | None  # the trainer's mesh (None: one device)
  env: Env | None
  sampling: SamplingParams | None  # the rollouts' (rl block)
  loss: LossConfig | None

  @property
  def lora(self) -> lora_lib.LoraConfig | None:
    """`config.lora` (validated by `build`), or None: full fine-tuning."""
    if "lora" not in self.config:
      return None
    return lora_lib.LoraConfig.from_dict(self.config.lora.to_dict())

  @property
  def kl_to_start(self) -> bool:
    """`config.rl.kl_to_start`: the GRPO step takes the start policy's params
    (`ref_params=`) and logs the KL to it."""
    return kl_to_start(self.config)

  def make_engine(self, params: Any, *, version: int = 0, weight_update: str = "keep",
                  sharding: sharding_lib.Sharding | None = None) -> DecodeEngine:
    e = self.config.engine
    extra_stops = len(self.env.stop_ids) - 1  # besides EOS; 4 fit the default shapes
    return DecodeEngine(self.cfg, params, numerics=self.numerics, num_slots=e.num_slots,
                        max_seq_len=e.max_seq_len, eos_id=self.env.tokenizer.eos_id,
                        version=version, weight_update=weight_update, sharding=sharding,
                        max_stop_tokens=max(4, extra_stops),
                        prefill_buckets=bool(e.get("prefill_buckets", True)),
                        max_prefill_tokens=int(e.get("max_prefill_tokens", 0)),
                        serving_layout=e.get("serving_layout", None))

  def engine_sharding(self) -> sharding_lib.Sharding | None:
    """A rollout host's mesh: `config.engine.mesh` (axis sizes; none or 1 device: no mesh)
    over this process's first devices, with the decode rules (weights replicated over
    fsdp, the KV page pool split like the slots)."""
    shape = {k: int(v) for k, v in self.config.engine.get("mesh", {}).items()}
    size = math.prod(shape.values())
    if size == 1:
      return None
    local = jax.local_devices()
    if size > len(local):
      raise ConfigError(f"config.engine.mesh {shape} needs {size} devices, this process has "
                        f"{len(local)} (to simulate CPU devices: XLA_FLAGS="
                        f"--xla_force_host_platform_device_count={size})")
    sharding = sharding_lib.Sharding(sharding_lib.make_mesh(shape, local[:size]),
                                     sharding_lib.DECODE_RULES)
    check_engine_slots(sharding, self.numerics, self.config.engine.num_slots,
                       "config.engine.num_slots")
    return sharding

  def trainer_engine_sharding(self) -> sharding_lib.Sharding | None:
    """The trainer's mesh (`config.mesh`, every device of the job) with the decode rules,
    for an engine that every trainer process builds (`make_engine(params, sharding=...)`)
    and drives in lockstep: the same requests in the same order, the same steps (see
    `DecodeEngine`). It takes the trainer's serving params as they are (global arrays by
    the training rules, here and in `update_weights`) and reshards them on device. None on
    one device. (`build` checked num_slots against this mesh: both tables split the slots
    alike.)"""
    if self.sharding is None:
      return None
    return dataclasses.replace(self.sharding, rules=sharding_lib.DECODE_RULES)

  def rl_optimizer(self) -> optax.GradientTransformation:
    return block_optimizer(self.config.rl, skip_empty=signal_scaled(self.config))

  def grpo_step(self, optimizer: optax.GradientTransformation,
                state_sharding: learner.TrainState | None = None,
                sharding: sharding_lib.Sharding | None = None):
    """The jitted GRPO step (`sharding`: the trainer's mesh unless given, e.g. abstract)."""
    c = self.config.rl
    return learner.make_grpo_step(self.cfg, optimizer, numerics=self.numerics,
                                  loss_cfg=self.loss, replay=c.router_replay,
                                  temperature=c.temperature,
                                  sharding=sharding or self.sharding,
                                  state_sharding=state_sharding, lora=self.lora,
                                  reference=self.kl_to_start,
                                  scale_by_signal=signal_scaled(self.config),
                                  step_clip_norm=step_clip_norm(self.config))


def build(config: ml_collections.ConfigDict, needs: Iterable[str] = LOCKSTEP, *,
          devices: bool = True, platform: str | None = None) -> Built:
  """Validates `config` for `needs` and builds the run's objects. `devices=False`: no mesh
  of real devices (the AOT check lowers on an abstract one); `platform`: the backend the
  model's "auto" choices are made for (default: the running one)."""
  validate(config, needs)
  needs = set(needs)
  try:
    cfg = model_config(config)
    numerics = Numerics(config.numerics)
  except ConfigError:
    raise
  except (TypeError, ValueError, OSError) as e:
    raise ConfigError(f"config.model / config.init_from / config.numerics: {e}") from None
  # every "auto", once
  cfg = cfg.resolved(platform or jax.default_backend(), numerics.mode)
  check_shapes(config, needs, cfg)
  sharding = make_sharding(config.mesh.to_dict()) if devices and "mesh" in needs else None
  if sharding is not None and "engine" in needs:  # evaluations run an engine on this mesh
    check_engine_slots(sharding, numerics, config.engine.num_slots,
                       "config.engine.num_slots on config.mesh")
  env = make_env(config, cfg) if "env" in needs else None
  if env is not None and "sft" in needs:
    check_sft_targets(config, env)
  sampling = loss = None
  if "rl" in needs:
    rl = config.rl
    sampling = SamplingParams(temperature=rl.temperature, top_k=rl.top_k, top_p=rl.top_p,
                              max_new_tokens=rl.max_new_tokens)
    loss = LossConfig(**rl.loss.to_dict())
  return Built(config, cfg, numerics, sharding, env, sampling, loss)

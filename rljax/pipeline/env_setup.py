"""A config's tokenizer and env: the `tokenizer` block (char, a Hugging Face directory, or
the env's own), the env made with it, and the checks that the two fit the model
(`check_vocabulary`) and the warm start (`check_sft_targets`)."""

from __future__ import annotations

import inspect
import json
import numbers
import os
from typing import Any

import ml_collections

from rljax import envs
from rljax.envs.base import Env
from rljax.model import ModelConfig
from rljax.pipeline.config_error import ConfigError, init_from_hf

# "env": the env's factory makes its own tokenizer (make_env)
TOKENIZER_KEYS = {"char": (), "hf": ("path", "stop_tokens", "chat_template"), "env": ()}


def hf_tokenizer_dir(config: ml_collections.ConfigDict) -> str | None:
  """The directory of a `kind="hf"` tokenizer (`path`, or init_from's directory when it is
  ""); None for the char tokenizer."""
  t = config.get("tokenizer")
  if not isinstance(t, ml_collections.ConfigDict) or t.get("kind") != "hf":
    return None
  path = t.get("path") or init_from_hf(config)
  if not path:
    raise ConfigError("config.tokenizer.path is empty and there is no config.init_from "
                      "checkpoint to take the tokenizer from")
  return path


def tokenizer_kind(config: ml_collections.ConfigDict) -> str | None:
  """config.tokenizer.kind, its block checked; None when the block is absent."""
  if "tokenizer" not in config:
    return None
  t = config.tokenizer
  if not isinstance(t, ml_collections.ConfigDict):
    raise ConfigError(f"config.tokenizer must be a block (a ConfigDict), not {t!r}")
  if t.get("kind") not in TOKENIZER_KEYS:
    raise ConfigError(f"config.tokenizer.kind must be one of {sorted(TOKENIZER_KEYS)}, not "
                      f"{t.get('kind')!r}")
  keys = set(TOKENIZER_KEYS[t.kind])
  missing, unknown = keys - set(t.keys()), set(t.keys()) - keys - {"kind"}
  if missing or unknown:
    raise ConfigError(f"config.tokenizer (kind={t.kind!r}) takes the keys {sorted(keys)}; "
                      f"missing {sorted(missing)}, unknown {sorted(unknown)}")
  return t.kind


def env_brings_tokenizer(config: ml_collections.ConfigDict) -> bool:
  """Whether the env makes its own tokenizer: `config.tokenizer.kind = "env"`, or a factory
  that declares `own_tokenizer = True` (`envs.brings_tokenizer`; its config has no
  tokenizer block or kind "env": a char or hf block would be ignored, so it is an error)."""
  kind = tokenizer_kind(config)
  try:
    declared = envs.brings_tokenizer(config.env.name)
  except ValueError as e:
    raise ConfigError(f"config.env ({config.env.name}): {e}") from None
  if declared and kind not in (None, "env"):
    raise ConfigError(f"config.env.name={config.env.name!r} brings its own tokenizer "
                      f"(own_tokenizer = True), but config.tokenizer.kind={kind!r} names "
                      "another: drop the tokenizer block, or set its kind to 'env'")
  return declared or kind == "env"


def make_tokenizer(config: ml_collections.ConfigDict) -> envs.Tokenizer:
  """config.tokenizer as an object; the char tokenizer when the block is absent."""
  kind = tokenizer_kind(config)
  if kind is None or kind == "char":
    return envs.CharTokenizer()
  if kind == "env":
    raise ConfigError("config.tokenizer.kind='env': the tokenizer is the env's own "
                      "(make_env(config, cfg).tokenizer), not one the config makes")
  t = config.tokenizer
  path = hf_tokenizer_dir(config)
  if not os.path.isdir(path):
    raise ConfigError(f"config.tokenizer.path: {path!r} is not a directory")
  try:
    import transformers  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise ConfigError("config.tokenizer.kind='hf' needs the transformers package "
                      "(pip install -e '.[test]')") from None
  try:
    hf = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
  except (OSError, ValueError) as e:
    raise ConfigError(f"config.tokenizer.path: {path!r} is not a tokenizer directory: "
                      f"{e}") from None
  stop_tokens = tuple(t.stop_tokens) or default_stop_tokens(hf, path, init_from_hf(config))
  try:
    return envs.TransformersTokenizer(hf, stop_tokens=stop_tokens,
                                      chat_template=t.chat_template)
  except ValueError as e:  # the message starts with the field's name
    raise ConfigError(f"config.tokenizer.{e}") from None


def default_stop_tokens(hf_tokenizer, *dirs: str | None) -> tuple[str, ...]:
  """The stop tokens of `tokenizer.stop_tokens = ()`: the tokenizer's EOS first, then the
  `eos_token_id`(s) of the first `generation_config.json` among `dirs` (the tokenizer's
  directory, init_from's: what transformers' `generate` stops at). () when there is
  neither (TransformersTokenizer then names the missing EOS)."""
  out = [hf_tokenizer.eos_token] if hf_tokenizer.eos_token is not None else []
  for directory in dict.fromkeys(d for d in dirs if d):
    path = os.path.join(directory, "generation_config.json")
    if not os.path.isfile(path):
      continue
    try:
      with open(path) as f:
        ids = json.load(f).get("eos_token_id")
    except (OSError, ValueError) as e:
      raise ConfigError(f"config.tokenizer.stop_tokens is () but {path} is unreadable: "
                        f"{e}") from None
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    for i in ids:
      try:
        token = hf_tokenizer.convert_ids_to_tokens(int(i)) if isinstance(i, int) else None
      except (IndexError, OverflowError, ValueError):
        token = None
      if token is None:
        raise ConfigError(f"config.tokenizer.stop_tokens is () but {path}'s eos_token_id "
                          f"{i!r} is not a token of the tokenizer")
      out.append(token)
    break
  return tuple(dict.fromkeys(out))


def check_vocabulary(tokenizer: envs.Tokenizer, cfg: ModelConfig, where: str) -> None:
  """The tokenizer's ids must all be the model's (`where`: which tokenizer, for the error)."""
  size = getattr(tokenizer, "vocab_size", None)
  if not isinstance(size, numbers.Integral) or isinstance(size, bool):
    raise ConfigError(f"{where} is {tokenizer!r}, not a tokenizer (no integer vocab_size)")
  if size > cfg.vocab_size:
    raise ConfigError(f"{where} has {size} ids, the model (config.model.vocab_size) only "
                      f"{cfg.vocab_size}")


def takes_tokenizer(factory: Any) -> bool:
  """Whether `factory` accepts `tokenizer=` (a callable without a signature: assumed)."""
  try:
    params = inspect.signature(factory).parameters.values()
  except (TypeError, ValueError):
    return True
  return any((p.name == "tokenizer" and p.kind != p.POSITIONAL_ONLY) or p.kind == p.VAR_KEYWORD
             for p in params)


def make_env(config: ml_collections.ConfigDict, cfg: ModelConfig) -> Env:
  """config.env with config.tokenizer, or with its own (`env_brings_tokenizer`); the
  tokenizer it uses must fit the model's vocabulary."""
  name = config.env.name
  own = env_brings_tokenizer(config)
  kwargs = config.env.kwargs.to_dict()
  if "sandbox" in config.env:  # optional: the sandboxed tool's settings (python_tool)
    kwargs["sandbox"] = config.env.sandbox.to_dict()
  if "tokenizer" in kwargs:
    raise ConfigError("config.env.kwargs.tokenizer: the tokenizer is config.tokenizer's, or "
                      "the env's own (config.tokenizer.kind = 'env'), never an env kwarg")
  if not own:
    tokenizer = make_tokenizer(config)
    check_vocabulary(tokenizer, cfg, "config.tokenizer" if "tokenizer" in config
                     else "the char tokenizer")
    if not takes_tokenizer(envs.factory(name)):
      raise ConfigError(f"config.env.name={name!r} takes no tokenizer=: an env that makes "
                        "its own tokenizer needs config.tokenizer.kind = 'env' (or its "
                        "factory's own_tokenizer = True)")
    kwargs["tokenizer"] = tokenizer
  try:
    env = envs.make(name, **kwargs)
  except (TypeError, ValueError) as e:
    hint = (" (an env that makes its own tokenizer: config.tokenizer.kind = 'env', or its "
            "factory's own_tokenizer = True)"
            if isinstance(e, TypeError) and not own and "tokenizer" in str(e) else "")
    raise ConfigError(f"config.env ({name}): {e}{hint}") from None
  if own:
    tokenizer = getattr(env, "tokenizer", None)
    check_vocabulary(tokenizer, cfg, f"the env's own tokenizer ({type(tokenizer).__name__} "
                     f"of config.env.name={name!r})")
  return env


def check_sft_targets(config: ml_collections.ConfigDict, env: Env) -> None:
  """A warm start that would train on SFT targets needs an env that has them."""
  sft_runs = config.sft.steps > 0 and not config.sft.load
  if sft_runs and not getattr(env, "has_sft_targets", True):
    why = getattr(env, "no_sft_targets", "")
    raise ConfigError(f"config.sft.steps={config.sft.steps}, but the env has no SFT targets "
                      f"({why or 'a dataset env has them with config.env.kwargs.answer_field'}"
                      "): set config.sft.steps = 0, or config.sft.load")

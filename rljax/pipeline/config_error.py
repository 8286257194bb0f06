"""What every reader of a run's config shares: `ConfigError`, and init_from's checkpoint
directory."""

from __future__ import annotations

import ml_collections


class ConfigError(ValueError):
  """A config that cannot make a run; the message names the block and key."""


def init_from_hf(config: ml_collections.ConfigDict) -> str | None:
  """The HF checkpoint directory of `init_from = "hf:DIR"`; None for a random init ("")."""
  init_from = config.get("init_from", "")
  if not init_from:
    return None
  if not init_from.startswith("hf:") or len(init_from) == 3:
    raise ConfigError(f"config.init_from {init_from!r}: expected 'hf:/path/to/checkpoint_dir' "
                      "(or '' for a random init)")
  return init_from[3:]

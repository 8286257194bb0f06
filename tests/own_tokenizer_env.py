"""Envs that bring their own tokenizer, named by import path in tests' configs
("tests.own_tokenizer_env:own", ...; see rljax.pipeline.run.make_env)."""

from rljax.envs import ArithmeticEnv, CharTokenizer


class WideCharTokenizer(CharTokenizer):
  """The char tokenizer with `extra` unused ids above its own: not the config's."""

  def __init__(self, extra: int):
    super().__init__()
    self.vocab_size += extra


def own(*, extra_ids: int = 4, **kwargs) -> ArithmeticEnv:
  """Declares its own tokenizer: a config needs no tokenizer block for it."""
  return ArithmeticEnv(tokenizer=WideCharTokenizer(extra_ids), **kwargs)


own.own_tokenizer = True


def undeclared(*, extra_ids: int = 4, min_digits: int = 1, max_digits: int = 2,
               ops: tuple[str, ...] = ("+",), partial_credit: float = 0.0,
               held_out_fraction: float = 0.1, latency=None) -> ArithmeticEnv:
  """Takes no tokenizer= and does not say so: needs config.tokenizer.kind = "env"."""
  return ArithmeticEnv(tokenizer=WideCharTokenizer(extra_ids), min_digits=min_digits,
                       max_digits=max_digits, ops=ops, partial_credit=partial_credit,
                       held_out_fraction=held_out_fraction, latency=latency)


def forwarding(**kwargs) -> ArithmeticEnv:
  """Like `undeclared`, but its signature takes anything: a tokenizer= fails in the call."""
  return ArithmeticEnv(tokenizer=WideCharTokenizer(4), **kwargs)


class _NoTokenizerEnv(ArithmeticEnv):
  stop_ids = ()  # an Env in shape (runtime_checkable), so make_env sees its tokenizer


def no_tokenizer(**kwargs) -> ArithmeticEnv:
  """Declares its own tokenizer, but its env has none."""
  env = _NoTokenizerEnv(**kwargs)
  env.tokenizer = None
  return env


no_tokenizer.own_tokenizer = True

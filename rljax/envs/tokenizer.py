"""Tokenizers for the envs: a fixed char-level vocabulary, and an adapter for Hugging Face
`tokenizers` with the same interface.

Envs work on token ids at their boundaries (DESIGN.md: token in, token out) and on text
only inside a verifier. Markers the envs need as single tokens (tool-call open/close,
observation open/close) are written as `<calc>`, `</calc>`, `<obs>`, `</obs>` in text;
`CharTokenizer` maps each to one special id, a real tokenizer must have them as added
tokens (`token_to_id` finds them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Protocol

import numpy as np

if TYPE_CHECKING:
  import tokenizers

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
CALL_OPEN, CALL_CLOSE = "<calc>", "</calc>"  # the model's tool call: <calc>12*34</calc>
OBS_OPEN, OBS_CLOSE = "<obs>", "</obs>"  # the env's answer to it: <obs>408</obs>
SPECIAL_TOKENS = (PAD, BOS, EOS, CALL_OPEN, CALL_CLOSE, OBS_OPEN, OBS_CLOSE)
# Every plain character the tasks need. No '<' or '>', so markers are unambiguous.
CHARS = "0123456789" + " +-*/()=?:,." + "abcdefghijklmnopqrstuvwxyz"

PAD_ID, BOS_ID, EOS_ID, CALL_OPEN_ID, CALL_CLOSE_ID, OBS_OPEN_ID, OBS_CLOSE_ID = range(7)


class Tokenizer(Protocol):
  """What an env needs from a tokenizer."""

  vocab_size: int
  pad_id: int | None
  bos_id: int | None
  eos_id: int

  def encode(self, text: str) -> np.ndarray:
    """[T] int32; never adds BOS/EOS on its own."""

  def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
    """Raises ValueError on an id outside the vocabulary."""

  def token_to_id(self, token: str) -> int | None:
    """The id of a token written as text (e.g. a marker), or None."""


def _as_id_list(ids: Iterable[int], vocab_size: int) -> list[int]:
  out = [int(i) for i in np.asarray(ids, dtype=np.int64).reshape(-1)]
  for i in out:
    if not 0 <= i < vocab_size:
      raise ValueError(f"token id {i} outside the vocabulary [0, {vocab_size})")
  return out


class CharTokenizer:
  """Deterministic char-level tokenizer: 7 special tokens, then one id per char of CHARS.

  55 ids in all, so it fits a model with a larger embedding table (ids beyond
  `vocab_size` are never produced by `encode` and are rejected by `decode`).
  """

  def __init__(self):
    self.tokens: tuple[str, ...] = SPECIAL_TOKENS + tuple(CHARS)
    self._ids = {t: i for i, t in enumerate(self.tokens)}
    self.vocab_size = len(self.tokens)
    self.pad_id, self.bos_id, self.eos_id = PAD_ID, BOS_ID, EOS_ID

  def encode(self, text: str) -> np.ndarray:
    ids, i = [], 0
    while i < len(text):
      if text[i] == "<":
        tok = next((t for t in SPECIAL_TOKENS if text.startswith(t, i)), None)
        if tok is None:
          raise ValueError(f"unknown marker at {i} in {text!r}")
      else:
        tok = text[i]
        if tok not in self._ids:
          raise ValueError(f"character {tok!r} at {i} is not in the vocabulary")
      ids.append(self._ids[tok])
      i += len(tok)
    return np.asarray(ids, dtype=np.int32)

  def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
    skip = len(SPECIAL_TOKENS) if skip_special_tokens else 0
    return "".join(self.tokens[i] for i in _as_id_list(ids, self.vocab_size) if i >= skip)

  def token_to_id(self, token: str) -> int | None:
    return self._ids.get(token)

  def to_hf(self, vocab_size: int | None = None):
    """This tokenizer as a `transformers.PreTrainedTokenizerFast` with the same ids (BPE
    without merges = one token per char, special tokens as added tokens, BOS prepended as
    the envs' prompts have it, decode concatenates); ids from `self.vocab_size` up to the
    model's `vocab_size` are unused special tokens. Needs `transformers` (test extras)."""
    import tokenizers  # pylint: disable=g-import-not-at-top
    import transformers  # pylint: disable=g-import-not-at-top
    unused = tuple(f"<unused{i}>" for i in range((vocab_size or self.vocab_size) - self.vocab_size))
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(
        {t: i for i, t in enumerate(self.tokens + unused)}, merges=[]))
    tok.add_special_tokens([t for t in self.tokens + unused if t.startswith("<")])
    tok.decoder = tokenizers.decoders.Fuse()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, add_bos_token=True)


class HFTokenizer:
  """Adapter: a Hugging Face `tokenizers.Tokenizer` behind the `Tokenizer` interface.

  Special tokens are looked up by their text; `eos_token` must exist. For the calculator
  env the markers (`<calc>` ...) must be added tokens of the wrapped tokenizer.
  """

  def __init__(self, tokenizer: "tokenizers.Tokenizer", *, pad_token: str | None = PAD,
               bos_token: str | None = BOS, eos_token: str = EOS):
    self.hf = tokenizer
    self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    self.pad_id = tokenizer.token_to_id(pad_token) if pad_token else None
    self.bos_id = tokenizer.token_to_id(bos_token) if bos_token else None
    eos_id = tokenizer.token_to_id(eos_token)
    if eos_id is None:
      raise ValueError(f"eos token {eos_token!r} is not in the tokenizer")
    self.eos_id = eos_id

  @classmethod
  def from_file(cls, path: str, **kwargs) -> "HFTokenizer":
    """Loads a `tokenizer.json` (no network)."""
    import tokenizers  # pylint: disable=g-import-not-at-top  (a test/extra dependency)
    return cls(tokenizers.Tokenizer.from_file(str(path)), **kwargs)

  def encode(self, text: str) -> np.ndarray:
    return np.asarray(self.hf.encode(text, add_special_tokens=False).ids, dtype=np.int32)

  def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
    return self.hf.decode(_as_id_list(ids, self.vocab_size),
                          skip_special_tokens=skip_special_tokens)

  def token_to_id(self, token: str) -> int | None:
    return self.hf.token_to_id(token)

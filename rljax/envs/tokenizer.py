"""Tokenizers for the envs: a fixed char-level vocabulary, and adapters with the same
interface for a Hugging Face `tokenizers.Tokenizer` and for a local `transformers` tokenizer
directory (with its chat template and several stop tokens).

Envs work on token ids at their boundaries (DESIGN.md: token in, token out) and on text
only inside a verifier. Markers the envs need as single tokens (tool-call open/close,
observation open/close) are written as `<calc>`, `</calc>`, `<obs>`, `</obs>` in text;
`CharTokenizer` maps each to one special id, a real tokenizer must have them as added
tokens (`token_to_id` finds them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Mapping, Protocol, Sequence

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
  eos_id: int  # what the policy ends its answer with (SFT targets end with it)
  stop_ids: tuple[int, ...]  # every id that ends an answer; eos_id first

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
    self.stop_ids = (EOS_ID,)

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
    self.stop_ids = (eos_id,)

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


class TransformersTokenizer:
  """Adapter: a `transformers` tokenizer (e.g. a model's own, read from its directory by
  `from_dir`) behind the `Tokenizer` interface, with its chat template and stop tokens.

  `stop_tokens` are the tokens that end an answer, the first one being `eos_id` (what SFT
  targets end with): `("<|im_end|>", "<|endoftext|>")` for a Qwen chat model; empty: the
  tokenizer's own eos token. With `chat_template=True` the envs' text prompts are rendered
  as one user message through the chat template (`apply_chat_template`), generation
  prompt included. `vocab_size` counts added tokens (`len(tokenizer)`); ids from there up
  to the model's vocabulary are not tokens (`decode` raises).
  """

  def __init__(self, tokenizer, *, stop_tokens: Sequence[str] = (), chat_template: bool = False):
    self.hf = tokenizer
    self.name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    self._vocab: dict[str, int] = tokenizer.get_vocab()
    self.vocab_size = len(tokenizer)
    self.pad_id, self.bos_id = tokenizer.pad_token_id, tokenizer.bos_token_id
    stop_tokens = tuple(stop_tokens)
    if not stop_tokens:
      if tokenizer.eos_token is None:
        raise ValueError(f"stop_tokens: none given and {self.name} has no eos token")
      stop_tokens = (tokenizer.eos_token,)
    missing = [t for t in stop_tokens if t not in self._vocab]
    if missing:
      raise ValueError(f"stop_tokens: {missing} not in the vocabulary of {self.name}")
    self.stop_ids = tuple(dict.fromkeys(self._vocab[t] for t in stop_tokens))
    self.eos_id = self.stop_ids[0]
    if chat_template and not tokenizer.chat_template:
      raise ValueError(f"chat_template: {self.name} has no chat template")
    self.chat_template = bool(chat_template)

  @classmethod
  def from_dir(cls, path: str, **kwargs) -> "TransformersTokenizer":
    """`transformers.AutoTokenizer` from a local directory (never the Hub)."""
    import transformers  # pylint: disable=g-import-not-at-top  (an optional dependency)
    return cls(transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True),
               **kwargs)

  def encode(self, text: str) -> np.ndarray:
    return np.asarray(self.hf.encode(text, add_special_tokens=False), dtype=np.int32)

  def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
    return self.hf.decode(_as_id_list(ids, self.vocab_size),
                          skip_special_tokens=skip_special_tokens,
                          clean_up_tokenization_spaces=False)

  def decode_sampled(self, ids: Iterable[int]) -> str:
    """The text of sampled ids; an id of the model's vocabulary that is no token of this
    tokenizer (the model's table may be larger) reads as U+FFFD. Never raises: the ids are
    the truth, the text a reading of them."""
    out, run = [], []
    for t in list(ids) + [None]:
      if t is not None and 0 <= t < self.vocab_size:
        run.append(t)
        continue
      if run:
        out.append(self.decode(run))
        run = []
      if t is not None:
        out.append("\ufffd")
    return "".join(out)

  def token_to_id(self, token: str) -> int | None:
    return self._vocab.get(token)

  def apply_chat_template(self, messages: Sequence[Mapping[str, str]]) -> np.ndarray:
    """[T] int32: the messages rendered by the chat template, then the generation prompt
    (rendered as text, then encoded: the ids of a fresh tokenization of that text)."""
    if not self.hf.chat_template:
      raise ValueError(f"{self.name} has no chat template")
    if (isinstance(messages, (str, bytes)) or not messages
        or not all(isinstance(m, Mapping) and isinstance(m.get("role"), str)
                   and isinstance(m.get("content"), str) for m in messages)):
      raise ValueError("chat messages must be a non-empty list of {'role': str, "
                       f"'content': str}}, got {str(messages)[:200]}")
    text = self.hf.apply_chat_template([dict(m) for m in messages], tokenize=False,
                                       add_generation_prompt=True)
    return self.encode(text)


# A Qwen-style chat template: each message as <|im_start|>role\ncontent<|im_end|>\n, then
# the assistant's turn opened when a generation prompt is asked for.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")
CHAT_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def train_byte_level_bpe(texts: Iterable[str], directory: str, *, vocab_size: int = 512,
                         individual_digits: bool = False,
                         chat_template: str = CHAT_TEMPLATE) -> str:
  """Trains a small byte-level BPE tokenizer on `texts` and saves it to `directory` as a
  `transformers` tokenizer with Qwen's chat tokens (CHAT_SPECIAL_TOKENS; eos <|im_end|>,
  pad <|endoftext|>) and `chat_template`: a real tokenizer of the kind `from_dir` reads, for
  tests and examples. Any text encodes (every byte is a token). `individual_digits`: every
  digit its own token, never merged (as Qwen's tokenizers split numbers), and the other
  text merged across words and punctuation (a task's fixed phrases become few tokens).
  Returns `directory`."""
  # pylint: disable=g-import-not-at-top  (optional dependencies)
  import transformers
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  tok = Tokenizer(models.BPE())
  if individual_digits:  # digits split off; merges may then cross words and punctuation
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  else:
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(CHAT_SPECIAL_TOKENS),
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tok.train_from_iterator(list(texts), trainer=trainer)
  hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                            pad_token="<|endoftext|>")
  hf.chat_template = chat_template
  hf.save_pretrained(directory)
  return directory

"""Stop sequences of a Tinker `SamplingParams.stop`: token ids and strings.

`stop` is None (the tokenizer's EOS stops a sequence), `[]` (nothing stops it but
`max_tokens`), or a string, or a list of token ids and strings (EOS stops it too). Token
ids stop the engine where they are sampled; the token is the sequence's last. Strings are
matched on the decoded text of the sampled tokens (never the prompt's), across token
boundaries: a sequence ends with the first token whose text completes a match, that token
kept (the stop string is part of the returned tokens, as the Tinker service returns them:
the cookbook's renderers parse e.g. "\\n\\nUser:" out of the sampled tokens and count a
response without it as cut short), and its log-probs are cut to the same length.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from rljax.tinker.training import UserError

MAX_STOP_TOKENS = 4  # the engine's stop-token slots (EOS included)
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256


@dataclasses.dataclass(frozen=True)
class Stops:
  tokens: tuple[int, ...] = ()
  strings: tuple[str, ...] = ()


def parse_stops(stop: Any, *, vocab_size: int, eos_id: int | None,
                can_match_text: bool) -> Stops:
  """`sampling_params.stop`, checked (UserError names what is wrong)."""
  if stop is None:
    return Stops(tokens=() if eos_id is None else (eos_id,))
  items = [stop] if isinstance(stop, (str, int)) else stop
  if not isinstance(items, list):
    raise UserError(f"stop must be a string, a list of strings and token ids, or null; got "
                    f"{type(stop).__name__}")
  tokens = [] if eos_id is None or not items else [eos_id]
  strings = []
  for s in items:
    if isinstance(s, str):
      if not s or len(s) > MAX_STOP_CHARS or "\ufffd" in s:
        raise UserError(f"stop: a stop string must have 1 to {MAX_STOP_CHARS} characters, "
                        f"none U+FFFD (what undecodable bytes read as), got {s!r:.300}")
      strings.append(s)
    elif isinstance(s, int) and not isinstance(s, bool):
      if not 0 <= s < vocab_size:
        raise UserError(f"stop: token id {s} is not in [0, {vocab_size})")
      tokens.append(s)
    else:
      raise UserError(f"stop: each entry must be a string or a token id, got {s!r:.100} "
                      f"({type(s).__name__})")
  tokens = list(dict.fromkeys(tokens))
  if len(tokens) > MAX_STOP_TOKENS:
    raise UserError(f"stop: at most {MAX_STOP_TOKENS} token ids (EOS counts), got "
                    f"{len(tokens)}")
  if len(strings) > MAX_STOP_STRINGS:
    raise UserError(f"stop: at most {MAX_STOP_STRINGS} strings, got {len(strings)}")
  if strings and not can_match_text:
    raise UserError("stop strings need the server's tokenizer (start it with "
                    "--tokenizer_dir, or pass stop token ids)")
  return Stops(tuple(tokens), tuple(dict.fromkeys(strings)))


def stop_cut(ids: Sequence[int], strings: Sequence[str], text_of) -> int | None:
  """The fewest leading ids whose text (`text_of(ids)`: e.g. a `TransformersTokenizer`'s
  `decode_sampled`) holds one of `strings`; None if no prefix does."""
  if not strings or not ids or not any(s in text_of(ids) for s in strings):
    return None
  # a match, once in the text, stays as k grows (more ids extend the text; only a trailing
  # incomplete character, read as U+FFFD, changes, and no stop string holds one)
  lo, hi = 1, len(ids)
  while lo < hi:
    mid = (lo + hi) // 2
    if any(s in text_of(ids[:mid]) for s in strings):
      hi = mid
    else:
      lo = mid + 1
  return lo

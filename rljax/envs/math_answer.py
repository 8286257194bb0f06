r"""Final numeric answers of math word problems, and a `DatasetEnv` reward function that
compares them.

The final answer of a text is what follows its last "####" (GSM8K's solutions end with
"#### 42"), else the content of its last "\boxed{...}". Its number is the first number in
that answer, read as an exact fraction after dropping thousands separators: "1,234",
"1234.0", "$1,234" and "1234." are one answer, "0.5" and "1/2" another, and so is
"\frac{1}{2}".

  reward_fn(prompt, completion, answer=reference) -> Verdict

success (reward 1) when the completion's final number equals the reference's; a
completion without "####" or "\boxed{}" and a number in it, or with another number, is a
model_failure (reward 0). A reference answer without a number is a data error (raises:
an infra failure, never a gradient). A reference with neither marker is read as a whole
("42" works as an answer field).
"""

from __future__ import annotations

import re
from fractions import Fraction

from rljax.envs.base import Verdict

_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_FRAC = re.compile(r"\\d?frac\{\s*(-?[\d.]+)\s*\}\{\s*(-?[\d.]+)\s*\}")
_BOXED = "\\boxed{"


def _last_boxed(text: str) -> str | None:
  """The content of the last \\boxed{...}, braces balanced; None when there is none."""
  start = text.rfind(_BOXED)
  if start < 0:
    return None
  depth, i = 1, start + len(_BOXED)
  for j in range(i, len(text)):
    depth += {"{": 1, "}": -1}.get(text[j], 0)
    if depth == 0:
      return text[i:j]
  return None


def final_answer(text: str) -> str | None:
  """The text after the last "####" (up to the end of its line), else the last boxed
  content; None when the text has neither."""
  if "####" in text:
    return text.rsplit("####", 1)[1].strip().split("\n", 1)[0]
  return _last_boxed(text)


def parse_number(text: str | None) -> Fraction | None:
  """The first number in `text` as a fraction (commas as thousands separators, "a/b" and
  \\frac{a}{b} as fractions); None when there is none."""
  if text is None:
    return None
  text = _FRAC.sub(r"\1/\2", text)
  match = _NUMBER.search(text)
  if match is None:
    return None
  try:
    return Fraction(match.group().replace(",", ""))
  except (ValueError, ZeroDivisionError):
    return None


def reward_fn(prompt, completion: str, *, answer: str, **fields) -> Verdict:
  """Success when the completion's final number equals the reference answer's."""
  del prompt, fields  # the reference answer says everything
  expected = parse_number(final_answer(answer) or answer)
  if expected is None:
    raise ValueError(f"the reference answer has no number: {answer[-80:]!r}")
  written = final_answer(completion)
  got = parse_number(written)
  if got is None:
    return Verdict.model_failure("no final answer")
  if got != expected:
    return Verdict.model_failure("wrong", answer=written[:80])
  return Verdict.success(answer=written[:80])

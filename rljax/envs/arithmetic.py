"""Arithmetic: multi-digit addition and multiplication, single turn.

Prompt "<bos>12+34=", expected completion "46<eos>". The answer is the text before the
first EOS (surrounding spaces ignored): digits equal to the result is success (reward 1);
wrong digits, anything that is not digits, invalid ids, or no EOS is model_failure
(reward 0). With `partial_credit` c > 0 a wrong but well-formed integer answer earns
c x (digit positions that match the result, aligned from the units digit) / (positions in
the longer of the two): a dense signal for tasks no sample of a group solves (the outcome
stays model_failure, so pass@k is unchanged).

`little_endian=True` writes every number least-significant digit first, in the prompt and
in the answer ("<bos>21+43=" asks 12+34, "64<eos>" answers 46): the format in which a small
transformer adds digit by digit, carries flowing left to right as it writes. The answer
must then be the result's digits reversed exactly (leading zeros of the reversed text are
the result's trailing ones: 100 is "001").

Difficulty knobs: digits per operand (uniform in [min_digits, max_digits], then the
operand uniform among numbers of that many digits; 1 digit includes 0) and the operation
set. The split key sorts the operands (both ops commute), so "12+34" and "34+12" are
always in the same split.
"""

from __future__ import annotations

import re

import numpy as np

from rljax.envs.base import BaseEnv, SFTTarget, Task, Verdict
from rljax.rl.trajectory import Outcome

OPS = ("+", "*")
_MAX_ANSWER_DIGITS = 64
_INT = re.compile(r"-?[0-9]+")


def draw_operand(rng: np.random.Generator, min_digits: int, max_digits: int) -> int:
  digits = int(rng.integers(min_digits, max_digits + 1))
  low = 0 if digits == 1 else 10**(digits - 1)
  return int(rng.integers(low, 10**digits))


def canonical_key(operands: tuple[int, ...], ops: tuple[str, ...]) -> str:
  """A flat expression's split key: operands sorted when it has one commutative op."""
  if len(set(ops)) == 1 and ops[0] in OPS:
    operands = tuple(sorted(operands))
  out = str(operands[0])
  for op, x in zip(ops, operands[1:]):
    out += f"{op}{x}"
  return out


def check_int_answer(text: str | None, expected: int) -> Verdict:
  """The verdict for an answer that should be the integer `expected`."""
  if text is None:
    return Verdict.model_failure("undecodable")
  text = text.strip()
  if len(text) > _MAX_ANSWER_DIGITS or not _INT.fullmatch(text):
    return Verdict.model_failure("malformed", answer=text[:_MAX_ANSWER_DIGITS])
  if int(text) != expected:
    return Verdict.model_failure("wrong", answer=text)
  return Verdict.success(answer=text)


def _from_little_endian(text: str | None) -> str | None:
  """The answer's digits in the usual order; text that is not a bare digit string is left
  as it is (check_int_answer calls it malformed)."""
  if text is None:
    return None
  stripped = text.strip()
  return stripped[::-1] if stripped.isdigit() and stripped.isascii() else text


def digit_match_fraction(answer: str, expected: int) -> float:
  """Positions, aligned from the units digit, where the answer's characters equal the
  result's, over the positions of the longer of the two (a sign counts as a position)."""
  want = str(expected)
  width = max(len(answer), len(want))
  a, w = answer.rjust(width), want.rjust(width)
  return sum(x == y for x, y in zip(a, w)) / width


class ArithmeticEnv(BaseEnv):
  name = "arithmetic"

  def __init__(self, *, min_digits: int = 1, max_digits: int = 2,
               ops: tuple[str, ...] = ("+",), partial_credit: float = 0.0,
               little_endian: bool = False, **kwargs):
    super().__init__(**kwargs)
    if not 0.0 <= partial_credit < 1.0:
      raise ValueError(f"partial_credit must be in [0, 1), got {partial_credit}")
    if not 1 <= min_digits <= max_digits:
      raise ValueError("need 1 <= min_digits <= max_digits")
    if not ops or any(op not in OPS for op in ops):
      raise ValueError(f"ops must be a non-empty subset of {OPS}")
    self.min_digits, self.max_digits, self.ops = min_digits, max_digits, tuple(ops)
    self.partial_credit = partial_credit
    self.little_endian = bool(little_endian)

  def _written(self, n: int) -> str:
    """A number as prompts and answers write it."""
    return str(n)[::-1] if self.little_endian else str(n)

  def _sample(self, rng: np.random.Generator) -> Task:
    a = draw_operand(rng, self.min_digits, self.max_digits)
    b = draw_operand(rng, self.min_digits, self.max_digits)
    op = self.ops[int(rng.integers(len(self.ops)))]
    result = a + b if op == "+" else a * b
    text = f"{self._written(a)}{op}{self._written(b)}="
    return Task(self.name, text, canonical_key((a, b), (op,)), self._prompt_ids(text),
                self._written(result), {"operands": (a, b), "op": op, "result": result})

  def verify(self, task: Task, completion_ids: np.ndarray) -> Verdict:
    text = self._answer_text(completion_ids)
    if isinstance(text, Verdict):
      return text
    if self.little_endian:
      text = _from_little_endian(text)
    verdict = check_int_answer(text, task.data["result"])
    if self.little_endian and verdict.outcome == Outcome.SUCCESS and text.strip() != str(
        task.data["result"]):  # exact digits only: "0010" is not 100 written backwards
      verdict = Verdict.model_failure("wrong", answer=text.strip())
    if self.partial_credit and verdict.info.get("reason") == "wrong":
      fraction = digit_match_fraction(verdict.info["answer"], task.data["result"])
      return Verdict.model_failure("wrong", reward=self.partial_credit * fraction,
                                   answer=verdict.info["answer"], digits_matched=fraction)
    return verdict

  def sft_target(self, task: Task) -> SFTTarget:
    return self._target(task.answer)

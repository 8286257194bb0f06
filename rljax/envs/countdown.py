"""Countdown: reach a target with the given numbers and + - * / and parentheses.

Prompt "<bos>3 5 2 7 to 16=", a right completion "(3+5)*2<eos>". The verifier parses the
text before EOS with `rljax.envs.expr.parse` (exact fractions, never `eval`) and checks:

  - it is a valid expression (else model_failure "malformed"; division by zero included);
  - its numbers are a sub-multiset of the given ones: each given number at most once, no
    other numbers (else model_failure "numbers"); with must_use_all, exactly the multiset;
  - its value equals the target (else model_failure "wrong", reward `partial_credit`,
    0 by default: a small format reward for a valid expression over allowed numbers).

Targets are reachable by construction: a random binary expression over all the numbers
whose value is an integer in [1, max_target]; that expression is the reference answer.
The split key is the sorted numbers and the target.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np

from rljax.envs import expr
from rljax.envs.base import BaseEnv, SFTTarget, Task, Verdict

_PREC = {"+": 1, "-": 1, "*": 2, "/": 2}


def _random_expression(rng: np.random.Generator, numbers: list[int],
                       ops: str) -> tuple[str, int, Fraction] | None:
  """Random binary tree over the numbers (each once); (text, precedence, value), or None
  on a division by zero. Parentheses only where precedence or associativity needs them."""
  if len(numbers) == 1:
    return str(numbers[0]), 3, Fraction(numbers[0])
  cut = int(rng.integers(1, len(numbers)))
  left = _random_expression(rng, numbers[:cut], ops)
  right = _random_expression(rng, numbers[cut:], ops)
  if left is None or right is None:
    return None
  op = ops[int(rng.integers(len(ops)))]
  (lt, lp, lv), (rt, rp, rv) = left, right
  if op == "/" and rv == 0:
    return None
  value = {"+": lv + rv, "-": lv - rv, "*": lv * rv, "/": lv / rv if rv else None}[op]
  prec = _PREC[op]
  if lp < prec:
    lt = f"({lt})"
  if rp < prec or (rp == prec and op in "-/"):
    rt = f"({rt})"
  return f"{lt}{op}{rt}", prec, value


class CountdownEnv(BaseEnv):
  name = "countdown"

  def __init__(self, *, min_numbers: int = 3, max_numbers: int = 4, max_number: int = 20,
               max_target: int = 100, ops: str = "+-*/", must_use_all: bool = False,
               partial_credit: float = 0.0, **kwargs):
    super().__init__(**kwargs)
    if not 2 <= min_numbers <= max_numbers:
      raise ValueError("need 2 <= min_numbers <= max_numbers")
    if not ops or any(op not in _PREC for op in ops):
      raise ValueError("ops must be a non-empty subset of '+-*/'")
    self.min_numbers, self.max_numbers = min_numbers, max_numbers
    self.max_number, self.max_target, self.ops = max_number, max_target, ops
    self.must_use_all, self.partial_credit = must_use_all, partial_credit

  def _sample(self, rng: np.random.Generator) -> Task:
    while True:
      k = int(rng.integers(self.min_numbers, self.max_numbers + 1))
      numbers = [int(x) for x in rng.integers(1, self.max_number + 1, size=k)]
      made = _random_expression(rng, numbers, self.ops)
      if made is not None and made[2].denominator == 1 and 1 <= made[2] <= self.max_target:
        break
    shown = [numbers[i] for i in rng.permutation(k)]  # the solution's order is a hint
    target = int(made[2])
    text = f"{' '.join(map(str, shown))} to {target}="
    key = f"{' '.join(map(str, sorted(numbers)))} to {target}"
    return Task(self.name, text, key, self._prompt_ids(text), made[0],
                {"numbers": tuple(shown), "target": target})

  def verify(self, task: Task, completion_ids: np.ndarray) -> Verdict:
    text = self._answer_text(completion_ids)
    if isinstance(text, Verdict):
      return text
    try:
      parsed = expr.parse(text)
    except expr.ExprError as e:
      return Verdict.model_failure("malformed", error=str(e))
    available = sorted(task.data["numbers"])
    used = sorted(parsed.numbers)
    if (used != available) if self.must_use_all else not _is_submultiset(used, available):
      return Verdict.model_failure("numbers", used=tuple(used))
    if parsed.value != task.data["target"]:
      return Verdict.model_failure("wrong", reward=self.partial_credit,
                                   value=expr.format_value(parsed.value))
    return Verdict.success(expression=text)

  def sft_target(self, task: Task) -> SFTTarget:
    return self._target(task.answer)


def _is_submultiset(used: list[int], available: list[int]) -> bool:
  left = list(available)
  for x in used:
    if x not in left:
      return False
    left.remove(x)
  return True

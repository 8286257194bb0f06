"""A safe arithmetic expression parser: model text is parsed, never `eval`ed.

Grammar (recursive descent, exact `Fraction` arithmetic, usual precedence, left assoc.):

  expr   := term (('+' | '-') term)*
  term   := factor (('*' | '/') factor)*
  factor := NUMBER | '(' expr ')' | '-' factor      (unary minus only if allowed)
  NUMBER := '0' | [1-9][0-9]*                       (no leading zeros, no signs, no dots)

Spaces are ignored. Everything else is an `ExprError` (a `ValueError`): unknown
characters, division by zero, and inputs past the size limits (length, digits per number,
nesting depth), which bound the work a hostile string can cause. `parse` returns the value
and the numbers in the order written, so a caller can check which numbers were used.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction


class ExprError(ValueError):
  """The text is not a valid expression (a model failure, never an infra failure)."""


@dataclasses.dataclass(frozen=True)
class Parsed:
  value: Fraction
  numbers: tuple[int, ...]  # the literals, in the order written


def parse(text: str, *, allow_unary_minus: bool = False, max_len: int = 256,
          max_digits: int = 12, max_depth: int = 32) -> Parsed:
  if len(text) > max_len:
    raise ExprError(f"expression longer than {max_len} characters")
  return _Parser(_lex(text, max_digits), allow_unary_minus, max_depth).run()


def format_value(value: Fraction) -> str:
  """'12', '-3', or '7/2'."""
  if value.denominator == 1:
    return str(value.numerator)
  return f"{value.numerator}/{value.denominator}"


def _lex(text: str, max_digits: int) -> list[str]:
  tokens, i = [], 0
  while i < len(text):
    c = text[i]
    if c == " ":
      i += 1
    elif c in "+-*/()":
      tokens.append(c)
      i += 1
    elif "0" <= c <= "9":
      j = i
      while j < len(text) and "0" <= text[j] <= "9":
        j += 1
      num = text[i:j]
      if len(num) > 1 and num[0] == "0":
        raise ExprError(f"number with a leading zero: {num!r}")
      if len(num) > max_digits:
        raise ExprError(f"number longer than {max_digits} digits")
      tokens.append(num)
      i = j
    else:
      raise ExprError(f"unexpected character {c!r} at {i}")
  if not tokens:
    raise ExprError("empty expression")
  return tokens


class _Parser:

  def __init__(self, tokens: list[str], allow_unary_minus: bool, max_depth: int):
    self.tokens, self.pos = tokens, 0
    self.allow_unary_minus, self.max_depth = allow_unary_minus, max_depth
    self.numbers: list[int] = []

  def run(self) -> Parsed:
    value = self.expr(0)
    if self.pos != len(self.tokens):
      raise ExprError(f"unexpected {self.tokens[self.pos]!r} after a complete expression")
    return Parsed(value, tuple(self.numbers))

  def peek(self) -> str | None:
    return self.tokens[self.pos] if self.pos < len(self.tokens) else None

  def take(self) -> str:
    tok = self.peek()
    if tok is None:
      raise ExprError("expression ends too early")
    self.pos += 1
    return tok

  def expr(self, depth: int) -> Fraction:
    value = self.term(depth)
    while self.peek() in ("+", "-"):
      op, rhs = self.take(), self.term(depth)
      value = value + rhs if op == "+" else value - rhs
    return value

  def term(self, depth: int) -> Fraction:
    value = self.factor(depth)
    while self.peek() in ("*", "/"):
      op, rhs = self.take(), self.factor(depth)
      if op == "*":
        value *= rhs
      elif rhs == 0:
        raise ExprError("division by zero")
      else:
        value /= rhs
    return value

  def factor(self, depth: int) -> Fraction:
    if depth > self.max_depth:
      raise ExprError(f"nesting deeper than {self.max_depth}")
    tok = self.take()
    if tok == "(":
      value = self.expr(depth + 1)
      if self.take() != ")":
        raise ExprError("missing ')'")
      return value
    if tok == "-" and self.allow_unary_minus:
      return -self.factor(depth + 1)
    if tok.isdigit():
      self.numbers.append(int(tok))
      return Fraction(int(tok))
    raise ExprError(f"unexpected {tok!r}")

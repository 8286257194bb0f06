"""Calculator tool: a multi-turn env whose episode is one growing sequence.

Prompt "<bos>123*45?". The policy may call the tool; the env answers with an observation:

  action 1   <calc>123*45</calc>      policy tokens (loss_mask 1); the close marker ends a turn
  obs        <obs>5535</obs>          env tokens (loss_mask 0), appended by `step`
  action 2   5535<eos>                policy tokens; EOS ends the episode

`step` answers an action that ends with `</calc>` with the value of the expression after
the action's last `<calc>` (`rljax.envs.expr.parse`, unary minus allowed; a fraction is
written "7/2"; a bad expression gets "<obs>error</obs>", which is the model's problem,
not the env's; the step's info counts it in `tool_errors`). An action that ends any other
way (EOS, or truncated) ends the episode, as does the last of `max_turns` actions.
`verify` reads the answer between the last `</obs>` and the first EOS, as in the
arithmetic env.

The expression is a flat chain of min_operands..max_operands operands with ops drawn from
`ops` (any of + - *); its split key is `arithmetic.canonical_key`, so a two-operand
problem is in the same split here as in the arithmetic env.
"""

from __future__ import annotations

import numpy as np

from rljax.envs import expr
from rljax.envs.arithmetic import canonical_key, check_int_answer, draw_operand
from rljax.envs.base import BaseEnv, SFTTarget, StepResult, Task, Verdict
from rljax.envs.tokenizer import CALL_CLOSE, CALL_OPEN, OBS_CLOSE, OBS_OPEN


def tool_result(expression: str) -> str:
  """What the calculator answers, as text."""
  try:
    return expr.format_value(expr.parse(expression, allow_unary_minus=True).value)
  except expr.ExprError:
    return "error"


class CalculatorEnv(BaseEnv):
  name = "calculator"

  def __init__(self, *, min_digits: int = 2, max_digits: int = 3, min_operands: int = 2,
               max_operands: int = 2, ops: tuple[str, ...] = ("*",), max_turns: int = 3,
               **kwargs):
    super().__init__(**kwargs)
    if not 1 <= min_digits <= max_digits or not 2 <= min_operands <= max_operands:
      raise ValueError("need 1 <= min_digits <= max_digits and 2 <= min_operands <= max_operands")
    if not ops or any(op not in "+-*" for op in ops):
      raise ValueError("ops must be a non-empty subset of + - *")
    if max_turns < 1:
      raise ValueError("max_turns must be >= 1")
    self.min_digits, self.max_digits = min_digits, max_digits
    self.min_operands, self.max_operands = min_operands, max_operands
    self.ops, self.max_turns = tuple(ops), max_turns
    ids = {}
    for marker in (CALL_OPEN, CALL_CLOSE, OBS_OPEN, OBS_CLOSE):
      ids[marker] = self.tokenizer.token_to_id(marker)
      if ids[marker] is None or list(self.tokenizer.encode(marker)) != [ids[marker]]:
        raise ValueError(f"the tokenizer must encode {marker!r} as a single token")
    self.call_close_id, self.obs_close_id = ids[CALL_CLOSE], ids[OBS_CLOSE]

  @property
  def stop_ids(self) -> tuple[int, ...]:
    return super().stop_ids + (self.call_close_id,)

  def _sample(self, rng: np.random.Generator) -> Task:
    k = int(rng.integers(self.min_operands, self.max_operands + 1))
    operands = tuple(draw_operand(rng, self.min_digits, self.max_digits) for _ in range(k))
    ops = tuple(self.ops[int(rng.integers(len(self.ops)))] for _ in range(k - 1))
    expression = str(operands[0]) + "".join(f"{o}{x}" for o, x in zip(ops, operands[1:]))
    result = int(expr.parse(expression).value)
    text = f"{expression}?"
    return Task(self.name, text, canonical_key(operands, ops), self._prompt_ids(text),
                str(result), {"expression": expression, "result": result})

  def observation(self, expression: str) -> np.ndarray:
    return self.tokenizer.encode(f"{OBS_OPEN}{tool_result(expression)}{OBS_CLOSE}")

  def step(self, task: Task, history_ids: np.ndarray, action_ids: np.ndarray) -> StepResult:
    self.latency.sleep()
    action = np.asarray(action_ids).reshape(-1)
    turn = int(np.sum(np.asarray(history_ids) == self.obs_close_id)) + 1
    if not len(action) or action[-1] != self.call_close_id or turn >= self.max_turns:
      return StepResult(None, True)
    text = self._decode(action)
    if text is None or CALL_OPEN not in text or not text.endswith(CALL_CLOSE):
      return self._malformed_call()
    return self._answer_call(text[text.rindex(CALL_OPEN) + len(CALL_OPEN):-len(CALL_CLOSE)])

  def _malformed_call(self) -> StepResult:
    """The observation of an action that ends the turn with a call it never opened."""
    return StepResult(self.tokenizer.encode(f"{OBS_OPEN}error{OBS_CLOSE}"), False,
                      info={"tool_calls": 1, "tool_errors": 1})

  def _answer_call(self, call: str) -> StepResult:
    """The tool's answer to one call (the text between the markers)."""
    value = tool_result(call)
    return StepResult(self.tokenizer.encode(f"{OBS_OPEN}{value}{OBS_CLOSE}"), False,
                      info={"tool_calls": 1, "tool_errors": int(value == "error")})

  def verify(self, task: Task, completion_ids: np.ndarray) -> Verdict:
    text = self._answer_text(completion_ids)
    if isinstance(text, Verdict):
      return text
    verdict = check_int_answer(text.rsplit(OBS_CLOSE, 1)[-1], task.data["result"])
    verdict.info["tool_calls"] = text.count(CALL_OPEN)
    return verdict

  def sft_target(self, task: Task) -> SFTTarget:
    """One tool call, its observation (loss_mask 0), then the answer."""
    tok = self.tokenizer
    call = tok.encode(f"{CALL_OPEN}{task.data['expression']}{CALL_CLOSE}")
    obs = self.observation(task.data["expression"])
    answer = np.concatenate([tok.encode(task.answer), [tok.eos_id]])
    ids = np.concatenate([call, obs, answer]).astype(np.int32)
    mask = np.concatenate([np.ones(len(call)), np.zeros(len(obs)), np.ones(len(answer))])
    return SFTTarget(ids, mask.astype(bool))

"""Envs: tokenizers (char, HF tokenizers, a transformers directory with a chat template and
two stop ids), deterministic disjoint splits, verifiers, the safe parser, guards, the
multi-turn flow, injected latency, envs by import path."""

import ast
import pathlib
import threading
import time
import types
from fractions import Fraction

from hypothesis import given, settings, strategies as st
import numpy as np
import pytest

from rljax import envs
from rljax.engine.scheduler import SamplingParams
from rljax.envs import expr
from rljax.envs.base import BaseEnv
from rljax.envs.tokenizer import (CALL_CLOSE_ID, CHARS, EOS_ID, SPECIAL_TOKENS,
                                  CharTokenizer, HFTokenizer, TransformersTokenizer,
                                  train_byte_level_bpe)
from rljax.pipeline import rollout as rollout_lib
from rljax.rl.trajectory import Outcome

TOK = CharTokenizer()
FAST = settings(max_examples=150, deadline=None)


def ids(text):
  return TOK.encode(text)


def make_envs():
  return [envs.ArithmeticEnv(max_digits=2, ops=("+", "*")), envs.CountdownEnv(),
          envs.CalculatorEnv(ops=("+", "-", "*"), max_operands=3)]


# ------------------------------------------------------------------------------ tokenizer


@FAST
@given(st.lists(st.sampled_from(SPECIAL_TOKENS + tuple(CHARS)), max_size=40))
def test_char_tokenizer_round_trip(pieces):
  text = "".join(pieces)
  encoded = TOK.encode(text)
  assert encoded.dtype == np.int32 and len(encoded) == len(pieces)
  assert TOK.decode(encoded) == text
  assert TOK.decode(encoded, skip_special_tokens=True) == "".join(
      p for p in pieces if p not in SPECIAL_TOKENS)


def test_char_tokenizer_fixed_vocab_and_errors():
  assert TOK.vocab_size <= 64
  assert (TOK.pad_id, TOK.bos_id, TOK.eos_id) == (0, 1, 2)
  assert list(TOK.encode("<calc>1</calc>")) == [3, TOK.token_to_id("1"), CALL_CLOSE_ID]
  for bad in ("A", "12%3", "<foo>", "<", "é"):
    with pytest.raises(ValueError):
      TOK.encode(bad)
  for bad_ids in ([TOK.vocab_size], [-1], [1, 127]):
    with pytest.raises(ValueError):
      TOK.decode(bad_ids)


def _tiny_hf_tokenizer():
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=list(SPECIAL_TOKENS),
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tok.train_from_iterator(["12+34=46", "123*45=5535", "3 5 2 7 to 16=", "(3+5)*2"] * 5,
                          trainer=trainer)
  return tok


def test_hf_tokenizer_adapter(tmp_path):
  raw = _tiny_hf_tokenizer()
  raw.save(str(tmp_path / "tokenizer.json"))
  for tok in (HFTokenizer(raw), HFTokenizer.from_file(tmp_path / "tokenizer.json")):
    assert tok.eos_id == raw.token_to_id("<eos>") and tok.bos_id == raw.token_to_id("<bos>")
    text = "<calc>123*45</calc><obs>5535</obs>5535 to 16=(3+5)"
    encoded = tok.encode(text)
    assert encoded.dtype == np.int32 and tok.decode(encoded) == text
    assert list(tok.encode("<calc>")) == [tok.token_to_id("<calc>")]
    with pytest.raises(ValueError):
      tok.decode([tok.vocab_size])
  with pytest.raises(ValueError):
    HFTokenizer(raw, eos_token="</s>")
  # The envs run unchanged on it, multi-turn included.
  for env in (envs.ArithmeticEnv(tokenizer=tok), envs.CountdownEnv(tokenizer=tok),
              envs.CalculatorEnv(tokenizer=tok)):
    for task in env.prompts("train", 5, seed=0):
      assert task.prompt_ids[0] == tok.bos_id
      target = env.sft_target(task).completion_ids
      if env.max_turns > 1:
        episode = envs.rollout(env, task, _scripted(_actions(env, env.sft_target(task))))
        np.testing.assert_array_equal(episode.completion_ids, target)
        verdict = episode.verdict
      else:
        verdict = env.verify(task, target)
      assert verdict.outcome == Outcome.SUCCESS, (task.task_id, verdict)


STOPS = ("<|im_end|>", "<|endoftext|>")
TEXTS = [f"{a}+{b}={a + b} and {a}*{b}={a * b}? <calc>{a}*{b}</calc> Why?" for a in range(20)
         for b in range(0, 200, 13)]


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
  """A real byte-level BPE tokenizer directory (Qwen's chat tokens and template)."""
  return train_byte_level_bpe(TEXTS, str(tmp_path_factory.mktemp("bpe")), vocab_size=400)


def test_transformers_tokenizer(bpe_dir):
  tok = TransformersTokenizer.from_dir(bpe_dir, stop_tokens=STOPS, chat_template=True)
  im_start, im_end, endoftext = (tok.token_to_id(t) for t in ("<|im_start|>", *STOPS))
  assert tok.stop_ids == (im_end, endoftext) and tok.eos_id == im_end
  assert tok.vocab_size == 400 and tok.bos_id is None and tok.pad_id == endoftext
  assert tok.token_to_id("<|nope|>") is None
  text = "Tom has 12 apples. <|im_end|>Ünïcode ∑ 🙂<|endoftext|>"
  ids = tok.encode(text)
  assert ids.dtype == np.int32 and tok.decode(ids) == text
  assert im_end in ids and len(tok.encode("<|im_end|>")) == 1
  assert tok.decode(ids, skip_special_tokens=True) == "Tom has 12 apples. Ünïcode ∑ 🙂"
  with pytest.raises(ValueError, match="outside the vocabulary"):
    tok.decode([tok.vocab_size])
  chat = tok.apply_chat_template([{"role": "system", "content": "Be brief."},
                                  {"role": "user", "content": "2+2?"}])
  assert tok.decode(chat) == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
                              "2+2?<|im_end|>\n<|im_start|>assistant\n")
  assert chat[0] == im_start
  for bad in ([], "hi", [{"role": "user"}], [{"role": "user", "content": 3}]):
    with pytest.raises(ValueError, match="chat messages must be"):
      tok.apply_chat_template(bad)
  # the tokenizer's own eos token when no stop tokens are given; errors name the argument
  assert TransformersTokenizer.from_dir(bpe_dir).stop_ids == (im_end,)
  with pytest.raises(ValueError, match=r"stop_tokens: \['</s>'\] not in the vocabulary"):
    TransformersTokenizer.from_dir(bpe_dir, stop_tokens=("<|im_end|>", "</s>"))
  plain = TransformersTokenizer.from_dir(bpe_dir).hf
  plain.chat_template = None
  with pytest.raises(ValueError, match="chat_template: .* has no chat template"):
    TransformersTokenizer(plain, chat_template=True)


def test_envs_on_a_chat_tokenizer_with_two_stop_ids(bpe_dir):
  tok = TransformersTokenizer.from_dir(bpe_dir, stop_tokens=STOPS, chat_template=True)
  im_end, endoftext = tok.stop_ids
  env = envs.ArithmeticEnv(max_digits=2, tokenizer=tok)
  assert env.stop_ids == (im_end, endoftext)
  task = env.prompts("train", 1, seed=0)[0]
  assert tok.decode(task.prompt_ids) == (f"<|im_start|>user\n{task.task_id}<|im_end|>\n"
                                         "<|im_start|>assistant\n")
  target = env.sft_target(task).completion_ids
  assert target[-1] == im_end and tok.decode(target[:-1]) == task.answer
  # either stop id ends the answer; without one it is a model failure
  answer = tok.encode(task.answer)
  for stop in (im_end, endoftext):
    assert env.verify(task, np.append(answer, [stop, 7])).outcome == Outcome.SUCCESS
  assert env.verify(task, answer).info["reason"] == "no eos"
  assert env.verify(task, np.append(tok.encode(task.answer + "1"), endoftext)
                    ).info["reason"] == "wrong"
  # the rollout asks the engine to stop on every stop id besides EOS
  runner = rollout_lib.EpisodeRunner(types.SimpleNamespace(eos_id=im_end), env,
                                     sampling=SamplingParams(), seed=0)
  runner.close()
  assert runner.sampling.stop_tokens == (endoftext,)


# --------------------------------------------------------------------------------- splits


@pytest.mark.parametrize("env", make_envs(), ids=lambda e: e.name)
def test_prompts_deterministic(env):
  a, b = env.prompts("train", 40, seed=7), env.prompts("train", 40, seed=7)
  assert [t.task_id for t in a] == [t.task_id for t in b]
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x.prompt_ids, y.prompt_ids)
    assert x.prompt_ids.dtype == np.int32 and x.prompt_ids[0] == TOK.bos_id
    assert TOK.decode(x.prompt_ids[1:]) == x.task_id
  assert len({t.task_id for t in a}) == 40  # distinct within a call
  assert [t.task_id for t in env.prompts("train", 10, seed=7)] == [t.task_id for t in a[:10]]
  assert [t.task_id for t in env.prompts("train", 40, seed=8)] != [t.task_id for t in a]
  with pytest.raises(ValueError):
    env.prompts("test", 1, seed=0)


@pytest.mark.parametrize("env", make_envs(), ids=lambda e: e.name)
def test_train_and_held_out_are_disjoint(env):
  train = [t for seed in range(3) for t in env.prompts("train", 300, seed=seed)]
  held = [t for seed in range(3) for t in env.prompts("held_out", 40, seed=seed)]
  assert {t.split_key for t in train}.isdisjoint({t.split_key for t in held})
  assert {t.task_id for t in train}.isdisjoint({t.task_id for t in held})
  assert all(envs.split_of(t.split_key, env.held_out_fraction) == "held_out" for t in held)


def test_split_ignores_seed_difficulty_and_operand_order():
  easy = envs.ArithmeticEnv(max_digits=2, ops=("*",))
  hard = envs.ArithmeticEnv(min_digits=1, max_digits=3, ops=("+", "*"))
  held_keys = {t.split_key for s in range(3) for t in hard.prompts("held_out", 100, seed=s)}
  train_keys = {t.split_key for s in range(3) for t in easy.prompts("train", 500, seed=s)}
  assert held_keys.isdisjoint(train_keys)
  # A commuted problem has the same key, so it can never sit in the other split.
  task = easy.prompts("train", 1, seed=0)[0]
  a, b = task.data["operands"]
  assert task.split_key == envs.arithmetic.canonical_key((b, a), ("*",))
  # Calculator two-operand problems share the arithmetic split.
  calc = envs.CalculatorEnv(max_digits=2)
  calc_held = {t.split_key for t in calc.prompts("held_out", 50, seed=0)}
  assert calc_held.isdisjoint(train_keys)


def test_small_problem_space_raises_instead_of_looping():
  env = envs.ArithmeticEnv(max_digits=1, held_out_fraction=0.1)
  with pytest.raises(ValueError, match="distinct"):
    env.prompts("held_out", 60, seed=0)  # about 5 of the 55 one-digit sums are held out


# ------------------------------------------------------------------------------ verifiers


def test_arithmetic_verify():
  env = envs.ArithmeticEnv()
  task = next(t for t in env.prompts("train", 50, seed=0) if t.data["result"] >= 10)
  right = task.answer
  wrong = str(int(right) + 1)
  cases = {
      right + "<eos>": (Outcome.SUCCESS, None),
      " " + right + " <eos><pad><pad>": (Outcome.SUCCESS, None),
      wrong + "<eos>": (Outcome.MODEL_FAILURE, "wrong"),
      right: (Outcome.MODEL_FAILURE, "no eos"),
      right[0] + "a" + right[1:] + "<eos>": (Outcome.MODEL_FAILURE, "malformed"),
      "<eos>": (Outcome.MODEL_FAILURE, "malformed"),
      "<calc>" + right + "<eos>": (Outcome.MODEL_FAILURE, "malformed"),
      "9" * 5000 + "<eos>": (Outcome.MODEL_FAILURE, "malformed"),
  }
  for text, (outcome, reason) in cases.items():
    verdict = env.verify(task, ids(text))
    assert verdict.outcome == outcome and verdict.info.get("reason") == reason, text[:20]
    assert verdict.reward == (1.0 if outcome == Outcome.SUCCESS else 0.0)
  # Ids the char tokenizer does not have (a 128-entry model vocabulary) are the model's fault.
  verdict = env.verify(task, np.array([100, EOS_ID]))
  assert verdict.outcome == Outcome.MODEL_FAILURE and verdict.info["reason"] == "undecodable"
  np.testing.assert_array_equal(env.sft_target(task).completion_ids, ids(right + "<eos>"))


def test_arithmetic_partial_credit():
  env = envs.ArithmeticEnv(min_digits=3, max_digits=3, partial_credit=0.5)
  task = next(t for t in env.prompts("train", 50, seed=0) if t.data["result"] >= 1000)
  right = task.answer  # four digits
  one_off = right[:-1] + str((int(right[-1]) + 1) % 10)
  cases = {right: (Outcome.SUCCESS, 1.0),
           one_off: (Outcome.MODEL_FAILURE, 0.5 * 3 / 4),
           right[1:]: (Outcome.MODEL_FAILURE, 0.5 * 3 / 4),  # dropped the leading digit
           "1" + right: (Outcome.MODEL_FAILURE, 0.5 * 4 / 5),
           "-" + right: (Outcome.MODEL_FAILURE, 0.5 * 4 / 5),
           "x" + right: (Outcome.MODEL_FAILURE, 0.0)}  # malformed: no credit
  for text, (outcome, reward) in cases.items():
    verdict = env.verify(task, ids(text + "<eos>"))
    assert verdict.outcome == outcome and verdict.reward == pytest.approx(reward), text
  assert envs.ArithmeticEnv().verify(task, ids(one_off + "<eos>")).reward == 0.0
  with pytest.raises(ValueError, match="partial_credit"):
    envs.ArithmeticEnv(partial_credit=1.0)


def test_arithmetic_little_endian():
  """Numbers least-significant digit first in the prompt and the answer; only the exact
  reversed digits succeed."""
  env = envs.ArithmeticEnv(min_digits=3, max_digits=3, little_endian=True)
  big_endian = envs.ArithmeticEnv(min_digits=3, max_digits=3)
  for le, be in zip(env.prompts("train", 20, seed=3), big_endian.prompts("train", 20, seed=3)):
    a, b = le.data["operands"]
    assert le.data == be.data and le.split_key == be.split_key  # same tasks, same splits
    assert le.task_id == f"{str(a)[::-1]}+{str(b)[::-1]}=" and le.answer == be.answer[::-1]
  task = next(t for t in env.prompts("train", 200, seed=0) if t.data["result"] % 10 == 0)
  right = task.answer  # starts with "0": the result's trailing zero, written first
  cases = {right: Outcome.SUCCESS,
           " " + right + " ": Outcome.SUCCESS,
           right[::-1]: Outcome.MODEL_FAILURE,  # the usual order is wrong here
           right + "0": Outcome.MODEL_FAILURE,  # "0" more: a leading zero, not the digits
           right[1:]: Outcome.MODEL_FAILURE,
           "-" + right: Outcome.MODEL_FAILURE,
           right[:1] + "a" + right[1:]: Outcome.MODEL_FAILURE}
  for text, outcome in cases.items():
    assert env.verify(task, ids(text + "<eos>")).outcome == outcome, text
  np.testing.assert_array_equal(env.sft_target(task).completion_ids, ids(right + "<eos>"))
  credit = envs.ArithmeticEnv(min_digits=3, max_digits=3, little_endian=True,
                              partial_credit=0.5)
  one_off = str((int(right[0]) + 1) % 10) + right[1:]  # the units digit wrong
  width = len(right)
  assert credit.verify(task, ids(one_off + "<eos>")).reward == pytest.approx(
      0.5 * (width - 1) / width)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 127), max_size=30), st.integers(0, 2))
def test_verifiers_never_raise_on_model_ids(completion, which):
  env = make_envs()[which]
  task = env.prompts("train", 1, seed=which)[0]
  verdict = env.verify(task, np.array(completion + [EOS_ID], np.int32))
  assert verdict.outcome in (Outcome.SUCCESS, Outcome.MODEL_FAILURE)


def test_countdown_verify():
  env = envs.CountdownEnv()
  task = envs.base.Task("countdown", "3 5 2 7 to 16=", "2 3 5 7 to 16", ids("<bos>3 5 2 7 to 16="),
                        "(3+5)*2", {"numbers": (3, 5, 2, 7), "target": 16})
  cases = {
      "(3+5)*2": (Outcome.SUCCESS, None),
      "7+3*2+ (5-2)": (Outcome.MODEL_FAILURE, "numbers"),  # 2 used twice
      "3*5+1": (Outcome.MODEL_FAILURE, "numbers"),  # 1 is not given
      "16": (Outcome.MODEL_FAILURE, "numbers"),
      "7/(5-5)": (Outcome.MODEL_FAILURE, "malformed"),  # parsed (division by zero) first
      "2*7/(5-3)": (Outcome.MODEL_FAILURE, "wrong"),
      "(3+5)*2)": (Outcome.MODEL_FAILURE, "malformed"),
      "-3+5": (Outcome.MODEL_FAILURE, "malformed"),  # no unary minus in countdown
      "abs(3)": (Outcome.MODEL_FAILURE, "malformed"),
      "": (Outcome.MODEL_FAILURE, "malformed"),
      "5*2+7-3/3": (Outcome.MODEL_FAILURE, "numbers"),
  }
  for text, (outcome, reason) in cases.items():
    verdict = env.verify(task, ids(text + "<eos>"))
    assert verdict.outcome == outcome and verdict.info.get("reason") == reason, (text, verdict)
  # Division by zero over allowed numbers is a model failure, not a crash.
  task2 = envs.base.Task("countdown", "4 4 9 to 9=", "4 4 9 to 9", ids("<bos>4 4 9 to 9="),
                         "9*(4/4)", {"numbers": (4, 4, 9), "target": 9})
  verdict = env.verify(task2, ids("9/(4-4)<eos>"))
  assert verdict.outcome == Outcome.MODEL_FAILURE and verdict.info["reason"] == "malformed"
  assert "division by zero" in verdict.info["error"]
  assert env.verify(task2, ids("9*4/4<eos>")).outcome == Outcome.SUCCESS
  assert env.verify(task2, ids("9<eos>")).outcome == Outcome.SUCCESS  # at most once each
  strict = envs.CountdownEnv(must_use_all=True, partial_credit=0.1)
  assert strict.verify(task2, ids("9<eos>")).info["reason"] == "numbers"
  partial = strict.verify(task2, ids("9*4+4<eos>"))
  assert partial.info["reason"] == "wrong" and partial.reward == 0.1


def test_countdown_generated_tasks_are_reachable():
  env = envs.CountdownEnv(max_numbers=5)
  for task in env.prompts("train", 200, seed=3):
    numbers, target = task.data["numbers"], task.data["target"]
    assert 3 <= len(numbers) <= 5 and all(1 <= x <= 20 for x in numbers)
    assert 1 <= target <= 100 and task.task_id == f"{' '.join(map(str, numbers))} to {target}="
    parsed = expr.parse(task.answer)
    assert parsed.value == target and sorted(parsed.numbers) == sorted(numbers)
    assert env.verify(task, env.sft_target(task).completion_ids).outcome == Outcome.SUCCESS


# ---------------------------------------------------------------------------- safe parser


def _tree(max_leaves=10):
  """(text, value or None on division by zero, numbers), fully parenthesised."""
  leaf = st.integers(0, 30).map(lambda n: (str(n), Fraction(n), (n,)))

  def combine(args):
    (lt, lv, ln), op, (rt, rv, rn) = args
    if lv is None or rv is None or (op == "/" and rv == 0):
      value = None
    else:
      value = {"+": lv + rv, "-": lv - rv, "*": lv * rv, "/": lv / rv if rv else 0}[op]
    return f"({lt} {op} {rt})", value, ln + rn

  return st.recursive(
      leaf, lambda c: st.tuples(c, st.sampled_from("+-*/"), c).map(combine), max_leaves=max_leaves)


@FAST
@given(_tree())
def test_parser_matches_fraction_arithmetic_on_trees(case):
  text, value, numbers = case
  if value is None:
    with pytest.raises(expr.ExprError, match="division by zero"):
      expr.parse(text)
  else:
    parsed = expr.parse(text)
    assert parsed.value == value and parsed.numbers == numbers


@FAST
@given(st.lists(st.integers(0, 30), min_size=1, max_size=8), st.data())
def test_parser_precedence_and_associativity(numbers, data):
  ops = data.draw(st.lists(st.sampled_from("+-*/"), min_size=len(numbers) - 1,
                           max_size=len(numbers) - 1))
  text = str(numbers[0]) + "".join(f"{o}{n}" for o, n in zip(ops, numbers[1:]))
  # Oracle: fold * and / left to right into terms, then + and - left to right.
  terms, signs, zero_div = [Fraction(numbers[0])], [], False
  for op, n in zip(ops, numbers[1:]):
    if op in "*/":
      zero_div |= op == "/" and n == 0
      terms[-1] = terms[-1] * n if op == "*" else (terms[-1] / n if n else terms[-1])
    else:
      signs.append(op)
      terms.append(Fraction(n))
  value = terms[0]
  for op, t in zip(signs, terms[1:]):
    value = value + t if op == "+" else value - t
  if zero_div:
    with pytest.raises(expr.ExprError):
      expr.parse(text)
  else:
    assert expr.parse(text).value == value


def test_parser_rejects_everything_else():
  for bad in ("", " ", "1+", "(1", "1)", "()", "1 2", "007", "1.5", "2**3", "1e3", "--1",
              "__import__('os').system('true')", "(lambda: 1)()", "x", "1" * 13,
              "(" * 40 + "1" + ")" * 40, "1+" * 200 + "1"):
    with pytest.raises(expr.ExprError):
      expr.parse(bad)
  assert expr.parse("-(2-5)*-1", allow_unary_minus=True).value == -3
  assert expr.format_value(expr.parse("7/2").value) == "7/2"


def test_no_eval_anywhere_in_envs():
  forbidden = {"eval", "exec", "compile", "__import__"}
  for path in pathlib.Path(envs.__file__).parent.glob("*.py"):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        assert node.func.id not in forbidden, f"{path.name}:{node.lineno} calls {node.func.id}"


# ----------------------------------------------------------------------------- guards


class _Raising(envs.ArithmeticEnv):

  def verify(self, task, completion_ids):
    raise RuntimeError("sandbox crashed")

  def step(self, task, history_ids, action_ids):
    raise OSError("tool down")


class _Hanging(envs.ArithmeticEnv):

  def __init__(self):
    super().__init__()
    self.release = threading.Event()
    self.returned = threading.Event()

  def verify(self, task, completion_ids):
    self.release.wait(30)
    self.returned.set()
    return envs.Verdict.success()


def test_raising_and_hanging_envs_are_infra_failures():
  task = envs.ArithmeticEnv().prompts("train", 1, seed=0)[0]
  completion = ids(task.answer + "<eos>")
  verdict = envs.safe_verify(_Raising(), task, completion, timeout_s=1.0)
  assert verdict.outcome == Outcome.INFRA_FAILURE and verdict.reward == 0.0
  assert "sandbox crashed" in verdict.info["error"]

  hanging = _Hanging()
  verdict = envs.safe_verify(hanging, task, completion, timeout_s=0.2)
  # the caller is back while the env still hangs (it only returns once released)
  assert not hanging.returned.is_set()
  assert verdict.outcome == Outcome.INFRA_FAILURE and verdict.info["reason"] == "timeout"
  hanging.release.set()
  assert hanging.returned.wait(30)

  class BadVerdict(envs.ArithmeticEnv):

    def verify(self, task, completion_ids):
      return envs.Verdict(float("nan"), Outcome.SUCCESS)

  assert envs.safe_verify(BadVerdict(), task, completion).outcome == Outcome.INFRA_FAILURE
  assert envs.safe_verify(envs.ArithmeticEnv(), task, completion).outcome == Outcome.SUCCESS


def test_failing_step_ends_the_episode_as_infra_failure():
  class Broken(envs.CalculatorEnv):

    def step(self, task, history_ids, action_ids):
      raise OSError("tool down")

  env = Broken()
  task = env.prompts("train", 1, seed=0)[0]
  result = envs.safe_step(env, task, np.zeros(0, np.int32), ids("<calc>1+1</calc>"))
  assert result.done and "tool down" in result.error
  episode = envs.rollout(env, task, _scripted(_actions(env, env.sft_target(task))))
  assert episode.verdict.outcome == Outcome.INFRA_FAILURE and episode.turns == 1


# ------------------------------------------------------------------------- multi-turn flow


def _actions(env, target=None, script=None):
  """The policy's actions: the loss-masked runs of an SFT target, or a script split after
  each stop token."""
  if target is not None:
    mask = target.loss_mask
    starts = np.flatnonzero(mask & ~np.concatenate([[False], mask[:-1]]))
    ends = np.flatnonzero(mask & ~np.concatenate([mask[1:], [False]])) + 1
    return [target.completion_ids[a:b] for a, b in zip(starts, ends)]
  script, out, start = ids(script), [], 0
  for i, t in enumerate(script):
    if t in env.stop_ids:
      out.append(script[start:i + 1])
      start = i + 1
  return out + ([script[start:]] if start < len(script) else [])


def _scripted(actions):
  """A policy that replays the actions in order, whatever the sequence so far."""
  it = iter(actions)
  return lambda sequence: next(it)


def test_calculator_step_flow():
  env = envs.CalculatorEnv()
  assert isinstance(env, envs.MultiTurnEnv) and env.stop_ids == (EOS_ID, CALL_CLOSE_ID)
  task = env.prompts("train", 1, seed=0)[0]
  expression, result = task.data["expression"], task.data["result"]
  history = np.zeros(0, np.int32)
  step = env.step(task, history, ids(f"ok<calc>{expression}</calc>"))
  assert not step.done and TOK.decode(step.observation_ids) == f"<obs>{result}</obs>"
  for action, obs in ((f"<calc>{expression}+", None), (f"{result}<eos>", None),
                      ("<calc>1/0</calc>", "<obs>error</obs>"),
                      ("1+1</calc>", "<obs>error</obs>"),
                      ("<calc>7/2</calc>", "<obs>7/2</obs>"),
                      ("<calc>-3*2</calc>", "<obs>-6</obs>")):
    step = env.step(task, history, ids(action))
    assert step.done == (obs is None), action
    if obs is None:
      assert step.observation_ids is None
    else:
      assert TOK.decode(step.observation_ids) == obs
  # The last of max_turns actions gets no tool answer.
  used = ids("<calc>1</calc><obs>1</obs><calc>2</calc><obs>2</obs>")
  assert env.step(task, used, ids("<calc>3</calc>")).done

  # A whole episode is one growing sequence with observations masked out.
  target = env.sft_target(task)
  episode = envs.rollout(env, task, _scripted(_actions(env, target)))
  np.testing.assert_array_equal(episode.completion_ids, target.completion_ids)
  np.testing.assert_array_equal(episode.loss_mask, target.loss_mask)
  assert TOK.decode(episode.completion_ids[~episode.loss_mask]) == f"<obs>{result}</obs>"
  assert episode.verdict.outcome == Outcome.SUCCESS and episode.turns == 2
  assert episode.verdict.info["tool_calls"] == 1

  for script, outcome, reason in (
      (f"{result}<eos>", Outcome.SUCCESS, None),  # no tool needed
      (f"<calc>{expression}</calc>{result + 1}<eos>", Outcome.MODEL_FAILURE, "wrong"),
      ("<calc>1</calc><calc>2</calc><calc>3</calc>",
       Outcome.MODEL_FAILURE, "no eos"),
      (f"<calc>{expression}</calc>{result}", Outcome.MODEL_FAILURE, "no eos"),
  ):
    episode = envs.rollout(env, task, _scripted(_actions(env, script=script)))
    assert episode.verdict.outcome == outcome, script
    assert episode.verdict.info.get("reason") == reason, script
    assert episode.turns <= env.max_turns


# ---------------------------------------------------------------------------------- latency


def test_latency_model():
  off = envs.LatencyModel()
  assert not off.enabled and off.sample() == 0.0 and not off.sample(100).any()
  tail = envs.LatencyModel("pareto", scale_s=0.01, shape=1.1, seed=0).sample(20000)
  median, p99 = np.percentile(tail, [50, 99])
  assert tail.min() >= 0.01 and p99 > 20 * median
  body = envs.LatencyModel("lognormal", scale_s=0.05, shape=0.25, seed=0).sample(20000)
  assert abs(np.median(body) - 0.05) < 0.005 and np.percentile(body, 99) < 3 * np.median(body)
  np.testing.assert_array_equal(envs.LatencyModel("pareto", 1.0, 1.5, seed=4).sample(10),
                                envs.LatencyModel("pareto", 1.0, 1.5, seed=4).sample(10))
  assert envs.LatencyModel("pareto", 1.0, 0.5, cap_s=3.0).sample(1000).max() == 3.0
  with pytest.raises(ValueError):
    envs.LatencyModel("weibull")


def test_latency_is_applied_and_a_slow_env_times_out():
  slow = envs.ArithmeticEnv(latency=envs.LatencyModel("pareto", scale_s=0.3, shape=2.0))
  task = slow.prompts("train", 1, seed=0)[0]
  verdict = envs.safe_verify(slow, task, ids(task.answer + "<eos>"), timeout_s=0.05)
  # The env sleeps at least 0.3 s; the caller stopped waiting for it at its deadline.
  assert verdict.outcome == Outcome.INFRA_FAILURE and verdict.info["reason"] == "timeout"
  quick = envs.ArithmeticEnv(latency=envs.LatencyModel("lognormal", scale_s=0.01, shape=0.1))
  start = time.monotonic()
  assert quick.verify(task, ids(task.answer + "<eos>")).outcome == Outcome.SUCCESS
  assert time.monotonic() - start >= 0.007


def test_registry_and_protocol():
  # the dataset env needs data (test_dataset_env), function_call a tokenizer whose chat
  # template renders tools (test_function_call)
  for name in set(envs.ENVS) - {"dataset", "function_call"}:
    env = envs.make(name)
    assert isinstance(env, envs.Env) and isinstance(env, BaseEnv) and env.name == name
  with pytest.raises(ValueError, match="unknown env 'chess'"):
    envs.make("chess")


def test_env_by_import_path():
  env = envs.make("rljax.envs.countdown:CountdownEnv", max_numbers=3, tokenizer=TOK)
  assert isinstance(env, envs.CountdownEnv) and env.tokenizer is TOK
  for path, message in (("rljax.envs.nowhere:Env", "cannot import 'rljax.envs.nowhere'"),
                        ("rljax.envs.countdown:NoSuchEnv", "has no attribute 'NoSuchEnv'"),
                        ("rljax.envs.countdown:", "not an import path"),
                        ("collections:OrderedDict", "returned OrderedDict, which is not an Env")):
    with pytest.raises(ValueError, match=message):
      envs.make(path)

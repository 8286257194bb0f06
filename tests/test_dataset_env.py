"""DatasetEnv: rows of JSONL, parquet or a saved HF dataset as text or chat prompts, splits,
rewards from a reward_fn (in the verifying thread or in worker processes that are killed
at their deadline); the math_answer reward and its worked example (examples/gsm_tiny);
build() of a config with an hf tokenizer block and a dataset env."""

import importlib.util
import json
import os
import pathlib
import re
import sys
import time

import numpy as np
import pytest

from rljax import envs
from rljax.envs import expr, math_answer
from rljax.envs.dataset import DatasetEnv
from rljax.envs.processes import CallFailed, CallTimeout, ProcessPool
from rljax.envs.tokenizer import TransformersTokenizer, train_byte_level_bpe
from rljax.pipeline import wire
from rljax.pipeline.run import ConfigError, build
from rljax.rl.trajectory import Outcome

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "gsm_tiny"
MATH_REWARD = "rljax.envs.math_answer:reward_fn"
STOPS = ("<|im_end|>", "<|endoftext|>")


def _example_rows():
  with open(EXAMPLE / "train.jsonl", encoding="utf-8") as f:
    return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
  texts = [f"{r['question']}\n{r['answer']}" for r in _example_rows()]
  return train_byte_level_bpe(texts, str(tmp_path_factory.mktemp("tok")), vocab_size=512)


@pytest.fixture(scope="module")
def tok(tok_dir):
  return TransformersTokenizer.from_dir(tok_dir, stop_tokens=STOPS, chat_template=True)


def _write_jsonl(path, rows):
  with open(path, "w", encoding="utf-8") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
  return str(path)


def _answer_ids(tok, text, stop="<|im_end|>"):
  return np.append(tok.encode(text), tok.token_to_id(stop)).astype(np.int32)


# ------------------------------------------------------------------ the math answer reward


def test_final_answers_and_numbers():
  cases = {"so 3+4 = 7\n#### 7": 7, "#### 1,234": 1234, "####  $1,234.00 dollars.": 1234,
           "#### -5": -5, "#### 12\nthen more text": 12, "a #### 3 then #### 4": 4,
           r"The answer is \boxed{1234.0}.": 1234, r"\boxed{\frac{1}{2}}": 0.5,
           r"\boxed{0.5}": 0.5, r"\boxed{{12}}": 12, r"\boxed{1} or \boxed{2}": 2,
           r"\boxed{3/4}": 0.75}
  for text, number in cases.items():
    assert math_answer.parse_number(math_answer.final_answer(text)) == number, text
  for text in ("no marker 12", r"\boxed{12", "#### none", r"\boxed{}", "#### 3/0"):
    assert math_answer.parse_number(math_answer.final_answer(text)) is None, text

  reward = math_answer.reward_fn
  reference = "Half of 8 is 8/2 = <<8/2=4>>4\n#### 4"
  assert reward("q", "#### 4", answer=reference).outcome == Outcome.SUCCESS
  assert reward("q", r"so \boxed{4.0}", answer="4").outcome == Outcome.SUCCESS
  assert reward("q", "#### 5", answer=reference).info["reason"] == "wrong"
  assert reward("q", "4", answer=reference).info["reason"] == "no final answer"
  with pytest.raises(ValueError, match="reference answer has no number"):
    reward("q", "#### 4", answer="four")


def test_the_example_rows_are_right():
  rows = _example_rows()
  assert 50 <= len(rows) <= 100 and len({r["id"] for r in rows}) == len(rows)
  for row in rows:
    steps = re.findall(r"<<([^=<>]+)=([^<>]+)>>", row["answer"])
    assert steps, row["id"]
    for expression, value in steps:
      assert expr.parse(expression).value == int(value), (row["id"], expression)
    assert row["answer"].endswith(f"#### {steps[-1][1]}"), row["id"]
    assert math_answer.reward_fn(row["question"], row["answer"], **row).reward == 1.0


# ---------------------------------------------------------------------- the dataset env


def test_dataset_env_on_the_example(tok):
  env = DatasetEnv(path=str(EXAMPLE / "train.jsonl"), prompt_field="question",
                   answer_field="answer", id_field="id", reward_fn=MATH_REWARD,
                   held_out_fraction=0.2, tokenizer=tok)
  assert isinstance(env, envs.Env) and env.stop_ids == tok.stop_ids and env.has_sft_targets
  train, held = env.prompts("train", 59, seed=0), env.prompts("held_out", 11, seed=0)
  assert len({t.task_id for t in train + held}) == 70
  assert all(envs.split_of(t.task_id, 0.2) == "train" for t in train)
  assert all(envs.split_of(t.task_id, 0.2) == "held_out" for t in held)
  assert [t.task_id for t in env.prompts("train", 10, seed=0)] == [t.task_id for t in train[:10]]
  assert [t.task_id for t in env.prompts("train", 10, seed=1)] != [t.task_id for t in train[:10]]
  with pytest.raises(ValueError, match="the held_out split has 11 distinct rows, 12 were"):
    env.prompts("held_out", 12, seed=0)

  task = held[0]
  row = next(r for r in _example_rows() if r["id"] == task.task_id)
  assert tok.decode(task.prompt_ids) == (f"<|im_start|>user\n{row['question']}<|im_end|>\n"
                                         "<|im_start|>assistant\n")
  target = env.sft_target(task).completion_ids
  assert tok.decode(target) == row["answer"] + "<|im_end|>"
  number = row["answer"].rsplit("#### ", 1)[1]
  cases = {(row["answer"], "<|im_end|>"): Outcome.SUCCESS,
           (f"So \\boxed{{{number}}}", "<|endoftext|>"): Outcome.SUCCESS,
           (f"#### {int(number) + 1}", "<|im_end|>"): Outcome.MODEL_FAILURE}
  for (text, stop), outcome in cases.items():
    assert envs.safe_verify(env, task, _answer_ids(tok, text, stop)).outcome == outcome
  assert env.verify(task, tok.encode(row["answer"])).info["reason"] == "no eos"
  # a rollout host scores the task it gets from the queue (JSON) the same way
  payload = json.loads(json.dumps(wire.task_to_payload(task)))
  assert envs.safe_verify(env, wire.task_from_payload(payload), target).reward == 1.0


def test_rows_from_jsonl_parquet_and_a_saved_dataset(tmp_path, tok):
  rows = [{"key": f"k{i}", "n": 3, "split": "test" if i % 4 == 0 else "train",
           "prompt": f"Say {i} three times." if i % 2 else None,
           "messages": None if i % 2 else [{"role": "system", "content": "Be short."},
                                           {"role": "user", "content": f"Say {i}."}]}
          for i in range(12)]
  kwargs = dict(reward_fn="reward_fns:length_reward", id_field="key", split_field="split",
                success_threshold=1.0, tokenizer=tok)
  sources = [_write_jsonl(tmp_path / "rows.jsonl", rows)]
  pyarrow = pytest.importorskip("pyarrow")
  import pyarrow.parquet  # pylint: disable=import-outside-toplevel
  pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), tmp_path / "rows.parquet")
  sources.append(str(tmp_path / "rows.parquet"))
  datasets = pytest.importorskip("datasets")
  datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
  sources.append(str(tmp_path / "saved"))

  by_source = []
  for path in sources:
    env = DatasetEnv(path=path, **kwargs)
    held = env.prompts("held_out", 3, seed=0)
    assert sorted(t.task_id for t in held) == ["k0", "k4", "k8"], path
    by_source.append([(t.task_id, list(t.prompt_ids), t.data["prompt"])
                      for t in env.prompts("train", 9, seed=0)])
  assert by_source[1:] == by_source[:-1]

  env = DatasetEnv(path=sources[0], **kwargs)
  chat = next(t for t in env.prompts("train", 9, seed=0) if t.task_id == "k2")
  assert tok.decode(chat.prompt_ids) == ("<|im_start|>system\nBe short.<|im_end|>\n"
                                         "<|im_start|>user\nSay 2.<|im_end|>\n"
                                         "<|im_start|>assistant\n")
  # a number reward: >= success_threshold is a success, lower keeps its reward
  assert env.verify(chat, _answer_ids(tok, "abc")).outcome == Outcome.SUCCESS
  short = env.verify(chat, _answer_ids(tok, "ab", "<|endoftext|>"))
  assert short.outcome == Outcome.MODEL_FAILURE and short.reward == pytest.approx(2 / 3)
  # no answer_field: no SFT targets
  assert not env.has_sft_targets
  with pytest.raises(ValueError, match="no SFT targets without answer_field"):
    env.sft_target(chat)
  # rows whose prompt is too long are skipped
  limit = len(chat.prompt_ids)
  short_env = DatasetEnv(path=sources[0], max_prompt_tokens=limit, **kwargs)
  assert all(len(t.prompt_ids) <= limit for t in short_env.prompts("train", 3, seed=0))


def test_reward_fn_gets_the_prompt_and_the_other_fields(tmp_path, tok):
  path = _write_jsonl(tmp_path / "rows.jsonl", [{"prompt": "Hi", "gold": [1, 2], "n": 7}])
  for processes in (0, 1):
    env = DatasetEnv(path=path, reward_fn="reward_fns:echo_fields", held_out_fraction=0.0,
                     verifier_processes=processes, tokenizer=tok)
    (task,) = env.prompts("train", 1, seed=0)
    verdict = envs.safe_verify(env, task, _answer_ids(tok, "Hello"))
    assert verdict.outcome == Outcome.INFRA_FAILURE and verdict.info["reason"] == "exception"
    assert "AssertionError" in verdict.info["error"]
    assert repr(("Hi", "Hello", [("gold", [1, 2]), ("n", 7)])) in verdict.info["error"]
    env.close()
  bad = DatasetEnv(path=path, reward_fn="reward_fns:not_a_number", held_out_fraction=0.0,
                   tokenizer=tok)
  verdict = envs.safe_verify(bad, bad.prompts("train", 1, seed=0)[0], _answer_ids(tok, "x"))
  assert verdict.outcome == Outcome.INFRA_FAILURE and "not a number or a Verdict" in str(verdict)


def test_a_broken_reward_fn_is_an_infra_failure_of_its_kind_with_its_traceback(tmp_path, tok):
  rows = [{"prompt": f"Q{kind}", "kind": kind} for kind in ("raise", "string", "nan", "ok")]
  path = _write_jsonl(tmp_path / "rows.jsonl", rows)
  for processes in (0, 1):  # in the verifying thread, and in a worker process
    env = DatasetEnv(path=path, reward_fn="reward_fns:broken", held_out_fraction=0.0,
                     verifier_processes=processes, tokenizer=tok)
    verdicts = {t.data["fields"]["kind"]: envs.safe_verify(env, t, _answer_ids(tok, "x"))
                for t in env.prompts("train", 4, seed=0)}
    env.close()
    assert {k: (v.outcome, v.info.get("reason"), v.info.get("error_type"))
            for k, v in verdicts.items()} == {
        "raise": (Outcome.INFRA_FAILURE, "exception", "KeyError"),
        "string": (Outcome.INFRA_FAILURE, "bad_return", "bad_return"),
        "nan": (Outcome.INFRA_FAILURE, "nan", "nan"),
        "ok": (Outcome.SUCCESS, None, None)}
    # the traceback reaches the reward function's own line, worker process or not
    assert 'return fields["no_such_field"]' in verdicts["raise"].info["traceback"]
    assert "returned str '1.0', not a number" in verdicts["string"].info["error"]
  # a Verdict with a reward that is no number, or not finite, is a bad return / NaN too
  class Env(DatasetEnv):
    def verify(self, task, completion_ids):
      return envs.Verdict(task.data["fields"]["reward"], Outcome.SUCCESS)
  path = _write_jsonl(tmp_path / "v.jsonl", [{"prompt": "a", "reward": "1"}])
  env = Env(path=path, reward_fn=MATH_REWARD, held_out_fraction=0.0, tokenizer=tok)
  (task,) = env.prompts("train", 1, seed=0)
  assert envs.safe_verify(env, task, _answer_ids(tok, "x")).info["reason"] == "bad_return"
  env.verify = lambda task, ids: envs.Verdict(float("inf"), Outcome.SUCCESS)
  assert envs.safe_verify(env, task, _answer_ids(tok, "x")).info["reason"] == "nan"


def test_rows_without_an_answer_are_fine_until_sft_needs_them(tmp_path, tok):
  rows = [{"prompt": "a", "answer": "1"}, {"prompt": "b"}, {"prompt": "c", "answer": 3}]
  path = _write_jsonl(tmp_path / "rows.jsonl", rows)
  env = DatasetEnv(path=path, reward_fn=MATH_REWARD, answer_field="answer",
                   held_out_fraction=0.0, tokenizer=tok)
  tasks = {t.task_id: t for t in env.prompts("train", 3, seed=0)}  # every row is a task
  assert not env.has_sft_targets
  assert "2 of 3 rows" in env.no_sft_targets and "rows [1, 2]" in env.no_sft_targets
  assert env.sft_target(tasks["a"]).completion_ids[-1] == tok.eos_id
  for task_id, kind in (("b", "NoneType"), ("c", "int")):
    with pytest.raises(ValueError, match=rf"row {ord(task_id) - 97}: answer field 'answer' "
                       rf"\(answer_field\) is {kind}, not text: no SFT target"):
      env.sft_target(tasks[task_id])
  assert tasks["c"].data["fields"]["answer"] == 3  # reward_fn still gets the field


def test_dataset_errors_name_the_file_row_and_field(tmp_path, tok, monkeypatch):
  good = [{"prompt": "p", "answer": "1"}]

  def make(rows=None, path=None, **kwargs):
    path = path or _write_jsonl(tmp_path / "rows.jsonl", rows if rows is not None else good)
    kwargs = {"reward_fn": MATH_REWARD, "tokenizer": tok, "held_out_fraction": 0.0, **kwargs}
    return DatasetEnv(path=str(path), **kwargs)

  (tmp_path / "bad.jsonl").write_text('{"prompt": "p"}\n{"prompt": \n')
  (tmp_path / "list.jsonl").write_text('["p"]\n')
  (tmp_path / "rows.csv").write_text("prompt\np\n")
  cases = [
      (dict(path=tmp_path / "nowhere.jsonl"), "nowhere.jsonl': no such file"),
      (dict(path=tmp_path / "rows.csv"), "expected a .jsonl or .parquet file"),
      (dict(path=tmp_path / "bad.jsonl"), r"bad.jsonl:2: not JSON"),
      (dict(path=tmp_path / "list.jsonl"), r"list.jsonl:1: a row must be a JSON object"),
      (dict(rows=[]), "has no rows"),
      (dict(rows=[{"question": "p"}]), r"row 0: no text field 'prompt' \(prompt_field\)"),
      (dict(rows=[{"prompt": "p"}], id_field="id"), r"row 0: no id field 'id' \(id_field\)"),
      (dict(rows=[{"prompt": "p", "s": "dev"}], split_field="s"), "split field 's' is 'dev'"),
      (dict(reward_fn="reward_fns:nothing_here"), "has no attribute 'nothing_here'"),
      (dict(verifier_processes=-1), "verifier_processes >= 0"),
  ]
  for kwargs, message in cases:
    with pytest.raises(ValueError, match=message):
      make(**kwargs)
  # errors of a row found when its task is made
  for rows, kwargs, message in (
      ([{"prompt": "p", "completion": "c"}], {}, r"field\(s\) \['completion'\] would clash"),
      ([{"prompt": "p", "x": float("nan")}], {}, "its fields must be JSON"),
  ):
    with pytest.raises(ValueError, match=message):
      make(rows, **kwargs).prompts("train", 1, seed=0)
  chat_rows = [{"messages": [{"role": "user", "content": "p"}]}]
  with pytest.raises(ValueError, match="row 0: chat messages need a tokenizer with a chat"):
    make(chat_rows, tokenizer=envs.CharTokenizer()).prompts("train", 1, seed=0)
  # a saved DatasetDict, and the packages a format needs
  datasets = pytest.importorskip("datasets")
  split = datasets.Dataset.from_list(good)
  datasets.DatasetDict({"train": split, "test": split}).save_to_disk(str(tmp_path / "dict"))
  with pytest.raises(ValueError, match=r"holds the splits \['test', 'train'\]: point path"):
    make(path=tmp_path / "dict")
  monkeypatch.setitem(sys.modules, "datasets", None)
  with pytest.raises(ValueError, match="needs the `datasets` package, which is not installed"):
    make(path=tmp_path / "dict")
  monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
  (tmp_path / "rows.parquet").write_bytes(b"")
  with pytest.raises(ValueError, match="reading parquet needs pyarrow"):
    make(path=tmp_path / "rows.parquet")


# ------------------------------------------------------------------ verifier processes


def _gone(pid: int) -> bool:
  """No such process, or a zombie (killed; waiting for a reaper that is not ours)."""
  try:
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
      return f.read().rsplit(")", 1)[1].split()[0] == "Z"
  except FileNotFoundError:
    return True


def test_a_hung_reward_fn_is_killed_with_its_children(tmp_path, tok):
  pid_file = str(tmp_path / "pids")
  path = _write_jsonl(tmp_path / "rows.jsonl", [{"prompt": "p", "pid_file": pid_file}])
  env = DatasetEnv(path=path, reward_fn="reward_fns:hang_with_a_child", held_out_fraction=0.0,
                   verifier_processes=1, verifier_timeout_s=1.0, tokenizer=tok)
  (task,) = env.prompts("train", 1, seed=0)
  verdict = envs.safe_verify(env, task, _answer_ids(tok, "x"), timeout_s=60.0)
  assert verdict.outcome == Outcome.INFRA_FAILURE and verdict.info["reason"] == "timeout"
  assert "worker process was killed" in verdict.info["error"]  # its deadline, not safe_verify's
  worker, child = map(int, pathlib.Path(pid_file).read_text().split())
  with pytest.raises(ProcessLookupError):
    os.kill(worker, 0)  # killed and reaped
  deadline = time.monotonic() + 10.0
  while not _gone(child) and time.monotonic() < deadline:
    time.sleep(0.05)
  assert _gone(child)
  assert env._pool.pids == []  # pylint: disable=protected-access
  env.close()


def test_process_pool_replaces_a_killed_worker():
  pool = ProcessPool("time:sleep", processes=1, timeout_s=1.0)
  assert pool.call(0.0) is None
  (first,) = pool.pids
  with pytest.raises(CallTimeout):
    pool.call(120.0)
  assert pool.pids == []
  assert pool.call(0.0) is None and pool.pids != [first]
  pool.close()
  with pytest.raises(CallFailed, match="closed"):
    pool.call(0.0)
  failing = ProcessPool("math:sqrt", processes=2, timeout_s=10.0)
  assert failing.call(4.0) == 2.0
  with pytest.raises(CallFailed, match="math:sqrt raised ValueError: math domain error"):
    failing.call(-1.0)
  assert failing.call(9.0) == 3.0  # an exception keeps the worker
  failing.close()
  with pytest.raises(CallFailed, match="cannot import 'no_such_module'"):
    ProcessPool("no_such_module:f", processes=1, timeout_s=1.0).call()


# ----------------------------------------------------------------------------- build


def _example_config(tok_dir):
  spec = importlib.util.spec_from_file_location("gsm_tiny_config", EXAMPLE / "config.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(tok_dir)


def test_build_with_an_hf_tokenizer_and_a_dataset_env(tok_dir, tmp_path):
  needs = ("model", "env", "sft")
  built = build(_example_config(tok_dir), needs, devices=False)
  env = built.env
  assert isinstance(env, DatasetEnv) and isinstance(env.tokenizer, TransformersTokenizer)
  assert env.tokenizer.vocab_size == 512 and env.stop_ids == tuple(
      env.tokenizer.token_to_id(t) for t in STOPS)
  task = env.prompts("train", 1, seed=0)[0]
  assert env.verify(task, env.sft_target(task).completion_ids).outcome == Outcome.SUCCESS
  env.close()

  def error(message, **changes):
    config = _example_config(tok_dir)
    for key, value in changes.items():
      block, field = key.split("__")
      config[block][field] = value
    with pytest.raises(ConfigError, match=message):
      build(config, needs, devices=False)

  (tmp_path / "empty").mkdir()
  error(r"config.tokenizer.path: '/nowhere' is not a directory", tokenizer__path="/nowhere")
  error(r"config.tokenizer.path: .*empty' is not a tokenizer directory",
        tokenizer__path=str(tmp_path / "empty"))
  error(r"config.tokenizer.stop_tokens: \['</s>'\] not in the vocabulary",
        tokenizer__stop_tokens=("<|im_end|>", "</s>"))
  error(r"config.tokenizer has 512 ids, the model \(config.model.vocab_size\) only 256",
        model__vocab_size=256)
  error(r"config.tokenizer.kind must be one of \['char', 'env', 'hf'\], not 'sentencepiece'",
        tokenizer__kind="sentencepiece")
  error(r"config.env \(dataset\): .*no such file", env__kwargs=dict(
      path="/nowhere.jsonl", reward_fn=MATH_REWARD))
  error(r"config.sft.steps=100, but the env has no SFT targets", env__kwargs=dict(
      path=str(EXAMPLE / "train.jsonl"), prompt_field="question", reward_fn=MATH_REWARD))
  config = _example_config(tok_dir)
  config.tokenizer.chat = True
  with pytest.raises(ConfigError, match=r"takes the keys .*unknown \['chat'\]"):
    build(config, needs, devices=False)
  # without SFT targets and SFT off, or an env named by import path, it builds
  config = _example_config(tok_dir)
  config.env.name = "rljax.envs.dataset:DatasetEnv"
  del config.env.kwargs["answer_field"]
  config.sft.steps = 0
  assert not build(config, needs, devices=False).env.has_sft_targets

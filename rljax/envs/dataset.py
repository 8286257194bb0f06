"""DatasetEnv: prompts from the rows of a JSONL or parquet file (or a saved Hugging Face
`datasets` directory), completions scored by a text-level reward function.

  env = DatasetEnv(path="examples/gsm_tiny/train.jsonl", prompt_field="question",
                   answer_field="answer", reward_fn="rljax.envs.math_answer:reward_fn",
                   tokenizer=tokenizer)

Prompts. A row's prompt is its text field `prompt_field`, rendered as every env renders
text (BOS + text, or one user message through the chat template when the tokenizer has
`chat_template` on), or else chat messages in `messages_field` ([{"role", "content"},
...]), always rendered by the tokenizer's chat template.

Scoring. A completion is cut at its first stop id and decoded (no stop id, or ids that
are not tokens: a model_failure, no call); then `reward_fn(prompt, completion, **fields)`
scores the text, with `prompt` the row's prompt text or message list and `fields` the
row's other fields (all but prompt_field and messages_field). It returns a Verdict, or a
number: a reward >= `success_threshold` is a success, a lower one a model_failure with
that reward. A reward_fn that raises, returns anything else (`BadReward`: a string such
as "1.0" too), returns NaN, or overruns its deadline is an infra failure (`safe_verify`:
reasons "exception", "bad_return", "nan", "timeout"); the rollout logs the first of each
kind with its traceback and the row (`Task.data["row"]`: its index in the file).
`reward_fn` must be importable wherever episodes are scored: the trainer (it imports it
when the env is built), every rollout host, and (verifier_processes > 0) each verifier
worker, a fresh interpreter started with the caller's sys.path as PYTHONPATH: an installed
package, or a module on PYTHONPATH of every one of them (README: "Where the reward
function must import").
`reward_fn` is an import path ("package.module:function"). `verifier_processes` = N > 0
runs it in N worker processes, each killed when a call overruns `verifier_timeout_s`
(`rljax.envs.processes`; keep it below the rollout's verify timeout, 10 s, which would
otherwise give up first); 0 calls it in the verifying thread (`safe_verify`'s timeout then
abandons a hung call's thread, which keeps running).

Splits. `split_field` names a column whose values are "train" or "held_out" ("test" and
"validation" mean held_out); without one, `split_of(key, held_out_fraction)` of the row's
key: its `id_field` value, or its prompt (the text, or the messages as JSON). Rows with
a key seen before are dropped. `prompts(split, n, seed)` is the first n rows of the split
in a seeded shuffle (rows whose prompt is longer than `max_prompt_tokens` skipped).

SFT targets: the row's `answer_field` text + EOS. Without an answer_field, or with rows
that have no text there, there are none (`has_sft_targets` is False, `no_sft_targets`
says why, and `sft_target` raises): configure SFT off. Rows without an answer are fine
when SFT is off (the field, when present, still reaches reward_fn).

A task carries its prompt and fields in `Task.data` (they travel to rollout hosts as
JSON), so every field must be JSON: text, numbers, lists, objects.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from rljax.envs.base import (SPLITS, BadReward, BaseEnv, SFTTarget, Split, Task, Verdict,
                             split_of)
from rljax.envs.importing import import_object
from rljax.envs.processes import ProcessPool
from rljax.rl.trajectory import Outcome

SPLIT_VALUES: dict[str, Split] = {"train": "train", "held_out": "held_out", "test": "held_out",
                                  "validation": "held_out"}
_REWARD_ARGS = ("prompt", "completion")  # reward_fn's positional arguments


def read_rows(path: str) -> list[dict[str, Any]]:
  """The rows of a .jsonl or .parquet file, or of a directory saved by
  `datasets.Dataset.save_to_disk`."""
  if os.path.isdir(path):
    return _read_hf_dataset(path)
  if not os.path.isfile(path):
    raise ValueError(f"path {path!r}: no such file or directory")
  if path.endswith(".jsonl"):
    return _read_jsonl(path)
  if path.endswith(".parquet"):
    try:
      import pyarrow.parquet  # pylint: disable=g-import-not-at-top
    except ImportError:
      raise ValueError(f"path {path!r}: reading parquet needs pyarrow, which is not "
                       "installed") from None
    return pyarrow.parquet.read_table(path).to_pylist()
  raise ValueError(f"path {path!r}: expected a .jsonl or .parquet file, or a directory "
                   "saved by datasets.Dataset.save_to_disk")


def _read_jsonl(path: str) -> list[dict[str, Any]]:
  rows = []
  with open(path, encoding="utf-8") as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        row = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{number}: not JSON ({e})") from None
      if not isinstance(row, dict):
        raise ValueError(f"{path}:{number}: a row must be a JSON object, not "
                         f"{type(row).__name__}")
      rows.append(row)
  return rows


def _read_hf_dataset(path: str) -> list[dict[str, Any]]:
  try:
    import datasets  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise ValueError(f"path {path!r} is a directory (a saved Hugging Face dataset?): reading "
                     "one needs the `datasets` package, which is not installed; write the "
                     "rows as .jsonl or .parquet instead") from None
  try:
    data = datasets.load_from_disk(path)
  except FileNotFoundError as e:
    raise ValueError(f"path {path!r}: not a saved Hugging Face dataset ({e})") from None
  if isinstance(data, datasets.DatasetDict):
    raise ValueError(f"path {path!r} holds the splits {sorted(data)}: point path at one of "
                     f"them ({os.path.join(path, next(iter(data)))}), with split_field if "
                     "its rows name their split")
  return data.to_list()


class DatasetEnv(BaseEnv):
  name = "dataset"

  def __init__(self, *, path: str, reward_fn: str, prompt_field: str = "prompt",
               messages_field: str = "messages", answer_field: str | None = None,
               id_field: str | None = None, split_field: str | None = None,
               success_threshold: float = 1.0, max_prompt_tokens: int = 0,
               verifier_processes: int = 0, verifier_timeout_s: float = 5.0, **kwargs):
    super().__init__(**kwargs)
    if verifier_processes < 0 or verifier_timeout_s <= 0 or max_prompt_tokens < 0:
      raise ValueError("need verifier_processes >= 0, verifier_timeout_s > 0 and "
                       "max_prompt_tokens >= 0")
    self.path, self.reward_fn = path, reward_fn
    self.prompt_field, self.messages_field = prompt_field, messages_field
    self.answer_field, self.id_field = answer_field or None, id_field or None
    self.split_field = split_field or None
    self.success_threshold, self.max_prompt_tokens = success_threshold, max_prompt_tokens
    self._reward = import_object(reward_fn)  # fails here, not at the first verify
    if not callable(self._reward):
      raise ValueError(f"reward_fn {reward_fn!r} is not callable")
    self._pool = (ProcessPool(reward_fn, processes=verifier_processes,
                              timeout_s=verifier_timeout_s) if verifier_processes else None)
    self._rows = read_rows(path)
    if not self._rows:
      raise ValueError(f"path {path!r} has no rows")
    self._keys: list[str] = []
    self._split_rows: dict[str, list[int]] = {s: [] for s in SPLITS}
    seen: set[str] = set()
    for index, row in enumerate(self._rows):
      key = self._key(index, row)
      self._keys.append(key)
      if key not in seen:
        seen.add(key)
        self._split_rows[self._split(index, row, key)].append(index)
    self._tasks: dict[int, Task] = {}

  @property
  def has_sft_targets(self) -> bool:
    return not self.no_sft_targets

  @property
  def no_sft_targets(self) -> str:
    """Why the rows have no SFT targets ("" when they all do)."""
    if self.answer_field is None:
      return "no answer_field (config.env.kwargs.answer_field)"
    missing = [i for i, row in enumerate(self._rows)
               if not isinstance(row.get(self.answer_field), str)]
    if missing:
      return (f"{len(missing)} of {len(self._rows)} rows of {self.path} have no text "
              f"answer field {self.answer_field!r} (rows {missing[:5]}"
              f"{' ...' if len(missing) > 5 else ''})")
    return ""

  def close(self) -> None:
    """Stops the verifier processes, if any."""
    if self._pool is not None:
      self._pool.close()

  # ---- rows -----------------------------------------------------------------------------

  def _where(self, index: int) -> str:
    return f"{self.path} row {index}"

  def _prompt(self, index: int, row: dict[str, Any]) -> str | list:
    """The row's prompt text or chat messages."""
    if isinstance(row.get(self.prompt_field), str):
      return row[self.prompt_field]
    if isinstance(row.get(self.messages_field), list):
      return row[self.messages_field]
    raise ValueError(f"{self._where(index)}: no text field {self.prompt_field!r} "
                     f"(prompt_field) and no message list {self.messages_field!r} "
                     f"(messages_field); its fields: {sorted(row)}")

  def _key(self, index: int, row: dict[str, Any]) -> str:
    if self.id_field is None:
      prompt = self._prompt(index, row)
      return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)
    if self.id_field not in row:
      raise ValueError(f"{self._where(index)}: no id field {self.id_field!r} (id_field)")
    return str(row[self.id_field])

  def _split(self, index: int, row: dict[str, Any], key: str) -> Split:
    if self.split_field is None:
      return split_of(key, self.held_out_fraction)
    value = row.get(self.split_field)
    if value not in SPLIT_VALUES:
      raise ValueError(f"{self._where(index)}: split field {self.split_field!r} is "
                       f"{value!r}, not one of {sorted(SPLIT_VALUES)}")
    return SPLIT_VALUES[value]

  def _task(self, index: int) -> Task:
    if index in self._tasks:
      return self._tasks[index]
    row = self._rows[index]
    prompt = self._prompt(index, row)
    fields = {k: v for k, v in row.items() if k not in (self.prompt_field, self.messages_field)}
    clash = [k for k in _REWARD_ARGS if k in fields]
    if clash:
      raise ValueError(f"{self._where(index)}: field(s) {clash} would clash with "
                       f"reward_fn's arguments {_REWARD_ARGS}; rename them")
    # a row without a text answer has no SFT target (sft_target says so); scoring and GRPO
    # need none
    answer = row.get(self.answer_field) if self.answer_field is not None else None
    answer = answer if isinstance(answer, str) else ""
    data = {"prompt": prompt, "fields": fields, "row": index}
    try:
      json.dumps(data, allow_nan=False)
    except (TypeError, ValueError) as e:
      raise ValueError(f"{self._where(index)}: its fields must be JSON (they travel to "
                       f"rollout hosts): {e}") from None
    try:
      prompt_ids = (self._prompt_ids(prompt) if isinstance(prompt, str)
                    else self._chat_prompt_ids(prompt))
    except ValueError as e:
      raise ValueError(f"{self._where(index)}: {e}") from None
    task = Task(self.name, self._keys[index], self._keys[index], prompt_ids, answer, data)
    self._tasks[index] = task
    return task

  def _chat_prompt_ids(self, messages: list) -> np.ndarray:
    if not hasattr(self.tokenizer, "apply_chat_template"):
      raise ValueError(f"chat messages need a tokenizer with a chat template, not "
                       f"{type(self.tokenizer).__name__} (config.tokenizer.kind = 'hf')")
    return self.tokenizer.apply_chat_template(messages)

  def prompts(self, split: Split, n: int, seed: int) -> list[Task]:
    """The first n rows of the split in a shuffle seeded by `seed` (a prefix of the list
    for a larger n); raises when the split has fewer usable rows."""
    if split not in SPLITS:
      raise ValueError(f"split must be one of {SPLITS}, not {split!r}")
    rows = self._split_rows[split]
    tasks = []
    for j in np.random.default_rng(seed).permutation(len(rows)):
      if len(tasks) == n:
        break
      task = self._task(rows[j])
      if not self.max_prompt_tokens or len(task.prompt_ids) <= self.max_prompt_tokens:
        tasks.append(task)
    if len(tasks) < n:
      limit = f" of <= {self.max_prompt_tokens} prompt tokens" if self.max_prompt_tokens else ""
      raise ValueError(f"{self.path}: the {split} split has {len(tasks)} distinct rows{limit}, "
                       f"{n} were asked for")
    return tasks

  # ---- scoring --------------------------------------------------------------------------

  def verify(self, task: Task, completion_ids: np.ndarray) -> Verdict:
    text = self._answer_text(completion_ids)
    if isinstance(text, Verdict):
      return text
    args, fields = (task.data["prompt"], text), dict(task.data["fields"])
    if self._pool is not None:
      result = self._pool.call(*args, **fields)
    else:
      result = self._reward(*args, **fields)
    return self._as_verdict(result)

  def _as_verdict(self, result: Any) -> Verdict:
    if isinstance(result, Verdict):
      return result
    if not isinstance(result, (int, float, np.integer, np.floating)):
      text = repr(result)
      raise BadReward(f"reward_fn {self.reward_fn} returned {type(result).__name__} "
                      f"{text[:200]}{'...' if len(text) > 200 else ''}, not a number or a "
                      "Verdict")
    reward = float(result)
    if reward >= self.success_threshold:
      return Verdict(reward, Outcome.SUCCESS)
    return Verdict.model_failure("below success_threshold", reward=reward)

  def sft_target(self, task: Task) -> SFTTarget:
    if self.answer_field is None:
      raise ValueError(f"{self.path}: no SFT targets without answer_field; configure SFT "
                       "off (config.sft.steps = 0)")
    row = task.data.get("row")
    if (isinstance(row, int) and 0 <= row < len(self._rows)
        and not isinstance(self._rows[row].get(self.answer_field), str)):
      value = self._rows[row].get(self.answer_field)
      raise ValueError(f"{self._where(row)}: answer field {self.answer_field!r} "
                       f"(answer_field) is {type(value).__name__}, not text: no SFT target; "
                       "configure SFT off (config.sft.steps = 0)")
    return self._target(task.answer)

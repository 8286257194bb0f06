"""The function_call env (a `multiply` tool called through the chat template's
`<tool_call>`) and GRPO through the OpenAI endpoint (rljax.serving.harness, the loop of
experiments/study_agent_grpo.py): the env's episodes are the endpoint's records token for
token, and one update on groups a harness drove over HTTP with the `openai` SDK re-scores
every sampled token bitwise."""

import ml_collections
import numpy as np
import pytest

from configs import function_call_tiny
from rljax import envs
from rljax.envs.function_call import FunctionCallEnv, call_tool, call_text
from rljax.envs.tokenizer import TransformersTokenizer, train_byte_level_bpe
from rljax.rl.trajectory import Outcome
from rljax.serving import harness



@pytest.fixture(scope="module")
def env():
  env = envs.make("function_call", tokenizer=TransformersTokenizer.from_dir(
      function_call_tiny.TOKENIZER, stop_tokens=("<|im_end|>", "<|endoftext|>")))
  assert isinstance(env, FunctionCallEnv) and isinstance(env, envs.MultiTurnEnv)
  return env


def _ids(env, text, stop=True):
  ids = env.tokenizer.encode(text).tolist()
  return np.asarray(ids + ([env.tokenizer.eos_id] if stop else []), np.int32)


@pytest.mark.parametrize("name,arguments,error", [
    ("multiply", '{"a": 12, "b": 3}', False),
    ("add", '{"a": 12, "b": 3}', True),  # unknown tool
    ("multiply", "{not json", True),
    ("multiply", '{"a": 12}', True),  # missing
    ("multiply", '{"a": 12, "b": 3, "c": 1}', True),  # extra
    ("multiply", '{"a": 1.5, "b": 3}', True),  # not an integer
    ("multiply", '{"a": true, "b": 3}', True),  # a bool is no integer
    ("multiply", '{"a": "12", "b": 3}', True),
    ("multiply", "[12, 3]", True),
])
def test_call_tool_answers_or_errs_for_the_model(name, arguments, error):
  text, is_error = call_tool(name, arguments)
  assert is_error == error
  assert (text == "36") if not error else text.startswith("error: ")


def test_a_demonstration_is_an_episode_the_env_scores_a_success(env):
  task = env.prompts("train", 1, 0)[0]
  target = env.sft_target(task)
  ids, tok = target.completion_ids, env.tokenizer
  first = int(np.flatnonzero(np.isin(ids, tok.stop_ids))[0]) + 1
  assert tok.decode(ids[:first - 1]) == call_text(task.data["a"], task.data["b"])
  step = env.step(task, np.zeros(0, np.int32), ids[:first])
  assert not step.done and dict(step.info) == {"tool_calls": 1, "tool_errors": 0}
  obs_end = first + len(step.observation_ids)
  np.testing.assert_array_equal(ids[first:obs_end], step.observation_ids)
  assert not target.loss_mask[first:obs_end].any() and target.loss_mask[obs_end:].all()
  assert f"<tool_response>\n{task.answer}\n</tool_response>" in tok.decode(step.observation_ids)
  assert env.step(task, ids[:obs_end], ids[obs_end:]).done  # the answer: no call, the end
  assert env.verify(task, ids).outcome == Outcome.SUCCESS


def test_the_model_failures_of_an_episode(env):
  task = env.prompts("train", 1, 0)[0]
  none = np.zeros(0, np.int32)
  a, b = task.data["a"], task.data["b"]
  wrong_tool = _ids(env, call_text(a, b).replace("multiply", "add"))
  step = env.step(task, none, wrong_tool)
  assert not step.done and dict(step.info) == {"tool_calls": 1, "tool_errors": 1}
  assert "error: unknown tool" in env.tokenizer.decode(step.observation_ids)
  for action in (_ids(env, call_text(a, b)[:-3]),  # malformed: an unclosed call is content
                 _ids(env, call_text(a, b), stop=False)):  # cut by max_tokens
    assert env.step(task, none, action).done
  # the last allowed turn ends the episode even with a call
  history = np.concatenate([wrong_tool, step.observation_ids] * (env.max_turns - 1))
  assert env.step(task, history, wrong_tool).done
  verdicts = {"wrong": env.verify(task, _ids(env, str(a * b + 1))),
              "cut": env.verify(task, _ids(env, str(a * b), stop=False)),
              "a call": env.verify(task, _ids(env, call_text(a, b))),
              "right": env.verify(task, _ids(env, f" {a * b}\n"))}
  assert [v.outcome for v in verdicts.values()] == [Outcome.MODEL_FAILURE] * 3 + [Outcome.SUCCESS]
  assert verdicts["cut"].info["reason"] == "no eos"
  assert verdicts["a call"].info["reason"] == "ended on a tool call"


def test_a_tokenizer_without_a_tools_template_is_refused(tmp_path):
  with pytest.raises(ValueError, match="does not render tools"):
    FunctionCallEnv(tokenizer=TransformersTokenizer.from_dir(
        train_byte_level_bpe(["What is 1 * 2?"], str(tmp_path), vocab_size=300)))
  with pytest.raises(ValueError, match="transformers tokenizer with a chat template"):
    FunctionCallEnv()  # the char tokenizer


@pytest.fixture(scope="module")
def served(tmp_path_factory):
  """A deterministic function_call_tiny run (2 layers, 8 slots) after a short SFT, its
  in-process greedy episodes of the held-out tasks (the env's steps), and the endpoint on
  its engine."""
  # pylint: disable=import-outside-toplevel
  from rljax.pipeline import core, sft
  from rljax.pipeline.evaluate import greedy_groups
  from rljax.pipeline.run import LOCKSTEP, build
  from rljax.serving import Endpoint
  config = function_call_tiny.get_config()
  config.numerics = "deterministic"
  config.model.num_hidden_layers = 2
  config.engine = ml_collections.ConfigDict(dict(num_slots=8, max_seq_len=96,
                                                 prefill_buckets=False))
  config.sft.update(dict(steps=40, target_pass1=0.0, batch_size=16, log_every=40))
  config.rl.update(dict(prompts_per_step=2, group_size=2))
  config.eval.num_tasks = 6
  run = core.setup(build(config, LOCKSTEP), str(tmp_path_factory.mktemp("run")))
  sft.sft(run)
  run.engine.update_weights(run.serve(run.state), run.version)
  inprocess = [g.trajectories[0] for g in greedy_groups(
      run.engine, run.env, run.heldout, seed=0, max_new_tokens=config.rl.max_new_tokens)]
  with Endpoint(run.engine, run.env.tokenizer, sampling=run.built.sampling, seed=0,
                model_name=config.name, group_size=2, tool_parser="hermes") as endpoint:
    yield run, endpoint, inprocess


def test_the_harness_episode_is_the_envs_episode_token_for_token(served):
  # the same greedy policy in-process (the env's steps) and through HTTP (the openai SDK
  # with tools; the model's tool_calls run by the harness, sent back as tool messages):
  # the same ids, masks and reward; each task twice, a group of two
  run, endpoint, inprocess = served
  outs = {}
  for i, task in enumerate(run.heldout):
    for k in range(2):
      outs[f"same-{i}-{k}"] = harness.run_episode(
          endpoint.url, run.config.name, run.env, task, f"same-{i}-{k}", f"same-{i}",
          temperature=0.0, max_tokens=run.config.rl.max_new_tokens)
  assert any(o["tool_calls"] for o in outs.values()), outs  # the tool path is exercised
  groups = {g.task.task_id: g.trajectories for g in endpoint.take_groups(2)}
  assert len(groups) == len(run.heldout)
  for i, ref in enumerate(inprocess):
    for k, traj in enumerate(groups[f"same-{i}"]):
      np.testing.assert_array_equal(traj.prompt_ids, ref.prompt_ids)
      np.testing.assert_array_equal(traj.completion_ids, ref.completion_ids)
      np.testing.assert_array_equal(traj.loss_mask, ref.loss_mask)
      assert traj.reward == ref.reward == outs[f"same-{i}-{k}"]["reward"]


def test_one_grpo_step_on_episodes_a_harness_drove(served):
  import concurrent.futures  # pylint: disable=import-outside-toplevel
  from rljax.pipeline import core, grpo_update  # pylint: disable=import-outside-toplevel
  run, endpoint, _ = served
  learner = grpo_update.grpo_learner(run)
  tasks = core.task_stream(run.env, 16, 0)
  with concurrent.futures.ThreadPoolExecutor(4) as pool:
    record = harness.grpo_step(run, endpoint, pool, run.config.name, learner, tasks, 1)
  assert run.version == 1 and record["episodes"] == 4
  assert record["mismatch_tokens"] > 0 and record["mismatch_max_abs"] == 0.0  # bitwise
  assert 1.0 <= record["turns_per_episode"] <= run.env.max_turns
  assert 0.0 <= record["tool_errors_per_episode"] <= record["tool_calls_per_episode"]
  assert endpoint.stats["http_500"] == 0

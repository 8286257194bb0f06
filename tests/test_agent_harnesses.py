"""Third-party agent harnesses, unchanged, against the OpenAI-compatible endpoint
(rljax.serving): `verifiers` (a ToolEnv with a tool and a rubric, rolling out through its
OpenAI chat-completions client), the OpenAI Agents SDK (`openai-agents`: a function tool,
several turns) and `smolagents` (its ToolCallingAgent through its OpenAI model). Each is
configured only through its public API (base_url, api_key, model name, tools, headers);
each episode is named by the endpoint's `X-Episode-Id` header or a per-episode base_url;
verifiers' own `run_group` names its rollouts itself (their trajectory ids, with the group's
`X-Group-Id`: the endpoint registers them on first use).

The model is tiny and random: it answers garbage, so no test expects a meaningful tool
call. What is checked: every harness runs its real loop against the server (its requests
carry the tools), the calls are recorded as episodes whose tokens the trainer's forward
re-scores bitwise (deterministic numerics), the episodes become groups, and one GRPO
update runs on all of them with mismatch_max_abs 0.0. The tool-result path is driven with
the test's tool parser that reads a call out of every reply: verifiers and the Agents SDK
run the tool and send the call and its result back as the server sent them (the next turn
appends the rendered result); smolagents sends a called reply back as text, which the
server refuses (history_mismatch)."""

import asyncio

import numpy as np
import openai
import pytest

from test_openai_endpoint import TOOLS_TEMPLATE, _register, rescore_diff, served  # noqa: F401  pylint: disable=unused-import

SHORT = "Use the tool."  # the context is 128 tokens: instructions stay short
TOOL_NAME = "add"


@pytest.fixture(scope="module", autouse=True)
def tools_template(served):
  """The checkpoint's chat template renders the request's tools (names only: the context
  is 128 tokens) and the assistant's tool calls (this module's run: its own instance)."""
  hf = served[0].env.tokenizer.hf
  template, hf.chat_template = hf.chat_template, TOOLS_TEMPLATE
  yield
  hf.chat_template = template


GROUPS = {}  # harness -> the group its test took from the endpoint (for the GRPO update)


def _recorded_tools(endpoint, episode_id):
  """The tools of the episode's first call (every later call must send the same)."""
  with endpoint._lock:  # pylint: disable=protected-access
    return endpoint._episodes[episode_id].tools  # pylint: disable=protected-access


def _assert_tools_rendered(run, traj, names):
  """The episode's first prompt is the template's render of the harness's tools."""
  text = run.env.tokenizer.decode(traj.prompt_ids)
  assert text.startswith("<|im_start|>system\n<tools>" + "".join(f"{n} " for n in names) +
                         "</tools><|im_end|>"), text


def _finish_group(run, endpoint, name, episodes, rewards):
  """Finishes the episodes (their harness's rewards), takes their group, checks the
  trainer re-scores every sampled token bitwise."""
  names = [[c["function"]["name"] for c in _recorded_tools(endpoint, e)] for e in episodes]
  trajs = [endpoint.finish(eid, reward=r) for eid, r in zip(episodes, rewards)]
  for t, n in zip(trajs, names):
    assert t.loss_mask.any()
    _assert_tools_rendered(run, t, n)
  assert rescore_diff(run, trajs) == 0.0
  (group,) = [g for g in endpoint.take_groups(len(episodes)) if g.task.task_id == name]
  assert [t.reward for t in group.trajectories] == list(rewards)
  GROUPS[name] = group
  return trajs


# ---- verifiers -------------------------------------------------------------------------


def add(a: int, b: int) -> int:
  """Adds two integers.

  Args:
      a: the first
      b: the second
  """
  return a + b


def _verifiers_tool_env(reward_fn):
  """verifiers' ToolEnv with the `add` tool on one question, scored by `reward_fn`."""
  import verifiers as vf  # pylint: disable=import-outside-toplevel
  from datasets import Dataset  # pylint: disable=import-outside-toplevel
  dataset = Dataset.from_list([{"question": "What is 12 + 34?", "answer": "46"}])
  return vf.ToolEnv(dataset=dataset, eval_dataset=dataset, tools=[add], max_turns=3,
                    system_prompt=SHORT, rubric=vf.Rubric(funcs=[reward_fn]))


def test_verifiers_tool_env_rolls_out_through_the_endpoint(served):
  from verifiers.clients import OpenAIChatCompletionsClient  # pylint: disable=import-outside-toplevel
  run, endpoint = served

  def correct(completion, answer, **kwargs) -> float:
    text = " ".join(str(m.get("content") or "") for m in completion if m["role"] == "assistant")
    return float(answer in text)

  env = _verifiers_tool_env(correct)
  inputs = env.get_eval_dataset(n=1).to_list()
  episodes = [f"vf-{k}" for k in range(2)]

  async def rollouts():
    outs = []
    for eid in episodes:
      _register(endpoint, eid, "verifiers")
      client = OpenAIChatCompletionsClient(openai.AsyncOpenAI(
          api_key="unused", base_url=f"{endpoint.url}/episodes/{eid}/v1", max_retries=0))
      outs.append(await env.run_rollout(dict(inputs[0]), client, "rljax",
                                        {"max_tokens": 6, "temperature": 1.0}))
    return outs

  outs = asyncio.run(rollouts())
  for eid, out in zip(episodes, outs):
    assert out.get("error") is None, out.get("error")
    assert [t["function"]["name"] for t in _recorded_tools(endpoint, eid)] == [TOOL_NAME]
  _finish_group(run, endpoint, "verifiers", episodes,
                [float(o["reward"]) for o in outs])


def test_verifiers_run_group_names_its_rollouts_through_its_client_config(served):
  # verifiers' own group API, unchanged: one ClientConfig for the whole group; each
  # rollout's calls carry its trajectory_id (extra_headers_from_state) and the group's
  # X-Group-Id (extra_headers): the endpoint registers each id in the group on its first
  # call, and the group is complete when the rollouts are finished with the rubric's rewards
  from verifiers.types import ClientConfig  # pylint: disable=import-outside-toplevel
  run, endpoint = served
  before = endpoint.stats["registered_on_first_use"]

  def correct(completion, answer, **kwargs) -> float:
    text = " ".join(str(m.get("content") or "") for m in completion if m["role"] == "assistant")
    return float(answer in text) + 0.5 * len(text) / 100  # rollouts differ: a signal

  env = _verifiers_tool_env(correct)
  config = ClientConfig(api_base_url=f"{endpoint.url}/v1", api_key_var="RLJAX_TEST_NO_KEY",
                        max_retries=0, extra_headers={"X-Group-Id": "verifiers-group"},
                        extra_headers_from_state={"X-Episode-Id": "trajectory_id"})
  inputs = env.get_eval_dataset(n=1).to_list() * 2
  outs = asyncio.run(env.run_group(inputs, config, "rljax", {"max_tokens": 6},
                                   state_columns=["trajectory_id"]))
  assert all(o.get("error") is None for o in outs), [o.get("error") for o in outs]
  reward = {o["trajectory_id"]: float(o["reward"]) for o in outs}
  assert len(reward) == 2 and endpoint.stats["registered_on_first_use"] == before + 2
  with endpoint._lock:  # pylint: disable=protected-access
    episodes = [e.episode_id for e in endpoint._groups["verifiers-group"]]  # pylint: disable=protected-access
  assert sorted(episodes) == sorted(reward)
  for eid in episodes:
    assert [t["function"]["name"] for t in _recorded_tools(endpoint, eid)] == [TOOL_NAME]
  _finish_group(run, endpoint, "verifiers-group", episodes, [reward[e] for e in episodes])



# ---- the OpenAI Agents SDK ---------------------------------------------------------------


def test_openai_agents_sdk_runs_several_turns_through_the_endpoint(served):
  import agents  # pylint: disable=import-outside-toplevel
  run, endpoint = served

  @agents.function_tool
  def add(a: int, b: int) -> int:
    """Adds two integers."""
    return a + b

  def agent_for(eid):
    client = openai.AsyncOpenAI(api_key="unused", base_url=f"{endpoint.url}/v1",
                                default_headers={"X-Episode-Id": eid}, max_retries=0)
    return agents.Agent(name="calc", instructions=SHORT, tools=[add],
                        model=agents.OpenAIChatCompletionsModel("rljax", client),
                        model_settings=agents.ModelSettings(max_tokens=6))

  episodes = [f"agents-{k}" for k in range(2)]
  config = agents.RunConfig(tracing_disabled=True)

  async def episode(eid):
    agent = agent_for(eid)
    result = await agents.Runner.run(agent, "What is 12 + 34?", run_config=config, max_turns=4)
    for follow_up in ("And 7 * 8?", "Thanks."):  # more turns: the conversation goes on
      result = await agents.Runner.run(
          agent, result.to_input_list() + [{"role": "user", "content": follow_up}],
          run_config=config, max_turns=4)
    return result

  results = []
  for eid in episodes:
    _register(endpoint, eid, "openai-agents")
    results.append(asyncio.run(episode(eid)))
  for eid in episodes:
    assert [t["function"]["name"] for t in _recorded_tools(endpoint, eid)] == [TOOL_NAME]
    assert endpoint.episode(eid).turns >= 3
  _finish_group(run, endpoint, "openai-agents", episodes,
                [float("46" in str(r.final_output)) for r in results])


# ---- smolagents ---------------------------------------------------------------------------


# smolagents warns about any function defined in a test (a closure) that it wraps as a tool
@pytest.mark.filterwarnings("ignore:Function 'add' has decorators other than @tool")
def test_smolagents_tool_calling_agent_runs_through_the_endpoint(served):
  import importlib.resources  # pylint: disable=import-outside-toplevel
  import smolagents  # pylint: disable=import-outside-toplevel
  import yaml  # pylint: disable=import-outside-toplevel
  run, endpoint = served

  @smolagents.tool
  def add(a: int, b: int) -> int:
    """Adds two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b

  templates = yaml.safe_load(importlib.resources.files("smolagents.prompts").joinpath(
      "toolcalling_agent.yaml").read_text())
  templates["system_prompt"] = SHORT
  # its final-answer call resends the memory under the same system message: the episode
  # goes on (a different one would be a history_mismatch: a branch is a new episode)
  templates["final_answer"] = {"pre_messages": SHORT, "post_messages": "Answer: {{task}}"}

  def model(eid, **kwargs):
    return smolagents.OpenAIServerModel(
        "rljax", api_base=f"{endpoint.url}/episodes/{eid}/v1", api_key="unused",
        client_kwargs={"max_retries": 0}, max_tokens=6, **kwargs)

  # smolagents asks for tool_choice="required" by default: a forced call is not the
  # policy's own sample, so the server refuses it by name (never silently ignored)
  _register(endpoint, "smol-forced", "smol-forced")
  agent = smolagents.ToolCallingAgent(tools=[add], model=model("smol-forced"), max_steps=1,
                                      prompt_templates=templates, verbosity_level=0)
  with pytest.raises(smolagents.utils.AgentGenerationError, match="tool_choice=required"):
    agent.run("What is 12 + 34?")
  assert endpoint.episode("smol-forced").turns == 0
  endpoint.drop("smol-forced")

  episodes = [f"smol-{k}" for k in range(2)]
  answers = []
  for eid in episodes:
    _register(endpoint, eid, "smolagents")
    agent = smolagents.ToolCallingAgent(tools=[add], model=model(eid, tool_choice="auto"),
                                        max_steps=1, prompt_templates=templates,
                                        verbosity_level=0)
    answers.append(agent.run("What is 12 + 34?"))
  for eid, answer in zip(episodes, answers):
    # the tools it sent: ours and its own final_answer
    assert [t["function"]["name"] for t in _recorded_tools(endpoint, eid)] == [
        TOOL_NAME, "final_answer"]
    assert endpoint.episode(eid).turns == 1  # its one step
    # after max_steps without an answer it asks for one in a call without tools: a
    # different prompt than the episode's (the template renders tools), refused as a
    # branch, which smolagents returns as its answer
    assert "history_mismatch" in str(answer)
  _finish_group(run, endpoint, "smolagents", episodes,
                [float("46" in str(a)) for a in answers])


# ---- the tool-call round trip ------------------------------------------------------------


@pytest.fixture
def every_reply_calls_add(served):
  """The server's tool parser reads add(12, 34) out of every reply (the test's parser: the
  random model's tokens are garbage, so the harnesses' tool-result path needs it)."""
  from rljax.serving.tools import load_tool_parser  # pylint: disable=import-outside-toplevel
  endpoint = served[1]
  parser, endpoint.tool_parser = endpoint.tool_parser, load_tool_parser(
      "test_openai_endpoint:always_calls")
  yield
  endpoint.tool_parser = parser


def _assert_tool_round_trip(run, endpoint, eid, tool_turns):
  """The episode's turns after the first each appended the harness's tool result (46):
  the assistant's call and the tool message came back as the server sent them."""
  assert endpoint.episode(eid).turns == tool_turns + 1
  traj = endpoint.finish(eid, reward=0.0)
  text = run.env.tokenizer.decode(traj.completion_ids[~traj.loss_mask])
  assert text.count("<tool_response>\n46\n</tool_response>") == tool_turns, text
  assert rescore_diff(run, [traj]) == 0.0


@pytest.mark.filterwarnings("ignore:Function 'add' has decorators other than @tool")
def test_harnesses_run_their_tools_and_send_the_results_back(served, every_reply_calls_add):
  import agents  # pylint: disable=import-outside-toplevel
  import verifiers as vf  # pylint: disable=import-outside-toplevel
  from datasets import Dataset  # pylint: disable=import-outside-toplevel
  from verifiers.clients import OpenAIChatCompletionsClient  # pylint: disable=import-outside-toplevel
  run, endpoint = served
  ran = []

  def add(a: int, b: int) -> int:
    """Adds two integers.

    Args:
        a: the first
        b: the second
    """
    ran.append((a, b))
    return a + b

  # verifiers: every reply a call, so the ToolEnv runs the tool until max_turns
  dataset = Dataset.from_list([{"question": "What is 12 + 34?", "answer": "46"}])
  env = vf.ToolEnv(dataset=dataset, eval_dataset=dataset, tools=[add], max_turns=2,
                   system_prompt=SHORT, rubric=vf.Rubric(funcs=[lambda **kw: 0.0]))
  _register(endpoint, "vf-tools")
  client = OpenAIChatCompletionsClient(openai.AsyncOpenAI(
      api_key="unused", base_url=f"{endpoint.url}/episodes/vf-tools/v1", max_retries=0))
  out = asyncio.run(env.run_rollout(env.get_eval_dataset(n=1).to_list()[0], client, "rljax",
                                    {"max_tokens": 4}))
  assert out.get("error") is None, out.get("error")
  _assert_tool_round_trip(run, endpoint, "vf-tools", tool_turns=1)  # 2 turns: 128 tokens
  assert ran == [(12, 34)]  # the last turn's call is not run: max_turns ended the rollout

  # the Agents SDK: the function tool runs and its result goes back as the next turn
  _register(endpoint, "agents-tools")
  agent = agents.Agent(
      name="calc", instructions=SHORT, tools=[agents.function_tool(add)],
      model=agents.OpenAIChatCompletionsModel("rljax", openai.AsyncOpenAI(
          api_key="unused", base_url=f"{endpoint.url}/v1",
          default_headers={"X-Episode-Id": "agents-tools"}, max_retries=0)),
      model_settings=agents.ModelSettings(max_tokens=4))
  with pytest.raises(agents.exceptions.MaxTurnsExceeded):  # every reply calls the tool
    asyncio.run(agents.Runner.run(agent, "What is 12 + 34?", max_turns=2,
                                  run_config=agents.RunConfig(tracing_disabled=True)))
  _assert_tool_round_trip(run, endpoint, "agents-tools", tool_turns=1)
  assert ran == [(12, 34)] * 3  # the SDK ran both turns' calls, then hit max_turns

  # smolagents: its ToolCallingAgent runs the tool, but sends the call back as the text
  # "Calling tools:\n[{...}]" (an assistant message without tool_calls) and the result as a
  # user "Observation:" message: not the reply the model sampled, so the next call is a
  # history_mismatch, never a silent re-tokenization (the episode keeps its first turn)
  import importlib.resources  # pylint: disable=import-outside-toplevel
  import smolagents  # pylint: disable=import-outside-toplevel
  import yaml  # pylint: disable=import-outside-toplevel
  templates = yaml.safe_load(importlib.resources.files("smolagents.prompts").joinpath(
      "toolcalling_agent.yaml").read_text())
  templates["system_prompt"] = SHORT
  _register(endpoint, "smol-tools")
  agent = smolagents.ToolCallingAgent(
      tools=[smolagents.tool(add)], prompt_templates=templates, verbosity_level=0, max_steps=2,
      model=smolagents.OpenAIServerModel(
          "rljax", api_base=f"{endpoint.url}/episodes/smol-tools/v1", api_key="unused",
          client_kwargs={"max_retries": 0}, max_tokens=4, tool_choice="auto"))
  with pytest.raises(smolagents.utils.AgentGenerationError,
                     match=r"history_mismatch: messages\[2\] \(assistant\)"):
    agent.run("What is 12 + 34?")
  assert ran == [(12, 34)] * 4
  _assert_tool_round_trip(run, endpoint, "smol-tools", tool_turns=0)


def test_the_harnesses_episodes_train_in_one_grpo_update(served):
  from rljax.pipeline import grpo_update  # pylint: disable=import-outside-toplevel
  from rljax.pipeline import wire  # pylint: disable=import-outside-toplevel
  run, _ = served
  assert sorted(GROUPS) == ["openai-agents", "smolagents", "verifiers", "verifiers-group"]
  # one batch of the harnesses' groups (the fixture's run updates on two groups)
  run.config.rl.prompts_per_step = len(GROUPS)
  decoded = [wire.group_from_arrays(wire.group_to_arrays(g.trajectories), g.request_id)
             for g in GROUPS.values()]
  metrics = grpo_update.train_on_groups(run, grpo_update.grpo_learner(run), decoded)
  sampled = sum(int(t.loss_mask.sum()) for g in decoded for t in g)
  assert metrics["mismatch_tokens"] == sampled and metrics["mismatch_max_abs"] == 0.0
  assert np.isfinite(float(metrics["loss"])) and run.version == 1

"""A function-calling harness on the `openai` SDK, and GRPO on the episodes it drives
through an `Endpoint` (experiments/study_agent_grpo.py's loop, tests/test_function_call.py).

The harness is what agent frameworks do: chat completions with `tools`; the model's
`tool_calls` run by the harness and answered as `role: tool` messages, until a reply
without calls (the answer) or `env.max_turns` replies; each episode named by the
`X-Episode-Id` / `X-Group-Id` headers (registered on first use) and finished with its
reward (`POST /v1/episodes/{id}/finish`), or dropped (`DELETE`) when it only evaluates.
It needs of `env`: `messages(task)`, `tools`, `call_tool(name, arguments) -> (text,
is_error)`, `reward_of(task, final_content)`, `max_turns` (rljax.envs.function_call).

`grpo_step`: one rollout of `rl.prompts_per_step` tasks x `rl.group_size` episodes at
once through the endpoint, the complete groups taken from it (`take_groups`), one update
(`grpo_update.train_on_groups`), the new weights served; its `grpo` record carries the
harness's turns, tool calls and tool errors per episode. `evaluate`: held-out greedy
pass@1 through the endpoint (`temperature: 0`).
"""

from __future__ import annotations

import functools
import itertools
import time

import httpx
import numpy as np
import openai

from rljax.pipeline import grpo_update
from rljax.pipeline.watch import rollout_stats


def run_episode(url: str, model: str, env, task, episode_id: str, group_id: str | None,
                **params) -> dict:
  """One episode of a function-calling harness on the `openai` SDK against the endpoint at
  `url`: chat calls with `env.tools` until a reply without tool calls (the answer) or
  `env.max_turns` replies; then the episode is finished with its reward (`env.reward_of`
  the last reply's content). Returns the reward and the episode's turns, tool calls and
  tool errors. `group_id` None: an evaluation episode (a group of its own, dropped instead
  of finished: never trained)."""
  headers = {"X-Episode-Id": episode_id, "X-Group-Id": group_id or episode_id}
  messages, final = env.messages(task), None
  turns = tool_calls = tool_errors = 0
  with openai.OpenAI(api_key="unused", base_url=f"{url}/v1", default_headers=headers,
                     max_retries=2, timeout=600.0) as client:
    for _ in range(env.max_turns):
      try:
        reply = client.chat.completions.create(model=model, messages=messages,
                                               tools=env.tools, **params)
      except openai.BadRequestError as e:  # the context is full: the episode ends here
        if getattr(e, "code", None) != "context_length_exceeded":
          raise
        break
      turns += 1
      message = reply.choices[0].message
      messages.append(message.model_dump(exclude_none=True))
      if not message.tool_calls:
        final = message.content
        break
      for call in message.tool_calls:
        response, error = env.call_tool(call.function.name, call.function.arguments)
        tool_calls, tool_errors = tool_calls + 1, tool_errors + error
        messages.append({"role": "tool", "tool_call_id": call.id, "content": response})
  reward = env.reward_of(task, final)
  if group_id is None:
    httpx.delete(f"{url}/v1/episodes/{episode_id}", timeout=60.0).raise_for_status()
  else:
    httpx.post(f"{url}/v1/episodes/{episode_id}/finish", json={"reward": reward},
               timeout=60.0).raise_for_status()
  return {"reward": reward, "turns": turns, "tool_calls": tool_calls,
          "tool_errors": tool_errors}


def episode_means(outs: list[dict]) -> dict:
  return {"pass1": float(np.mean([o["reward"] for o in outs])),
          **{f"{k}_per_episode": float(np.mean([o[k] for o in outs]))
             for k in ("turns", "tool_calls", "tool_errors")}}


def run_all(pool, episodes) -> list[dict]:
  """Every episode (a `run_episode` call) at once: the endpoint batches their turns;
  results in order."""
  return [f.result() for f in [pool.submit(episode) for episode in episodes]]


def evaluate(run, endpoint, pool, model: str, name: str) -> dict:
  """Held-out greedy pass@1 through the endpoint (an `endpoint_eval` record)."""
  t0 = time.perf_counter()
  episodes = [functools.partial(run_episode, endpoint.url, model, run.env, task,
                                f"eval-{name}-{i}", None, temperature=0.0,
                                max_tokens=run.config.rl.max_new_tokens)
              for i, task in enumerate(run.heldout)]
  out = episode_means(run_all(pool, episodes)) | {"eval_s": time.perf_counter() - t0}
  run.log.write("endpoint_eval", run.version, out)
  return out


def grpo_step(run, endpoint, pool, model: str, learner, tasks, step: int) -> dict:
  """One rollout through the endpoint, one update on the groups it recorded, the new
  weights served."""
  c = run.config.rl
  t0 = time.perf_counter()
  episodes = [functools.partial(run_episode, endpoint.url, model, run.env, task,
                                f"s{step}-p{p}-e{k}", f"s{step}-p{p}",
                                max_tokens=c.max_new_tokens)
              for p, task in enumerate(itertools.islice(tasks, c.prompts_per_step))
              for k in range(c.group_size)]
  outs = run_all(pool, episodes)
  groups = endpoint.take_groups(c.group_size)
  if len(groups) != c.prompts_per_step:
    raise RuntimeError(f"step {step}: {len(groups)} complete groups, not {c.prompts_per_step}")
  t1 = time.perf_counter()
  metrics = grpo_update.train_on_groups(run, learner, [g.trajectories for g in groups])
  endpoint.update_weights(run.serve(run.state), run.version)
  t2 = time.perf_counter()
  stats = rollout_stats([t for g in groups for t in g.trajectories])
  means = episode_means(outs)
  record = metrics | stats | {k: v for k, v in means.items() if k != "pass1"} | {
      "rollout_s": t1 - t0, "train_s": t2 - t1}
  return run.log.write("grpo", run.version, record)

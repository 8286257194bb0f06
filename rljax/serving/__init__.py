"""rljax.serving: an OpenAI-compatible HTTP endpoint on a `DecodeEngine` that records every call as a
token-space `Trajectory`: an external agent loop (any OpenAI client, someone else's
harness) drives the engine, and the trainer gets the episodes like env-made ones.

Endpoints (JSON over HTTP/1.1, `http.server.ThreadingHTTPServer`; `stream: true`: the
same call as server-sent events, text as the engine steps produce it: `stream.py`):

  POST /v1/episodes                  {"episode_id"?, "group_id"?} -> {"episode_id", ...}
  POST /v1/chat/completions          messages -> one assistant reply (the chat template)
  POST /v1/completions               prompt (text, or token ids) -> one completion
  POST /v1/episodes/{id}/finish      {"reward": r, "outcome"?} -> the episode is a Trajectory
  GET  /v1/episodes/{id}             the record so far (turns, token counts, state)
  DELETE /v1/episodes/{id}           forget an unfinished episode (its group stops waiting)
  GET  /v1/models, GET /v1/models/{id}, GET /health

Episodes. Every generation call belongs to an episode the harness registered first
(`POST /v1/episodes`; an unknown id is a 404, never a silently new episode, unless the
call names its group: below). A call names it by `extra_body={"episode_id": ...}`, by
the header `X-Episode-Id`, or by its base URL:
`OpenAI(base_url=f"{server}/episodes/{id}/v1")` serves that episode's calls with no extra
field at all (for harnesses that cannot add one). One call at a time per episode (a second
waits for the first, up to `busy_wait_s`; then 409).
`group_id` (default: the episode id) groups episodes for GRPO: the trainer takes complete
groups (`Endpoint.take_groups(group_size)`: `group_size` finished episodes, none open).
A call that also names its group (`extra_body={"group_id": ...}` or `X-Group-Id`)
registers an unknown episode id in that group on first use (within `group_size`; a known
one must be in that group, else 400 `wrong_group`): for harnesses that name each rollout
themselves and cannot register it first, e.g. verifiers' own `env.run_group` with
`ClientConfig(extra_headers={"X-Group-Id": g}, extra_headers_from_state={"X-Episode-Id":
"trajectory_id"})` (`stats["registered_on_first_use"]`).

Token space. An episode is one growing token sequence, as a multi-turn env episode is:
turn n's prompt is every earlier prompt and sampled token of the episode followed by the
tokens of only what the harness appended since (never a re-tokenization of the history).
The engine keeps the sequence parked between turns (`Request(keep_pages=True)`) and
continues it with `extend` (only the new tokens are prefilled: the earlier turns' KV is
reused). When more episodes are open than the page pool holds (`max_resident`, default
what the pool holds at max_seq_len each), the least recently used parked one is released;
its next turn is a fresh `submit` of the recorded tokens plus the new ones under the same
request id, so the sampling keys (seed, request id, sample 0, position) and, in
deterministic numerics, every recorded bit are what `extend` would have given (tested).
A turn whose sampling differs from the parked request's (other stop tokens) takes the same
fresh path.

Chat templating is incremental (`rljax.envs.chat`, shared with the envs that speak
through a chat template: `function_call`'s episodes are the endpoint's, token for token).
The first call's messages are rendered by the tokenizer's
chat template with the generation prompt and tokenized. A later call must repeat the
recorded conversation exactly (every earlier message, and the assistant replies exactly as
this server returned them: role and content compared) and append at least one non-assistant
message; otherwise 400 `history_mismatch` (a harness that edits history starts a new
episode). The appended tokens are the template applied to the delta, in context: the
conversation is rendered with the last reply's content replaced by a sentinel and the new
messages after it; only the text after the sentinel (the template's close of the reply,
the new messages, the generation prompt) is tokenized. If the reply ended on a stop token
whose text begins that close (`<|im_end|>`), that text is dropped (the token was sampled);
a reply cut by max_tokens gets the close as observation tokens. Templates that rewrite
earlier turns (Qwen3 drops old reasoning) therefore never change recorded tokens: the
policy's context is what it sampled. Tokenizers without a chat template (the char
tokenizer) serve `/v1/completions` only.

Completions: `prompt` is text or a list of token ids, fixed per episode. Text: a later
prompt must start with the episode's text so far (its prompts and the returned completion
texts, without a final stop token's text); the rest is tokenized. Token ids: a later
prompt must start with every token of the episode (stop tokens included); the rest is
appended as is. No BOS is added.

Recorded per episode (the Trajectory at finish): prompt_ids = the first call's prompt;
completion = every later token, sampled ones with loss_mask True, behaviour log-prob and
engine version, appended (observation/template) ones with loss_mask False, log-prob 0 and
version -1; expert_ids for every position (the engine's routing of each fed token; the
last sampled token is never fed: zeros). Every response also carries these ids in an
`rljax` field (prompt_token_ids: the tokens this call appended, completion_token_ids,
completion_logprobs), so a harness can check token in / token out itself.

Parameters: each one is honoured, or the call is a 400 naming it (`error.param`); values
that ask for nothing (`presence_penalty: 0`, `logit_bias: {}`, `store: false`, ...) pass.
Sampling is the server's (`sampling`, e.g. the config's rl block: the trainer's loss
assumes the behaviour temperature): `temperature` / `top_p` other than the server's are a
400, except `temperature: 0`, greedy (the record keeps the temperature-1 log-probs).
`seed`: the turn's sampling keys are (seed, a fixed id, position) instead of (server seed,
the episode's request id, position), so the same seed, tokens and weights sample the same
tokens in any episode. `max_tokens` (or `max_completion_tokens`) caps the turn, within
the room max_seq_len leaves (a prompt that leaves none: 400 `context_length_exceeded`).
`stop`: up to 4 strings matched on the decoded text (across tokens); the turn ends with
the token whose text completes one (a single-token one also stops the engine; otherwise
the engine's tokens after it are dropped from the record and its sequence released: the
next turn resubmits the record), finish_reason "stop", the content cut before the stop
string (recorded, not returned; a completion prompt may repeat it). `n` must be 1 (a
GRPO group is several episodes); `logprobs` returns the behaviour log-probs
(`top_logprobs` unsupported); `model` other than the server's: 404 `model_not_found`.
Registering more episodes in a group than the endpoint's `group_size`: 409 `group_full`.

Tools. A chat call's `tools` are rendered by the tokenizer's chat template
(`apply_chat_template(..., tools=...)`), fixed by the episode's first call (other tools
later: 400 `history_mismatch`); `tool_choice` "auto" or "none" (renders them, parses no
call); a forced call ("required", a named function) or `parallel_tool_calls: false` is a
400. The reply's text goes through the endpoint's `tool_parser` (`tools.py`: "hermes" for
Qwen3 / Hermes `<tool_call>{json}</tool_call>`, or `package.module:function`); calls come
back as `message.tool_calls` with finish_reason "tool_calls", the text around them as
content. Malformed calls are the model's outcome: the text is the content, finish_reason
as sampled. The harness sends the assistant message back with its `tool_calls` (compared
by name and arguments as JSON values) and `role: tool` replies (`tool_call_id`): the next
turn is the template's text after the sentinel, the reply rendered without its calls (its
sampled tokens, calls included, are recorded); the history is never re-tokenized.

Retries and lost replies (`deliveries.py`). A call whose body is the episode's last
call's (an SDK's automatic retry after a timeout or a dropped connection: the turn was
recorded, its reply never arrived) gets that call's response, waiting for it while it
still runs (`stats["replayed_calls"]`): the turn is recorded once and delivered to the
retry. A reply the client was gone for (it closed its end before the reply, or the write
failed; plain or streamed) counts in `stats["undelivered_replies"]` and leaves its turn
unseen until some retry delivers it. If instead the episode's next call fits the record
*before* that turn (the harness gave up on it: the same history with another observation
or other parameters), the turn is rolled back first: the record returns exactly to its
state before it (ids, masks, log-probs, versions, routing, conversation), the engine's
sequence holding it is released, and the call is a fresh submit of the record under the
same request id (the bits of an episode that never had the turn; tested bitwise, plain and
cut mid-stream). Finishing an episode whose last turn is unseen rolls it back too (its
only turn: 400 `empty_episode`): no trained token was unseen by its harness
(`stats["rolled_back_turns"]`). A call (or finish, or DELETE) that arrives while its
episode's turn is still running or its reply still being written (a harness that gave up on it: its
client timed out) waits for that turn and for the server's word on its delivery (up to
`busy_wait_s`, then 409 `episode_busy`), so a reply its client never got is rolled back
rather than refused as `history_mismatch`. Under load (the test: 64 episodes at once on
loopback,
every 8th dropping its first call's connection and retrying) no call is a 500.

Long episodes: one whose reply reached max_seq_len (`finish_reason` "length"), or whose
last call was refused with `context_length_exceeded`, finishes as an episode cut by the
context (`FinishReason.CONTEXT`; the trainer's `config.rl.overlong` says what it trains).

Threads. One engine-owner thread drives the engine (submits, extends, releases,
`step`, `update_weights`); HTTP handler threads validate, tokenize, enqueue a turn and wait
for it. Concurrent calls are decoded in the same engine steps (continuous batching);
`pause` / `resume` hold new turns back (those in the engine go on). No handler thread
calls JAX. An engine failure fails the calls in flight with 500 and every
later one with 503.

Modules: `api` (OpenAI schema: errors, messages, parameters), `server` (the HTTP handler),
`episodes` (episode records, registration, groups), `deliveries` (retries, undelivered
replies, rollbacks), `owner` (the engine-owner thread), `render` (a call's history against
the record, the chat template, ids to text, stop strings), `tools` (tools and tool-call
parsers), `stream` (server-sent events), `endpoint` (`Endpoint`, tying them together),
`group_files` (taken groups as `.npz` files a trainer reads: `write_group`,
`write_groups`, experiments/serve.py's loop), `harness` (a function-calling harness on
the `openai` SDK and GRPO steps on the episodes it drives: experiments/study_agent_grpo.py).
"""

from rljax.serving.api import ApiError
from rljax.serving.endpoint import Endpoint
from rljax.serving.episodes import EpisodeRecord

__all__ = ["ApiError", "Endpoint", "EpisodeRecord"]

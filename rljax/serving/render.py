"""Rendering: a call's history checked against its episode's record and its new ids (the
chat template applied incrementally), and sampled ids back to text. A mixin of `Endpoint`
(it holds `tokenizer` and `stop_ids`)."""

from __future__ import annotations

from rljax.envs.chat import TemplateError, UnsuitableTemplate, render_after_reply, render_prompt
from rljax.serving.api import ApiError, same_message


class Renderer:
  """Text in and out of token space for the endpoint."""

  def _chat_ids(self, ep, messages: list[dict], tools: list[dict] | None) -> list[int]:
    """A chat call's new ids: its messages must repeat the episode's recorded conversation
    (else 400 `history_mismatch`); the template's text for what they append."""
    if ep.turns == 0:
      return self._render_ids(messages, None, tools=tools)
    if tools != ep.tools:
      raise ApiError(400, "history_mismatch: tools differ from the episode's first call's "
                     "(the template rendered those into its prompt)", "history_mismatch",
                     param="tools")
    known = ep.messages
    for i, m in enumerate(known):
      if i >= len(messages) or not same_message(messages[i], m):
        raise ApiError(400, f"history_mismatch: messages[{i}] ({m['role']}) differs from "
                       "the episode's recorded conversation (earlier messages and replies "
                       "must be sent back unchanged; start a new episode to branch)",
                       "history_mismatch")
    new = messages[len(known):]  # not empty: the last message is not the reply
    if any(m["role"] == "assistant" for m in new):
      raise ApiError(400, "history_mismatch: an assistant message the engine did not "
                     "sample; replies must be this server's", "history_mismatch")
    return self._render_ids(known, new, stopped_on=ep.last_stop_id, tools=tools)

  def _completion_ids(self, ep, prompt, ids_mode: bool) -> list[int]:
    """A completion call's new ids: its prompt must extend the episode's (else 400
    `history_mismatch`); the rest tokenized (text) or as is (ids)."""
    if ep.turns and ids_mode != ep.ids_mode:
      raise ApiError(400, f"episode {ep.episode_id!r} takes its prompts as "
                     f"{'token ids' if ep.ids_mode else 'text'}", "history_mismatch")
    if ids_mode:
      if prompt[:len(ep.tokens)] != ep.tokens:
        raise ApiError(400, "history_mismatch: the prompt's ids do not start with the "
                       "episode's tokens", "history_mismatch")
      return prompt[len(ep.tokens):]
    known = ep.text or ""
    if not prompt.startswith(known):
      raise ApiError(400, "history_mismatch: the prompt does not start with the "
                     "episode's text so far (its prompts and completions)",
                     "history_mismatch")
    rest = prompt[len(known):]
    if ep.unsent_text and rest.startswith(ep.unsent_text):
      rest = rest[len(ep.unsent_text):]  # recorded already (a stop string)
    try:
      return self.tokenizer.encode(rest).tolist()
    except ValueError as e:
      raise ApiError(400, f"prompt: {e}") from None

  def _reply_text(self, sampled: list[int]) -> str:
    ids = sampled[:-1] if sampled and sampled[-1] in self.stop_ids else sampled
    return self._decode(ids)

  def _stop_cut(self, sampled: list[int], stops: tuple[str, ...]
                ) -> tuple[int, str, str] | None:
    """Where a reply's text first holds one of `stops` (matched on the decoded text, across
    tokens): (k, the text before the stop, the rest of the first k tokens' text) for the
    fewest leading sampled tokens k whose text holds one; None if none does."""
    if not stops:
      return None
    body = sampled[:-1] if sampled and sampled[-1] in self.stop_ids else sampled
    if not any(s in self._decode(body) for s in stops):
      return None
    for k in range(1, len(body) + 1):
      text = self._decode(body[:k])
      found = [text.find(s) for s in stops if s in text]
      if found:
        return k, text[:min(found)], text[min(found):]
    return None

  def _pieces(self, ids: list[int]) -> list[str]:
    return [self._decode([t]) for t in ids]

  def _decode(self, ids: list[int]) -> str:
    """Text of sampled ids (`TransformersTokenizer.decode_sampled`: never raises; the text
    is the episode's record of what was said, the ids are the truth)."""
    return self.tokenizer.decode_sampled(ids)

  def _render_ids(self, history: list[dict], new: list[dict] | None, *,
                  stopped_on: int | None = None, tools: list[dict] | None = None) -> list[int]:
    """First turn (`new` None): the messages rendered with the generation prompt (and the
    tools, as the template renders them). Later: the template applied to the delta in
    context (`rljax.envs.chat.render_after_reply`)."""
    try:
      if new is None:
        return self.tokenizer.encode(render_prompt(self.tokenizer.hf, history, tools)).tolist()
      stop_text = "" if stopped_on is None else self._decode([stopped_on])
      after = render_after_reply(self.tokenizer.hf, history, new, tools, stop_text)
    except UnsuitableTemplate as e:
      raise ApiError(500, str(e), kind="server_error") from None
    except TemplateError as e:
      raise ApiError(400, str(e)) from None
    return self.tokenizer.encode(after).tolist()

"""Trajectories -> fixed-shape packed training batches (token in, token out)."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import numpy as np

from rljax import sharding as sharding_lib
from rljax.model.packing import pack
from rljax.rl.trajectory import Trajectory


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainBatch:
  """Packed rows; position i of a row predicts `targets[i]` (the next token).

  Shapes: [R, L] unless noted; S = number of sequence slots (static).
  """

  tokens: np.ndarray  # int32
  positions: np.ndarray  # int32, 0-based per sequence
  segment_ids: np.ndarray  # int32, 0 = padding
  targets: np.ndarray  # int32
  loss_mask: np.ndarray  # bool: the target is a token the policy produced
  behaviour_logprobs: np.ndarray  # f32, aligned with targets (0 off-mask)
  versions: np.ndarray  # int32 policy version of each target (-1 off-mask)
  seq_ids: np.ndarray  # int32 sequence slot per token, -1 on padding
  advantages: np.ndarray  # [S] f32
  valid: np.ndarray  # [S] bool: False for infra failures and empty slots
  routing: np.ndarray | None  # [R, L, num_moe_layers, k] int32 expert ids to replay


def build_batch(trajs: Sequence[Trajectory], advantages: np.ndarray, valid: np.ndarray, *,
                row_len: int, num_rows: int, num_seqs: int, page_size: int,
                with_routing: bool = False) -> TrainBatch:
  """Packs trajectories (sequence slot j = trajs[j]) into `num_rows` rows of `row_len`."""
  if len(trajs) > num_seqs:
    raise ValueError(f"{len(trajs)} trajectories exceed num_seqs={num_seqs}")
  p = pack([t.tokens for t in trajs], row_len, page_size, num_rows=num_rows)
  shape = p.tokens.shape
  targets = np.zeros(shape, np.int32)
  loss_mask = np.zeros(shape, bool)
  behaviour = np.zeros(shape, np.float32)
  versions = np.full(shape, -1, np.int32)
  seq_ids = np.full(shape, -1, np.int32)
  routing = None
  if with_routing:
    first = next(t.expert_ids for t in trajs if t.expert_ids is not None)
    routing = np.zeros(shape + first.shape[1:], np.int32)
  for j, (t, (row, start, n)) in enumerate(zip(trajs, p.placements)):
    n_p = len(t.prompt_ids)
    targets[row, start:start + n - 1] = t.tokens[1:]
    seq_ids[row, start:start + n] = j
    lo = start + n_p - 1  # this position predicts the first completion token
    c = len(t.completion_ids)
    loss_mask[row, lo:lo + c] = t.loss_mask
    behaviour[row, lo:lo + c] = np.where(t.loss_mask, t.behaviour_logprobs, 0.0)
    versions[row, lo:lo + c] = np.where(t.loss_mask, t.versions, -1)
    if routing is not None:
      routing[row, start:start + n] = t.expert_ids
  adv = np.zeros(num_seqs, np.float32)
  ok = np.zeros(num_seqs, bool)
  adv[:len(trajs)] = advantages
  ok[:len(trajs)] = valid
  return TrainBatch(p.tokens, p.positions, p.segment_ids, targets, loss_mask, behaviour,
                    versions, seq_ids, adv, ok, routing)


def split_microbatches(batch: TrainBatch, num_micro: int) -> TrainBatch:
  """Row-wise split: every [R, ...] leaf becomes [num_micro, R / num_micro, ...].

  Per-sequence leaves ([S]) are replicated per microbatch (seq_ids index them globally).
  """
  rows = batch.tokens.shape[0]
  if rows % num_micro:
    raise ValueError(f"{rows} rows do not split into {num_micro} microbatches")

  def split(name, x):
    if x is None:
      return None
    if name in ("advantages", "valid"):
      return np.broadcast_to(x, (num_micro,) + x.shape)
    return x.reshape((num_micro, rows // num_micro) + x.shape[1:])

  return TrainBatch(**{f.name: split(f.name, getattr(batch, f.name))
                       for f in dataclasses.fields(batch)})


def global_batch(local: TrainBatch, sharding: sharding_lib.Sharding, *, first_seq: int,
                 advantages: np.ndarray, valid: np.ndarray) -> TrainBatch:
  """The microbatches of several processes as one batch of global arrays, each process
  feeding only the rows it packed (`local`: split_microbatches of its part of the batch,
  sequence slots from 0): every microbatch's rows are split over the processes by the
  "batch" rule (`Sharding.process_part`), this process's sequence slots are renumbered
  from `first_seq`, and the per-sequence leaves are the whole batch's (`advantages`,
  `valid`: [S], the same on every process), replicated."""
  _, parts = sharding.process_part("batch")
  rows = sharding.named((None, "batch"))
  every = sharding.named(())

  def place(name: str, x: np.ndarray | None):
    if x is None:
      return None
    if name in ("advantages", "valid"):
      whole = advantages if name == "advantages" else valid
      data = np.broadcast_to(np.asarray(whole, x.dtype), x.shape[:1] + whole.shape)
      return jax.make_array_from_process_local_data(every, np.ascontiguousarray(data),
                                                    data.shape)
    if name == "seq_ids":
      x = np.where(x >= 0, x + first_seq, -1).astype(x.dtype)
    shape = (x.shape[0], x.shape[1] * parts) + x.shape[2:]
    return jax.make_array_from_process_local_data(rows, x, shape)

  return TrainBatch(**{f.name: place(f.name, getattr(local, f.name))
                       for f in dataclasses.fields(local)})

"""Packing sequences into fixed-shape rows, each sequence starting on a page boundary.

`forward` requires page-aligned segment starts: that is what makes a packed training
row's attention blocks line up with the engine's pages (rljax.model.attention).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class Packed:
  tokens: np.ndarray  # [rows, row_len] int32
  positions: np.ndarray  # [rows, row_len] int32, 0-based within each segment
  segment_ids: np.ndarray  # [rows, row_len] int32, 1.. per row; 0 = padding
  placements: tuple[tuple[int, int, int], ...]  # per sequence: (row, start, length)


def aligned_length(n: int, page_size: int) -> int:
  return -(-n // page_size) * page_size


def pack(sequences: Sequence[Sequence[int]], row_len: int, page_size: int,
         num_rows: int | None = None, pad_id: int = 0) -> Packed:
  """First-fit packing in order; raises if a sequence is longer than a row or if
  `num_rows` rows do not hold them all."""
  if row_len % page_size:
    raise ValueError(f"row_len {row_len} must be a multiple of page_size {page_size}")
  fill: list[int] = []
  placements = []
  for seq in sequences:
    n = len(seq)
    if n == 0 or n > row_len:
      raise ValueError(f"sequence of length {n} does not fit a row of {row_len}")
    need = aligned_length(n, page_size)
    row = next((r for r, used in enumerate(fill) if used + need <= row_len), None)
    if row is None:
      row = len(fill)
      fill.append(0)
    placements.append((row, fill[row], n))
    fill[row] += need
  rows = len(fill) if num_rows is None else num_rows
  if len(fill) > rows:
    raise ValueError(f"{len(sequences)} sequences need {len(fill)} rows, only {rows} allowed")
  tokens = np.full((rows, row_len), pad_id, np.int32)
  positions = np.zeros((rows, row_len), np.int32)
  segments = np.zeros((rows, row_len), np.int32)
  seg_counter = [0] * rows
  for seq, (row, start, n) in zip(sequences, placements):
    seg_counter[row] += 1
    tokens[row, start:start + n] = np.asarray(seq, np.int32)
    positions[row, start:start + n] = np.arange(n, dtype=np.int32)
    segments[row, start:start + n] = seg_counter[row]
  return Packed(tokens, positions, segments, tuple(placements))


def unpack(values: np.ndarray, packed: Packed) -> list[np.ndarray]:
  """Per-sequence slices of a [rows, row_len] array computed on packed rows."""
  return [np.asarray(values[row, start:start + n]) for row, start, n in packed.placements]

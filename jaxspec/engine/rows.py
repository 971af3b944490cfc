"""The host-side per-row arrays of one device call (plain numpy): which request sits in which row
of a call, and its page table, lengths, stop ids and sampling parameters. Rows with no request
are idle: the null page, length 0, no stop id, greedy (`jaxspec.engine.device.idle_rows`).

`layout` is a list of (row, request) pairs; a call has `num_rows` rows (a prefill or decode row
bucket), so one compiled step serves any mix of requests.
"""

from __future__ import annotations

import numpy as np

from jaxspec.decoding.sampling import RowSampling, SamplingParams
from jaxspec.engine import device


_GREEDY = SamplingParams()     # idle rows' (checked once, not every round)


def sampling(layout, num_rows: int) -> RowSampling:
  """`RowSampling` ([num_rows] arrays): each laid-out request's parameters, idle rows greedy."""
  params = [_GREEDY] * num_rows
  for row, request in layout:
    params[row] = request.sampling
  return RowSampling.stack(params)


def stop_table(layout, num_rows: int, width: int) -> np.ndarray:
  """[num_rows, width] int32 each laid-out request's stop ids, -1 padded (width: the engine's
  `max_stop_tokens`)."""
  stop = np.full((num_rows, width), -1, np.int32)
  for row, request in layout:
    stop[row, :len(request.stop_tokens)] = request.stop_tokens
  return stop


def prefill_inputs(layout, num_rows: int, pages_per_seq: int, chunk_size: int) -> tuple:
  """(page_table [num_rows, pages_per_seq] int32, lengths [num_rows] int32 tokens cached,
  tokens [num_rows, chunk_size] int32 the chunk, right-padded with 0, counts [num_rows] int32
  its length) of a prefill call; `layout` pairs rows with (request, chunk token ids)."""
  table, lengths = device.idle_rows(num_rows, pages_per_seq)
  tokens = np.zeros((num_rows, chunk_size), np.int32)
  counts = np.zeros((num_rows,), np.int32)
  for row, (request, chunk) in layout:
    pages = request.handle.pages
    table[row, :len(pages)] = pages
    lengths[row] = request.num_computed
    tokens[row, :len(chunk)] = chunk
    counts[row] = len(chunk)
  return table, lengths, tokens, counts


def decode_inputs(layout, num_rows: int, pages_per_seq: int) -> tuple:
  """(page_table [num_rows, pages_per_seq] int32, lengths [num_rows] int32 tokens cached,
  pending [num_rows] int32 last emitted token, room [num_rows] int32 tokens it may still emit)
  of a decode round over the laid-out decoding requests (idle rows: null page, 0)."""
  table, lengths = device.idle_rows(num_rows, pages_per_seq)
  pending = np.zeros((num_rows,), np.int32)
  room = np.zeros((num_rows,), np.int32)
  for row, request in layout:
    pages = request.handle.pages
    table[row, :len(pages)] = pages
    lengths[row] = request.num_computed
    pending[row] = request.output[-1]
    room[row] = request.room
  return table, lengths, pending, room

"""Checking a new request against an engine before it is queued (host side): everything that
can be refused at `Engine.add_request` is refused here, so a queued request never fails later.
"""

from __future__ import annotations

from typing import Optional, Sequence

from jaxspec.cache.page_hash import salt_bytes
from jaxspec.checks import counted
from jaxspec.decoding.generate import ContextOverflowError, check_request
from jaxspec.decoding.sampling import SamplingParams, check_sampling


def request_id(engine, request_id):
  """The id of a new request: `request_id` checked, or (None) the engine's next unused int.

  Raises:
    ValueError: an id that is not hashable, one not equal to itself (NaN), or one in use (live
      or in `engine.outputs`).
  """
  if request_id is None:
    request_id = next(engine._ids)
    while request_id in engine._live or request_id in engine.outputs:
      request_id = next(engine._ids)
    return request_id
  try:
    hash(request_id)
  except TypeError:
    raise ValueError(f'request id {request_id!r} is not hashable') from None
  if request_id != request_id:     # NaN: never equal to itself, so never found again
    raise ValueError(f'request id {request_id!r} does not equal itself: it could not be '
                     f'looked up (outputs[{request_id!r}]) or refused when reused')
  if request_id in engine._live or request_id in engine.outputs:
    raise ValueError(f'request id {request_id!r} is already in use')
  return request_id


def check(engine, prompt_tokens: Sequence[int], max_tokens: int, stop_tokens: Sequence[int],
          salt, sampling: Optional[SamplingParams]):
  """(prompt list of int, max_tokens int, stop tuple of int, salt bytes, SamplingParams) of a
  new request.

  Args:
    engine: the `Engine` (its models, K, window, max_seq_len, pool, stop-table width, default
      sampling).
    prompt_tokens, max_tokens, stop_tokens, salt, sampling: as `Engine.add_request`.
  Raises:
    ValueError (or TypeError from the checks it shares with `generate`): an empty prompt, a
      token or stop id outside the vocabulary, max_tokens < 1, prompt + max_tokens + (K + 1)
      tokens past what the pool holds, more stop ids than `max_stop_tokens`, a salt that is
      not str or bytes, sampling that is not a SamplingParams.
    ContextOverflowError (a ValueError): prompt + max_tokens + (K + 1) tokens past a model's
      context or the engine's max_seq_len.
  """
  _, slack, stop = check_request(engine.target, [prompt_tokens], max_new_tokens=max_tokens,
                                 stop_tokens=stop_tokens, draft=engine.draft,
                                 draft_params=engine.draft_params,
                                 k=engine.k if engine.draft is not None else None,
                                 max_tokens_name='max_tokens', one_request=True,
                                 min_slack=engine.window)
  stop = tuple(stop.tolist())
  if len(stop) > engine.max_stop_tokens:
    raise ValueError(f'{len(stop)} stop ids exceed max_stop_tokens={engine.max_stop_tokens}')
  prompt, max_tokens = [int(t) for t in prompt_tokens], int(max_tokens)
  span = len(prompt) + max_tokens + slack
  sizes = f'prompt of {counted(len(prompt), "token")} + max_tokens={max_tokens} + {slack}'
  if span > engine.max_seq_len:
    raise ContextOverflowError(f'{sizes} = {span} exceeds the engine\'s '
                               f'max_seq_len={engine.max_seq_len}')
  need = engine._request_pages(span)
  if need > engine.prefix.num_pages - 1:
    raise ValueError(f'{sizes} needs {need} pages, the pool has {engine.prefix.num_pages - 1}')
  sampling = engine.sampling if sampling is None else sampling
  check_sampling(sampling)
  return prompt, max_tokens, stop, salt_bytes(salt), sampling

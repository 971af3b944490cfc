"""The engine's speculation settings: which drafter and K policy serve it (checked once), and
the K and per-row caps of each decode round (checked every round). Host side, plain Python.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from jaxspec.decoding.generate import MAX_K
from jaxspec.engine.drafters import make_drafter
from jaxspec.engine.k_policy import FixedK, KPolicy, make_policy


def setup(drafter, k_policy, *, has_draft_model: bool, k: int):
  """(Drafter or None, KPolicy or None) of an engine with speculation length k (K_max).

  Args:
    drafter: None ('model' when a draft model is given, else no speculation), 'model', 'ngram'
      or a `Drafter`; k_policy: 'fixed', 'schedule', 'goodput' or a `KPolicy` (bound to k here).
    has_draft_model: whether the engine holds a draft model; k: int >= 0 (checked by the caller).
  Returns:
    (None, None) without speculation (k = 0, no drafter).
  Raises:
    ValueError: naming the value: a drafter without k >= 1 or k without a drafter, a drafter
      that needs a draft model without one (or takes none and got one), k > MAX_K, an adaptive
      policy without speculation, a policy whose candidates are not ints in [0, k] or that is
      already bound to another engine, an unknown drafter or policy.
  """
  made = make_drafter(drafter, has_draft_model)
  got = f'draft={"a model" if has_draft_model else "None"}'
  if made is not None and k == 0:
    raise ValueError(f'a drafter (a draft model, or drafter=\'ngram\') speculates: it needs the '
                     f'speculation length k >= 1; got {got}, drafter={drafter!r}, k={k}')
  if made is None and k != 0:
    raise ValueError(f"k={k} >= 1 needs a drafter (a draft model, or drafter='ngram'); got "
                     f'{got}, drafter={drafter!r}, k={k}')
  if made is not None and made.uses_draft_model != has_draft_model:
    need = 'needs a' if made.uses_draft_model else 'takes no'
    raise ValueError(f'drafter={drafter!r} {need} draft model, got {got}')
  if k > MAX_K:
    raise ValueError(f'speculation length K must be in [1, {MAX_K}], got k={k}')
  policy = make_policy(k_policy)
  if made is None:
    if not isinstance(policy, FixedK):
      raise ValueError(f"k_policy={k_policy!r} chooses K but the engine does not speculate "
                       f"(give a draft model or drafter='ngram', and k >= 1)")
    return None, None
  policy.setup(k)
  bad = [c for c in policy.candidates if isinstance(c, bool) or not isinstance(c, int) or
         not 0 <= c <= k]
  if bad or not policy.candidates:
    raise ValueError(f'k_policy {policy!r} declares candidates {policy.candidates}: each must '
                     f'be an int in [0, k={k}]')
  return made, policy


def choose(policy: Optional[KPolicy], decodes, num_slots: int, k_max: int, draft_sync=None):
  """The round's K and caps [num_slots] int32 (caps[slot] <= K, proposals a row may accept),
  from the policy (None: K = 0), checked.

  Args:
    decodes: the decoding requests (with `.id`, `.slot` and `.room`, given to the policy as
      `KPolicy.rooms`).
    draft_sync: the engine's lazy draft cache (`jaxspec.engine.draft_sync.DraftSync`) or None:
      it probes when due and tells the policy its catch-up seconds (`KPolicy.sync_s`) before
      the choice, and catches the draft up after a choice of K >= 1.
  Raises:
    ValueError: the policy chose a K that is not an int candidate in [0, k_max], or caps that
      are not ints in [0, K] (one per request).
  """
  caps = np.zeros((num_slots,), np.int32)
  if policy is None:
    return 0, caps
  if draft_sync is not None:
    policy.sync_s = draft_sync.before_choice(decodes)
  policy.rooms = [r.room for r in decodes]
  k, row_caps = policy.choose([r.id for r in decodes])
  if isinstance(k, bool) or not isinstance(k, int) or k not in policy.candidates or \
      not 0 <= k <= k_max or len(row_caps) != len(decodes) or \
      any(isinstance(c, bool) or not isinstance(c, int) or not 0 <= c <= k for c in row_caps):
    raise ValueError(f'k_policy {policy!r} chose K={k!r} (candidates {policy.candidates}) with '
                     f'caps {row_caps!r} for {len(decodes)} requests: K must be an int '
                     f'candidate in [0, k={k_max}] and each cap an int in [0, K]')
  for request, c in zip(decodes, row_caps):
    caps[request.slot] = c
  if draft_sync is not None:
    draft_sync.before_round(decodes, k)
  return k, caps


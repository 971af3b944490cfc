"""Closing the goodput K policy's loop (`jaxspec.engine.goodput`): how the K >= 1 rounds'
realized goodput compares with what the policy's model predicted for them, as one factor its
K >= 1 scores are multiplied by (a feedback correction of a model-based controller). Host side,
plain Python.

Why try it: the policy enters K >= 1 when an estimate says it pays, so the rounds it speculates
in are those whose α estimate came out high (the winner's curse: a noisy estimate chosen for being
high reads high on average), and what a round costs around it (draft-cache catch-ups, a cold
first round) is priced from models. What it found (`GoodputK(calibrate=True)`, off by default):
over 2-3 runs of the batching study at B = 1-8 on the development CPU the factor stayed at
0.90-1.03 (once 1.25), so the rounds the policy runs deliver about what it predicts, and turning
it on gained nothing (docs/adaptive_k.md, *Calibration*).
"""

from __future__ import annotations

import math

from jaxspec.checks import check_int, check_real


class Calibration:
  """factor = (realized / predicted tokens) / (realized / predicted seconds), each the mean of
  the per-round ratios over the K >= 1 rounds, weighed down by half every `half_life` K >= 1
  rounds and padded with `prior_rounds` rounds at ratio 1; clamped to [`low`, `high`] (1.0 before
  any K >= 1 round).

  Per K >= 1 round: `expect` sets the prediction when a choice of K >= 1 is scored (held choices
  keep it), `add_tokens` counts what each row emitted (accepted + 1), `round` closes the round
  with its seconds (device and host). The first K >= 1 round after a K = 0 round adds the
  choice's one-time seconds to both sides: `once_s` predicted (catch-up and first-round excess),
  `sync_s` realized (the first rounds' excess is already in their measured seconds).

  Args:
    half_life: K >= 1 rounds after which a round's weight has halved (>= 1).
    prior_rounds: rounds' weight of the prior ratio 1 (>= 0; 0: the first round alone decides).
    low, high: the factor's range (0 < low <= 1 <= high).
  Raises:
    ValueError: an argument out of range (named).
  """

  def __init__(self, half_life: int = 64, prior_rounds: float = 8.0, low: float = 0.5,
               high: float = 1.25):
    half_life = check_int('half_life', half_life, 1)
    self.prior_rounds = check_real('prior_rounds', prior_rounds, 0.0, math.inf, high_open=True)
    self.low = check_real('low', low, 0.0, 1.0, low_open=True)
    self.high = check_real('high', high, 1.0, math.inf, high_open=True)
    self._decay = 0.5 ** (1.0 / half_life)
    self._tokens = self._seconds = self._weight = 0.0    # decayed sums of per-round ratios
    self._expected = None        # (tokens, seconds, once_s, sync_s) of the current K >= 1 choice
    self._emitted = 0            # tokens the round in progress emitted so far
    self._last_k = 0
    self.rounds = 0              # K >= 1 rounds counted

  def expect(self, tokens: float, seconds: float, once_s: float = 0.0,
             sync_s: float = 0.0) -> None:
    """The prediction for each coming K >= 1 round: `tokens` the batch emits and `seconds` it
    takes (d(K) + h(K)); once_s / sync_s the one-time seconds predicted / to pay before the
    first of a stretch (ignored unless the round follows a K = 0 round). A prediction that is not
    finite and > 0 is dropped (its rounds are not counted)."""
    ok = all(math.isfinite(v) for v in (tokens, seconds, once_s, sync_s))
    self._expected = (tokens, seconds, once_s, sync_s) if ok and tokens > 0 and seconds > 0 \
        else None

  def add_tokens(self, tokens: int) -> None:
    """Tokens one row emitted in the round in progress."""
    self._emitted += tokens

  def round(self, k: int, seconds: float) -> None:
    """Close a decode round at K of `seconds` (a K = 0 round only marks that the next K >= 1
    round starts a stretch)."""
    emitted, self._emitted = self._emitted, 0
    first = self._last_k == 0
    self._last_k = k
    if k == 0 or self._expected is None or not (0 < seconds < math.inf):
      return
    tokens, predicted_s, once_s, sync_s = self._expected
    if first:
      predicted_s, seconds = predicted_s + once_s, seconds + sync_s
    self._tokens = self._tokens * self._decay + emitted / tokens
    self._seconds = self._seconds * self._decay + seconds / predicted_s
    self._weight = self._weight * self._decay + 1.0
    self.rounds += 1

  @property
  def factor(self) -> float:
    """Realized over predicted goodput of the K >= 1 rounds (1.0 before any)."""
    if not self.rounds:
      return 1.0
    ratio = (self._tokens + self.prior_rounds) / (self._seconds + self.prior_rounds)
    return min(self.high, max(self.low, ratio))

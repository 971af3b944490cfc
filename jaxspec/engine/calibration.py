"""Closing the goodput K policy's loop (`jaxspec.engine.goodput`): how the K >= 1 rounds'
realized goodput compares with what the policy's model predicted for them, as one factor its
K >= 1 scores are multiplied by (a feedback correction of a model-based controller). Host side,
plain Python.

Why try it: the policy enters K >= 1 when an estimate says it pays, so the rounds it speculates
in are those whose α estimate came out high (the winner's curse: a noisy estimate chosen for being
high reads high on average), and what a stretch at K >= 1 costs around its rounds (draft-cache
catch-ups, slower first rounds) is priced from models. What it found (`GoodputK(calibrate=True)`,
off by default): no gain in the batching study at B = 1-8 on the development CPU
(docs/adaptive_k.md, *Calibration*).
"""

from __future__ import annotations

import math

from jaxspec.checks import check_int, check_real


class Calibration:
  """factor = (realized / predicted tokens) / (realized / predicted seconds) over the K >= 1
  rounds, each a ratio of sums weighed down by half every `half_life` decode rounds (of any K:
  old evidence fades while the policy sits at K = 0) and padded with `prior_rounds` rounds at
  the mean prediction (ratio 1); clamped to [`low`, `high`]; 1.0 before any K >= 1 round.

  Per round: `expect` sets the prediction when a choice of K >= 1 is scored (held choices keep
  it), with the one-time seconds that choice priced (`once_s`: catch-up and slower first rounds),
  booked on the next K >= 1 round closed; `outcome` gives the round's emitted tokens (after stop
  and max-token cuts) and the catch-up seconds measured before it; `round` closes it with its
  seconds (device and host). Sums, not per-round ratios: a stretch's first rounds' excess lands
  on the second round as well as the first, while its price is booked on the first.

  Args:
    half_life: decode rounds after which a round's weight has halved (>= 1).
    prior_rounds: K >= 1 rounds' weight of the prior ratio 1 (>= 0; 0: the rounds alone, and
      the factor then stays where the last K >= 1 rounds left it while the policy runs K = 0).
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
    # Decayed sums over K >= 1 rounds: realized / predicted tokens, seconds; the rounds' weight.
    self._sums = [0.0] * 5
    self._expected = None        # (tokens, seconds) per round of the current K >= 1 choice
    self._once = 0.0             # one-time seconds priced by that choice, not yet booked
    self._outcome = (0, 0.0)     # (tokens, catch-up seconds) of the round in progress
    self.rounds = 0              # K >= 1 rounds counted

  def expect(self, tokens: float, seconds: float, once_s: float = 0.0) -> None:
    """The prediction for each coming K >= 1 round: `tokens` the batch emits and `seconds` (d(K) +
    h(K)) it takes, and `once_s`, the one-time seconds the choice priced (booked on the next
    K >= 1 round). A prediction that is not finite, tokens and seconds > 0 and once_s >= 0 is
    dropped (its rounds are not counted)."""
    ok = all(math.isfinite(v) for v in (tokens, seconds, once_s)) and tokens > 0 and \
        seconds > 0 and once_s >= 0
    self._expected = (float(tokens), float(seconds)) if ok else None
    self._once = float(once_s) if ok else 0.0

  def outcome(self, tokens: int, catch_up_s: float = 0.0) -> None:
    """What the round in progress emitted (tokens, all rows, after cuts) and the seconds of the
    draft catch-up run before it (0 without one)."""
    self._outcome = (tokens, catch_up_s)

  def round(self, k: int, seconds: float) -> None:
    """Close a decode round at K of `seconds`. Every round fades the sums; a K >= 1 round with a
    prediction and finite seconds > 0 adds to them."""
    (tokens, catch_up_s), self._outcome = self._outcome, (0, 0.0)
    self._sums = [s * self._decay for s in self._sums]
    if k == 0 or self._expected is None or not (0 < seconds < math.inf) or \
        not (0 <= catch_up_s < math.inf) or not (0 <= tokens < math.inf):
      return
    predicted_tokens, predicted_s = self._expected
    once, self._once = self._once, 0.0
    for i, value in enumerate((tokens, predicted_tokens, seconds + catch_up_s,
                               predicted_s + once, 1.0)):
      self._sums[i] += value
    self.rounds += 1

  @property
  def factor(self) -> float:
    """(realized / predicted tokens) / (realized / predicted seconds) of the K >= 1 rounds, padded
    and clamped (the class doc); 1.0 before any."""
    tokens, predicted_tokens, seconds, predicted_s, weight = self._sums
    if not self.rounds or weight < 1e-12:      # nothing measured, or faded to nothing
      return 1.0
    pad_tokens = self.prior_rounds * predicted_tokens / weight
    pad_s = self.prior_rounds * predicted_s / weight
    ratio = ((tokens + pad_tokens) / (predicted_tokens + pad_tokens)) / \
        ((seconds + pad_s) / (predicted_s + pad_s))
    return min(self.high, max(self.low, ratio))

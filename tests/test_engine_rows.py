"""Decode rounds sized to the busy rows (`Engine(decode_buckets=...)`): a round runs in the
smallest bucket that holds its decoding requests, outputs do not depend on the buckets (greedy,
with and without speculation), and bad buckets are refused."""

import functools

import numpy as np
import pytest

from jaxspec.decoding import generate
from jaxspec.engine import Engine
from jaxspec.engine.live_costs import line_through
from test_engine import alone                # noqa: F401 (a fixture: greedy output alone)
from test_engine_drafters import Scripted   # K from a cycle, K = 0 included

L, M = 8, 20
SHAPES = dict(num_slots=4, page_size=L, chunk_size=8, num_pages=64)


def _record_rows(engine) -> list:
  """Wrap the engine's decode call: the row count of every round it runs."""
  rows, call = [], engine._call_decode

  def recorded(table, *args, **kwargs):
    rows.append(table.shape[0])
    return call(table, *args, **kwargs)

  engine._call_decode = recorded
  return rows


@pytest.mark.parametrize('speculate', [False, True])
def test_rounds_use_the_smallest_bucket_and_outputs_do_not_change(tiny, tiny_draft, speculate):
  config, params = tiny
  def spec():          # a policy instance per engine
    return dict(draft=tiny_draft[0], draft_params=tiny_draft[1], k=3,
                k_policy=Scripted([3, 0, 1])) if speculate else {}
  rng = np.random.default_rng(3)
  prompts = [rng.integers(3, 64, size=n).tolist() for n in (5, 11, 3, 17)]
  max_tokens = [M, 4, 9, 13]                   # requests finish at different rounds
  engine = Engine(config, params, **SHAPES, **spec())
  assert engine.decode_buckets == (1, 4)       # 4 // 4^i, down to 1
  rows = _record_rows(engine)
  ids = [engine.add_request(p, max_tokens=m) for p, m in zip(prompts, max_tokens)]
  outs = engine.run()

  @functools.lru_cache(maxsize=None)
  def decoded_alone(i):
    return generate(config, params, [prompts[i]], max_new_tokens=M, page_size=L).tokens[0]

  for i, rid in enumerate(ids):
    assert outs[rid].tokens == decoded_alone(i)[:max_tokens[i]]
  # Full rounds while 2-4 requests decode, then 1-row rounds for the last one (the 20-token
  # request runs alone after the others finish).
  assert set(rows) == {1, 4} and rows[-1] == 1 and rows[0] == 4
  full = Engine(config, params, **SHAPES, **spec(), decode_buckets=(4,))
  full_rows = _record_rows(full)
  full_ids = [full.add_request(p, max_tokens=m) for p, m in zip(prompts, max_tokens)]
  full_outs = full.run()
  assert set(full_rows) == {4}
  assert [full_outs[r].tokens for r in full_ids] == [outs[r].tokens for r in ids]


def test_cost_tables_per_bucket(tiny, tiny_draft):
  config, params = tiny
  engine = Engine(config, params, **SHAPES, draft=tiny_draft[0], draft_params=tiny_draft[1],
                  k=2, k_policy='goodput')
  engine.warm_up(cost_repeats=1, decode_rounds=1)
  assert set(engine.row_costs) == {1, 4}
  assert all(set(t) == {0, 1, 2} and min(t.values()) > 0 for t in engine.row_costs.values())
  assert engine.step_costs == engine.row_costs[4]
  assert set(engine.prefill_costs) == set(engine.prefill_buckets)   # goodput prices admissions
  with pytest.raises(ValueError, match='decode buckets'):
    engine.measure_costs(1, widths=(2,))


def test_policy_prices_the_line_through_the_timed_k_entries(tiny, tiny_draft, monkeypatch):
  """`row_costs` keeps what was timed; the policy gets each row's K >= 2 entries on their
  Theil-Sen line (`live_costs.line_through`), K = 0 and K = 1 as timed. The timing is replaced
  by a table on a line with K = 2 timed far too fast and K = 1 below the line (as a round
  without the draft's loop is), so the line and the timed values differ."""
  from jaxspec.engine import timing
  timed = {0: 1.0, 1: 1.3, 2: 1.1, 3: 2.0, 4: 2.25, 5: 2.5, 6: 2.75}
  monkeypatch.setattr(timing, 'decode_costs', lambda engine, repeats, widths, **options: {
      (rows, k): t * rows for rows in widths for k, t in timed.items()})
  config, params = tiny
  engine = Engine(config, params, **SHAPES, draft=tiny_draft[0], draft_params=tiny_draft[1],
                  k=6, k_policy='goodput')
  engine.warm_up(cost_repeats=1, decode_rounds=1)
  idle = engine.policy.live.idle
  assert engine.row_costs and all(table[2] == 1.1 * rows
                                  for rows, table in engine.row_costs.items())
  for rows, table in [(None, engine.step_costs), *engine.row_costs.items()]:
    width = rows or SHAPES['num_slots']
    assert idle[rows][2] == pytest.approx(1.75 * width)        # on the line, not as timed
    assert idle[rows][1] == table[1] == pytest.approx(1.3 * width)    # as timed, off the line
    assert idle[rows][0] == table[0] == width
    assert idle[rows] == pytest.approx(line_through(table))


def test_line_through_ignores_one_entry_off():
  line = {0: 1.0, 1: 1.5, 2: 1.75, 3: 2.0, 4: 2.25, 5: 2.5, 6: 2.75}
  off = {**line, 2: 1.1}                                 # K = 2 timed far too fast
  assert line_through(off) == pytest.approx(line)
  assert line_through({**line, 6: 12.5}) == pytest.approx(line)     # an end entry far off
  # K = 1 is not on the line (a round without the draft's loop): kept as timed, below the line
  # or above it, and it does not move the line.
  for k1 in (1.2, 0.2, 1.9):
    assert line_through({**line, 1: k1, 3: 1.4}) == pytest.approx({**line, 1: k1})
  # Fewer than LINE_POINTS K >= 2 entries: as timed (one end entry would tilt the line).
  few = {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0, 5: 100.0}
  assert line_through(few) == few
  assert line_through({**line, 3: 0.0}) == {**line, 3: 0.0}       # not a time: set_costs refuses
  assert line_through({0: 1.0, 4: 2.0}) == {0: 1.0, 4: 2.0}
  # Flat, then steep (a round memory-bound up to some K): far from any line, kept as timed.
  bent = {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0, 5: 3.0, 6: 5.0, 7: 7.0, 8: 9.0}
  assert line_through(bent) == bent
  # Nearly flat: where the line would price a K >= 1 round at or below K = 0's, the timed
  # value stays.
  flat = {0: 1.0, 1: 1.02, 2: 1.03, 3: 1.05, 4: 1.08, 5: 1.12, 6: 1.2, 7: 1.3, 8: 1.45}
  fitted = line_through(flat)
  assert fitted[1] == 1.02 and fitted[2] == 1.03        # the line's K = 2: 0.99, below K = 0's
  assert fitted[8] == pytest.approx(0.8625 + 8 * 0.0625)
  assert all(fitted[k] > 1.0 for k in fitted if k)


@pytest.mark.parametrize('buckets', [(0, 4), (2,), (4, 5), ('a', 4), 4, (True, 4)])
def test_bad_decode_buckets(tiny, buckets):
  config, params = tiny
  with pytest.raises(ValueError, match='decode_buckets'):
    Engine(config, params, **SHAPES, decode_buckets=buckets)


def test_default_buckets():
  from jaxspec.engine.device import decode_buckets as _decode_buckets
  assert _decode_buckets(1, None) == (1,)
  assert _decode_buckets(3, None) == (3,)
  assert _decode_buckets(8, None) == (2, 8)
  assert _decode_buckets(64, None) == (1, 4, 16, 64)
  assert _decode_buckets(8, [8, 8, 1]) == (1, 8)
  made = _decode_buckets(8, np.array([2, 8]))             # numpy ints, given back as ints
  assert made == (2, 8) and all(type(b) is int for b in made)


def test_measure_costs_widths(tiny, tiny_draft):
  # Timing some buckets only stores their rows; a policy needing a cost table still needs one
  # until the full batch's row is timed (the next round measures every bucket), and runs.
  config, params = tiny
  engine = Engine(config, params, **SHAPES, draft=tiny_draft[0], draft_params=tiny_draft[1],
                  k=2, k_policy='goodput')
  assert engine.measure_costs(1, widths=(1, 1)) == {}
  assert set(engine.row_costs) == {1} and engine.policy.needs_costs
  for bad in (4, (True,), (3,), ('1',), (1.0,)):     # 1.0 == 1 was a TypeError deeper down
    with pytest.raises(ValueError, match='widths'):
      engine.measure_costs(1, widths=bad)
  engine.measure_costs(1, widths=(np.int64(1),))
  assert all(type(rows) is int for rows in engine.row_costs)
  with pytest.raises(ValueError, match='cost_repeats must be an int >= 1, got 0'):
    engine.warm_up(cost_repeats=0)                     # was 'repeats', after the compiles
  with pytest.raises(ValueError, match='decode_rounds must be an int >= 1, got 0'):
    engine.warm_up(decode_rounds=0)
  with pytest.raises(ValueError, match='catch_up_repeats must be an int >= 1, got 0'):
    engine.measure_costs(1, catch_up_repeats=0)
  with pytest.raises(ValueError, match='decode_budget_s must be a finite number'):
    engine.warm_up(decode_budget_s=0)
  with pytest.raises(ValueError, match='budget_s must be a finite number'):
    engine.measure_costs(1, budget_s=-1.0)
  rid = engine.add_request([5, 9, 13], max_tokens=3)
  assert len(engine.run()[rid].tokens) == 3
  assert set(engine.row_costs) == {1, 4} and not engine.policy.needs_costs


def test_prompt_lookup_rows_read_their_own_context(tiny):
  # Prompt lookup proposes from the context of the request in each row: with K fixed, what a
  # request proposes and accepts depends on its own context only, so it is the same in a
  # staggered batch (rows compacted as requests finish) as when the request runs alone.
  config, params = tiny
  rng = np.random.default_rng(5)
  prompts = [(rng.integers(3, 64, size=n).tolist() * 3)[:3 * n - 1] for n in (4, 7, 3, 6, 5)]
  max_tokens = [M, 6, 14, 9, M]
  engine = Engine(config, params, **SHAPES, drafter='ngram', k=3)
  rows = _record_rows(engine)
  ids, step = [], 0
  while len(ids) < len(prompts) or engine.has_unfinished():
    if len(ids) < len(prompts) and step % 2 == 0:
      ids.append(engine.add_request(prompts[len(ids)], max_tokens=max_tokens[len(ids)]))
    engine.step()
    step += 1
  assert set(rows) == {1, 4}
  batched = [engine.outputs[r] for r in ids]
  for prompt, m, out in zip(prompts, max_tokens, batched):
    rid = engine.add_request(prompt, max_tokens=m)
    single = engine.run()[rid]
    assert out.tokens == single.tokens
    assert (out.metrics.proposed, out.metrics.accepted) == (single.metrics.proposed,
                                                            single.metrics.accepted)
  assert sum(o.metrics.accepted for o in batched) > 0
  assert engine.prefix.num_held == 0


def test_self_draft_accepts_everything_with_compacted_rows(tiny, alone):
  # draft = target: every capped proposal must be accepted, so a draft cache that is wrong for
  # some row (a prefill chunk that filled the draft after a gap: a prefix-cache hit; rows
  # compacted as requests finish) shows as a rejection. Repeated prompts hit the prefix cache;
  # K cycles through 0 (lazy draft cache: probes, catch-ups, eager prefills between rounds).
  config, params = tiny
  seen = []

  class Record(Scripted):
    def observe(self, request_id, k, accepted, successes, trials):
      seen.append((k, accepted))

  engine = Engine(config, params, **SHAPES, draft=config, draft_params=params, k=3,
                  k_policy=Record([3, 0, 0, 1, 2, 0, 3]))
  rng = np.random.default_rng(11)
  base = [rng.integers(3, 64, size=n).tolist() for n in (19, 6, 12)]
  # Request 1 is prefilled without the draft (no round at K >= 1 yet), then with it after a gap
  # (its first chunk's draft half never written) and finishes at once; request 3 hits its
  # pages and is prefilled with the draft (after a round at K = 2) past a gap, so its draft
  # cache is right only if that chunk is not counted as drafted and the catch-up starts at 0.
  prompts = [base[1], base[0], base[2], base[0] + [7], base[1], base[0]]
  max_tokens = [M, 1, 16, 11, 9, 3]
  stops = [(), (), (), (9, 10, 11), (40,), ()]
  arrivals = [0, 0, 2, 6, 7, 9]
  ids, step = {}, 0
  while len(ids) < len(prompts) or engine.has_unfinished():
    for i, at in enumerate(arrivals):
      if at == step:
        ids[i] = engine.add_request(prompts[i], max_tokens=max_tokens[i], stop_tokens=stops[i])
    engine.step()
    step += 1
  for i, rid in ids.items():
    assert engine.outputs[rid].tokens == alone(prompts[i], max_tokens[i], stops[i])
  assert engine.outputs[ids[3]].metrics.cached_tokens == 16
  assert {k for k, _ in seen} == {0, 1, 2, 3}
  assert all(a == k for k, a in seen if k > 0)
  assert engine.prefix.num_held == 0

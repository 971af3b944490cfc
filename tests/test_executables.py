"""Compiled executables outliving their engines, and the guard against the memory-mapping limit
(`jaxspec.executables`)."""

import gc
import mmap
import os
import warnings

import jax
import pytest

from jaxspec import executables
from jaxspec.engine import Engine, compile_counts


@pytest.fixture(autouse=True)
def _no_earlier_clear(monkeypatch):
  """Each test starts as a process that never cleared (`release_near_limit` remembers the last
  clear's count)."""
  monkeypatch.setattr(executables, '_after_last_clear', None)


def _serve(engine) -> list:
  """One request through `engine`; its tokens."""
  request = engine.add_request([3, 1, 4, 1, 5], max_tokens=4)
  return engine.run()[request].tokens


def _compiled() -> int:
  """The engine's prefill and decode steps compiled and still cached."""
  counts = compile_counts()
  return counts['decode_round'] + counts['prefill_chunk']


def test_a_dropped_engines_executables_live_until_jax_caches_are_cleared(tiny, memory_mappings):
  """The README's advice for long loops: the jitted steps are module-level, so a dropped engine's
  compiled steps (hundreds of memory mappings each on the CPU) stay until `jax.clear_caches()`."""
  config, params = tiny
  gc.collect()
  before, _ = memory_mappings()
  engine = Engine(config, params, num_slots=2, num_pages=23, page_size=4, chunk_size=4)
  _serve(engine)
  del engine
  gc.collect()
  kept, _ = memory_mappings()
  assert compile_counts()['decode_round'] >= 1 and compile_counts()['prefill_chunk'] >= 1
  assert kept > before + 100                     # its prefill and decode steps outlive it
  jax.clear_caches()
  gc.collect()
  assert _compiled() == 0
  assert memory_mappings()[0] < before + 50


def test_release_near_limit_clears_past_the_threshold_and_warns(tiny, memory_mappings):
  config, params = tiny
  _serve(Engine(config, params, num_slots=2, num_pages=21, page_size=4, chunk_size=4))
  held, limit = memory_mappings()
  assert _compiled() >= 2
  with warnings.catch_warnings():
    warnings.simplefilter('error')                  # below the threshold: no warning, nothing freed
    assert not executables.release_near_limit(min(1.0, 2 * held / limit))
  assert _compiled() >= 2
  with pytest.warns(RuntimeWarning, match=r'tester: \d+ memory mappings held, past 0.001'):
    assert executables.release_near_limit(0.001, what='tester')
  assert _compiled() == 0
  assert memory_mappings()[0] < held


def test_an_engine_built_near_the_limit_clears_earlier_steps_and_still_decodes(
    tiny, memory_mappings, monkeypatch):
  config, params = tiny
  shape = dict(num_slots=2, num_pages=22, page_size=4, chunk_size=4)
  first = _serve(Engine(config, params, **shape))
  assert _compiled() >= 2
  monkeypatch.setattr(executables, 'NEAR_LIMIT', 1e-6)   # every process is "near" it now
  with pytest.warns(RuntimeWarning, match='Engine: .* cleared JAX') as caught:
    engine = Engine(config, params, **shape)
  assert caught[0].filename == __file__           # the user's line, not jaxspec's
  assert _compiled() == 0                         # the first engine's steps were freed
  assert _serve(engine) == first                  # and compile again, with the same output


def test_off_linux_nothing_is_counted_or_cleared(tiny, monkeypatch):
  config, params = tiny
  _serve(Engine(config, params, num_slots=2, num_pages=21, page_size=4, chunk_size=4))
  monkeypatch.setattr(executables, 'MAX_MAP_COUNT', '/nonexistent/max_map_count')
  assert executables.memory_mappings() is None
  assert not executables.release_near_limit(1e-6)
  assert _compiled() >= 2


@pytest.mark.parametrize('fraction', [0, 0.0, -0.5, 1.5, float('nan'), True, '0.5'])
def test_release_near_limit_refuses_a_bad_fraction(fraction):
  with pytest.raises(ValueError, match='fraction must be'):
    executables.release_near_limit(fraction)


def test_a_clear_that_leaves_the_process_past_the_threshold_waits_before_the_next(monkeypatch):
  """Mappings JAX does not own keep the process past the threshold after a clear: the next Engine
  must not clear again (and drop the live engines' steps) until the count has grown by half the
  room left below the limit."""
  counts = [(40000, 65530)]
  monkeypatch.setattr(executables, 'memory_mappings', lambda: counts[0])
  with pytest.warns(RuntimeWarning, match=r'40000 mappings left; still past 0.5 of it'):
    assert executables.release_near_limit()
  with warnings.catch_warnings():
    warnings.simplefilter('error')
    assert not executables.release_near_limit()            # nothing has grown
    counts[0] = (52765, 65530)                              # 40000 + (65530 - 40000) / 2
    assert not executables.release_near_limit()
  counts[0] = (52766, 65530)
  with pytest.warns(RuntimeWarning, match='52766 memory mappings held'):
    assert executables.release_near_limit()


def test_mapped_files_whose_paths_are_not_utf8_are_counted(tmp_path, memory_mappings):
  path = os.path.join(os.fsencode(tmp_path), b'\xff\xfe-weights.bin')
  with open(path, 'wb') as f:
    f.write(b'\0' * mmap.PAGESIZE)
  before = memory_mappings()[0]
  with open(path, 'rb') as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ):
    assert memory_mappings()[0] == before + 1               # was None: a UnicodeDecodeError


@pytest.mark.parametrize('text, limit', [(' 65530\n', 65530), ('0', None), ('-5', None),
                                         ('abc', None), ('', None), ('1e5', None)])
def test_the_limit_must_be_a_positive_integer(tmp_path, monkeypatch, memory_mappings, text, limit):
  (tmp_path / 'max_map_count').write_text(text)
  monkeypatch.setattr(executables, 'MAX_MAP_COUNT', str(tmp_path / 'max_map_count'))
  counts = executables.memory_mappings()
  assert (counts if limit is None else counts[1]) == limit


def test_a_bad_near_limit_is_named(monkeypatch):
  monkeypatch.setattr(executables, 'NEAR_LIMIT', 2)
  with pytest.raises(ValueError, match=r'NEAR_LIMIT must be a finite number in \(0.0, 1.0\], '
                                       r'got 2'):
    executables.release_near_limit()

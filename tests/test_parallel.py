"""Beyond one device: partition specs, mesh checks, multi-process settings (this process, one
device), sharded steps on 8 simulated CPU devices (tests/parallel_worker.py in a subprocess), and
two processes on localhost through jax.distributed (gloo collectives)."""

import dataclasses
import json
import os
import pathlib
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import fake_experiment
from xla_flags import compile_settings
from experiments.records import read_results
from experiments.sweep import run_sweep
from jaxspec.decoding.steps import LOCAL_STEPS
from jaxspec.models import PRESETS, ModelConfig, param_shapes
from jaxspec.parallel import (MODEL, check_model_fits, distributed, make_mesh, param_specs,
                              place_pair, shard_params)

TESTS = pathlib.Path(__file__).parent
ROOT = TESTS.parent


# ---- partition specs and mesh checks (one device) ----

@pytest.mark.parametrize('config', [
    PRESETS['target-12m'], PRESETS['draft-1m'],
    ModelConfig.from_name('test-tiny', qkv_bias=True, tie_embeddings=True)],
    ids=['target-12m', 'draft-1m', 'tiny-bias-tied'])
def test_every_split_dimension_is_heads_hidden_units_or_vocab(config):
  shapes, specs = param_shapes(config), param_specs(param_shapes(config))
  flat_specs = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
  splittable = {config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim,
                config.d_ff, config.vocab_size}
  split_leaves = 0
  for (path, leaf), spec in zip(jax.tree_util.tree_flatten_with_path(shapes)[0], flat_specs):
    name = jax.tree_util.keystr(path)
    for dim, axis in zip(leaf.shape, tuple(spec)):
      if axis == MODEL:
        assert dim in splittable, (name, leaf.shape, spec)
        split_leaves += 1
    if 'norm' in name or 'embed' in name:
      assert spec == P(), name                         # norms and the embedding are replicated
  # q, k, v, o, gate, up, down per layer (+ biases) and the output head when untied.
  per_layer = 7 + 3 * config.qkv_bias
  assert split_leaves == config.num_layers * per_layer + (not config.tie_embeddings)


def test_a_parameter_without_a_rule_is_an_error():
  shapes = param_shapes(PRESETS['test-tiny'])
  shapes['params']['layer_0']['attn']['rotary'] = {'freq': jax.ShapeDtypeStruct((4,), np.float32)}
  with pytest.raises(ValueError, match=r'no partition rule for parameter '
                                       r'params/layer_0/attn/rotary/freq of shape \(4,\)'):
    param_specs(shapes)


def test_model_axis_that_does_not_divide_the_heads_names_the_sizes():
  target = PRESETS['target-12m']                       # 6 query heads, 2 KV heads
  check_model_fits(target, 2)                          # divides everything
  with pytest.raises(ValueError, match=r'mesh.model=8 does not divide num_heads=6, '
                                       r'num_kv_heads=2 of the target'):
    check_model_fits(target, 8)
  with pytest.raises(ValueError, match=r'mesh.model=3 does not divide num_kv_heads=2, d_ff=1024, '
                                       r'vocab_size=4096'):
    check_model_fits(target, 3)


def test_mesh_larger_than_the_devices_names_both_counts():
  with pytest.raises(ValueError, match=r'data=1 x model=2 = 2 devices does not match the 1 '
                                       r'device available'):
    make_mesh(1, 2)
  with pytest.raises(ValueError, match=r'mesh.model must be an int >= 1, got 0'):
    make_mesh(1, 0)


def test_a_one_by_one_mesh_keeps_the_single_device_path(tiny):
  config, params = tiny
  steps, target_params, draft_params = place_pair({'data': 1, 'model': 1}, config, params, params)
  assert steps is LOCAL_STEPS and target_params is params and draft_params is params
  # int() read -1 x -1 as one device and 4.9 x 2.2 as a 4 x 2 mesh.
  for mesh, bad in (({'data': -1, 'model': -1}, 'mesh.data must be an int >= 1, got -1'),
                    ({'data': 1, 'model': 2.2}, r'mesh.model must be an int >= 1, got 2\.2')):
    with pytest.raises(ValueError, match=bad):
      place_pair(mesh, config, params, params)


# ---- multi-process settings ----

def test_distributed_settings_come_from_config_then_environment():
  env = {'JAX_COORDINATOR_ADDRESS': 'host0:1234', 'JAX_NUM_PROCESSES': '4', 'JAX_PROCESS_ID': '3'}
  assert distributed.settings(None, env) == distributed.DistributedSettings('host0:1234', 4, 3)
  unset = dict(coordinator_address='', num_processes=0, process_id=-1)
  assert distributed.settings(unset, env) == distributed.DistributedSettings('host0:1234', 4, 3)
  chosen = dict(coordinator_address='h:1', num_processes=2, process_id=0)
  assert distributed.settings(chosen, env) == distributed.DistributedSettings('h:1', 2, 0)
  single = distributed.settings(unset, {})
  assert single == distributed.DistributedSettings('', 1, 0) and not single.enabled


@pytest.mark.parametrize('config, message', [
    (dict(num_processes=2, process_id=1), r'num_processes=2 needs a coordinator_address'),
    (dict(coordinator_address='h:1', num_processes=2),        # every process was process 0
     r"num_processes=2 needs each process's index: set distributed.process_id or "
     r'\$JAX_PROCESS_ID'),
    (dict(coordinator_address='h:1', num_processes=2.7, process_id=0),
     r'distributed.num_processes must be an int, got 2.7'),
    (dict(coordinator_address='h:1', num_processes=True, process_id=0), r'got True'),
    (dict(coordinator_address='h:1', num_processes=2, process_id=-5),
     r'process_id must be >= 0, or -1 for \$JAX_PROCESS_ID, got -5'),
    (dict(coordinator_address='localhost', num_processes=2, process_id=0),
     r"coordinator_address must be host:port \(an integer port\) or 'auto', got 'localhost'"),
    (dict(coordinator_address='h:1', num_processes=2, process_id=2),
     r'process_id=2 outside \[0, num_processes=2\)'),
    (dict(coordinator_address='h:1', num_processes='two'),
     r"num_processes must be an int, got 'two'"),
])
def test_bad_distributed_settings_are_named(config, message):
  with pytest.raises(ValueError, match=message):
    distributed.settings(config, {})


def test_a_process_count_without_ids_is_refused_for_sweep_shards_too():
  # Sweeps read only the index and count: both processes took shard 0 of 2 before.
  with pytest.raises(ValueError, match="needs each process's index"):
    distributed.settings(None, {'JAX_NUM_PROCESSES': '2'}, need_coordinator=False)
  with pytest.raises(ValueError, match=r"\$JAX_PROCESS_ID must be an int, got 'x'"):
    distributed.settings(None, {'JAX_NUM_PROCESSES': '2', 'JAX_PROCESS_ID': 'x'},
                         need_coordinator=False)
  auto = distributed.settings(dict(coordinator_address='auto'), {'JAX_NUM_PROCESSES': '2'})
  assert auto == distributed.DistributedSettings('auto', 2, None)  # the cluster assigns ids
  with pytest.raises(ValueError, match="needs each process's index"):   # not without a runtime
    distributed.settings(dict(coordinator_address='auto'), {'JAX_NUM_PROCESSES': '2'},
                         need_coordinator=False)
  stray = distributed.settings(None, {'JAX_COORDINATOR_ADDRESS': 'localhost'})   # one process
  assert stray.num_processes == 1 and not stray.enabled


def test_tied_embeddings_need_no_vocabulary_the_model_axis_divides():
  tied = ModelConfig(vocab_size=97, d_model=16, num_layers=1, num_heads=2, num_kv_heads=2,
                     head_dim=8, d_ff=32, tie_embeddings=True)
  check_model_fits(tied, 2)                           # the embedding is replicated, no lm_head
  with pytest.raises(ValueError, match='does not divide vocab_size=97'):
    check_model_fits(dataclasses.replace(tied, tie_embeddings=False), 2)
  with pytest.raises(ValueError, match=r"mesh fields are data and model, got \['modle'\]"):
    place_pair({'modle': 2}, tied, {}, {})            # a misspelt key ran on one device
  with pytest.raises(ValueError, match='splits a target by its ModelConfig, got config=None'):
    shard_params({}, None, make_mesh(1, 1))


def test_make_mesh_refuses_no_devices_and_a_device_twice():
  with pytest.raises(ValueError, match='empty device list'):     # was an IndexError
    make_mesh(1, 1, devices=[])
  device = jax.devices()[0]
  with pytest.raises(ValueError, match='a device more than once'):
    make_mesh(2, 1, devices=[device, device])


def test_single_process_initialize_starts_no_runtime():
  assert not distributed.initialize(None, {}).enabled
  assert not jax.distributed.is_initialized()


def test_joining_a_multi_process_run_says_which_before_it_waits(monkeypatch, capsys):
  joined = []
  monkeypatch.setattr(jax.distributed, 'initialize',
                      lambda *args, **kwargs: joined.append((args, kwargs)))
  env = {'JAX_COORDINATOR_ADDRESS': 'localhost:9876', 'JAX_NUM_PROCESSES': '2',
         'JAX_PROCESS_ID': '0'}
  assert distributed.initialize(None, env).enabled
  assert joined == [(('localhost:9876', 2, 0), {'initialization_timeout': 300})]
  err = capsys.readouterr().err
  assert 'joining a 2-process run as process 0 at coordinator localhost:9876' in err
  assert 'within 300 s, JAX aborts this process' in err
  assert '$JAX_NUM_PROCESSES' in err


def test_sweep_shard_process_takes_the_cases_of_this_process(tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, 'experiments.fake', fake_experiment)
  monkeypatch.setenv('JAX_PROCESS_ID', '1')
  monkeypatch.setenv('JAX_NUM_PROCESSES', '2')
  outcome = run_sweep(str(TESTS / 'fake_config.py'), tmp_path, shard='process', progress=False,
                      overrides={'log': str(tmp_path / 'log.txt')})
  # Cases 1, 3, 5 of k in (1, 2, 4) x temperature in (0, 1).
  assert outcome.ran == ['k=1,temperature=1.0', 'k=2,temperature=1.0', 'k=4,temperature=1.0']


# ---- 8 simulated CPU devices, mesh data=2 x model=4 (tests/parallel_worker.py) ----

def _compile_settings() -> list:
  """What the subprocesses below keep of this process's XLA_FLAGS: its compile settings
  (`xla_flags.compile_settings`), not a device count or a dump folder."""
  return compile_settings(os.environ.get('XLA_FLAGS', ''))


@pytest.fixture(scope='module')
def worker(smoke_runs):  # pylint: disable=unused-argument  (started first: both run at once)
  env = {**os.environ, 'PYTHONPATH': str(ROOT),
         'XLA_FLAGS': ' '.join(_compile_settings() + ['--xla_force_host_platform_device_count=8'])}
  proc = subprocess.run([sys.executable, str(TESTS / 'parallel_worker.py')], env=env,
                        capture_output=True, text=True, timeout=600, check=False)
  lines = [l for l in proc.stdout.splitlines() if l.startswith('RESULT ')]
  assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
  return json.loads(lines[-1][len('RESULT '):])


def test_worker_has_8_devices_and_each_holds_a_slice_of_the_target(worker):
  assert worker['devices'] == 8
  assert worker['q_shape'] == [32, 64] and worker['q_shard_shape'] == [32, 16]  # heads / 4
  assert worker['draft_shard_shape'] == [32, 64]                                 # replicated


def test_the_experiment_reads_the_target_into_its_slices_on_a_mesh(worker):
  # It read the whole target onto device 0 (load_model) and split it afterwards.
  q, shard = worker['experiment_q'], worker['experiment_q_shard']
  assert shard == [q[0], q[1] // 2]                                    # model axis of 2
  assert worker['experiment_draft_replicated'] and worker['experiment_placement_kept']
  assert worker['sums_split_independent']       # the checkpoint sums, shard by shard or whole


def test_sharded_logits_match_one_device(worker):
  for step in ('prefill', 'decode', 'verify'):
    assert worker['logits'][step] < 1e-4 * max(1.0, worker['logit_scale']), step
    assert worker['logits'][step + '_argmax_equal'], step
  assert worker['cache_spec_kept']                 # the cache comes back split as it went in


def test_sharded_greedy_decoding_gives_the_single_device_tokens(worker):
  assert worker['ar_mesh'] == worker['ar_local']
  assert worker['sp_mesh'] == worker['sp_local'] == worker['ar_local']
  assert all(len(t) == 24 for t in worker['sp_mesh'])
  assert worker['alpha_mesh'] == worker['alpha_local'] and 0 < worker['alpha_mesh'] < 1


def test_prefix_cache_with_host_tier_on_a_sharded_target(worker):
  """Two turns of three conversations in a pool that demotes: same tokens, hits, promotions and
  acceptance as on one device."""
  assert worker['prefix_mesh'] == worker['prefix_local']
  assert sum(turn[2] for turn in worker['prefix_mesh']) > 0   # host-tier promotions happened


def test_eviction_on_a_sharded_target(worker):
  """H2O under a budget the prompts overflow, target split over 'model' (scores summed over the
  heads' shards): the same tokens, kept positions and scores as on one device."""
  tokens, key_pos, scores = worker['evict_mesh']
  ref_tokens, ref_key_pos, ref_scores = worker['evict_local']
  assert tokens == ref_tokens and key_pos == ref_key_pos
  assert abs(scores - ref_scores) <= 1e-4 * ref_scores
  assert max(sum(p >= 0 for p in row) for layer in key_pos for row in layer) <= 12  # budget held


def test_sharded_steps_compile_once(worker):
  # Two prefills (target, draft), the two decode loops and the empty caches, once per shape;
  # further prompts of other lengths and seeds reuse them.
  assert worker['compilations_first'] > 0
  assert worker['compilations_after'] == worker['compilations_first']


def test_no_collective_moves_a_whole_weight_or_kv_pool(worker):
  sizes, split = worker['collective_sizes'], worker['split_sizes']
  assert sizes                                     # the o / down all-reduces are there
  assert max(sizes) < min(split), (sorted(set(sizes)), sorted(set(split)))


def test_checkpoint_loads_straight_into_its_shardings(worker):
  assert worker['load_sharded_equal']
  assert worker['load_sharded_bfloat16_equal']
  assert "dtype must be a floating-point dtype" in worker['error_load_sharded_dtype']
  assert ("config.json differs from the config its tensors were saved with (d_ff: 64 -> 128)"
          in worker['error_load_sharded_config'])
  assert ("tensor ['params']['layer_0']['mlp']['down']['kernel'] has shape (64, 32), config "
          "implies (128, 32)") in worker['error_load_sharded']
  assert ('tensor params/layer_0/mlp/down/kernel does not match its checksum' in
          worker['error_load_sharded_checksum'])


def test_mesh_errors_name_the_sizes(worker):
  assert 'data=3 x model=3 = 9 devices does not match the 8 devices' in worker['error_mesh_size']
  assert ("its mesh's 'data' axis must be 1, got data=2" in
          worker['error_prefix_data_axis'])      # was: 'use batch_size a multiple of 2'
  for key in ('error_heads_params', 'error_heads_cache'):
    assert 'mesh.model=8 does not divide num_heads=6, num_kv_heads=2' in worker[key]
  assert 'batch of 1 rows is not a multiple of mesh.data=2' in worker['error_batch']
  assert worker['shipped_model_2'] is None         # the shipped target splits 2 ways
  assert worker['pool_share_target'] is None       # 1/4 of the target's pool on each of 8
  assert ('in the host memory its CPU devices share (draft: 0.0 GiB, 11 pages of 8 tokens, 2 '
          'layers, 8 shares), more than the 0.0 GiB of memory of' in
          worker['error_pool_share_draft'])


def test_params_not_placed_on_the_mesh_are_refused(worker):
  assert ("target tensor ['params']['embed']['embedding'] is not placed on the mesh"
          in worker['error_unplaced_target'])
  assert 'shard_params(params, config, mesh, replicate=True)' in worker['error_unplaced_draft']


# ---- two processes on localhost through jax.distributed ----

def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('localhost', 0))
    return s.getsockname()[1]


@pytest.fixture(scope='module')
def smoke_runs(tmp_path_factory):
  """The smoke experiment (json only) as one process and as two processes splitting the shipped
  target model=2 across them; started here, awaited by the test, so they overlap the worker."""
  tmp = tmp_path_factory.mktemp('smoke')
  smoke = [sys.executable, '-m', 'experiments.run', '--config=configs/speculative.py:smoke',
           '--config.workloads=json']
  env = {k: v for k, v in os.environ.items() if not k.startswith(('JAX_', 'XLA_FLAGS'))}
  env['PYTHONPATH'] = str(ROOT)
  if _compile_settings():
    env['XLA_FLAGS'] = ' '.join(_compile_settings())
  launch = lambda args, env: subprocess.Popen(smoke + args, env=env, cwd=ROOT, text=True,
                                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
  procs = [launch([f'--workdir={tmp / "one"}'], env)]
  dist = dict(env, JAX_COORDINATOR_ADDRESS=f'localhost:{_free_port()}', JAX_NUM_PROCESSES='2')
  for pid in (0, 1):
    procs.append(launch(['--config.mesh.model=2', f'--workdir={tmp / "two"}'],
                        dict(dist, JAX_PROCESS_ID=str(pid))))
  yield tmp, procs
  for p in procs:
    if p.poll() is None:
      p.kill()
      p.wait()


DETERMINISTIC = ('workload', 'k', 'acceptance_rate', 'acceptance_per_position',
                 'mean_accepted_length', 'tokens_generated', 'matches_autoregressive')


@pytest.mark.slow
def test_two_processes_run_the_smoke_experiment_like_one(smoke_runs):
  tmp, procs = smoke_runs
  logs = [p.communicate(timeout=600)[0] for p in procs]
  assert [p.returncode for p in procs] == [0, 0, 0], '\n'.join(l[-2000:] for l in logs)
  one = list((tmp / 'one' / 'speculative').glob('*/results.jsonl'))
  two = list((tmp / 'two' / 'speculative').glob('*/results.jsonl'))
  assert len(one) == 1 and len(two) == 1           # process 1 wrote nothing
  (a,), (b,) = read_results(one[0]), read_results(two[0])
  assert {f: a[f] for f in DETERMINISTIC} == {f: b[f] for f in DETERMINISTIC}
  assert b['matches_autoregressive'] is True
  assert 'connected to 1 peer' in logs[1] + logs[2]  # the gloo collectives joined both

"""Model directories: round trip, and clear errors for missing or corrupt checkpoints."""

import dataclasses
import json
import pathlib
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.models import CheckpointError, ModelConfig, load_model, save_model
from jaxspec.models.checkpoint import param_shapes, shipped
from jaxspec.training import init_params

# A read of a corrupt tensor (these tests damage files on purpose) leaves orbax/TensorStore's
# pending read coroutines unfinished; the collector reports them when it frees them (conftest
# collects after each file), as warnings about orbax's internals, not about these tests.
pytestmark = pytest.mark.filterwarnings('ignore::pytest.PytestUnraisableExceptionWarning')


@pytest.fixture
def saved(tmp_path):
  config = ModelConfig.from_name('test-tiny')
  params = init_params(config, 0)
  save_model(tmp_path / 'm', config, params, dtype='float32', info={'val_loss': 1.5})
  return tmp_path / 'm', config, params


def _largest_data_file(path):
  files = [f for f in (path / 'params').rglob('*') if f.is_file() and f.parent.name == 'd']
  return max(files, key=lambda f: f.stat().st_size)


def test_round_trip_is_exact_in_float32(saved):
  path, config, params = saved
  loaded_config, loaded = load_model(path)
  assert loaded_config == config
  jax.tree.map(np.testing.assert_array_equal, loaded, params)


def test_bfloat16_storage_rounds_to_bfloat16(tmp_path):
  config = ModelConfig.from_name('test-tiny')
  params = init_params(config, 0)
  save_model(tmp_path / 'b', config, params)          # bfloat16 by default
  _, loaded = load_model(tmp_path / 'b')
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-2, atol=1e-2), loaded, params)


def test_missing_directory_is_named(tmp_path):
  with pytest.raises(CheckpointError, match='no model directory at .*nowhere'):
    load_model(tmp_path / 'nowhere')


def test_missing_params_is_named(saved):
  path, _, _ = saved
  shutil.rmtree(path / 'params')
  with pytest.raises(CheckpointError, match='params is missing'):
    load_model(path)


def test_a_flipped_byte_in_the_tensor_data_is_refused(saved):
  path, _, _ = saved
  load_model(path)                                   # whole: loads
  data = _largest_data_file(path)
  raw = bytearray(data.read_bytes())
  raw[len(raw) // 2] ^= 0x10                         # one bit of one weight, mid-file
  data.write_bytes(bytes(raw))
  with pytest.raises(CheckpointError, match='does not match its checksum'):
    load_model(path)


def test_split_independent_sums_catch_the_flipped_byte_too(saved):
  # Across processes (load_sharded), where no tensor is whole anywhere, the sums are the check.
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  from jaxspec.models.checksums import verify_sums  # pylint: disable=import-outside-toplevel
  from jaxspec.models.shard_sums import tensor_sums  # pylint: disable=import-outside-toplevel
  path, _, params = saved
  with ocp.StandardCheckpointer() as ckptr:
    assert verify_sums(path / 'checksums.json', ckptr.restore(path / 'params'))
    data = _largest_data_file(path)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r'tensor params/\S+ does not match its sum in '
                                              r'checksums.json \(1 of'):
      verify_sums(path / 'checksums.json', ckptr.restore(path / 'params'))
  w = np.asarray(params['params']['layer_0']['mlp']['down']['kernel'])
  swapped = w.copy()
  swapped[[0, 1]] = swapped[[1, 0]]                     # two rows swapped: the sum moves too
  assert tensor_sums({'w': w}) != tensor_sums({'w': swapped})
  assert tensor_sums({'w': w.astype(jnp.bfloat16)}) != tensor_sums({'w': w})
  (path / 'checksums.json').write_text('{"sha256": {}, "dtype": {}}')   # written before sums
  assert not verify_sums(path / 'checksums.json', params)


def test_load_sharded_across_processes_checks_the_sums(saved, monkeypatch):
  # Across processes no tensor is whole anywhere: the SHA-256 was skipped, nothing was checked.
  from jaxspec.parallel import checkpoint as sharded  # pylint: disable=import-outside-toplevel
  from jaxspec.parallel import make_mesh  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(sharded, '_single_process', lambda: False)
  path, _, _ = saved
  sharded.load_sharded(path, make_mesh(1, 1))
  listed = json.loads((path / 'checksums.json').read_text())
  data = _largest_data_file(path)
  original = data.read_bytes()
  raw = bytearray(original)
  raw[len(raw) // 2] ^= 0x10
  data.write_bytes(bytes(raw))
  with pytest.raises(CheckpointError, match=r'does not match its sum in checksums.json'):
    sharded.load_sharded(path, make_mesh(1, 1))
  data.write_bytes(original)      # the flipped bit may make an inf, refused on its own
  del listed['sum32']                                    # written before the sums existed
  (path / 'checksums.json').write_text(json.dumps(listed))
  with pytest.warns(UserWarning, match='across processes its tensors are loaded unverified'):
    sharded.load_sharded(path, make_mesh(1, 1))
  listed['sum32'] = {}                                   # lists no tensor: not "verified"
  (path / 'checksums.json').write_text(json.dumps(listed))
  with pytest.raises(CheckpointError, match='does not list sums of the same tensors'):
    sharded.load_sharded(path, make_mesh(1, 1))


def test_a_checksum_mismatch_names_the_tensor(saved):
  path, _, _ = saved
  sums = json.loads((path / 'checksums.json').read_text())
  name = 'params/layer_0/mlp/down/kernel'
  assert name in sums['sha256']
  sums['sha256'][name] = '0' * 64
  (path / 'checksums.json').write_text(json.dumps(sums))
  with pytest.raises(CheckpointError, match=re.escape(f'tensor {name} does not match its '
                                                      f'checksum in checksums.json (1 of')):
    load_model(path)


@pytest.mark.parametrize('text', ['{"sha256": [1]', '[]', '{"sha256": "x"}', '{}'])
def test_a_malformed_checksums_file_is_named(saved, text):
  path, _, _ = saved
  (path / 'checksums.json').write_text(text)
  with pytest.raises(CheckpointError, match='checksums.json is unreadable or malformed'):
    load_model(path)


def test_a_directory_without_checksums_loads_unverified(saved):
  path, _, params = saved                      # as a directory saved before checksums existed
  (path / 'checksums.json').unlink()
  with pytest.warns(UserWarning, match='has no checksums.json: its tensors are loaded unverified'):
    _, loaded = load_model(path)
  jax.tree.map(np.testing.assert_array_equal, loaded, params)


def test_a_save_cut_short_is_refused_until_saved_again(saved, monkeypatch):
  """A save killed after the new params and before the new config used to load as a silent mix
  of the two models."""
  from jaxspec.parallel import load_sharded, make_mesh  # pylint: disable=import-outside-toplevel
  path, config, params = saved
  other = ModelConfig.from_name('test-tiny', rope_theta=500.0)
  real = pathlib.Path.write_text

  def killed(self, text, *args, **kwargs):
    if self.name == 'config.json':
      raise KeyboardInterrupt
    return real(self, text, *args, **kwargs)

  monkeypatch.setattr(pathlib.Path, 'write_text', killed)
  with pytest.raises(KeyboardInterrupt):
    save_model(path, other, init_params(other, 1), dtype='float32')
  monkeypatch.undo()
  for load in (lambda: load_model(path), lambda: load_sharded(path, make_mesh(1, 1))):
    with pytest.raises(CheckpointError, match='a save_model into it did not finish '
                                              r'\(SAVE_INCOMPLETE is there\)'):
      load()
  save_model(path, config, params, dtype='float32')
  assert not (path / 'SAVE_INCOMPLETE').exists() and load_model(path)[0] == config
  # A save cut short over a Hugging Face directory: its old model loaded silently.
  hf = shutil.copytree(pathlib.Path(__file__).parent / 'fixtures/hf/llama', path.parent / 'hf')
  (hf / 'SAVE_INCOMPLETE').write_text('')
  with pytest.raises(CheckpointError, match='did not finish'):
    load_model(hf)


def test_load_sharded_names_a_missing_tensor_file_and_a_missing_params_directory(saved):
  # Were a 400-character tensorstore repr naming no tensor, and "'NoneType' object has no
  # attribute 'tree'".
  from jaxspec.parallel import load_sharded, make_mesh  # pylint: disable=import-outside-toplevel
  path, _, _ = saved
  max(path.glob('params/ocdbt.process_0/d/*'), key=lambda f: f.stat().st_size).unlink()
  with pytest.raises(CheckpointError,
                     match=r'cannot read the checkpoint at .*\(tensor params\.\S+\)$'):
    load_sharded(path, make_mesh(1, 1))
  shutil.rmtree(path / 'params')
  with pytest.raises(CheckpointError, match=r'params is missing'):
    load_sharded(path, make_mesh(1, 1))
  with pytest.raises(CheckpointError, match=r'no model directory at .*nowhere'):
    load_sharded(path / 'nowhere', make_mesh(1, 1))


def test_shipped_models_carry_checksums():
  for name in ('target', 'draft'):
    sums = json.loads((shipped(name) / 'checksums.json').read_text())['sha256']
    assert len(sums) == len(jax.tree.leaves(param_shapes(load_model(shipped(name))[0])))


def test_bad_config_is_named(saved):
  path, _, _ = saved
  (path / 'config.json').write_text('{"vocab_size": 64}')
  with pytest.raises(CheckpointError, match='config.json is not a valid ModelConfig'):
    load_model(path)


def test_wrong_shape_names_the_tensor(saved):
  path, config, _ = saved
  fields = json.loads((path / 'config.json').read_text())
  fields['d_ff'] = config.d_ff * 2
  (path / 'config.json').write_text(json.dumps(fields))
  sums = json.loads((path / 'checksums.json').read_text())
  del sums['config']                       # as a directory saved before configs were listed
  (path / 'checksums.json').write_text(json.dumps(sums))
  with pytest.raises(CheckpointError,
                     match=r"tensor \['params'\]\['layer_0'\]\['mlp'\].*has shape \(64, 32\)"):
    load_model(path)


@pytest.mark.parametrize('changes', [
    dict(num_heads=2, num_kv_heads=1, head_dim=16),     # every shape kept, every token changed
    dict(norm_eps=0.5), dict(rope_theta=500.0), dict(max_seq_len=100000)])
def test_a_config_edited_beside_its_tensors_is_named(saved, changes):
  # checksums.json listed tensors only: each of these loaded silently (three changed the tokens).
  path, config, params = saved
  fields = json.loads((path / 'config.json').read_text())
  (path / 'config.json').write_text(json.dumps({**fields, **changes}, indent=4))
  with pytest.raises(CheckpointError, match='config.json differs from the config its tensors '
                                            'were saved with') as raised:
    load_model(path)
  for key, value in changes.items():
    assert f'{key}: {fields[key]!r} -> {value!r}' in str(raised.value)
  (path / 'config.json').write_text(json.dumps(fields))            # reformatted: the same config
  assert load_model(path)[0] == config


def test_numerics_fields_a_lower_context_and_other_spellings_may_change(saved):
  # Not properties of the weights: refusing them would refuse legitimate edits.
  path, config, _ = saved
  fields = json.loads((path / 'config.json').read_text())
  default_left_out = {k: v for k, v in fields.items() if k != 'exact_verify'}
  for edited, want in [({**fields, 'dtype': 'bfloat16'}, dict(dtype='bfloat16')),
                       ({**fields, 'exact_verify': True}, dict(exact_verify=True)),
                       ({**fields, 'max_seq_len': 128}, dict(max_seq_len=128)),
                       (default_left_out, {}), ({**fields, 'rope_scaling': None}, {})]:
    (path / 'config.json').write_text(json.dumps(edited))
    assert load_model(path)[0] == dataclasses.replace(config, **want)


@pytest.mark.parametrize('dtype', ['foo', 'int32', 'bool', None])   # None: was 'needs x64'
def test_a_dtype_that_is_not_floating_is_named(tmp_path, dtype):
  with pytest.raises(ValueError, match=f'dtype must be a floating-point dtype .*got {dtype!r}'):
    load_model(tmp_path, dtype)


def test_save_refuses_a_bad_dtype_or_params_before_writing_anything(saved, tmp_path):
  path, config, params = saved
  other = ModelConfig.from_name('test-tiny', rope_theta=500.0)
  for dtype in ('int8', 'float8', 'float64'):
    with pytest.raises(ValueError, match=f'dtype .*{dtype!r}'):
      save_model(path, other, params, dtype=dtype)
  with pytest.raises(CheckpointError, match=r'params given to save_model is missing tensor'):
    save_model(path, other, {'params': {}})
  with pytest.raises(CheckpointError, match=r'params given to save_model: tensor .* has shape'):
    save_model(tmp_path / 'new', other, jax.tree.map(lambda x: x[..., :1], params))
  # info that is not JSON was found after the params and config were already replaced.
  with pytest.raises(ValueError, match='info is not JSON-serialisable'):
    save_model(path, other, params, info={'val_loss': np.float32(3.0)})
  with pytest.raises(ValueError, match='info is not JSON-serialisable'):
    save_model(path, other, params, info={'val_loss': float('nan')})
  assert not (tmp_path / 'new').exists()
  assert load_model(path)[0] == config             # the directory is as it was
  assert json.loads((path / 'info.json').read_text()) == {'val_loss': 1.5}
  save_model(path, config, params, dtype='float32')
  assert not (path / 'info.json').exists()         # a stale info.json is not left behind


def test_weights_beyond_float16_range_are_named_before_writing(saved, tmp_path):
  # Stored as inf before (numpy's overflow warning only; the checksums were of the inf values).
  from jaxspec.models.hf import save_pretrained  # pylint: disable=import-outside-toplevel
  _, config, params = saved
  big = jax.tree.map(lambda x: x, params)
  big['params']['embed']['embedding'] = big['params']['embed']['embedding'].at[3, 0].set(1e5)
  with pytest.raises(ValueError, match=r"tensor \['params'\]\['embed'\]\['embedding'\] holds 1 "
                                       r"values outside float16's range \(up to 1e\+05"):
    save_model(tmp_path / 'm16', config, big, dtype='float16')
  with pytest.raises(ValueError, match=r"tensor model.embed_tokens.weight holds 1 values outside "
                                       r"float16's range"):
    save_pretrained(tmp_path / 'hf', config, big, dtype='float16')
  assert not (tmp_path / 'm16').exists() and not (tmp_path / 'hf').exists()
  save_model(tmp_path / 'b', config, big, dtype='bfloat16')           # in bfloat16's range
  assert float(load_model(tmp_path / 'b')[1]['params']['embed']['embedding'][3, 0]) == 99840.0
  # Loaded in float16 they would be inf too (NaN logits): named, on both load paths.
  from jaxspec.models.hf import load_pretrained  # pylint: disable=import-outside-toplevel
  from jaxspec.parallel import load_sharded, make_mesh  # pylint: disable=import-outside-toplevel
  save_pretrained(tmp_path / 'hf', config, big, dtype='bfloat16')
  for load in (lambda: load_model(tmp_path / 'b', 'float16'),
               lambda: load_sharded(tmp_path / 'b', make_mesh(1, 1), dtype='float16'),
               lambda: load_pretrained(tmp_path / 'hf', 'float16')):
    with pytest.raises(CheckpointError, match=r"embed.* holds 1 values outside float16's range "
                                              r".*load in bfloat16 or float32"):
      load()
  (tmp_path / 'b' / 'checksums.json').unlink()   # unverified: restored straight into float16 before
  with pytest.warns(UserWarning, match='unverified'), pytest.raises(
      CheckpointError, match=r"embed.* holds 1 values outside float16's range"):
    load_sharded(tmp_path / 'b', make_mesh(1, 1), dtype='float16')


@pytest.mark.parametrize('bad', [np.nan, np.inf])
def test_non_finite_weights_are_refused_when_saved_and_loaded(saved, tmp_path, monkeypatch, bad):
  # Saved and loaded without a word (the checksums were of the NaN bytes); a draft with NaN
  # weights then proposed nothing and a run reported α = 0 as a measurement.
  from jaxspec.models import checkpoint  # pylint: disable=import-outside-toplevel
  from jaxspec.models.hf import load_pretrained, save_pretrained  # pylint: disable=C0415
  from jaxspec.parallel import load_sharded, make_mesh  # pylint: disable=import-outside-toplevel
  _, config, params = saved
  broken = jax.tree.map(lambda x: x, params)
  broken['params']['layer_1']['mlp']['up']['kernel'] = (
      broken['params']['layer_1']['mlp']['up']['kernel'].at[0, :3].set(bad))
  needle = r"up'\]\['kernel'\] holds 3 NaN or infinite values"
  for dtype in ('float32', 'bfloat16'):
    with pytest.raises(ValueError, match=needle):
      save_model(tmp_path / 'n', config, broken, dtype=dtype)
  with pytest.raises(ValueError, match='up_proj.weight holds 3 NaN or infinite values'):
    save_pretrained(tmp_path / 'hf', config, broken)
  assert not (tmp_path / 'n').exists() and not (tmp_path / 'hf').exists()
  monkeypatch.setattr(checkpoint, 'check_fits', lambda *args, **kwargs: None)   # as if older
  save_model(tmp_path / 'n', config, broken, dtype='float32')
  from jaxspec.models import hf  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(hf, 'check_fits', lambda *args, **kwargs: None)
  save_pretrained(tmp_path / 'hf', config, broken)
  monkeypatch.undo()
  for load in (lambda: load_model(tmp_path / 'n'),
               lambda: load_sharded(tmp_path / 'n', make_mesh(1, 1)),
               lambda: load_pretrained(tmp_path / 'hf')):
    with pytest.raises(CheckpointError, match='holds 3 NaN or infinite values'):
      load()


def test_float32_values_past_bfloat16s_max_are_named(saved, tmp_path):
  # bfloat16's max is 3.39e38, float32's 3.40e38: the cast between them was not checked.
  _, config, params = saved
  big = jax.tree.map(lambda x: x, params)
  big['params']['embed']['embedding'] = big['params']['embed']['embedding'].at[1, 1].set(3.4e38)
  with pytest.raises(ValueError, match=r"embedding'\] holds 1 values outside bfloat16's range "
                                       r'.*save in a wider dtype \(float32\)'):
    save_model(tmp_path / 'b', config, big)                  # bfloat16 by default
  save_model(tmp_path / 'f', config, big, dtype='float32')
  with pytest.raises(CheckpointError, match=r"outside bfloat16's range .*load in float32"):
    load_model(tmp_path / 'f', 'bfloat16')


def test_a_dtype_object_is_stored_as_its_name_and_saves(tmp_path):
  # np.dtype('bfloat16') passed the check unconverted: save_model then failed on config.json
  # after its SAVE_INCOMPLETE marker, leaving an unloadable directory; the configs hashed apart.
  import ml_dtypes  # pylint: disable=import-outside-toplevel
  named = ModelConfig.from_name('test-tiny', dtype='bfloat16')
  for dtype in (np.dtype(ml_dtypes.bfloat16), jnp.bfloat16):
    config = ModelConfig.from_name('test-tiny', dtype=dtype)
    assert config.dtype == 'bfloat16' and hash(config) == hash(named)
  save_model(tmp_path / 'm', ModelConfig.from_name('test-tiny', dtype=jnp.bfloat16),
             init_params(named, 0))
  assert load_model(tmp_path / 'm')[0] == named
  assert named.kv_bytes_per_token() == named.kv_bytes_per_token(2)   # the cache dtype's bytes


def test_params_that_are_not_floats_are_named(saved):
  from jaxspec.models import check_params  # pylint: disable=import-outside-toplevel
  _, config, params = saved
  for dtype in (jnp.int32, jnp.complex64):     # ran as garbage / dropped the imaginary part
    with pytest.raises(CheckpointError, match=f"target_params: tensor .* has dtype {dtype.__name__}"
                                              f", not a floating-point dtype"):
      check_params(config, jax.tree.map(lambda x, d=dtype: x.astype(d), params), 'target_params')
  with pytest.raises(CheckpointError,
                     match='params given to save_model: tensor .* has dtype int32'):
    save_model(saved[0], config, jax.tree.map(lambda x: x.astype(jnp.int32), params))
  assert load_model(saved[0])[0] == config                   # refused before anything was written


def test_running_out_of_device_memory_is_not_reported_as_a_damaged_checkpoint(saved, monkeypatch):
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  from jaxspec.parallel import load_sharded, make_mesh  # pylint: disable=import-outside-toplevel
  oom = jax.errors.JaxRuntimeError('RESOURCE_EXHAUSTED: Out of memory allocating 5 bytes.')

  def restore(*args, **kwargs):
    raise oom
  monkeypatch.setattr(ocp.StandardCheckpointer, 'restore', restore)
  for load in (lambda: load_model(saved[0]), lambda: load_sharded(saved[0], make_mesh(1, 1))):
    with pytest.raises(jax.errors.JaxRuntimeError, match='RESOURCE_EXHAUSTED'):
      load()


def test_model_config_bool_fields_must_be_bools():
  for field in ('tie_embeddings', 'qkv_bias', 'exact_verify'):
    with pytest.raises(ValueError, match=f"ModelConfig.{field} must be true or false, got 'no'"):
      ModelConfig.from_name('test-tiny', **{field: 'no'})


def test_a_tensor_restored_in_another_dtype_is_named(tmp_path):
  # pylint: disable-next=import-outside-toplevel
  from jaxspec.models.checkpoint import verify_checksums, write_checksums
  tree = {'w': np.ones((2, 3), np.float32)}
  write_checksums(tmp_path / 'checksums.json', tree)
  verify_checksums(tmp_path / 'checksums.json', tree)
  with pytest.raises(CheckpointError, match='tensor w was saved as float32 and restored as '
                                            'bfloat16'):
    verify_checksums(tmp_path / 'checksums.json', {'w': tree['w'].astype(jnp.bfloat16)})


def test_a_directory_holding_something_else_is_not_saved_into(saved, tmp_path):
  # A Hugging Face checkpoint given as the destination lost its config.json and tokenizer.json.
  import shutil  # pylint: disable=import-outside-toplevel
  from experiments import train as train_experiment  # pylint: disable=import-outside-toplevel
  from configs.train import get_config  # pylint: disable=import-outside-toplevel
  path, config, params = saved
  hf_dir = tmp_path / 'hf'
  shutil.copytree(pathlib.Path(__file__).parent / 'fixtures/hf/llama', hf_dir)
  before = {f.name: f.read_bytes() for f in hf_dir.iterdir() if f.is_file()}
  with pytest.raises(ValueError, match=r'hf is a directory that holds no jaxspec model \(config'):
    save_model(hf_dir, config, params)
  assert {f.name: f.read_bytes() for f in hf_dir.iterdir() if f.is_file()} == before
  settings = get_config('smoke')
  settings.out = str(hf_dir)
  with pytest.raises(ValueError, match=r"config.out='.*hf': .* holds no jaxspec model"):
    train_experiment.validate(settings)                 # before any training
  save_model(path, config, params, dtype='float32')     # a model directory is replaced
  (tmp_path / 'empty').mkdir()
  save_model(tmp_path / 'empty', config, params, dtype='float32')

"""Config of the fake sweep-test experiment (tests/fake_experiment.py): 3 K x 2 temperatures.

    python -m experiments.sweep --config=tests/fake_config.py  # needs experiments.fake registered
"""

import ml_collections


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.experiment = 'fake'
  c.workloads = 'json,code'
  c.k = 1
  c.temperature = 0.0
  c.num_prompts = 8
  c.log = ''            # file: one line per case started
  if arg == 'smoke':
    c.num_prompts = 1
  elif arg not in (None, ''):
    raise ValueError(f'unknown variant {arg!r}')
  return c


def get_sweep():
  from experiments.sweeps import product
  return product(k=[1, 2, 4], temperature=[0.0, 1.0])

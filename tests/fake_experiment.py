"""A fake experiment for the sweep tests: deterministic speculative-like records, no model.

Registered as `experiments.fake` by the tests. Config fields it reads (see fake_config.py):
workloads, k, temperature, num_prompts; `log` is a file that gets one line per case started, so
tests can count how often each case ran. The environment variables FAKE_FAIL_ON / FAKE_INTERRUPT_ON
name a case id that raises RuntimeError before writing / KeyboardInterrupt after writing its
first record (environment, not config: a resumed sweep must keep the same base config).
"""

import os


def validate(config) -> None:
  """What the runners check before any case runs: num_prompts >= 1."""
  if config.num_prompts < 1:
    raise ValueError(f'config.num_prompts must be >= 1, got {config.num_prompts}')


def run(config, results) -> None:
  """Writes one record per workload; raises as `fail_on` / `interrupt_on` ask."""
  case = results.tags.get('case_id', '')
  if config.log:
    with open(config.log, 'a') as f:
      f.write(case + '\n')
  if case == os.environ.get('FAKE_FAIL_ON'):
    raise RuntimeError(f'fake failure in {case}')
  for i, workload in enumerate(config.workloads.split(',')):
    if i == 1 and case == os.environ.get('FAKE_INTERRUPT_ON'):
      raise KeyboardInterrupt
    alpha = 1.0 / (1.0 + 0.1 * config.k + config.temperature + i)
    results.write({
        'workload': workload, 'k': config.k, 'temperature': config.temperature,
        'num_prompts': config.num_prompts, 'acceptance_rate': alpha,
        'speedup': 1.0 + alpha * config.k / 4, 'matches_autoregressive': None,
    })

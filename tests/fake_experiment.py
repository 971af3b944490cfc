"""A fake experiment for the sweep tests: deterministic speculative-like records, no model.

Registered as `experiments.fake` by the tests. Config fields it reads (see fake_config.py):
workloads, k, temperature, num_prompts; `fail_on` / `interrupt_on` name a case id that raises
RuntimeError before writing / KeyboardInterrupt after writing its first record; `log` is a file
that gets one line per case started, so tests can count how often each case ran.
"""


def run(config, results) -> None:
  """Writes one record per workload; raises as `fail_on` / `interrupt_on` ask."""
  case = results.tags.get('case_id', '')
  if config.log:
    with open(config.log, 'a') as f:
      f.write(case + '\n')
  if case == config.fail_on:
    raise RuntimeError(f'fake failure in {case}')
  for i, workload in enumerate(config.workloads.split(',')):
    if i == 1 and case == config.interrupt_on:
      raise KeyboardInterrupt
    alpha = 1.0 / (1.0 + 0.1 * config.k + config.temperature + i)
    results.write({
        'workload': workload, 'k': config.k, 'temperature': config.temperature,
        'num_prompts': config.num_prompts, 'acceptance_rate': alpha,
        'speedup': 1.0 + alpha * config.k / 4, 'matches_autoregressive': None,
    })

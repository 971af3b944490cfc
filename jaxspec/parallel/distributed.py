"""Multi-process start-up on JAX's own distributed runtime (`jax.distributed.initialize`).

Every process runs the same program; after `initialize`, `jax.devices()` lists the devices of all
processes and one mesh spans them. On CPU the cross-process collectives are gloo's (JAX's
default `jax_cpu_collectives_implementation`); on GPU NCCL, on TPU ICI/DCN.

Settings come from the config's `distributed` fields, and fields left at their defaults from the
environment: JAX_COORDINATOR_ADDRESS (host:port of process 0), JAX_NUM_PROCESSES,
JAX_PROCESS_ID. coordinator_address='auto' lets JAX detect a managed cluster (SLURM, Open MPI,
Cloud TPU pods, Kubernetes) by itself.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Mapping, Optional

import jax

from jaxspec.checks import check_int

ENV = dict(coordinator_address='JAX_COORDINATOR_ADDRESS', num_processes='JAX_NUM_PROCESSES',
           process_id='JAX_PROCESS_ID')


@dataclasses.dataclass(frozen=True)
class DistributedSettings:
  """How this process joins a multi-process run.

  Attributes:
    coordinator_address: 'host:port' of process 0's coordinator, 'auto' (cluster detection), or
      '' for a single process.
    num_processes: processes in the run (1 = no distributed runtime).
    process_id: this process's index in [0, num_processes); None with 'auto' when no id was
      given (the cluster assigns it: `jax.process_index()` after `initialize`).
  """

  coordinator_address: str = ''
  num_processes: int = 1
  process_id: Optional[int] = 0

  @property
  def enabled(self) -> bool:
    return self.num_processes > 1 or self.coordinator_address == 'auto'


def _env_int(environ, name: str, default: str) -> int:
  """An environment variable's decimal text as an int."""
  text = environ.get(ENV[name], default)
  try:
    return int(str(text).strip())
  except ValueError:
    raise ValueError(f'${ENV[name]} must be an int, got {text!r}') from None


def settings(config=None, environ: Optional[Mapping[str, str]] = None, *,
             need_coordinator: bool = True) -> DistributedSettings:
  """The settings of this process.

  Args:
    config: a ConfigDict (or dict) with coordinator_address ('' = from the environment),
      num_processes (0 = from the environment, else 1) and process_id (-1 = from the
      environment, else 0); None reads the environment only.
    environ: the environment (default os.environ).
    need_coordinator: False when only the process index and count matter (sweeps that split
      independent cases without starting the distributed runtime).
  Raises:
    ValueError: a count or id that is not an int (a float or bool in the config, text that is
      not a decimal in the environment), num_processes < 1, a process id outside [0,
      num_processes) (or below -1 in the config), several processes but no process id in the
      config or $JAX_PROCESS_ID (every process would be process 0: a join that hangs, a sweep
      whose shards all run shard 0), several processes without a coordinator address, or an
      address that is not 'auto' or host:port with an integer port.
  """
  environ = os.environ if environ is None else environ
  config = dict(config or {})
  address = str(config.get('coordinator_address') or environ.get(ENV['coordinator_address'], ''))
  address = address.strip()
  count = config.get('num_processes')
  count = 0 if count is None else check_int('distributed.num_processes', count)
  n = count or _env_int(environ, 'num_processes', '1')
  pid = config.get('process_id')
  pid = -1 if pid is None else check_int('distributed.process_id', pid)
  if pid < -1:
    raise ValueError(f'distributed.process_id must be >= 0, or -1 for ${ENV["process_id"]}, '
                     f'got {pid}')
  if n < 1:
    raise ValueError(f'distributed.num_processes must be >= 1, got {n}')
  if pid == -1:
    if ENV['process_id'] in environ:
      pid = _env_int(environ, 'process_id', '0')
    elif n == 1:
      pid = 0
    elif address == 'auto' and need_coordinator:
      pid = None                  # the cluster assigns it when the runtime starts
    else:
      raise ValueError(f'distributed.num_processes={n} needs each process\'s index: set '
                       f'distributed.process_id or ${ENV["process_id"]} (without it every '
                       f'process would be process 0)')
  if pid is not None and not 0 <= pid < n:
    raise ValueError(f'distributed.process_id={pid} outside [0, num_processes={n})')
  if n > 1 and not address and need_coordinator:
    raise ValueError(f'distributed.num_processes={n} needs a coordinator_address (host:port of '
                     f'process 0), as a config field or ${ENV["coordinator_address"]}')
  host, _, port = address.rpartition(':')
  if n > 1 and address not in ('', 'auto') and not (host and port.isdigit()):
    raise ValueError(f'distributed.coordinator_address must be host:port (an integer port) or '
                     f"'auto', got {address!r}")
  return DistributedSettings(address, n, pid)


JOIN_TIMEOUT_S = 300   # jax.distributed's initialization_timeout: seconds to wait for every process


def initialize(config=None, environ: Optional[Mapping[str, str]] = None) -> DistributedSettings:
  """Join the multi-process run that `settings(config, environ)` describes; a no-op for a single
  process. Must run before anything touches a device. Returns the settings used."""
  s = settings(config, environ)
  if s.enabled and not jax.distributed.is_initialized():
    # Joining blocks until every process has joined: say which run, so a stray environment
    # variable (an exported JAX_NUM_PROCESSES) does not look like a silent hang.
    which = 'assigned by the cluster' if s.process_id is None else s.process_id
    print(f'joining a {s.num_processes}-process run as process {which} at coordinator '
          f'{s.coordinator_address} (from config.distributed or $' +
          ', $'.join(ENV.values()) + f'); waiting for the other processes (if they have not all '
          f'joined within {JOIN_TIMEOUT_S} s, JAX aborts this process with a C++ stack trace '
          f'ending in DEADLINE_EXCEEDED)',
          file=sys.stderr, flush=True)
    if s.coordinator_address == 'auto':
      jax.distributed.initialize(initialization_timeout=JOIN_TIMEOUT_S)
    else:
      jax.distributed.initialize(s.coordinator_address, s.num_processes, s.process_id,
                                 initialization_timeout=JOIN_TIMEOUT_S)
  return s


def is_primary() -> bool:
  """Whether this is process 0, the one that writes results."""
  return jax.process_index() == 0

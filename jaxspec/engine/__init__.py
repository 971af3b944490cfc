"""Continuous batching: requests, the scheduler, the engine loop, batched speculative decoding."""

from jaxspec.engine.device import compile_counts
from jaxspec.engine.engine import Engine
from jaxspec.engine.request import Request, RequestMetrics, RequestOutput, State
from jaxspec.engine.scheduler import Scheduler

__all__ = ['Engine', 'Request', 'RequestMetrics', 'RequestOutput', 'Scheduler', 'State',
           'compile_counts']

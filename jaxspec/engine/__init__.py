"""Continuous batching: requests, the scheduler, the engine loop, batched speculative decoding,
and the evicting engine (each request's KV cache under an eviction budget)."""

from jaxspec.engine.device import compile_counts
from jaxspec.engine.engine import Engine
from jaxspec.engine.evicting import EvictingEngine, EvictingScheduler
from jaxspec.engine.request import Request, RequestMetrics, RequestOutput, State
from jaxspec.engine.scheduler import Scheduler

__all__ = ['Engine', 'EvictingEngine', 'EvictingScheduler', 'Request', 'RequestMetrics',
           'RequestOutput', 'Scheduler', 'State', 'compile_counts']

"""Continuous batching: requests, the scheduler, the engine loop, batched speculative decoding
with pluggable drafters (draft model, prompt lookup) and per-round K policies, and the evicting
engine (each request's KV cache under an eviction budget)."""

from jaxspec.decoding.output import NonFiniteLogitsError   # what check_outputs raises
from jaxspec.engine.device import compile_counts
from jaxspec.engine.drafters import Drafter, ModelDrafter, NGramDrafter, Round
from jaxspec.engine.engine import Engine
from jaxspec.engine.evicting import EvictingEngine, EvictingScheduler
from jaxspec.engine.goodput import AlphaTracker, GoodputK
from jaxspec.engine.k_policy import FixedK, KPolicy, ScheduleK
from jaxspec.engine.request import (Request, RequestMetrics, RequestOutput, State,
                                    check_outputs)
from jaxspec.engine.scheduler import Scheduler

__all__ = ['AlphaTracker', 'Drafter', 'Engine', 'EvictingEngine', 'EvictingScheduler', 'FixedK',
           'GoodputK', 'KPolicy', 'ModelDrafter', 'NGramDrafter', 'NonFiniteLogitsError', 'Request',
           'RequestMetrics',
           'RequestOutput', 'Round', 'ScheduleK', 'Scheduler', 'State', 'check_outputs',
           'compile_counts']

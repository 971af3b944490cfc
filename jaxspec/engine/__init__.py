"""Continuous batching: requests, the scheduler, the engine loop, batched speculative decoding
with pluggable drafters (draft model, prompt lookup) and per-round K policies."""

from jaxspec.engine.device import compile_counts
from jaxspec.engine.drafters import Drafter, ModelDrafter, NGramDrafter, Round
from jaxspec.engine.engine import Engine
from jaxspec.engine.k_policy import AlphaTracker, FixedK, GoodputK, KPolicy, ScheduleK
from jaxspec.engine.request import Request, RequestMetrics, RequestOutput, State
from jaxspec.engine.scheduler import Scheduler

__all__ = ['AlphaTracker', 'Drafter', 'Engine', 'FixedK', 'GoodputK', 'KPolicy', 'ModelDrafter',
           'NGramDrafter', 'Request', 'RequestMetrics', 'RequestOutput', 'Round', 'ScheduleK',
           'Scheduler', 'State', 'compile_counts']

"""Structured context hydration: schema-constrained small-model extraction of tool results into a
validated state, diffs as JSON Patch (RFC 6902), and the big model's context under each strategy.

    from jaxspec.hydration import (ContextSession, ModelExtractor, OracleExtractor, StateStore,
                                   hydrate)
"""

from jaxspec.hydration.context import ContextSession, TurnCost
from jaxspec.hydration.extract import Extraction, ModelExtractor, OracleExtractor
from jaxspec.hydration.pipeline import HydratedTurn, hydrate
from jaxspec.hydration.render import render_hydrated, render_stuffing
from jaxspec.hydration.schema import (INITIAL_STATE, RECORD_SCHEMA, STATE_SCHEMA, candidates,
                                      record_schema, truth_record, with_record)
from jaxspec.hydration.state import StateError, StateStore

__all__ = ['ContextSession', 'Extraction', 'HydratedTurn', 'INITIAL_STATE', 'ModelExtractor',
           'OracleExtractor', 'RECORD_SCHEMA', 'STATE_SCHEMA', 'StateError', 'StateStore',
           'TurnCost', 'candidates', 'hydrate', 'record_schema',
           'render_hydrated', 'render_stuffing', 'truth_record', 'with_record']

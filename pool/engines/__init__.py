"""Engines behind one protocol (`base.Engine`): the swap-native torch engine lives here."""

from pool.engines.base import Engine, EngineError, EngineStats, GenRequest, OutOfKvMemory, SamplingParams, TokenOut

__all__ = ["Engine", "EngineError", "EngineStats", "GenRequest", "OutOfKvMemory", "SamplingParams", "TokenOut"]

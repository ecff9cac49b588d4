"""Discrete-event simulator: virtual clock, cost model, traces, metrics, capacity search and reports."""

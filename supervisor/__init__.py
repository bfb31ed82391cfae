"""Placement Supervisor: NUMA placement for LLM inference engines and workers (no I/O here)."""

__version__ = "0.1.0"

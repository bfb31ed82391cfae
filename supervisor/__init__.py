"""Placement Supervisor: NUMA placement for LLM inference engines and their workers."""

__version__ = "0.1.0"

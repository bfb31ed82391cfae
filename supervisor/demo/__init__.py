"""A demo engine and demo workers that behave like the real ones (no GPU; no I/O here)."""

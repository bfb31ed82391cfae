"""Processes: the exec shim, spawning, restart policy, readiness, sd_notify."""

"""The daemon's own helpers, beside daemon.py: systemd notification, the instance
lock, its cgroups and the preflight checks."""

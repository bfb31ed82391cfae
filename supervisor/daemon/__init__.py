"""The daemon: the one composition root (`root.py`), `run`'s start-up sequence
(`start.py`) and the daemon's own helpers: systemd notification and STATUS=, the
config reload, the instance lock, its cgroups, its state directory, the SIGHUP
handler and the preflight checks."""

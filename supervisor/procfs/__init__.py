"""What /proc says about a process, below both run/ and watch/: its identity (pid +
start time, a pidfd) and the readers of stat, status, cmdline, environ, tasks and
numa_maps (I/O through HostFS; `parse_*` pure)."""

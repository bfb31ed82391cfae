"""`python -m supervisor` is the `placement-supervisor` command (runs `cli.main`: its I/O),
through `supervisor.entry`, which ignores SIGHUP before the heavy imports."""

from supervisor.entry import main

raise SystemExit(main())

"""`python -m supervisor` is the `placement-supervisor` command (runs `cli.main`: its I/O)."""

from supervisor.cli import main

raise SystemExit(main())

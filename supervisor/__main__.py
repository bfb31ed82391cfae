"""`python -m supervisor` is the `placement-supervisor` command."""

from supervisor.cli import main

raise SystemExit(main())

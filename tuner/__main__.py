"""`python -m tuner ...` is the `tuner` command (for checkouts that are not pip-installed)."""

from tuner.cli import main

raise SystemExit(main())

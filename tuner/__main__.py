"""`python -m drafter_attn.tuner ...` is the `tuner` command."""

from drafter_attn.tuner.cli import main

raise SystemExit(main())

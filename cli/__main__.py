"""`python -m cli ...`: the same as the `lorafleet` console script."""

from cli.main import main

raise SystemExit(main())

"""`python -m maxtext_moe` is the same as the `maxtext-moe` command."""

from maxtext_moe.cli import main

raise SystemExit(main())

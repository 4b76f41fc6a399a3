"""`python -m nfab`: the CLI."""

from nfab.cli.app import main

raise SystemExit(main())

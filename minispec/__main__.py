"""`python -m minispec ...` runs the `minispec` command (see cli.py)."""

import sys

from .cli import main

sys.exit(main())

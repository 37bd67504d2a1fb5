"""`python -m lorazor ...`: the `lorazor` command, for environments where it is not on PATH."""

import sys

from lorazor.cli import main

sys.exit(main())

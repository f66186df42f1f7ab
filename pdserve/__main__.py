"""`python -m pdserve` runs the CLI."""

import sys

from pdserve.cli import main

sys.exit(main())

"""`python -m creditlab`, the same as the `creditlab` command."""

import sys

from creditlab.cli import main

sys.exit(main())

"""`python -m creditlab`, the same as the `creditlab` command."""

import sys

from creditlab.cli import main

if __name__ == "__main__":
    sys.exit(main())

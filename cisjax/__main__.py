"""`python -m cisjax ...`: the same entry point as the `cisjax` console script."""

import sys

from cisjax.cli import main

if __name__ == "__main__":
    sys.exit(main())

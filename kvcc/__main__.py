"""``python -m kvcc``: the same as the ``kvcc`` console script."""

import sys

from kvcc.cli import main

if __name__ == "__main__":
    sys.exit(main())

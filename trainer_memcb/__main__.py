"""`python -m trainer_memcb` runs the `trainer-memcb` command."""

import sys

from trainer_memcb.cli import main

if __name__ == "__main__":
    sys.exit(main())

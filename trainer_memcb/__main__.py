"""`python -m trainer_memcb` runs the `trainer-memcb` command."""

import sys

from trainer_memcb.cli import console_main

if __name__ == "__main__":
    sys.exit(console_main())

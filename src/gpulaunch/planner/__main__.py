import sys

from .command import run

sys.exit(run())

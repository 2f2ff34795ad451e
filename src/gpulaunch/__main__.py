"""``python -m gpulaunch ...``: the same command line as the ``gpulaunch`` script."""
import sys

from .cli import main

sys.exit(main())

"""``python -m launch``: see ``launch.cli``."""

import sys

from launch.cli import main

sys.exit(main())

"""``python -m lcsm`` is the ``lcsm`` command."""

import sys

from lcsm.cli import main

sys.exit(main())

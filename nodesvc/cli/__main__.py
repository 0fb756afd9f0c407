"""``python -m nodesvc.cli``: the ``dlshare`` console script."""

import sys

from nodesvc.cli import main

sys.exit(main())

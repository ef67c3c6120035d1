"""``python -m agentkeep``: the ``agentkeep`` command (:func:`agentkeep.cli.main`)."""

import sys

from agentkeep.cli import main

if __name__ == "__main__":
    sys.exit(main())

"""``python -m autodist.planner.cli`` runs ``autodist-plan``."""

import sys

from autodist.planner.cli.main import main

sys.exit(main())

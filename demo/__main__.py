"""``python -m demo`` (what ``make demo`` runs)."""

import sys

from demo.walkthrough import main

sys.exit(main())

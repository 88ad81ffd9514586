"""``python -m megatron_ucp.cli``: the ``megatron-ucp`` command."""

import sys

from megatron_ucp.cli import main

sys.exit(main())

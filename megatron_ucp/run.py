"""``python -m megatron_ucp.run`` and ``from megatron_ucp.run import main``, as documented: the
zero-edit runner. The code lives in :mod:`megatron_ucp.integration.run`."""

import sys

from megatron_ucp.integration.run import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())

"""``python -m megatron_ucp.async_convert``: the background converter's entry, kept for
converters started by an earlier megatron-ucp. The code lives in :mod:`megatron_ucp.background.converter`."""

import sys

from megatron_ucp.background.converter import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())

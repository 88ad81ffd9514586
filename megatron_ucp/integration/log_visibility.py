"""The decision and summary lines of the hooks reach the training log, whoever configured logging.

When the ``megatron_ucp`` logger has no level of its own, it gets INFO on the first rank (WARNING on
the others, so that 768 ranks do not repeat it): a root logger left at WARNING, or configured by a
library at import (intel-extension-for-pytorch calls ``logging.basicConfig``), would otherwise drop
them. A handler is added only when neither that logger nor the root logger has one (the lines then
go to the application's handlers in its format). An application that sets the ``megatron_ucp``
logger's level or handlers keeps full control. :func:`restore` undoes it (uninstall).
"""

from __future__ import annotations

import logging
import os
from typing import Optional

_handler: Optional[logging.Handler] = None
_level_set = False


def make_visible() -> None:
    """A level (and, where nobody has one, a handler) for the ``megatron_ucp`` logger; see the module."""
    global _handler, _level_set
    pkg = logging.getLogger("megatron_ucp")
    if pkg.level == logging.NOTSET:
        pkg.setLevel(logging.INFO if os.environ.get("RANK", "0") == "0" else logging.WARNING)
        _level_set = True
    if _handler is not None or pkg.handlers or logging.getLogger().handlers:
        return
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("[megatron-ucp] %(levelname)s %(message)s"))
    pkg.addHandler(_handler)
    pkg.propagate = False


def restore() -> None:
    """Remove the log handler and level :func:`make_visible` added, if any."""
    global _handler, _level_set
    pkg = logging.getLogger("megatron_ucp")
    if _handler is not None:
        pkg.removeHandler(_handler)
        pkg.propagate = True
        _handler = None
    if _level_set:
        pkg.setLevel(logging.NOTSET)
        _level_set = False

"""What only a ZeRO-3 engine's loads need, around DeepSpeed's own ``load_checkpoint``.

DeepSpeed's stage-3 load takes the module's buffers, the scheduler and the counters from this rank's
model-states file, then its optimizer load reads this rank's own rank file (and refuses another DP size)
or, in universal mode, every parameter's whole state files on every rank (before 0.18, the first
sub-group only). For one load megatron-ucp replaces that optimizer load (``_load_zero_checkpoint``,
through :func:`megatron_ucp.deepspeed.surface.scoped_replace`) and, where this rank has no model-states
file of DeepSpeed's naming, tells its loader which one to read:

* a DP change (or another sub-group cut) from the native rank files and a restart at the saved DP size are
  every stage's (:mod:`megatron_ucp.integration.native_routes`); at ZeRO-3 the reshard's partitions load in
  place of DeepSpeed's optimizer load (:func:`replacing_optimizer_load`), which restores the module from the
  masters, and from the file :func:`model_states_for` names;
* :func:`stage3_universal_optimizer_load`: a universal folder (converted from any ZeRO stage) read by our
  loader (:func:`megatron_ucp.integration.partition_load.load_universal_partitions`): each rank reads only
  its slice of each parameter's state files, with the ledger.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from megatron_ucp.config import UcpConfig
from megatron_ucp.deepspeed import surface
from megatron_ucp.format import dsformat as F
from megatron_ucp.integration.live_layout import TpPlace
from megatron_ucp.integration.partition_load import load_universal_partitions
from megatron_ucp.plan.accounting import AccountingReport

log = logging.getLogger(__name__)


def _mp_of(path: Path) -> int:
    found = re.search(r"mp_rank_(\d+)", path.name)
    return int(found.group(1)) if found else 0


def model_states_for(engine: Any, folder: Path) -> Optional[Path]:
    """The model-states file this rank reads from ``folder`` when DeepSpeed's own name for it is not there
    (None: DeepSpeed finds its own). A ZeRO-3 rank beyond the saved DP size reads DP rank 0's; a load
    across ZeRO stages reads the other stage's file of its model-parallel rank (universal mode reads only
    the client state from it, which every file holds alike)."""
    own = Path(surface.model_states_file(engine, str(folder.parent), folder.name))
    if own.is_file():
        return None
    mp = _mp_of(own)
    for name in (F.zero3_model_file(0, mp), f"mp_rank_{mp:02d}_model_states.pt"):
        if (folder / name).is_file():
            return folder / name
    return None


def replacing_optimizer_load(load: Callable[[Any, str, str, bool], bool]) -> Any:
    """``_load_zero_checkpoint`` replaced by ``load(engine, load_dir, tag, load_optimizer_states)`` for one load."""

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def _load_zero_checkpoint(self: Any, load_dir: str, tag: str, load_optimizer_states: bool = True) -> bool:
            return load(self, load_dir, tag, load_optimizer_states)

        return _load_zero_checkpoint

    return surface.scoped_replace(surface.ENGINE, "_load_zero_checkpoint", make)


@contextlib.contextmanager
def stage3_universal_optimizer_load(
    engine: Any, config: UcpConfig, keep: Callable[[Any, AccountingReport], None]
) -> Iterator[None]:
    """For one universal load of a ZeRO-3 engine: our loader of its partitions in place of DeepSpeed's
    optimizer load; ``keep(optimizer, report)`` hands the report to the caller's finish. A load without
    optimizer states (the weights only) stays DeepSpeed's."""

    def load(self: Any, load_dir: str, tag: str, load_optimizer_states: bool) -> bool:
        if not load_optimizer_states:
            return original(self, load_dir, tag, load_optimizer_states=load_optimizer_states)
        folder = Path(load_dir) / tag
        report = load_universal_partitions(
            self.optimizer,
            folder,
            strict=config.strict,
            names=surface.param_names(self),
            tensor_parallel=TpPlace(*surface.tp_size_and_rank(getattr(self, "mpu", None))),
        )
        keep(self.optimizer, report)
        return True

    original = surface.resolve(surface.ENGINE)._load_zero_checkpoint
    with replacing_optimizer_load(load):
        yield

"""Converting a tag to its universal twin at load time, while every rank waits (the universal route).

One converter per node (:func:`~megatron_ucp.background.queue.node_assignment` picks it) runs its
share; when another live converter (the asynchronous one) already owns the twin, it waits for that
one instead. Every rank then checks the twin is complete before anyone loads it.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from pathlib import Path
from typing import Optional

from megatron_ucp import launchenv
from megatron_ucp.background.queue import node_assignment
from megatron_ucp.config import UcpConfig
from megatron_ucp.convert.execute import ConvertOptions, convert
from megatron_ucp.convert.universal import COMPLETE, ConversionInProgress, inspect_staging, universal_state
from megatron_ucp.errors import OutputExistsError, UcpError
from megatron_ucp.integration.collectives import broadcast_from_first, comm, raise_together
from megatron_ucp.plan.resume import ResumeDecision

log = logging.getLogger(__name__)


def convert_synchronously(
    load_dir: Path, native_tag: Optional[str], decision: ResumeDecision, from_latest: bool, config: UcpConfig
) -> None:
    """Convert the native tag to its universal twin while every rank waits (one converter per node)."""

    dist = comm()
    if native_tag is None or decision.tag is None:
        raise UcpError("internal: a conversion needs a native tag", subject=decision)

    rank, world = dist.get_rank(), dist.get_world_size()
    where = node_assignment(
        rank, world, launchenv.local_rank(os.environ), launchenv.local_size(os.environ), config.ranks_per_node
    )
    share = (where.node, where.nodes) if where.launcher else None
    attempt = broadcast_from_first(f"elastic-load-{uuid.uuid4().hex}" if rank == 0 else None)
    twin = load_dir / decision.tag
    error: Optional[BaseException] = None
    t0 = time.perf_counter()
    if share is not None:
        try:
            _convert_or_wait(load_dir / native_tag, twin, share, attempt, from_latest, config)
        except Exception as exc:
            error = exc
            log.error("megatron-ucp: converting %s on rank %d failed: %s", native_tag, rank, exc)
    # also the barrier: every converter finished
    raise_together(error, f"converting {native_tag} to {decision.tag}", subject=twin)
    if universal_state(twin) != COMPLETE:
        raise UcpError(
            f"{twin}: conversion reported success but the folder is not complete on rank {rank} "
            "(is the checkpoint directory shared by every node?)",
            subject=twin,
        )
    if rank == 0:
        log.info("megatron-ucp: converted %s -> %s in %.1fs", native_tag, decision.tag, time.perf_counter() - t0)


def _convert_or_wait(
    source: Path, twin: Path, share: tuple[int, int], attempt: str, from_latest: bool, config: UcpConfig
) -> None:
    """Run this rank's share; if another live converter (e.g. the async one) owns it, wait for it."""

    options = ConvertOptions(
        source=source,
        output=twin,
        workers=config.converter_workers,
        replace_stale=True,
        update_latest=from_latest,
        share_index=share[0],
        share_count=share[1],
        attempt_id=attempt,
        progress=False,
    )
    for _ in range(2):
        try:
            convert(options)
            return
        except OutputExistsError:
            if universal_state(twin, source) == COMPLETE:
                return
            raise
        except ConversionInProgress as exc:
            log.info("megatron-ucp: %s; waiting for it", exc)
            while universal_state(twin) != COMPLETE:
                info = inspect_staging(twin)
                if info is None or not info.is_live(options.stale_after):
                    break
                time.sleep(2.0)
            if universal_state(twin) == COMPLETE:
                return
    raise UcpError(f"{twin}: could not convert (another converter kept failing or died)", subject=twin)

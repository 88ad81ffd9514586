"""What the pointer files name that a user must hear about: ``latest_universal`` left naming the twin of a tag that is
gone or unsound. For ``status``."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from megatron_ucp.convert.universal import universal_state
from megatron_ucp.format import dsformat as F
from megatron_ucp.plan.resume import TwinState


def dangling_universal_pointer(
    root: Path,
    latest: Optional[str],
    pointer: Optional[str],
    rows: list[tuple[str, bool, Optional[str], Optional[str]]],
) -> list[str]:
    """``latest_universal`` naming the twin of a tag that is gone or found unsound: the hooks follow ``latest``, but
    a load that reads ``latest_universal`` itself would resume from what no sound native tag backs any more.
    ``rows``: each tag's (name, native tag there, verdict state, verdict)."""
    if pointer is None or not pointer.endswith(F.UNIVERSAL_SUFFIX):
        return []
    tag = pointer[: -len(F.UNIVERSAL_SUFFIX)]
    row = next((r for r in rows if r[0] == tag), None)
    if row is not None and row[1] and row[2] != "unsound":
        return []
    fate = "is gone" if row is None or not row[1] else f"is unsound ({row[3]})"
    twin = F.universal_tag(latest) if latest else None
    latest_row = next((r for r in rows if r[0] == latest), None)
    if (
        twin is not None
        and twin != pointer
        and latest_row is not None
        and latest_row[1]
        and latest_row[2] != "unsound"
        and latest is not None
        and universal_state(root / twin, root / latest) == TwinState.COMPLETE
    ):
        fix = f"`echo {twin} > {root / F.LATEST_UNIVERSAL}` points it at {latest}'s twin"
    else:  # the next conversion that completes writes it again
        fix = f"`rm {root / F.LATEST_UNIVERSAL}` removes it"
    return [
        f"{F.LATEST_UNIVERSAL}: names {pointer}, whose native tag {tag} {fate}: a restart through the hooks follows "
        f"{F.LATEST} instead, but a load that reads {F.LATEST_UNIVERSAL} itself resumes from it; {fix}"
    ]

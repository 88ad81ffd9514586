"""Every rank of a job takes the same way, hooks or stock (integration/handled.py): at PP > 1 only the stages
holding MoE layers see them, and a rank taking the hooks' way while another takes stock's meets it in other
collectives (a real bug: the fork's GPTModelPipe with experts died in our load hook, ranks 2-3 reading ranks
0-1's resume decision as their expert-layout verdict). Two gloo processes, real torch.distributed."""

from __future__ import annotations

import os
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp


class _Engine:
    """A rank's engine as ``local_reason`` sees it; the reason itself is stubbed per rank."""


def _rank(rank: int, store: str, out: str) -> None:
    from megatron_ucp.integration import handled

    os.environ["DS_ACCELERATOR"] = "cpu"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        reason = "mixture-of-experts param groups at TP x PP = 2 are not handled yet" if rank == 1 else None
        handled.local_reason = lambda engine: reason  # stage 1 holds the experts, stage 0 does not
        engine = _Engine()
        first = handled.unhandled_reason(engine)
        handled.local_reason = lambda engine: "changed"  # the agreed verdict is kept: no second collective
        again = handled.unhandled_reason(engine)
        Path(out, f"{rank}.txt").write_text(f"{first}\n{again}")
    finally:
        dist.destroy_process_group()


def test_every_rank_follows_the_first_reason_any_rank_has(tmp_path: Path) -> None:
    mp.spawn(_rank, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    said = "mixture-of-experts param groups at TP x PP = 2 are not handled yet"
    assert (tmp_path / "0.txt").read_text().splitlines() == [f"{said} (on rank 1)"] * 2
    assert (tmp_path / "1.txt").read_text().splitlines() == [said] * 2

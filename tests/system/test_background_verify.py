"""Every save judged in the background when it is not converted (``verify_saves``): real DeepSpeed (CPU, gloo, DP 2,
saved through the hooks at steps 2 and 4), node 0's converter reading each tag once after its save and recording the
verdict that ``status`` shows and a restart's fallback uses; no universal folder is written. Then, as the next save's
trigger would, a tag damaged on disk since its verdict is queued again and judged unsound, naming the file.
"""

from __future__ import annotations

from pathlib import Path

from megatron_ucp.background import queue as B
from megatron_ucp.background.status import root_status
from megatron_ucp.background.store import ConverterSettings, read_queue
from megatron_ucp.background.trigger import trigger, unfinished, wait_for_converter
from megatron_ucp.background.verdicts import read_verdict, verdict_is_current
from megatron_ucp.format import dsformat as F
from tests.support.dsharness import TrainSpec, run_training
from tests.support.elastic_support import flip_a_bit_in_the_largest_record

TAGS = ("global_step2", "global_step4")


def test_each_save_is_verified_in_the_background_and_a_damaged_one_judged_unsound(tmp_path: Path):
    root = tmp_path / "ckpt"
    spec = TrainSpec(
        dp=2,
        optimizer="bf16",
        steps=4,
        save_dir=root,
        save_at=(2, 4),
        dump_dir=tmp_path / "dumps",
        plugin=True,
        plugin_kwargs={"verify_saves": True, "converter_exit_wait": 120},
        timeout=400,
    )
    res = run_training(spec)
    assert res.ok, res.log[-3000:]
    assert "queued for background verification on 1 node(s)" in res.log, res.log[-3000:]
    assert "background verifications in" in res.log and "did not finish" not in res.log, res.log[-3000:]
    for tag in TAGS:
        verdict = read_verdict(root, tag)
        assert verdict is not None and verdict.sound and verdict.checked_by == "background verification", tag
        assert not (root / F.universal_tag(tag)).exists()  # verified, not converted
    done = [e for e in read_queue(root).events if e.kind is B.EventKind.COMPLETE]
    assert {e.tag for e in done} == set(TAGS) and all(e.job == B.VERIFY for e in done), done
    assert "partitions matching the checksums the save recorded" in done[-1].message
    rows = {t.tag: t for t in root_status(root, sizes=False).tags}
    assert [rows[t].verified for t in TAGS] == ["sound", "sound"]
    assert rows["global_step4"].universal.value == "absent"  # the verification is not a conversion
    assert unfinished(root, list(TAGS), B.VERIFY) == []

    victim = next((root / "global_step4").glob("*zero_pp_rank_1_*optim_states.pt"))
    flip_a_bit_in_the_largest_record(victim)
    assert not verdict_is_current(root, "global_step4")  # its verdict is on the files as they were
    trigger(root, "global_step4", 0, 1, ConverterSettings(), kind=B.VERIFY)
    assert wait_for_converter(root, 0, timeout=120)
    verdict = read_verdict(root, "global_step4")
    assert verdict is not None and not verdict.sound and str(victim) in verdict.problems[0], verdict
    last = read_queue(root).last_event("global_step4", B.VERIFY)
    assert last is not None and last.kind is B.EventKind.REJECTED and str(victim) in last.message
    assert {t.tag: t.verified for t in root_status(root, sizes=False).tags}["global_step4"] == "unsound"

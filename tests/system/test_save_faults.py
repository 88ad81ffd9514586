"""A save that fails or is killed at any of its steps never commits a partial save, never hangs the job, and leaves
what the next start needs (real DeepSpeed, CPU, gloo, DP 2; faults through ``megatron_ucp.faults``).

Every save here saves again a tag the shared run saved (its twelve iterations, one save each, Megatron's tracker
written after each): the earlier save of the tag is set aside, so every step of the set-aside, the commit and the
put-back is met. Three runs per mode (asynchronous, synchronous), one per kind of exception (``OSError``,
``ValueError``, ``MemoryError``), inject one fault into each save, at a step of its own (the copy, a file's write,
its ``fsync``, its rename, the set-aside, each write and rename of the commit, the put-back); the job tolerates the
failed saves (a job's policy: the hooks raise one error on every rank, or say it on every rank and go on). After
each run: every save either committed or left the tag with its earlier save, as the step says; ``latest`` and
Megatron's tracker name the last committed save; nothing is left aside except what a failed put-back left, which
``status`` names and the next start puts back. Then a chain of runs, each the previous one's next start, kills the
whole job at each step: each start loads a sound tag, from which ``latest`` and the tracker agree, with nothing
left aside after it.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Optional

import pytest

from megatron_ucp.background.set_aside import COMMITS_DIR, REPLACED_DIR, leftovers
from megatron_ucp.background.store import ucp_dir
from megatron_ucp.convert.native_verify import verify_native
from megatron_ucp.deepspeed.model_states import recorded_save_id
from megatron_ucp.faults import FAULT_ENV
from megatron_ucp.format import dsformat as F
from megatron_ucp.format.save_files import read_file_list
from tests.support.dsharness import TrainSpec, run_training
from tests.support.dsharness.checkpoints import session_cache

STEPS = 12
TRACKER = "latest_checkpointed_iteration.txt"
OPT = "bf16_zero_pp_rank_{}_mp_rank_00_optim_states.pt"
MODEL = F.MODEL_STATES_FILE


def _base():
    """The shared run: a save at every iteration (its own tags' earlier saves), Megatron's tracker after each."""
    return session_cache()(dp=2, steps=STEPS, save_at=tuple(range(1, STEPS + 1)), plugin=True, tracker=True)


@dataclasses.dataclass(frozen=True)
class Fault:
    step: int
    entries: tuple[str, ...]
    """``POINT:RANK`` (the kind appended)."""
    commits: bool
    left_aside: bool = False
    """The put-back itself failed: the earlier save waits in the store for the next start."""
    said: Optional[str] = None
    """What every rank says of the failure (the file that failed, or the commit); None: the save committed."""


COMMIT = "its commit failed"


def _g(step: int) -> str:
    return f"global_step{step}"


ASYNC_FAULTS = (
    Fault(1, (f"copy {_g(1)}/{MODEL}:0",), True),  # the file written before the save returns instead
    Fault(2, (f"write {_g(2)}/{OPT.format(1)}:1",), False, said=OPT.format(1)),
    Fault(3, (f"fsync {_g(3)}/{MODEL}:0",), False, said=MODEL),
    Fault(4, (f"rename {_g(4)}/{OPT.format(0)}:0",), False, said=OPT.format(0)),
    Fault(5, (f"set aside {_g(5)}:0",), True),  # saved over the earlier save, as without the set-aside
    Fault(6, (f"commit {_g(6)}: file list:0",), False, said=COMMIT),
    Fault(7, (f"commit {_g(7)}: {TRACKER}:0",), False, said=COMMIT),
    Fault(8, (f"commit {_g(8)}: mark:0",), False, said=COMMIT),
    Fault(9, (f"commit {_g(9)}: latest:0",), False, said=COMMIT),
    Fault(10, (f"commit {_g(10)}: place {TRACKER}:0",), False, said=COMMIT),
    Fault(11, (f"commit {_g(11)}: place latest:0",), False, said=COMMIT),
    Fault(12, (f"write {_g(12)}/{MODEL}:0", f"put back {_g(12)}:0"), False, left_aside=True, said=MODEL),
)
SYNC_FAULTS = (
    Fault(1, (f"write {_g(1)}/{MODEL}:0",), False, said=MODEL),
    Fault(2, (f"write {_g(2)}/{OPT.format(1)}:1",), False, said=OPT.format(1)),
    Fault(3, (f"set aside {_g(3)}:0",), True),
    Fault(4, (f"set aside {_g(4)}: {_g(4)}:0",), True),  # after the tag folder moved: put back, saved over
    Fault(6, (f"commit {_g(6)}: file list:0",), False, said=COMMIT),
    Fault(7, (f"commit {_g(7)}: mark:0",), False, said=COMMIT),
    Fault(8, (f"commit {_g(8)}: latest:0",), False, said=COMMIT),
    Fault(9, (f"commit {_g(9)}: place {F.LATEST}:0",), False, said=COMMIT),
    Fault(10, (f"commit {_g(10)}: place {_g(10)}.json:0",), False, said=COMMIT),
    Fault(
        11, (f"write {_g(11)}/{OPT.format(0)}:0", f"put back {_g(11)}:0"), False, left_aside=True, said=OPT.format(0)
    ),
)
MODES = {"async": (ASYNC_FAULTS, {"async_save": True}), "sync": (SYNC_FAULTS, {})}


def _copy(tmp_path: Path) -> Path:
    root = tmp_path / "ckpt"
    shutil.copytree(_base().root, root)
    return root


def _spec(root: Path, plugin_kwargs: dict, **fields) -> TrainSpec:
    return TrainSpec(
        dp=2,
        save_dir=root,
        plugin=True,
        plugin_kwargs=plugin_kwargs,
        tracker=True,
        tolerate_save_failures=True,
        timeout=180,
        **fields,
    )


def _save_of(tag_dir: Path) -> Optional[str]:
    return recorded_save_id(tag_dir)


def _assert_sound_latest(root: Path) -> str:
    """``latest`` names a tag whose files are whole and one save (verify), and the tracker names its iteration."""
    tag = (root / F.LATEST).read_text().strip()
    report = verify_native(root / tag)
    assert report.ok, report.problems
    assert (root / TRACKER).read_text().strip() == tag.removeprefix("global_step"), (tag, (root / TRACKER).read_text())
    return tag


@pytest.mark.parametrize("kind", ["OSError", "ValueError", "MemoryError"])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_fault_at_any_step_of_a_save_commits_nothing_partial_and_the_next_start_finds_what_it_needs(
    tmp_path: Path, mode: str, kind: str
):
    faults, kwargs = MODES[mode]
    base = _base()
    root = _copy(tmp_path)
    earlier = {f.step: _save_of(root / _g(f.step)) for f in faults}
    entries = ",".join(f"{e}:{kind}" for f in faults for e in f.entries)
    res = run_training(
        _spec(root, kwargs, steps=STEPS, save_at=tuple(f.step for f in faults), env={FAULT_ENV: entries})
    )
    assert res.returncode == 0 and res.steps[-1] == STEPS, res.log[-4000:]  # the job went on
    assert res.losses == base.result.losses
    sections = res.rank_logs()
    committed = [f.step for f in faults if f.commits]
    for f in faults:
        tag_dir = root / _g(f.step)
        now = _save_of(tag_dir)
        if f.commits:
            assert now != earlier[f.step], (f, res.log[-3000:])  # the new save, whole, with its file list
            assert read_file_list(root, _g(f.step)).save_id == now and verify_native(tag_dir).ok
        elif f.left_aside:
            assert now != earlier[f.step], f  # the failed save's files, until the next start puts the earlier back
        else:
            assert now == earlier[f.step], (f, res.log[-3000:])  # the earlier save back, untouched
            assert verify_native(tag_dir).ok
        if f.said is not None:  # said on every rank, naming the file (or the commit) that failed
            said = f"saving {_g(f.step)} in" if f.said == COMMIT else f"{_g(f.step)}/{f.said}: write failed"
            for rank, text in sections.items():
                assert said in text and (f.said != COMMIT or COMMIT in text), (f, rank, text[-3000:])
    assert (root / F.LATEST).read_text() == _g(max(committed)), res.log[-3000:]
    assert _assert_sound_latest(root) == _g(max(committed))
    aside = leftovers(root)
    assert [tag for tag, _, _ in aside] == [_g(f.step) for f in faults if f.left_aside], aside
    assert "the next start" in aside[0][2]
    # the next start: the earlier save back, nothing aside, and it resumes from latest
    restart = run_training(_spec(root, kwargs, steps=max(committed) + 1, load_dir=root))
    assert restart.returncode == 0 and restart.loaded_step == max(committed), restart.log[-3000:]
    assert restart.losses == [base.result.loss_at(max(committed) + 1)]
    for f in faults:
        if f.left_aside:
            assert _save_of(root / _g(f.step)) == earlier[f.step]
    assert leftovers(root) == [] and not any((ucp_dir(root) / REPLACED_DIR).iterdir())


KILLS = {
    "async": (
        f"copy {{tag}}/{MODEL}:0:kill",
        f"write {{tag}}/{OPT.format(1)}:1:kill",
        f"fsync {{tag}}/{MODEL}:0:kill",
        f"rename {{tag}}/{OPT.format(0)}:0:kill",
        "set aside {tag}:0:kill",
        "set aside {tag}: {tag}:0:kill",
        "commit {tag}: file list:0:kill",
        "commit {tag}: mark:0:kill",
        f"commit {{tag}}: place {TRACKER}:0:kill",
        "commit {tag}: place latest:0:kill",
        f"write {{tag}}/{MODEL}:0:OSError,put back {{tag}}:0:kill",
    ),
    "sync": (
        f"write {{tag}}/{OPT.format(1)}:1:kill",
        "set aside {tag}: {tag}:0:kill",
        "commit {tag}: file list:0:kill",
        "commit {tag}: mark:0:kill",
        "commit {tag}: place latest:0:kill",
        f"write {{tag}}/{MODEL}:0:OSError,put back {{tag}}:0:kill",
    ),
}
"""Each entry: the faults of one run (``{tag}``: the tag it saves), the last a kill of the whole job (SIGKILL of one
rank; the launcher ends the others, as torchrun does)."""


def _next_start_resumes_from(root: Path) -> str:
    """The tag the next start resumes from: the one whose commit a kill cut short (recorded: the next start writes
    its pointers first), else ``latest``'s, which the tracker names too."""
    tag, tracker = (root / F.LATEST).read_text().strip(), (root / TRACKER).read_text().strip()
    commits = sorted((ucp_dir(root) / COMMITS_DIR).glob("*.json"))
    if commits:
        assert len(commits) == 1, commits
        return json.loads(commits[0].read_text())["tag"]
    assert tag.removeprefix("global_step") == tracker, (tag, tracker)
    return tag


@pytest.mark.parametrize("mode", sorted(KILLS))
def test_a_job_killed_at_any_step_of_a_save_restarts_from_a_sound_tag_with_latest_and_the_tracker_agreeing(
    tmp_path: Path, mode: str
):
    """Each run is the previous one's next start: it loads ``latest`` (what the kill left settled first), trains one
    iteration and saves it again, killed at the next step of a save."""
    base = _base()
    root = _copy(tmp_path)
    (root / F.LATEST).write_text(_g(3))  # the chain starts from iteration 3: every save it makes is a save again
    (root / TRACKER).write_text("3")
    kwargs = MODES[mode][1]
    resumes = _g(3)
    for faults in KILLS[mode]:
        step = int(resumes.removeprefix("global_step"))
        tag = _g(step + 1)
        spec = _spec(root, kwargs, steps=step + 1, save_at=(step + 1,), load_dir=root, expect_failure=True)
        res = run_training(dataclasses.replace(spec, env={FAULT_ENV: faults.format(tag=tag)}))
        point = faults.format(tag=tag).rsplit(",", 1)[-1].rsplit(":", 2)[0]
        assert res.returncode != 0 and f": kill at {point}" in res.log, (faults, res.log[-3000:])
        assert res.loaded_step == step and res.losses == [base.result.loss_at(step + 1)], (faults, res.log[-3000:])
        resumes = _next_start_resumes_from(root)
        assert resumes in (_g(step), tag), (faults, resumes)
        assert verify_native(root / resumes).ok  # a sound tag, whichever the kill left
    step = int(resumes.removeprefix("global_step"))
    last = run_training(_spec(root, kwargs, steps=step + 1, load_dir=root))
    assert last.returncode == 0 and last.loaded_step == step, last.log[-3000:]
    assert leftovers(root) == [] and not any((ucp_dir(root) / REPLACED_DIR).iterdir())
    assert _assert_sound_latest(root) == _g(step)


def test_an_empty_latest_falls_back_to_the_newest_tag_and_status_says_so(tmp_path: Path):
    """``latest`` empty, as a power loss can leave a pointer whose bytes never reached the disk: the restart does
    not raise; it walks every tag, newest first, and resumes from the newest sound one; ``status`` predicts it."""
    from megatron_ucp.background.status import root_status

    base = _base()
    root = _copy(tmp_path)
    (root / F.LATEST).write_text("")
    answer = root_status(root, sizes=False).resume_answer()
    assert answer.tag == _g(STEPS) and answer.fallback and "empty" in answer.said, answer
    res = run_training(_spec(root, {}, steps=STEPS + 1, load_dir=root))
    assert res.returncode == 0 and res.loaded_step == STEPS, res.log[-3000:]
    assert "FALLING BACK" in res.log and "names no tag" in res.log
    assert res.losses and len(base.result.losses) == STEPS


@pytest.mark.parametrize("ranks", ["*", "0"], ids=["every-rank", "first-rank"])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_an_exception_inside_deepspeeds_own_save_leaves_the_earlier_save_for_the_next_start(
    tmp_path: Path, mode: str, ranks: str
):
    """DeepSpeed's save itself raises (on every rank, or on the first alone while the others go on writing into the
    tag's folder), after the tag's earlier save was set aside: the job dies of it, as without the hooks; ``latest``
    names the previous save, ``status`` names the earlier save waiting aside (a put-back now would hand the folder
    to ranks still writing), and the next start puts it back."""
    root = _copy(tmp_path)
    earlier = _save_of(root / _g(2))
    spec = _spec(root, MODES[mode][1], steps=2, save_at=(2,), expect_failure=True)
    res = run_training(dataclasses.replace(spec, env={FAULT_ENV: f"save {_g(2)}: model states:{ranks}:ValueError"}))
    assert res.returncode != 0 and "injected ValueError at save global_step2: model states" in res.log, res.log[-3000:]
    assert (root / F.LATEST).read_text() == _g(STEPS)
    assert [(tag, "puts this back" in fate) for tag, _, fate in leftovers(root)] == [(_g(2), True)], leftovers(root)
    restart = run_training(_spec(root, MODES[mode][1], steps=STEPS, load_dir=root))
    assert restart.returncode == 0 and restart.loaded_step == STEPS, restart.log[-3000:]
    assert _save_of(root / _g(2)) == earlier and verify_native(root / _g(2)).ok and leftovers(root) == []

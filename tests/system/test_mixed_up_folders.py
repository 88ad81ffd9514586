"""Folders whose files do not belong together: refused before anything is copied, naming the culprit.

Individually sound files of different saves or positions used to load silently with the wrong
state (issue "The native route binds every rank file to its rank and its save"). Each case here is
a folder a user could end up with: rank files swapped or copied over one another, a file or the
model states of another step, a hooked save with one stock file, special files where a rank file
should be, a state of the wrong dtype, ``latest`` naming a missing tag, model states of another DP
size, a file changed on disk after the save.

Cheap by design: the binding itself is tested on synthetic folders without a launch; the real
DeepSpeed runs are two, each trying a list of folders (``TrainSpec.refuse``), every one of which
must fail with the same error on every rank (the cross-rank protocol), before going on to a good
load that continues the uninterrupted losses: one at DP 3 (the native reshard, default route and
``reshard``; one folder through the universal route), one at DP 4 (a same-DP restart). Sources: the
session's stock and hooked BF16_Optimizer saves at DP 4 (steps 2 and 4) and its stock DP 2 save.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
import torch

from tests.support.dsharness.checkpoints import model_states_file, rank_file
from tests.support.elastic_support import assert_losses_continue, private_copy, resume, ucp_lines

pytestmark = pytest.mark.slow

TAG = "global_step2"


# ------------------------------------------------------------------------------------------------
# folder surgery
# ------------------------------------------------------------------------------------------------


def _copy(src_root: Path, base: Path, name: str) -> Path:
    return private_copy(src_root, base / name)


def _swap(tag: Path, a: int, b: int) -> None:
    tmp = tag / "swap.tmp"
    rank_file(tag, a).rename(tmp)
    rank_file(tag, b).rename(rank_file(tag, a))
    tmp.rename(rank_file(tag, b))


def _rewrite(path: Path, edit) -> None:
    """Load a rank file with torch, change it, save it back (torch's own writer)."""
    import deepspeed  # noqa: F401  (the file pickles DeepSpeed objects)

    sd = torch.load(path, weights_only=False)
    edit(sd["optimizer_state_dict"])
    torch.save(sd, path)


def _negate_first_exp_avg(optim: dict) -> None:
    state = optim["base_optimizer_state"]["state"][0]["exp_avg"]
    state[0] = -state[0] if state[0] != 0 else 1.0


def _exp_avg_as_bf16(optim: dict) -> None:
    state = optim["base_optimizer_state"]["state"][0]
    state["exp_avg"] = state["exp_avg"].to(torch.bfloat16)


def _name(path: Path) -> str:
    return path.name


# ------------------------------------------------------------------------------------------------
# the binding, no launch: synthetic saves
# ------------------------------------------------------------------------------------------------


def _synthetic(base: Path, dp: int = 4, iteration: int = 2, seed: int = 0, record: bool = False) -> Path:
    from megatron_ucp.plan.llama_shapes import LlamaShape
    from megatron_ucp.synthetic.content import SyntheticSpec
    from megatron_ucp.synthetic.writer import write_checkpoint

    shape = LlamaShape(layers=1, hidden=8, ffn=16, heads=2, vocab=40, original_vocab=37)
    spec = SyntheticSpec(shape=shape, dp=dp, flavour="plain", iteration=iteration, seed=seed, record=record)
    return write_checkpoint(base, spec, progress=False).tag_dir


def _bind(tag: Path) -> list[str]:
    from tests.support.elastic_support import bind_folder

    return bind_folder(model_states_file(tag), lambda r: rank_file(tag, r))


@pytest.mark.parametrize("record", [False, True], ids=["stock", "hooked"])
def test_the_binding_names_the_file_that_does_not_belong(tmp_path: Path, record: bool) -> None:
    """Every defect on a synthetic DP 4 save, with and without the hooks' record: the culprit named,
    its neighbours not; nothing on disk changed."""
    from megatron_ucp.errors import CheckpointFormatError

    good = _synthetic(tmp_path / "good", record=record)
    assert _bind(good) == []
    later = _synthetic(tmp_path / "later", iteration=5, record=record)
    other_run = _synthetic(tmp_path / "other", seed=7, record=record)  # same geometry and step, other values
    wide = _synthetic(tmp_path / "wide", dp=8, record=record)

    def case(name: str, edit) -> list[str]:
        tag = private_copy(good.parent, tmp_path / "cases" / name) / good.name
        edit(tag)
        before = {p.name: p.read_bytes() for p in tag.iterdir() if p.is_file()}
        problems = _bind(tag)
        assert {p.name: p.read_bytes() for p in tag.iterdir() if p.is_file()} == before
        return problems

    swapped = case("swapped", lambda t: _swap(t, 1, 2))
    assert len(swapped) == 2 and {_culprit(p) for p in swapped} == {
        _name(rank_file(good, 1)),
        _name(rank_file(good, 2)),
    }
    assert "swapped, or copied over this one" in swapped[0]
    copied = case("copied", lambda t: shutil.copyfile(rank_file(t, 1), rank_file(t, 2)))
    assert [_culprit(p) for p in copied] == [_name(rank_file(good, 2))]
    step = case("step", lambda t: shutil.copyfile(rank_file(later, 0), rank_file(t, 0)))
    assert step and {_culprit(p) for p in step} == {_name(rank_file(good, 0))}  # rank 0 itself, not rank 1
    assert "the other 3 rank file(s) say 2.0" in step[0] or "from another save" in step[0]
    wider = case("wide", lambda t: shutil.copyfile(rank_file(wide, 1), rank_file(t, 1)))
    assert _culprit(wider[0]) == _name(rank_file(good, 1)) and "saved at DP=8, the model states say DP=4" in wider[0]
    run = case("other-run", lambda t: shutil.copyfile(rank_file(other_run, 3), rank_file(t, 3)))
    if record:  # same geometry and step: only the record tells (without it the saved weights will)
        assert [_culprit(p) for p in run] == [_name(rank_file(good, 3))] and "from another save" in run[0]
    else:
        assert run == []
    if record:
        ms = case("model-states", lambda t: shutil.copyfile(model_states_file(later), model_states_file(t)))
        assert [_culprit(p) for p in ms] == ["mp_rank_00_model_states.pt"] and "from another save" in ms[0]
        with pytest.raises(
            CheckpointFormatError, match=r"5 rank files of model-parallel rank 0 \(extra: \w*zero_pp_rank_4"
        ):
            case("extra", lambda t: shutil.copyfile(rank_file(wide, 4), rank_file(t, 4)))
    else:
        stock_in_hooked = _synthetic(tmp_path / "hooked", record=True)
        mixed = case("hooked-file", lambda t: shutil.copyfile(rank_file(stock_in_hooked, 2), rank_file(t, 2)))
        assert [_culprit(p) for p in mixed] == [_name(rank_file(good, 2))] and "carries a megatron-ucp save" in mixed[0]


def _culprit(problem: str) -> str:
    return Path(problem.split(": ", 1)[0]).name


def test_special_files_are_called_what_they_are(tmp_path: Path) -> None:
    from megatron_ucp.errors import CheckpointFormatError

    good = _synthetic(tmp_path / "good")
    kinds = {
        1: ("a directory", lambda p: p.mkdir()),
        2: ("a FIFO (named pipe)", lambda p: os.mkfifo(p)),
        3: ("a symlink loop", lambda p: os.symlink(p.name, p)),
    }
    for r, (kind, make) in kinds.items():
        tag = private_copy(good.parent, tmp_path / f"special{r}") / good.name
        rank_file(tag, r).unlink()
        make(rank_file(tag, r))
        with pytest.raises(CheckpointFormatError, match=re.escape(f"{rank_file(tag, r)}: is {kind}, not a rank file")):
            _bind(tag)
    tag = private_copy(good.parent, tmp_path / "dangling") / good.name
    rank_file(tag, 0).unlink()
    os.symlink(tag / "nowhere", rank_file(tag, 0))
    with pytest.raises(CheckpointFormatError, match="is a dangling symbolic link"):
        _bind(tag)


# ------------------------------------------------------------------------------------------------
# real DeepSpeed: one launch refuses many folders, then loads a good one
# ------------------------------------------------------------------------------------------------


def _refused_alike(res, name: str, *named: Path, not_named: tuple[Path, ...] = (), kind: str = "") -> str:
    outcomes = res.refusals[name]
    assert all(o is not None for o in outcomes), (name, outcomes)
    messages = {o[1] for o in outcomes}
    assert len(messages) == 1, (name, outcomes)  # one error, the same on every rank
    message = messages.pop()
    assert "see their log" not in message and "Traceback" not in message, message
    for path in named:
        assert str(path) in message, (name, path, message)
    for path in not_named:
        assert str(path) not in message, (name, path, message)
    if kind:
        assert kind in message, (name, kind, message)
    return message


def _sources(ds_checkpoint, opt: str = "bf16") -> dict:
    """The session's stock and hooked saves of one optimizer class at DP 4 (steps 2 and 4)."""
    return {"stock": ds_checkpoint(opt, 4), "hooked": ds_checkpoint(opt, 4, plugin=True)}


def test_a_dp_3_resume_refuses_every_mixed_up_folder_and_loads_the_good_one(ds_checkpoint, tmp_path):
    sources = _sources(ds_checkpoint)
    stock, hooked = sources["stock"].root, sources["hooked"].root
    narrow = ds_checkpoint("bf16", 2).root
    f: dict[str, Path] = {}

    def folder(name: str, src: Path) -> Path:
        f[name] = _copy(src, tmp_path, name)
        return f[name] / TAG

    t = folder("swapped", stock)
    _swap(t, 1, 2)
    t = folder("copied-over", stock)
    shutil.copyfile(rank_file(t, 1), rank_file(t, 2))
    t = folder("stock-rank0-in-hooked", hooked)
    shutil.copyfile(rank_file(stock / TAG, 0), rank_file(t, 0))
    t = folder("hooked-model-states-of-step4", hooked)
    shutil.copyfile(model_states_file(hooked / "global_step4"), model_states_file(t))
    t = folder("stock-model-states-of-step4", stock)
    shutil.copyfile(model_states_file(stock / "global_step4"), model_states_file(t))
    t = folder("rank0-of-step4", stock)
    shutil.copyfile(rank_file(stock / "global_step4", 0), rank_file(t, 0))
    t = folder("hooked-rank3-of-step4", hooked)
    shutil.copyfile(rank_file(hooked / "global_step4", 3), rank_file(t, 3))
    t = folder("fifo", stock)
    rank_file(t, 2).unlink()
    os.mkfifo(rank_file(t, 2))
    t = folder("dtype", stock)
    _rewrite(rank_file(t, 1), _exp_avg_as_bf16)
    folder("latest-missing", stock)
    (f["latest-missing"] / "latest").write_text("global_step9")
    t = folder("dp2-model-states", stock)
    shutil.copyfile(model_states_file(narrow / TAG), model_states_file(t))
    t = folder("truncated", stock)
    rank_file(t, 3).write_bytes(rank_file(t, 3).read_bytes()[:4096])
    t = folder("universal-truncated", stock)
    rank_file(t, 3).write_bytes(rank_file(t, 3).read_bytes()[:4096])
    t = folder("changed-after-save", hooked)
    _rewrite(rank_file(t, 1), _negate_first_exp_avg)
    good = _copy(hooked, tmp_path, "good")
    reshard = {"resume_route": "reshard"}
    universal = {"resume_route": "universal"}
    attempts = [
        ("swapped", {}),
        ("copied-over", reshard),
        ("stock-rank0-in-hooked", {}),
        ("hooked-model-states-of-step4", reshard),
        ("rank0-of-step4", {}),
        ("hooked-rank3-of-step4", {}),
        ("fifo", reshard),
        ("dtype", {}),
        ("latest-missing", {"fallback": False}),  # (with the fallback, the restart loads global_step4: test_fallback)
        ("dp2-model-states", {}),
        ("truncated", {}),
        ("universal-truncated", universal),
        ("stock-model-states-of-step4", {}),  # after DeepSpeed's module load: the weights tell
        ("changed-after-save", reshard),  # after the copy: the file's recorded checksums tell
    ]
    refuse = [
        {"name": n, "dir": str(f[n]), "plugin_kwargs": kw, **({} if n == "latest-missing" else {"tag": TAG})}
        for n, kw in attempts
    ]
    before = {n: sorted(str(p.relative_to(f[n])) for p in f[n].rglob("*")) for n, _ in attempts if "universal" not in n}
    res = resume(3, "bf16", good, tmp_path / "run", load_tag=TAG, refuse=refuse, timeout=900)

    s = lambda name, r: rank_file(f[name] / TAG, r)  # noqa: E731
    m = _refused_alike(res, "swapped", s("swapped", 1), s("swapped", 2), not_named=(s("swapped", 0), s("swapped", 3)))
    assert "do not belong together" in m and "nothing was loaded" in m
    _refused_alike(res, "copied-over", s("copied-over", 2), not_named=(s("copied-over", 1),))
    _refused_alike(res, "stock-rank0-in-hooked", s("stock-rank0-in-hooked", 0), kind="carries no megatron-ucp save")
    _refused_alike(
        res,
        "hooked-model-states-of-step4",
        model_states_file(f["hooked-model-states-of-step4"] / TAG),
        not_named=tuple(s("hooked-model-states-of-step4", r) for r in range(4)),
        kind="from another save",
    )
    _refused_alike(res, "rank0-of-step4", s("rank0-of-step4", 0), not_named=(s("rank0-of-step4", 1),), kind="step")
    _refused_alike(res, "hooked-rank3-of-step4", s("hooked-rank3-of-step4", 3), kind="from another save")
    _refused_alike(res, "fifo", s("fifo", 2), kind="is a FIFO (named pipe), not a rank file")
    _refused_alike(res, "dtype", s("dtype", 1), kind="bfloat16 elements, not the")
    _refused_alike(res, "latest-missing", f["latest-missing"] / "latest", kind="names 'global_step9', but")
    _refused_alike(res, "dp2-model-states", model_states_file(f["dp2-model-states"] / TAG), kind="says DP=2")
    _refused_alike(res, "truncated", s("truncated", 3), kind="unreadable")
    m = _refused_alike(res, "universal-truncated", s("universal-truncated", 3), kind="converting global_step2")
    assert "failed on 1 rank(s)" in m
    _refused_alike(
        res,
        "stock-model-states-of-step4",
        model_states_file(f["stock-model-states-of-step4"] / TAG),
        kind="not the rounded fp32 masters",
    )
    _refused_alike(res, "changed-after-save", s("changed-after-save", 1), kind="'exp_avg'")
    for n, _ in attempts:  # nothing written next to a refused checkpoint (the universal route stages a twin)
        if "universal" not in n:
            assert sorted(str(p.relative_to(f[n])) for p in f[n].rglob("*")) == before[n], n

    lines = ucp_lines(res.log)
    assert any("DP changed 4 -> 3: resharding global_step2 from its native rank files" in x for x in lines), lines
    summary = [x for x in lines if x.startswith("megatron-ucp native reshard:")]
    assert summary and "every element placed exactly once" in summary[-1]
    assert "rank files bound to their positions and the saved weights" in summary[-1], summary
    assert "checked against the save's partition checksums" in summary[-1], summary
    assert res.loaded_step == 2 and res.steps == [3, 4]
    assert_losses_continue(res, sources["hooked"].loss_at)


@pytest.mark.parametrize("opt", ["bf16", "zero"])
def test_a_same_dp_restart_checks_what_the_save_recorded_and_names_the_file(ds_checkpoint, tmp_path, opt: str):
    """Also on every release of the matrix (Makefile ELASTIC_TESTS), with the class stock trains there."""
    sources = _sources(ds_checkpoint, opt)
    stock, hooked = sources["stock"].root, sources["hooked"].root
    f: dict[str, Path] = {}

    def folder(name: str, src: Path) -> Path:
        f[name] = _copy(src, tmp_path, name)
        return f[name] / TAG

    _swap(folder("swapped", stock), 1, 2)
    _rewrite(rank_file(folder("changed-after-save", hooked), 1), _negate_first_exp_avg)
    t = folder("stock-model-states-of-step4", stock)
    shutil.copyfile(model_states_file(stock / "global_step4"), model_states_file(t))
    t = folder("hooked-rank2-of-step4", hooked)
    shutil.copyfile(rank_file(hooked / "global_step4", 2), rank_file(t, 2))
    folder("stock-clean", stock)
    good = _copy(hooked, tmp_path, "good")
    names = ["swapped", "hooked-rank2-of-step4", "changed-after-save", "stock-model-states-of-step4", "stock-clean"]
    refuse = [{"name": n, "dir": str(f[n]), "tag": TAG} for n in names]
    res = resume(4, opt, good, tmp_path / "run", load_tag=TAG, refuse=refuse, timeout=900)

    s = lambda name, r: rank_file(f[name] / TAG, r)  # noqa: E731
    _refused_alike(res, "swapped", s("swapped", 1), s("swapped", 2), not_named=(s("swapped", 0),))
    _refused_alike(res, "hooked-rank2-of-step4", s("hooked-rank2-of-step4", 2), kind="from another save")
    _refused_alike(
        res,
        "changed-after-save",
        s("changed-after-save", 1),
        not_named=(s("changed-after-save", 0), s("changed-after-save", 2)),
        kind="differs from the checksum its save recorded",
    )
    _refused_alike(
        res,
        "stock-model-states-of-step4",
        model_states_file(f["stock-model-states-of-step4"] / TAG),
        kind="not the rounded fp32 masters",
    )
    assert res.refusals["stock-clean"] == [None] * 4  # a good stock folder loads (and was checked)
    lines = ucp_lines(res.log)
    assert any(
        "the masters checked against the saved weights (rank files without partition checksums)" in x for x in lines
    )
    assert any("global_step2 loaded at DP 4: every partition checked against the save's checksums" in x for x in lines)
    assert res.loaded_step == 2 and res.steps == [3, 4]
    assert_losses_continue(res, sources["hooked"].loss_at)

"""Hostile paths and tag files: nothing may delete, overwrite or write into a source, and nothing hangs.

Each test is a class of defect an adversarial run found (issue "Nothing lost, nothing stale, nothing
hangs"), exercised through the real CLI on a copy of the committed DeepSpeed 0.16.2 checkpoint:
outputs that are, contain or lie inside the source however spelled; tags with a trailing slash or
pointing out of the root; two files claiming one DP rank; tag files that are not UTF-8, that are
FIFOs or directories; rank files that are FIFOs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ucp.background.verdicts import read_verdict
from megatron_ucp.format import dsformat as F
from tests.support.source_digest import source_digest, verdict_files

TAG = "global_step2"
RANK1 = "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"


def cli(*args: str, cwd: Path | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "megatron_ucp.cli", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


@pytest.fixture
def root(tmp_path: Path, legacy_fixture) -> Path:
    ck = legacy_fixture("bf16_optimizer").copy_to(tmp_path / "ckpt")
    return ck


def refused(proc: subprocess.CompletedProcess, *words: str) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    message = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ""
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    for word in words:
        assert word in proc.stderr, (word, proc.stderr[-2000:])
    return message


# ---- 1. an output that is, contains or lies inside the source -----------------------------------


@pytest.mark.parametrize(
    "spelling", ["tag", "root", "parent", "tag-via-dotdot", "tag-via-symlink", "inside-tag", "root-via-dot"]
)
def test_force_never_replaces_or_writes_into_a_source(root: Path, spelling: str, tmp_path: Path):
    before = source_digest(root)
    link = tmp_path / "link-to-tag"
    link.symlink_to(root / TAG)
    output = {
        "tag": root / TAG,
        "root": root,
        "parent": root.parent,
        "tag-via-dotdot": root / TAG / ".." / TAG,
        "tag-via-symlink": link,
        "inside-tag": root / TAG / "uni",
        "root-via-dot": root / ".",
    }[spelling]
    proc = cli("convert", str(root), "--tag", TAG, "--output", str(output), "--force")
    refused(proc, "source")
    assert source_digest(root) == before and not verdict_files(root)  # the output refused, not the tag
    assert not (root / TAG / "uni").exists() and not (root / F.LATEST_UNIVERSAL).exists()


def test_output_dot_from_inside_the_tag_is_refused_before_any_work(root: Path):
    before = source_digest(root)
    proc = cli("convert", str(root), "--tag", TAG, "--output", ".", "--force", cwd=root / TAG)
    refused(proc, "source")
    assert source_digest(root) == before


def test_output_that_is_an_existing_file_is_refused_up_front(root: Path, tmp_path: Path):
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    proc = cli("convert", str(root), "--output", str(target), "--force")
    refused(proc, "not a folder")
    assert target.read_text() == "keep me"
    assert not list(tmp_path.glob(".*staging*"))


# ---- 2. tags: trailing slash normalised, paths out of the root refused ------------------------


def test_trailing_slash_tag_converts_to_the_usual_place(root: Path):
    proc = cli("convert", str(root), "--tag", TAG + "/")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (root / f"{TAG}_universal" / F.MANIFEST_FILE).is_file()
    assert not (root / TAG / "_universal").exists()


def test_latest_with_trailing_slash_is_the_same_tag(root: Path):
    (root / F.LATEST).write_text(TAG + "/\n")
    proc = cli("convert", str(root))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (root / F.LATEST_UNIVERSAL).read_text().strip() == f"{TAG}_universal"


@pytest.mark.parametrize("content", ["../other/global_step2", "global_step2/../global_step2", "..", "/abs/path"])
def test_latest_pointing_out_of_the_root_is_refused(root: Path, tmp_path: Path, content: str):
    other = tmp_path / "other"
    other.mkdir()
    (other / TAG).symlink_to(root / TAG)
    (root / F.LATEST).write_text(content)
    for command in (["convert", str(root)], ["inspect", str(root)]):
        refused(cli(*command), str(root / F.LATEST), "not a tag name")


# ---- 3. two files claiming one DP rank --------------------------------------------------------


@pytest.mark.parametrize(
    "impostor", ["bf16_zero_pp_rank_1_mp_rank_0_optim_states.pt", "bf16_zero_pp_rank_01_mp_rank_00_optim_states.pt"]
)
def test_two_files_for_one_rank_are_an_error_naming_both(root: Path, impostor: str):
    assert cli("convert", str(root)).returncode == 0  # a good twin, made before the impostor arrived
    uni = root / f"{TAG}_universal"
    before = source_digest(uni)
    (root / TAG / impostor).write_bytes((root / TAG / RANK1).read_bytes())
    for command in (
        ["convert", str(root), "--force"],
        ["inspect", str(root)],
        ["verify", str(uni), "--source", str(root)],
    ):
        proc = cli(*command)
        assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert "two files claim DP rank 1" in proc.stderr and impostor in proc.stderr and RANK1 in proc.stderr
    assert source_digest(uni) == before


# ---- 4/5. tag files that are not text, or not files -------------------------------------------


def test_latest_that_is_not_utf8_is_named(root: Path):
    (root / F.LATEST).write_bytes(b"global_step\xff\xfe2")
    for command in (["convert", str(root)], ["inspect", str(root)]):
        refused(cli(*command), str(root / F.LATEST), "not UTF-8")
    proc = cli("status", str(root))
    assert proc.returncode == 0 and "Traceback" not in proc.stderr and "not UTF-8" in proc.stderr


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_latest_that_is_a_special_file_never_hangs(root: Path, kind: str):
    latest = root / F.LATEST
    latest.unlink()
    if kind == "fifo":
        os.mkfifo(latest)
    else:
        latest.mkdir()
    words = "FIFO" if kind == "fifo" else "directory"
    for command in (["convert", str(root)], ["inspect", str(root)]):
        refused(cli(*command, timeout=30), str(latest), words)
    proc = cli("status", str(root), timeout=30)
    assert proc.returncode == 0 and words in proc.stderr, proc.stderr[-2000:]


def test_rank_file_that_is_a_fifo_is_named_not_read(root: Path):
    path = root / TAG / RANK1
    path.unlink()
    os.mkfifo(path)
    refused(cli("convert", str(root), timeout=30), str(path), "FIFO")


@pytest.mark.parametrize("name", [F.MODEL_STATES_FILE, "layer_01-model_00-model_states.pt"])
def test_a_model_states_file_that_is_a_fifo_is_refused_by_every_command(root: Path, name: str):
    """Every path that opens a checkpoint file goes through one special-file check: convert hung
    (killed after 90 s) on a FIFO model-states file that inspect and verify refused at once."""
    path = root / TAG / name
    path.unlink(missing_ok=True)
    os.mkfifo(path)
    refused(cli("convert", str(root), timeout=30), str(path), "FIFO")
    refused(cli("inspect", str(root), timeout=30), str(path), "FIFO")
    assert not (root / F.universal_tag(TAG)).exists()


@pytest.mark.parametrize("entries", [(9, 9), (8, 9), (0, 0)], ids=["both-high", "disk-vs-total", "zero"])
def test_model_states_that_torch_refuses_is_not_committed(root: Path, entries: tuple[int, int]):
    """A zip64 end-of-central-directory entry count damaged: our tolerant reader reads around it, torch's
    zip reader does not, and the file would be copied into the universal folder as it is. Convert
    opens every such file the way torch.load does first, and refuses, naming it; nothing is written."""
    import struct

    path = root / TAG / F.MODEL_STATES_FILE
    data = bytearray(path.read_bytes())
    at = data.rfind(b"PK\x06\x06")  # zip64 EOCD: entries on this disk at +24, in total at +32
    assert at > 0
    struct.pack_into("<QQ", data, at + 24, *entries)
    path.write_bytes(bytes(data))
    before = source_digest(root)
    refused(cli("convert", str(root), timeout=60), str(path), "torch's zip reader")
    assert source_digest(root) == before and not (root / F.universal_tag(TAG)).exists()
    verdict = read_verdict(root, TAG)  # what the conversion found in the tag's own file is the tag's verdict
    assert verdict is not None and not verdict.sound and str(path) in verdict.problems[0], verdict
    assert not (root / F.LATEST_UNIVERSAL).exists()


def test_a_copied_file_outside_torch_saves_form_is_judged_by_torch_itself(root: Path, monkeypatch):
    """A copied model-states file that torch's reader opens but that is not in torch.save's exact form
    (here: a zip comment) is handed to torch's own reader before the commit, and the conversion goes
    through; in torch.save's form, torch is never asked (no child imports it)."""
    import struct

    from megatron_ucp.convert import execute
    from megatron_ucp.format import torchload

    asked: list[list[str]] = []
    refused = torchload.TorchReaderCheck.refused

    def spy(self, paths, timeout=600.0):
        asked.append([os.fspath(p) for p in paths])
        return refused(self, paths, timeout)

    monkeypatch.setattr(torchload.TorchReaderCheck, "refused", spy)
    execute.convert(execute.ConvertOptions(source=root, progress=False))
    assert asked == [[]]  # torch.save's form: nothing for torch to judge
    path = root / TAG / F.MODEL_STATES_FILE
    data = bytearray(path.read_bytes())
    struct.pack_into("<H", data, len(data) - 2, 4)  # a 4-byte zip comment, which torch's reader accepts
    path.write_bytes(bytes(data) + b"note")
    asked.clear()
    execute.convert(execute.ConvertOptions(source=root, progress=False, force=True))
    assert [Path(p).name for p in asked[0]] == [F.MODEL_STATES_FILE]


def test_status_reports_symlink_loops_in_its_table(root: Path):
    """A tag folder or a `latest` that is a symlink loop is a line of status, not its end (exit 2)."""
    os.symlink("global_step9", root / "global_step9")
    proc = cli("status", str(root), timeout=30)
    assert proc.returncode == 0, proc.stderr[-2000:]
    row = next(line for line in proc.stdout.splitlines() if line.startswith("global_step9"))
    assert "unreadable" in row and "symlink loop" in proc.stdout
    assert any(line.startswith(TAG) and "yes" in line for line in proc.stdout.splitlines())
    (root / F.LATEST).unlink()
    os.symlink(F.LATEST, root / F.LATEST)
    proc = cli("status", str(root), "--json", timeout=30)
    assert proc.returncode == 0, proc.stderr[-2000:]
    import json

    report = json.loads(proc.stdout)
    assert report["latest"] is None and any("symlink loop" in p for p in report["problems"])


@pytest.mark.parametrize("kind,words", [("file", "is a file"), ("symlink-loop", "symlink loop")])
def test_tag_folder_that_is_not_a_folder_says_what_it_is(root: Path, kind: str, words: str):
    tag = root / "global_step9"
    if kind == "file":
        tag.write_text("not a folder")
    else:
        os.symlink(tag.name, tag)  # points at itself
    for command in (["convert", str(root), "--tag", tag.name], ["inspect", str(root), "--tag", tag.name]):
        refused(cli(*command, timeout=30), str(tag), words)


# ---- 6/7. shape and dtype are part of "accounted for" -----------------------------------------


def _rewrite(path: Path, change) -> None:
    import torch

    obj = torch.load(path, weights_only=False)
    change(obj)
    torch.save(obj, path)


def test_param_shapes_transposed_against_the_module_is_refused(root: Path):
    model = root / TAG / F.MODEL_STATES_FILE

    def transpose_one(states) -> None:
        for group in states[F.PARAM_SHAPES]:
            for name, shape in group.items():
                if len(shape) == 2 and shape[0] != shape[1] and name in states["module"]:
                    group[name] = type(shape)((shape[1], shape[0]))
                    states["transposed"] = name
                    return
        raise AssertionError("fixture has no non-square matrix")

    _rewrite(model, transpose_one)
    proc = cli("convert", str(root))
    refused(proc, str(model), "param_shapes gives")
    assert not (root / f"{TAG}_universal").exists()


def test_a_rank_with_a_state_in_another_dtype_is_named(root: Path):
    import torch

    path = root / TAG / RANK1

    def to_bf16(sd) -> None:
        state = sd["optimizer_state_dict"]["base_optimizer_state"]["state"]
        first = next(iter(state))
        state[first]["exp_avg"] = state[first]["exp_avg"].to(torch.bfloat16)

    _rewrite(path, to_bf16)
    refused(cli("convert", str(root)), str(path), "bfloat16")


def test_verify_reports_a_transposed_state_instead_of_crashing(root: Path):
    import torch

    assert cli("convert", str(root)).returncode == 0
    uni = root / f"{TAG}_universal"
    victim = next(
        p
        for p in (uni / "zero").rglob("fp32.pt")
        if torch.load(p, weights_only=False)["param"].dim() == 2
        and len(set(torch.load(p, weights_only=False)["param"].shape)) == 2
    )
    _rewrite(victim, lambda e: e.__setitem__("param", e["param"].t().contiguous()))
    proc = cli("verify", str(uni), "--source", str(root))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr + proc.stdout, proc.stdout + proc.stderr
    assert "shape" in proc.stdout + proc.stderr


# ---- 9. a universal twin is bound to the exact files it came from ----------------------------


def test_a_twin_made_from_an_earlier_save_is_stale_everywhere(root: Path):
    from megatron_ucp.convert.execute import ConvertOptions, convert
    from megatron_ucp.convert.universal import read_manifest, universal_state
    from megatron_ucp.plan.parallel_layout import ParallelLayout
    from megatron_ucp.plan.resume import Route, TwinState, decide_resume

    assert cli("convert", str(root)).returncode == 0
    uni = root / f"{TAG}_universal"
    assert universal_state(uni, root / TAG) == "complete"
    assert set(read_manifest(uni)["source_files"]) == {p.name for p in (root / TAG).iterdir()}

    # the run restarts from an earlier step and saves this tag again: new bytes, new times
    rank1 = root / TAG / RANK1
    st = rank1.stat()
    os.utime(rank1, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert universal_state(uni, root / TAG) == "stale"
    assert universal_state(uni) == "complete"  # without a source, nothing to compare

    proc = cli("convert", str(root))
    assert proc.returncode == 2 and "stale" in proc.stderr and RANK1 in proc.stderr, proc.stderr
    status = cli("status", str(root))
    assert status.returncode == 0 and "stale" in status.stdout, status.stdout

    decision = decide_resume(
        requested_tag=TAG,
        saved=ParallelLayout(dp=4),
        live=ParallelLayout(dp=3),
        load_universal=False,
        twin_state=TwinState.STALE,
        resume_route="universal",
    )
    assert decision.route is Route.CONVERT_THEN_UNIVERSAL and "earlier save" in decision.message

    result = convert(ConvertOptions(source=root, replace_stale=True, progress=False))  # what async and resume do
    assert result.committed and universal_state(uni, root / TAG) == "complete"
    assert read_manifest(uni)["source_files"][RANK1][1] == rank1.stat().st_mtime_ns


def test_a_twin_from_before_source_binding_is_judged_by_modification_times(root: Path):
    import json

    from megatron_ucp.convert.universal import stale_reason, universal_state

    assert cli("convert", str(root)).returncode == 0
    uni = root / f"{TAG}_universal"
    manifest_path = uni / F.MANIFEST_FILE
    manifest = json.loads(manifest_path.read_text())
    del manifest["source_files"]  # as written by megatron-ucp before source binding
    written = manifest_path.stat().st_mtime_ns
    manifest_path.write_text(json.dumps(manifest))
    os.utime(manifest_path, ns=(written, written))
    assert universal_state(uni, root / TAG) == "complete"  # every source file is older than the conversion

    rank1 = root / TAG / RANK1
    os.utime(rank1, ns=(written + 1_000_000_000, written + 1_000_000_000))  # re-saved after it
    assert universal_state(uni, root / TAG) == "stale"
    assert str(rank1) in stale_reason(uni, root / TAG)
    proc = cli("convert", str(root))
    assert proc.returncode == 2 and "stale" in proc.stderr and RANK1 in proc.stderr, proc.stderr


# ---- inspect runs the plan checks convert runs ---------------------------------------------------


def test_inspect_refuses_what_convert_refuses(root: Path):
    def shift_a_fragment(sd) -> None:
        mappings = sd["optimizer_state_dict"]["param_slice_mappings"][0]
        name = next(iter(mappings))
        address = mappings[name]
        mappings[name] = type(address)(numel=address.numel, start=address.start + 1)

    _rewrite(root / TAG / RANK1, shift_a_fragment)
    convert_err = refused(cli("convert", str(root)))
    inspect_err = refused(cli("inspect", str(root)))
    assert convert_err.split("error: ", 1)[-1] == inspect_err.split("error: ", 1)[-1], (convert_err, inspect_err)


def test_verify_source_compares_every_ranks_step(root: Path):
    import torch

    assert cli("convert", str(root)).returncode == 0
    rank2 = root / TAG / "bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt"

    def bump(sd) -> None:
        state = sd["optimizer_state_dict"]["base_optimizer_state"]["state"]
        group = next(iter(state))
        state[group]["step"] = state[group]["step"] + 1 if torch.is_tensor(state[group]["step"]) else 99

    _rewrite(rank2, bump)
    proc = cli("verify", str(root / f"{TAG}_universal"), "--source", str(root))
    assert proc.returncode == 1 and rank2.name in proc.stdout + proc.stderr, proc.stdout + proc.stderr


# ---- 8. what the converter copies must load where it will be loaded ----------------------------


def _damage_directory_entry(path: Path, record_suffix: bytes, field: int, delta: int) -> None:
    """Add ``delta`` to a 4-byte field of the central-directory entry whose name ends with the suffix."""
    import struct

    data = bytearray(path.read_bytes())
    i = 0
    while True:
        i = data.find(b"PK\x01\x02", i)
        assert i >= 0, record_suffix
        n = struct.unpack_from("<H", data, i + 28)[0]
        if bytes(data[i + 46 : i + 46 + n]).endswith(record_suffix):
            struct.pack_into("<I", data, i + field, struct.unpack_from("<I", data, i + field)[0] + delta)
            break
        i += 4
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("field,delta", [(20, 1), (24, 1), (42, 1)], ids=["compressed-size", "size", "offset"])
def test_damaged_model_states_are_never_committed(root: Path, field: int, delta: int):
    import torch

    model = root / TAG / F.MODEL_STATES_FILE
    _damage_directory_entry(model, b"data.pkl", field, delta)
    with pytest.raises(Exception):
        torch.load(model, weights_only=False)  # the loader that will read the copy rejects it
    refused(cli("convert", str(root)), str(model), "damaged")
    assert not (root / f"{TAG}_universal").exists() and not list(root.glob(".*staging*"))


def test_a_rank_file_torch_would_reject_converts_with_a_warning(root: Path):
    rank1 = root / TAG / RANK1
    _damage_directory_entry(rank1, b"data.pkl", 24, 1)
    proc = cli("convert", str(root))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert str(rank1) in proc.stderr and "torch.load would reject it" in proc.stderr
    assert cli("verify", str(root / f"{TAG}_universal")).returncode == 0


def test_one_truncated_manifest_does_not_hide_the_root(root: Path):
    assert cli("convert", str(root)).returncode == 0
    manifest = root / f"{TAG}_universal" / F.MANIFEST_FILE
    manifest.write_text(manifest.read_text()[:40])
    proc = cli("status", str(root))
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "unreadable manifest" in proc.stdout and TAG in proc.stdout


# ---- interrupted runs are repaired by the next convert, without --force ------------------------


def test_next_convert_cleans_a_killed_force_run_and_restores_latest_universal(root: Path):
    assert cli("convert", str(root)).returncode == 0
    uni = root / f"{TAG}_universal"
    # what a --force run SIGKILLed mid-way leaves: a staging sibling whose converter is gone
    staging = root / f".{uni.name}{F.STAGING_SUFFIX}"
    (staging / "heartbeats").mkdir(parents=True)
    (staging / "attempt.json").write_text('{"attempt_id": "killed", "fingerprint": "x"}')
    (staging / "heartbeats" / "0").write_text(f"{os.uname().nodename} 999999999")
    (staging / "zero").mkdir()
    # and a run killed between the commit rename and latest_universal
    (root / F.LATEST_UNIVERSAL).unlink()
    before = source_digest(uni)
    proc = cli("convert", str(root))
    # the conversion itself was done: the repairs are said in its one "already complete" line, exit 0
    done = [line for line in proc.stdout.splitlines() if "already a complete conversion" in line]
    assert proc.returncode == 0 and len(done) == 1, (proc.stdout, proc.stderr)
    assert "interrupted earlier run" in done[0] and "now names it" in done[0], done
    assert not staging.exists() and (root / F.LATEST_UNIVERSAL).read_text().strip() == uni.name
    assert source_digest(uni) == before


def test_an_output_write_failure_names_the_output_not_the_source(root: Path):
    """File size limit (EFBIG) on the writer: the message names an output file; the source is intact."""
    import resource
    import signal

    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (3000, 3000))

    before = source_digest(root)
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_ucp.cli", "convert", str(root), "--no-progress"],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=limit,
    )
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert f"{TAG}_universal" in last and f"/{TAG}/" not in last, last
    assert source_digest(root) == before and not (root / f"{TAG}_universal").exists()


def test_latest_universal_that_is_a_directory_is_refused_up_front(root: Path):
    (root / F.LATEST_UNIVERSAL).mkdir()
    refused(cli("convert", str(root)), str(root / F.LATEST_UNIVERSAL), "directory")
    assert not (root / f"{TAG}_universal").exists()
    assert not [p for p in root.iterdir() if ".tmp-" in p.name or "staging" in p.name]
    assert cli("convert", str(root), "--no-latest").returncode == 0


# ---- a background converter stopped by SIGTERM says so ------------------------------------------


def test_sigtermed_background_converter_records_an_event(root: Path, monkeypatch):
    import signal
    import time

    from megatron_ucp.background.store import EVENTS_LOG, ConverterSettings, ucp_dir
    from megatron_ucp.background.trigger import trigger
    from megatron_ucp.faults import PAUSE_ENV as FAULT_PAUSE_ENV

    monkeypatch.setenv(FAULT_PAUSE_ENV, f"{TAG}:30:0")  # the converter sleeps after its first parameter
    result = trigger(root, TAG, 0, 1, ConverterSettings(workers=1))
    assert result.spawned, result
    progress = ucp_dir(root) / "progress"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not list(progress.glob("*.json")):
        time.sleep(0.2)
    time.sleep(1.0)
    os.kill(result.spawned, signal.SIGTERM)
    deadline = time.monotonic() + 30
    events = ucp_dir(root) / EVENTS_LOG
    while time.monotonic() < deadline and "SIGTERM" not in (events.read_text() if events.exists() else ""):
        time.sleep(0.2)
    assert "interrupted" in events.read_text() and "SIGTERM" in events.read_text(), events.read_text()
    assert not (root / f"{TAG}_universal").exists()


def test_a_converter_killed_right_after_it_started_is_not_shown_in_progress(root: Path, monkeypatch):
    """The startup grace covers converters not yet seen; one seen and then SIGKILLed is interrupted at once."""
    import signal
    import time

    from megatron_ucp.background import queue as B
    from megatron_ucp.background.status import UniversalStatus, root_status
    from megatron_ucp.background.store import ConverterSettings, job_facts, read_queue, read_registrations
    from megatron_ucp.background.trigger import trigger
    from megatron_ucp.faults import PAUSE_ENV as FAULT_PAUSE_ENV

    monkeypatch.setenv(FAULT_PAUSE_ENV, f"{TAG}:30:0")
    result = trigger(root, TAG, 0, 1, ConverterSettings(workers=1))
    assert result.spawned, result
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (
        read_registrations(root).get(0) is None or read_registrations(root)[0].phase != "converting"
    ):
        time.sleep(0.1)
    os.kill(result.spawned, signal.SIGKILL)
    try:
        os.waitpid(result.spawned, 0)
    except ChildProcessError:  # already reaped
        pass
    job = read_queue(root).active
    facts = job_facts(root, job, read_registrations(root), 60.0)
    assert facts.runners_gone and not facts.runners_live and not facts.staging_live, facts
    assert B.judge(read_queue(root), job, facts, job.activated + 1.0) is B.Outcome.DEAD  # inside the grace
    (row,) = [t for t in root_status(root, sizes=False).tags if t.tag == TAG]
    assert row.universal is UniversalStatus.INTERRUPTED, row
    assert "killed" in row.detail and f"--tag {TAG}" in row.detail


# ---- integrity: checksums recorded once by the converter, checked by verify and the loader -------


@pytest.mark.parametrize("writer", ["direct", "torch.save"])
def test_the_manifest_records_every_state_files_checksum(root: Path, writer: str, monkeypatch):
    import torch

    from megatron_ucp.convert.execute import ConvertOptions, convert
    from megatron_ucp.convert.universal import read_manifest
    from megatron_ucp.format.integrity import ALGORITHM
    from megatron_ucp.plan.accounting import checksum

    if writer == "torch.save":
        monkeypatch.setenv("MEGATRON_UCP_TORCH_SAVE", "1")
    uni = convert(ConvertOptions(source=root, progress=False, workers=2)).output
    sums = read_manifest(uni)["checksums"]
    assert sums["algorithm"] == ALGORITHM
    files = sorted(
        p
        for p in (uni / F.UNIVERSAL_ZERO_DIR).rglob("*.pt")
        if p.name not in (f"{F.STEP_STATE}.pt", F.UNIVERSAL_OPTIMIZER_STATE_FILE)
    )
    assert sorted(sums["files"]) == [str(p.relative_to(uni / F.UNIVERSAL_ZERO_DIR))[:-3] for p in files]
    rows_seen = 0
    for path in files:
        entry = torch.load(path, weights_only=False)
        record = sums["files"][str(path.relative_to(uni / F.UNIVERSAL_ZERO_DIR))[:-3]]
        assert record["numel"] == entry[F.PARAM].numel() and record["sum"] == checksum(entry[F.PARAM]), path
        if F.VOCAB_PADDED_ROWS in entry:  # at their place in the parameter, after the kept rows
            rows_seen += 1
            assert record["rows_sum"] == checksum(entry[F.VOCAB_PADDED_ROWS], entry[F.PARAM].numel())
    assert rows_seen == 3  # fp32, exp_avg, exp_avg_sq of the padded vocabulary


def test_a_manifest_written_with_the_previous_checksum_is_still_checked(root: Path):
    """Folders converted before ucp-wsum64-v3 record v2 sums: verify checks them with v2, and finds a change."""
    from megatron_ucp.format.integrity import LEGACY_ALGORITHM
    from tests.support.elastic_support import flip_a_data_bit, rewrite_manifest_checksums

    assert cli("convert", str(root)).returncode == 0
    uni = root / f"{TAG}_universal"
    rewrite_manifest_checksums(uni, LEGACY_ALGORITHM)  # as megatron-ucp before v3 wrote it
    proc = cli("verify", str(uni))
    assert proc.returncode == 0 and "matching the manifest's checksum" in proc.stdout + proc.stderr, proc.stdout
    victim = uni / F.UNIVERSAL_ZERO_DIR / "language_model.encoder.final_layernorm.weight" / "exp_avg.pt"
    flip_a_data_bit(victim)
    proc = cli("verify", str(uni))
    assert proc.returncode == 1 and "checksum differs" in proc.stdout + proc.stderr


@pytest.mark.parametrize("damage", ["bit flip", "another file's tensor", "file removed"])
def test_verify_without_source_finds_what_changed_since_the_conversion(root: Path, damage: str):
    import shutil

    from tests.support.elastic_support import flip_a_data_bit

    assert cli("convert", str(root)).returncode == 0
    zero = root / f"{TAG}_universal" / F.UNIVERSAL_ZERO_DIR
    proc = cli("verify", str(zero.parent))
    assert proc.returncode == 0 and "matching the manifest's checksum" in proc.stdout + proc.stderr, proc.stdout
    victim = zero / "language_model.encoder.final_layernorm.weight" / "exp_avg.pt"
    if damage == "bit flip":
        flip_a_data_bit(victim)
        expected = "checksum differs"
    elif damage == "another file's tensor":  # same shape, valid file: only the checksum tells
        shutil.copyfile(victim.with_name("exp_avg_sq.pt"), victim)
        expected = "checksum differs"
    else:
        victim.unlink()
        expected = "missing"
    proc = cli("verify", str(zero.parent))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and str(victim) in out and expected in out, out

"""Random sequences of what a requeued job and its user do, over real DeepSpeed runs, each step held to the promises.

The suite's sequence tests (tests/system/test_fallback.py, the real fork's in tests/integration) run one scripted
path each; this explores more: per seed, a random sequence of actions over one checkpoint root, with the test
harness's tiny model (real DeepSpeed, CPU, gloo, the hooks installed). The actions:

* ``train``: a restart (fallback on) at a random DP size, two more iterations saved every second one into the same
  root (the last one twice, as Megatron saves its last iteration), saves synchronous or asynchronous and converted
  in the background or not, at random; ``train-batch``: the same at another global batch (24 for 12: the losses
  leave the reference curve from then on); ``kill``: asynchronous saves, one rank killed while it writes the last
  one; ``rerun``: the user reruns from an older tag (``--load-tag``), saving over the newer ones;
* ``cut``, ``flip``, ``nan``, ``delete-file``: one rank file of a random tag cut short, a bit flipped in it, a NaN
  written into its ``exp_avg_sq``, or the file deleted; ``delete-tag``: a random tag's folder removed;
  ``edit-latest``: ``latest`` pointed at an older tag, at a tag that is not there, or filled with garbage;
* ``verify``, ``deep``, ``convert``: ``megatron-ucp verify ROOT --tag T``, ``status ROOT --deep``, ``convert ROOT``;
* ``follow``: every command ``status`` prints (between backquotes) run as printed.

The oracle, after every step: ``latest`` names a folder holding one whole save and ``latest_universal`` a complete
folder; ``status --check``'s prediction holds for the next restart (it loads one of the tags the prediction lists,
in its order; one found sound is loaded; when it lists none, the restart resumes from none); after ``verify``,
``status`` says what ``verify`` found; a command ``status`` prints runs (exit 0, or 1 for a check that finds
damage); a fallback that repeats an earlier one says so; a restart's losses follow the uninterrupted run at DP 4
(until a global batch change; to bf16 reduction noise, 1e-3, widened by a sixteenth for each step its lineage trained
at another DP size) and its saves hold its rank files alone; a run with a rank killed fails. Each broken promise
is a finding; the findings, the steps that led to them, and how often each action and outcome occurred are
printed and written to ``benchmarks/results/sequence-explore-<date>.json``.

    python benchmarks/sequence_explore.py --seeds 10 --steps 20
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import json
import random
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_ucp.background.status import root_status  # noqa: E402
from megatron_ucp.background.status_text import format_status  # noqa: E402
from megatron_ucp.cli import main as cli  # noqa: E402
from tests.support.dsharness import TrainSpec, run_training  # noqa: E402
from tests.support.elastic_support import (  # noqa: E402
    LOSS_TOLERANCE,
    fallback_announcements,
    flip_a_bit_in_the_largest_record,
)

DP_SIZES = (2, 3, 4)
REFERENCE_STEPS = 60
REFERENCE_DP = 4
ACTIONS = {  # weight of each action once a tag exists
    "train": 6,
    "train-batch": 1,
    "kill": 2,
    "rerun": 1,
    "cut": 1,
    "flip": 1,
    "nan": 1,
    "delete-file": 1,
    "delete-tag": 1,
    "edit-latest": 1,
    "verify": 2,
    "deep": 1,
    "convert": 1,
    "follow": 1,
}


def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            code = cli(list(argv))
        except SystemExit as exc:  # argparse: a command that does not parse
            code = exc.code if isinstance(exc.code, int) else 2
    return code, out.getvalue(), err.getvalue()


def _tags(root: Path) -> list[int]:
    steps = []
    for p in root.glob("global_step*"):
        if p.is_dir() and not p.name.endswith("_universal") and p.name[len("global_step") :].isdigit():
            steps.append(int(p.name[len("global_step") :]))
    return sorted(steps)


def _rank_files(tag: Path) -> list[Path]:
    return sorted(tag.glob("*optim_states.pt"))


def _damage(root: Path, rng: random.Random, kind: str) -> str:
    import torch

    tag = root / f"global_step{rng.choice(_tags(root))}"
    files = _rank_files(tag)
    if not files:
        return f"{kind}: {tag.name} holds no rank file"
    victim = rng.choice(files)
    try:
        if kind == "flip":
            flip_a_bit_in_the_largest_record(victim)
        elif kind == "nan":
            states = torch.load(victim, weights_only=False)
            states["optimizer_state_dict"]["base_optimizer_state"]["state"][0]["exp_avg_sq"][0] = float("nan")
            torch.save(states, victim)
        elif kind == "delete-file":
            victim.unlink()
    except Exception:  # not a whole file any more (cut before, or left half-written by a killed save)
        kind = "cut"
    if kind == "cut":
        victim.write_bytes(victim.read_bytes()[: victim.stat().st_size * 2 // 3])
    return f"{kind} {victim.relative_to(root)}"


def _edit_latest(root: Path, rng: random.Random) -> str:
    tags = _tags(root)
    how = rng.choice(["older", "missing", "garbage"])
    if how == "older" and len(tags) > 1:
        text = f"global_step{rng.choice(tags[:-1])}"
    elif how == "missing":
        text = f"global_step{tags[-1] + 98}"
    else:
        how, text = "garbage", "\x00\x01 not a tag"
    (root / "latest").write_text(text)
    return f"edit-latest ({how}): {text!r}"


class Explorer:
    def __init__(self, work: Path, reference: dict[int, float]) -> None:
        self.work, self.reference = work, reference
        self.findings: list[dict] = []
        self.counts: collections.Counter = collections.Counter()

    def run(self, seed: int, steps: int, ops: Optional[list[str]] = None) -> list[str]:
        """One sequence: ``steps`` random actions (``ops``: these, in this order; the choices within each, such as the
        DP size or the file damaged, still drawn from ``seed``)."""
        self.seed, self.rng = seed, random.Random(seed)
        self.root = self.work / f"seed{seed}" / "ckpt"
        self.root.parent.mkdir(parents=True)
        self.diverged = False  # trained at another global batch: the reference curve no longer applies
        self.off: dict[int, int] = {}  # per saved step: steps its lineage trained at a DP other than the reference's
        self.refused = False  # the last restart resumed from no tag
        done: list[str] = []
        for i in range(len(ops) if ops is not None else steps):
            self.step = i
            tags = _tags(self.root)
            if ops is not None:
                op = ops[i]
            elif not tags:
                op = "train"
            else:
                names = list(ACTIONS)
                op = self.rng.choices(names, weights=[ACTIONS[n] for n in names])[0]
            self.counts[op] += 1
            said = self._act(op)
            for problem in _pointer_problems(self.root):
                self._finding(f"after {said}: {problem}")
            answer = self._answer()
            done.append(f"{said}; status --check: {answer}")
            print(f"  seed {seed} step {i}: {done[-1]}", flush=True)
        return done

    def _act(self, op: str) -> str:
        root = self.root
        if op in ("train", "train-batch", "kill", "rerun"):
            return self._train(op)
        if op in ("cut", "flip", "nan", "delete-file"):
            return _damage(root, self.rng, op)
        if op == "delete-tag":
            tag = root / f"global_step{self.rng.choice(_tags(root))}"
            shutil.rmtree(tag)
            return f"delete-tag {tag.name}"
        if op == "edit-latest":
            return _edit_latest(root, self.rng)
        if op == "verify":
            tag = f"global_step{self.rng.choice(_tags(root))}"
            code, _, _ = _cli("verify", str(root), "--tag", tag, "--no-progress")
            row = next((t for t in root_status(root, sizes=False).tags if t.tag == tag), None)
            seen = row.verified if row is not None else None
            if (code == 0) != (seen == "sound"):
                self._finding(f"verify {tag} exited {code}; status then says {seen!r} ({row.verdict if row else ''})")
            self.counts[f"verify exit {code}"] += 1
            return f"verify {tag} -> exit {code} (status: {seen})"
        if op == "deep":
            code, out, _ = _cli("status", str(root), "--deep", "--no-sizes", "--no-progress")
            self.counts[f"deep exit {code}"] += 1
            if code not in (0, 1):
                self._finding(f"status --deep exited {code}: {out[-500:]}")
            return f"status --deep -> exit {code}"
        if op == "convert":
            code, _, err = _cli("convert", str(root), "--no-progress")
            self.counts[f"convert exit {code}"] += 1
            return f"convert -> exit {code}" + (
                f" ({err.strip().splitlines()[-1][:160]})" if code and err.strip() else ""
            )
        return self._follow()

    def _follow(self) -> str:
        """Every command ``status`` prints, as printed: each must run (exit 0, or 1 for a check that finds damage)."""
        rs = root_status(self.root, sizes=False)
        text = format_status(rs)
        commands = list(dict.fromkeys(re.findall(r"`([^`]+)`", text)))
        ran, unsound = [], set()
        for command in commands:
            words = shlex.split(command)
            tag = words[words.index("--tag") + 1] if "--tag" in words[:-1] else None
            if words[0] == "megatron-ucp":
                code, _, err = _cli(*words[1:], *(["--no-progress"] if words[1] in ("verify", "convert") else []))
            elif words[0] in ("echo", "rm", "mv", "ls"):
                proc = subprocess.run(command, shell=True, capture_output=True, text=True)
                code, err = proc.returncode, proc.stderr
            else:
                continue  # prose in backquotes (a flag, a file name)
            checks = words[0] == "megatron-ucp" and words[1] in ("verify", "status")
            if checks and code == 1 and tag is not None:
                unsound.add(tag)
            # status prints a conversion of a tag not read yet as "once they are sound": verify said they are not
            conditional = words[0] == "megatron-ucp" and words[1] == "convert" and tag in unsound
            if code != 0 and not (checks and code == 1) and not conditional:
                self._finding(f"status printed `{command}`; it exited {code}: {err.strip()[-300:]}")
            ran.append(f"`{command}` -> {code}")
        self.counts["follow commands"] += len(ran)
        return "follow: " + ("; ".join(ran) if ran else "status printed no command")

    def _answer(self) -> str:
        if not (self.root / "latest").exists():
            self.answer = None
            return "no latest"
        code, _, err = _cli("status", str(self.root), "--check", "--no-sizes")
        self.answer = root_status(self.root, sizes=False).resume_answer()
        said = [line for line in err.splitlines() if line.startswith("megatron-ucp status --check: ")]
        if (code == 1) != (self.answer.tag is None):
            self._finding(f"status --check exited {code} but predicted tries {self.answer.tries}")
        return f"exit {code}: {said[-1].removeprefix('megatron-ucp status --check: ') if said else ''}"

    def _finding(self, what: str) -> None:
        self.findings.append({"seed": self.seed, "step": self.step, "finding": what})
        print(f"  FINDING (seed {self.seed}, step {self.step}): {what}", flush=True)

    def _train(self, op: str) -> str:
        root, rng = self.root, self.rng
        dp = rng.choice(DP_SIZES)
        tags = _tags(root)
        answer = getattr(self, "answer", None)
        fresh = not tags or (self.refused and answer is not None and answer.tag is None)  # the user starts over
        load_tag: Optional[str] = None
        if op == "rerun" and len(tags) > 1:
            start = rng.choice(tags[:-1])
            load_tag = f"global_step{start}"
        elif fresh:
            start = 0
        else:
            start = tags[-1]
        target = start + 2
        before = len(_fallback_lines(root))
        killed = op == "kill"
        options = {"async_save": killed or rng.random() < 0.5, "async_convert": rng.random() < 0.5}
        batch = 24 if op == "train-batch" else 12
        spec = TrainSpec(
            dp=dp,
            steps=target,
            global_batch=batch,
            save_dir=root,
            # every even step it trains (a damaged tag included), the last one twice (as Megatron's last iteration)
            save_at=(*range(2, target + 1, 2), target) if target % 2 == 0 else tuple(range(2, target + 1, 2)),
            load_dir=None if fresh else root,
            load_tag=load_tag,
            plugin=True,
            plugin_kwargs=options,
            expect_failure=True,
            timeout=600,
            # SIGKILL while it writes its rank file of the last save
            env={"MEGATRON_UCP_TEST_FAULT": f"write global_step{target}/*optim_states.pt:{dp - 1}:kill"}
            if killed
            else {},
        )
        res = run_training(spec)
        loaded = res.loaded_step
        how = "+".join(k for k, on in options.items() if on) or "sync"
        said = f"{op} at DP {dp}, batch {batch}{' from ' + load_tag if load_tag else ''}{' fresh' if fresh else ''} "
        said += f"to {target} ({how}): exit {res.returncode}, loaded {loaded}, trained {res.steps}"
        self.counts[f"{op}: {'resumed' if loaded else 'fresh' if fresh else 'refused'}"] += 1
        if not fresh and load_tag is None:
            self._hold_to_the_prediction(answer, res)
        self.refused = not fresh and loaded is None
        if batch != 12 and res.steps:
            self.diverged = True
        # bf16 gradients reduced over another DP size round in another order: the curve drifts by that noise at
        # every step trained off the reference's DP, and the drift is carried by every save of that lineage
        off = (0 if fresh else self.off.get(loaded or 0, 0)) + (len(res.steps) if dp != REFERENCE_DP else 0)
        for s in spec.save_at:  # the saves that committed carry the lineage (a killed run's last one does not)
            if s in res.steps and (res.ok or s != res.steps[-1]):
                self.off[s] = off
        if not self.diverged:
            for s, loss in zip(res.steps, res.losses, strict=True):
                tolerance = LOSS_TOLERANCE * (1 + off / 16) * max(1.0, abs(loss))
                if s in self.reference and abs(loss - self.reference[s]) > tolerance:
                    self._finding(
                        f"loss at {s}: {loss} vs uninterrupted {self.reference[s]} ({off} steps off DP {REFERENCE_DP})"
                    )
        if killed and res.ok:
            self._finding("a rank was killed writing the last save, and the run exited 0")
        for s in spec.save_at:
            if res.ok and s in res.steps:  # saved by this run
                files = _rank_files(root / f"global_step{s}")
                if len(files) != dp:
                    self._finding(f"global_step{s} saved at DP {dp} holds {len(files)} rank files")
        for entry in _fallback_lines(root)[before:]:
            if entry.get("repeat", 1) > 1 and "REPEATED FALLBACK" not in res.log:
                self._finding(f"a repeated fallback ({entry['latest']} -> {entry['loaded']}) said nothing")
        if fallback_announcements(res.log):
            said += " (fell back)"
            self.counts["fell back"] += 1
        return said

    def _hold_to_the_prediction(self, answer, res) -> None:
        """The restart against what ``status --check`` said before it: it loads one of the tags said, in their order
        (each one before it refused for its own files, its verdict recorded), one found sound when the last said
        was; when none was said, it resumes from none; a restart that resumes from none says why (no crash)."""
        if answer is None:
            return
        loaded = None if res.loaded_step is None else f"global_step{res.loaded_step}"
        if loaded is None and "no tag passes" not in res.log:
            self._finding(f"a restart resumed from no tag without the fallback's error: {res.log[-400:]}")
        if not answer.tries:
            if loaded is not None:
                self._finding(f"status said no tag resumes ({answer.said[:300]}); the restart loaded {loaded}")
            return
        if loaded is None:
            if answer.certain:
                self._finding(f"status said {answer.said[:300]}; the restart resumed from no tag")
            return
        if loaded not in answer.tries:
            self._finding(f"status said {answer.said[:300]}; the restart loaded {loaded}")
            return
        from megatron_ucp.background.verdicts import read_verdict

        # saved again by this run (every save but a killed run's last one commits): its verdict went with the old save
        saved = {f"global_step{s}" for s in res.steps if res.ok or s != res.steps[-1]}
        for passed in answer.tries[: answer.tries.index(loaded)]:
            if passed in saved:
                continue
            verdict = read_verdict(self.root, passed)
            if verdict is None or verdict.sound:
                self._finding(f"the restart passed over {passed} (said first) with no verdict against it")
        self.counts["prediction held"] += 1


def _pointer_problems(root: Path) -> list[str]:
    """What ``latest`` and ``latest_universal`` name that is not whole: only a save that committed may be named."""
    from megatron_ucp.convert.universal import universal_state

    problems = []
    latest, pointer = root / "latest", root / "latest_universal"
    try:
        name = latest.read_text().strip() if latest.is_file() else None
    except UnicodeDecodeError:
        name = None
    if name and name.isprintable() and (root / name).is_dir():
        tag = root / name
        files = _rank_files(tag)
        dp = {int(f.name.split("_rank_")[1].split("_")[0]) for f in files}
        written = [f.name for f in tag.iterdir() if f.name.endswith(".ucp-writing")]
        if written:
            problems.append(f"latest names {tag.name}, which holds half-written files {written}")
        elif files and (dp != set(range(len(files))) or not (tag / "mp_rank_00_model_states.pt").is_file()):
            pass  # damaged by an action of the sequence (a deleted rank file): the restart's judge is held to it
    if pointer.is_file() and universal_state(root / pointer.read_text().strip()) != "complete":
        problems.append(f"latest_universal names {pointer.read_text().strip()}, which is not a complete folder")
    return problems


def _fallback_lines(root: Path) -> list[dict]:
    path = root / ".ucp" / "fallbacks.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def explore(seeds: list[int], steps: int, work: Path, ops: Optional[list[str]] = None) -> Explorer:
    ref = run_training(TrainSpec(dp=REFERENCE_DP, steps=REFERENCE_STEPS, timeout=900))
    explorer = Explorer(work, dict(zip(ref.steps, ref.losses, strict=True)))
    explorer.sequences = {}
    for seed in seeds:
        print(f"seed {seed}:", flush=True)
        explorer.sequences[seed] = explorer.run(seed, steps, ops)
        shutil.rmtree(work / f"seed{seed}", ignore_errors=True)
    return explorer


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args()
    started = time.monotonic()
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    with tempfile.TemporaryDirectory(prefix="sequence-explore-") as tmp:
        explorer = explore(seeds, args.steps, Path(tmp))
    out = args.out / f"sequence-explore-{time.strftime('%Y-%m-%d')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "seeds": seeds,
        "steps": args.steps,
        "seconds": round(time.monotonic() - started),
        "findings": explorer.findings,
        "counts": dict(sorted(explorer.counts.items())),
        "sequences": explorer.sequences,
    }
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"counts: {json.dumps(report['counts'])}")
    print(
        f"{len(seeds)} sequences of {args.steps} steps in {report['seconds']} s: "
        f"{len(explorer.findings)} finding(s); {out}"
    )
    return 1 if explorer.findings else 0


if __name__ == "__main__":
    sys.exit(main())

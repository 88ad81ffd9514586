"""Random sequences of what a requeued job meets, over real DeepSpeed runs, each step checked against the promises.

The suite's sequence tests (tests/system/test_fallback.py, the real fork's in tests/integration) run one scripted
path each; this explores more: per seed, a random sequence of steps over one checkpoint root, with the test
harness's tiny model (real DeepSpeed, CPU, gloo, the hooks installed):

* ``train``: a restart (auto route, fallback on) at a random DP size, training two more iterations and saving
  each second one into the same root (a fresh start when the root is empty), its saves synchronous or asynchronous
  and converted in the background or not, at random; the last iteration is saved twice, as Megatron does when it
  falls on a save interval;
* ``kill``: the same with asynchronous saves, one rank killed while it writes the last save;
* ``damage``: one file of the newest tag cut short, one bit flipped in a rank file, or a NaN written into one
  rank file's ``exp_avg_sq``;
* ``verify``: ``megatron-ucp verify ROOT --tag`` of the newest tag (its verdict recorded);
* ``convert``: ``megatron-ucp convert ROOT`` (the tag in ``latest``).

After every step, ``latest`` must name a folder holding one whole save (its rank files, none half-written) and
``latest_universal`` a complete universal folder, and ``megatron-ucp status ROOT --check`` is asked what a restart
would load; the next restart is held to it: a tag said to be found sound loads as said; a fallback said loads that
tag or an older one; "not read yet" loads it or falls back, saying so. After every restart: the losses follow an
uninterrupted run at DP 4 (bf16 reduction noise, 1e-3), a tag saved holds that save's rank files alone, a fallback
that repeats an earlier one (the same tag, unchanged, to the same tag) says so, and a run with a rank killed fails.
Each broken promise is a finding; the findings and the steps that led to them are printed and written to
``benchmarks/results/sequence-explore-<date>.json``.

    python benchmarks/sequence_explore.py --seeds 3 --steps 10
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_ucp.cli import main as cli  # noqa: E402
from tests.support.dsharness import TrainSpec, run_training  # noqa: E402
from tests.support.elastic_support import (  # noqa: E402
    LOSS_TOLERANCE,
    fallback_announcements,
    flip_a_bit_in_the_largest_record,
)

DP_SIZES = (2, 3, 4)
REFERENCE_STEPS = 40


def _check(root: Path) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = cli(["status", str(root), "--check", "--no-sizes"])
    said = [line for line in err.getvalue().splitlines() if line.startswith("megatron-ucp status --check: ")]
    return code, said[-1].removeprefix("megatron-ucp status --check: ") if said else ""


def _quiet(*argv: str) -> int:
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        return cli([*argv, "--no-progress"])


def _tags(root: Path) -> list[int]:
    steps = []
    for p in root.glob("global_step*"):
        if p.is_dir() and not p.name.endswith("_universal") and p.name[len("global_step") :].isdigit():
            steps.append(int(p.name[len("global_step") :]))
    return sorted(steps)


def _damage(root: Path, rng: random.Random) -> str:
    import torch

    newest = root / f"global_step{_tags(root)[-1]}"
    victim = rng.choice(sorted(newest.glob("*optim_states.pt")))
    kind = rng.choice(["cut-short", "flipped-bit", "nan"])
    try:
        if kind == "flipped-bit":
            flip_a_bit_in_the_largest_record(victim)
        elif kind == "nan":
            states = torch.load(victim, weights_only=False)
            states["optimizer_state_dict"]["base_optimizer_state"]["state"][0]["exp_avg_sq"][0] = float("nan")
            torch.save(states, victim)
    except Exception:  # not a whole file any more (cut short before, or left half-written by a killed save)
        kind = "cut-short"
    if kind == "cut-short":
        victim.write_bytes(victim.read_bytes()[: victim.stat().st_size * 2 // 3])
    return f"damage {kind} {victim.relative_to(root)}"


class Explorer:
    def __init__(self, work: Path, reference: dict[int, float]) -> None:
        self.work, self.reference = work, reference
        self.findings: list[dict] = []
        self.refused = False
        """The last training found tags and resumed from none of them (a restart as it is fails again)."""

    def run(self, seed: int, steps: int) -> list[str]:
        rng = random.Random(seed)
        root = self.work / f"seed{seed}" / "ckpt"
        root.parent.mkdir(parents=True)
        done: list[str] = []
        answer = _check(root) if root.exists() else (1, "")
        for i in range(steps):
            ops = ["train"] if not _tags(root) else ["train", "train", "kill", "damage", "verify", "convert"]
            op = rng.choice(ops)
            if op in ("train", "kill"):
                said = self._train(root, rng, answer, i, seed, killed=op == "kill")
            elif op == "damage":
                said = _damage(root, rng)
            elif op == "verify":
                said = f"verify -> exit {_quiet('verify', str(root), '--tag', f'global_step{_tags(root)[-1]}')}"
            else:
                said = f"convert -> exit {_quiet('convert', str(root))}"
            for problem in _pointer_problems(root):
                self._finding(seed, i, f"after {said}: {problem}")
            answer = _check(root)
            if op == "train" and self.refused and answer[0] == 0:  # nothing changed since that restart
                self._finding(seed, i, f"a restart resumed from no tag; status then said {answer[1]}")
            done.append(f"{said}; status --check: exit {answer[0]}: {answer[1]}")
            print(f"  seed {seed} step {i}: {done[-1]}", flush=True)
        return done

    def _finding(self, seed: int, step: int, what: str) -> None:
        self.findings.append({"seed": seed, "step": step, "finding": what})
        print(f"  FINDING (seed {seed}, step {step}): {what}", flush=True)

    def _train(
        self, root: Path, rng: random.Random, answer: tuple[int, str], step: int, seed: int, killed: bool = False
    ) -> str:
        dp = rng.choice(DP_SIZES)
        tags = _tags(root)
        start = tags[-1] if tags else 0
        target = min(start + 2, REFERENCE_STEPS)
        before = len(_fallback_lines(root))
        options = {"async_save": killed or rng.random() < 0.5, "async_convert": rng.random() < 0.5}
        spec = TrainSpec(
            dp=dp,
            steps=target,
            save_dir=root,
            # every even step it trains (a damaged tag included), the last one twice (as Megatron's last iteration)
            save_at=(*range(2, target + 1, 2), target) if target % 2 == 0 else tuple(range(2, target + 1, 2)),
            load_dir=root if tags else None,
            plugin=True,
            plugin_kwargs=options,
            expect_failure=True,
            timeout=600,
            env={"MEGATRON_UCP_TEST_DIE": f"async write global_step{target}:{dp - 1}"} if killed else {},
        )
        res = run_training(spec)
        loaded = res.loaded_step or 0
        how = "+".join(k for k, on in options.items() if on) or "sync"
        said = (
            f"{'kill' if killed else 'train'} at DP {dp} to {target} ({how}): exit {res.returncode}, loaded {loaded}, "
        )
        said += f"trained {res.steps}"
        self.refused = bool(tags) and not res.ok and not res.steps and res.loaded_step is None
        code, text = answer
        if tags:
            if code == 1 and res.ok:
                self._finding(seed, step, f"status said no restart resumes ({text}); it loaded step {loaded}")
            if "(found sound)" in text and text.startswith("a restart resumes from"):
                want = int(text.split("global_step")[1].split(" ")[0])
                if loaded != want:
                    self._finding(seed, step, f"status said {text}; the restart loaded step {loaded}")
            if text.startswith("a restart falls back to"):
                want = int(text.split("global_step")[1].split(" ")[0])
                if loaded > want:
                    self._finding(seed, step, f"status said {text}; the restart loaded step {loaded}")
        for s, loss in zip(res.steps, res.losses, strict=True):
            if s in self.reference and abs(loss - self.reference[s]) > LOSS_TOLERANCE * max(1.0, abs(loss)):
                self._finding(seed, step, f"loss at {s}: {loss} vs uninterrupted {self.reference[s]}")
        if killed and res.ok:
            self._finding(seed, step, "a rank was killed writing the last save, and the run exited 0")
        for s in spec.save_at:
            if res.ok and s in res.steps:  # saved by this run
                files = sorted((root / f"global_step{s}").glob("*optim_states.pt"))
                if len(files) != dp:
                    self._finding(seed, step, f"global_step{s} saved at DP {dp} holds {len(files)} rank files")
        after = _fallback_lines(root)[before:]
        for entry in after:
            if entry.get("repeat", 1) > 1 and "REPEATED FALLBACK" not in res.log:
                self._finding(seed, step, f"a repeated fallback ({entry['latest']} -> {entry['loaded']}) said nothing")
        if fallback_announcements(res.log):
            said += " (fell back)"
        return said


def _pointer_problems(root: Path) -> list[str]:
    """What ``latest`` and ``latest_universal`` name that is not whole."""
    from megatron_ucp.convert.universal import universal_state

    problems = []
    latest, pointer = root / "latest", root / "latest_universal"
    if latest.is_file():
        tag = root / latest.read_text().strip()
        files = sorted(tag.glob("*optim_states.pt")) if tag.is_dir() else []
        dp = {int(f.name.split("_rank_")[1].split("_")[0]) for f in files}
        if not files or dp != set(range(len(files))) or not (tag / "mp_rank_00_model_states.pt").is_file():
            problems.append(f"latest names {tag.name}, which holds {[f.name for f in files]}")
        if tag.is_dir() and [f.name for f in tag.iterdir() if f.name.endswith(".ucp-writing")]:
            problems.append(f"latest names {tag.name}, which holds half-written files")
    if pointer.is_file() and universal_state(root / pointer.read_text().strip()) != "complete":
        problems.append(f"latest_universal names {pointer.read_text().strip()}, which is not a complete folder")
    return problems


def _fallback_lines(root: Path) -> list[dict]:
    path = root / ".ucp" / "fallbacks.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="sequence-explore-") as tmp:
        work = Path(tmp)
        ref = run_training(TrainSpec(dp=4, steps=REFERENCE_STEPS, timeout=900))
        explorer = Explorer(work, dict(zip(ref.steps, ref.losses, strict=True)))
        sequences = {}
        for seed in range(args.seeds):
            print(f"seed {seed}:", flush=True)
            sequences[seed] = explorer.run(seed, args.steps)
            shutil.rmtree(work / f"seed{seed}", ignore_errors=True)
    out = args.out / f"sequence-explore-{time.strftime('%Y-%m-%d')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"seeds": args.seeds, "steps": args.steps, "findings": explorer.findings, "sequences": sequences}
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(
        f"{args.seeds} sequences of {args.steps} steps in {time.monotonic() - started:.0f} s: "
        f"{len(explorer.findings)} finding(s); {out}"
    )
    return 1 if explorer.findings else 0


if __name__ == "__main__":
    sys.exit(main())

"""Session-cached real DeepSpeed checkpoints, the committed legacy fixtures, and the geometry of
the tiny model (what the tests expect DeepSpeed to have written).

``tests/conftest.py`` exposes :class:`CheckpointCache` as the session fixture ``ds_checkpoint``.
Cached checkpoints are shared by every test in the session: treat them as read-only and
:meth:`DsCheckpoint.copy_to` a private copy before writing anything next to them (a converter's
default output, ``latest_universal``, ...).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from .launch import REPO_ROOT, run_training
from .spec import TrainResult, TrainSpec

LEGACY_DIR = REPO_ROOT / "tests" / "fixtures" / "legacy"
LEGACY_162 = LEGACY_DIR / "ds0.16.2"
LEGACY_CLASSES = {"bf16_optimizer": "BF16_Optimizer", "zero_optimizer": "DeepSpeedZeroOptimizer"}
OPTIMIZER_CLASSES = {"bf16": "BF16_Optimizer", "zero": "DeepSpeedZeroOptimizer"}


def rank_file(tag_dir: Path, rank: int) -> Path:
    """DeepSpeed's name for a bf16 ZeRO rank file (TP=PP=1), both optimizer classes."""
    return Path(tag_dir) / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def model_states_file(tag_dir: Path) -> Path:
    return Path(tag_dir) / "mp_rank_00_model_states.pt"


def copy_tree(src: Path, dest: Path) -> Path:
    """Copy a checkpoint root (or any folder) to ``dest`` (must not exist); returns ``dest``."""
    shutil.copytree(src, dest)
    return Path(dest)


@dataclass(frozen=True)
class Geometry:
    """Default ZeRO-1/2 geometry of one param group (docs/how-it-works.md): the test's oracle."""

    numel: int
    dp: int

    @property
    def alignment(self) -> int:
        return 2 * self.dp

    @property
    def padded(self) -> int:
        return -(-self.numel // self.alignment) * self.alignment

    @property
    def partition(self) -> int:
        return self.padded // self.dp

    def true_length(self, rank: int) -> int:
        return max(0, min(self.partition, self.numel - rank * self.partition))

    @property
    def all_padding_ranks(self) -> list[int]:
        return [r for r in range(self.dp) if self.true_length(r) == 0]


def group_numels(hidden: int = 3, num_layers: int = 1, vocab: int = 64) -> list[int]:
    """Element counts of the two param groups of the tiny model (weight decay, no weight decay)."""
    from .model import build_model, tiny_model_param_groups

    model = build_model(vocab=vocab, hidden=hidden, num_layers=num_layers)
    return [sum(p.numel() for p in g["params"]) for g in tiny_model_param_groups(model)]


@dataclass(frozen=True)
class DsCheckpoint:
    """A finished harness run that saved checkpoints (read-only: shared by the session)."""

    root: Path
    """Checkpoint root: ``latest`` and one ``global_step{N}/`` per ``spec.save_at``."""
    spec: TrainSpec
    result: TrainResult
    dump_dir: Path

    @property
    def tags(self) -> list[str]:
        return [f"global_step{s}" for s in self.spec.save_at]

    def tag_dir(self, step: Optional[int] = None) -> Path:
        """``root/global_step{step}``; default: the last saved step."""
        return self.root / f"global_step{step if step is not None else self.spec.save_at[-1]}"

    def dump(self, name: str) -> Path:
        """A dump file by stem, e.g. ``"state_step2"`` or ``"rank3_step4"``."""
        path = self.dump_dir / f"{name}.pt"
        if not path.is_file():
            raise FileNotFoundError(f"no dump {name!r} in {self.dump_dir}: {sorted(self.result.dumps)}")
        return path

    def loss_at(self, step: int) -> float:
        return self.result.loss_at(step)

    def copy_to(self, dest: Path) -> Path:
        """A private copy of the checkpoint root at ``dest`` (must not exist); returns it."""
        return copy_tree(self.root, Path(dest))


class CheckpointCache:
    """Builds each distinct checkpoint once per session.

    ``cache(optimizer="bf16", dp=4, **spec_fields)`` trains with ``steps=4, save_at=(2, 4)`` unless
    overridden, saves under its own folder and dumps full states (``dump_dir``). Any other
    :class:`TrainSpec` field may be overridden (``zero_stage``, ``uc_info``, ``plugin``,
    ``plugin_kwargs``, ``global_batch``, ``hidden``, ...), except ``save_dir``/``dump_dir``.
    """

    def __init__(self, base: Path) -> None:
        self.base = Path(base)
        self._done: dict[str, DsCheckpoint] = {}
        self._lock = threading.Lock()

    def __call__(self, optimizer: str = "bf16", dp: int = 4, **fields: Any) -> DsCheckpoint:
        for reserved in ("save_dir", "dump_dir"):
            if reserved in fields:
                raise ValueError(f"{reserved} is chosen by the cache; copy_to() the result instead")
        fields.setdefault("steps", 4)
        fields.setdefault("save_at", (2, 4))
        # Validates and normalises the request; the placeholder paths keep the key path-free.
        probe = TrainSpec(dp=dp, optimizer=optimizer, save_dir=Path("."), dump_dir=Path("."), **fields)
        key = probe.to_json()
        with self._lock:
            if key in self._done:
                return self._done[key]
            digest = hashlib.sha1(key.encode()).hexdigest()[:8]
            folder = self.base / f"{optimizer}-dp{dp}-{digest}"
            if folder.exists():  # an earlier attempt at the same run failed part-way
                shutil.rmtree(folder)
            spec = TrainSpec(dp=dp, optimizer=optimizer, save_dir=folder / "ckpt", dump_dir=folder / "dumps", **fields)
            folder.mkdir(parents=True)
            (folder / "spec.json").write_text(key)
            result = run_training(spec)
            ck = DsCheckpoint(root=spec.save_dir, spec=spec, result=result, dump_dir=spec.dump_dir)
            self._done[key] = ck
            return ck


@dataclass(frozen=True)
class LegacyFixture:
    """A committed DeepSpeed 0.16.2 checkpoint (read-only; ``copy_to`` before converting)."""

    name: str
    """``"bf16_optimizer"`` or ``"zero_optimizer"``."""
    root: Path

    @property
    def tag_dir(self) -> Path:
        return self.root / (self.root / "latest").read_text().strip()

    @property
    def reference(self) -> Path:
        """``state_step2.pt``: full fp32 + optimizer states per parameter at save time."""
        return self.root / "reference" / "state_step2.pt"

    def rank_reference(self, rank: int) -> Path:
        return self.root / "reference" / f"rank{rank}_step2.pt"

    @property
    def facts(self) -> dict:
        return json.loads((LEGACY_162 / "facts.json").read_text())["classes"][self.name]

    def copy_to(self, dest: Path) -> Path:
        return copy_tree(self.root, Path(dest))


def legacy_fixture(name: str) -> LegacyFixture:
    if name not in LEGACY_CLASSES:
        raise ValueError(f"unknown legacy fixture {name!r}; one of {sorted(LEGACY_CLASSES)}")
    return LegacyFixture(name=name, root=LEGACY_162 / name)


_SESSION: Optional[CheckpointCache] = None


def session_cache() -> CheckpointCache:
    """The one cache of this test session, shared by the ``ds_checkpoint`` fixture and plain helpers."""
    global _SESSION
    if _SESSION is None:
        import atexit
        import tempfile

        base = Path(tempfile.mkdtemp(prefix="ucp-ds-checkpoints-"))
        atexit.register(shutil.rmtree, base, True)
        _SESSION = CheckpointCache(base)
    return _SESSION

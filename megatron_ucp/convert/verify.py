"""Verify a universal checkpoint folder: complete and well-shaped, and (given the source) bit-exact.

Completeness needs only the folder: the copied model-states file says which parameters and
shapes to expect, every parameter of a group must hold the same state files, steps must agree,
and every state file must still have the checksum the converter recorded in the manifest (bit
rot, a modified or replaced file; :mod:`megatron_ucp.format.integrity`).
With the source tag folder the conversion plan is rebuilt from the source's metadata and every
state tensor is compared with the concatenation of its fragments, element for element and dtype.
Problems are collected and reported together, each naming the parameter and file.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from tqdm import tqdm

from megatron_ucp.convert.execute import plan_checkpoint
from megatron_ucp.convert.universal import list_zero_folder, read_manifest
from megatron_ucp.convert.writer import RankFileCache, assemble_torch
from megatron_ucp.deepspeed.reader import (
    load_torch_file,
    rank_file_count_problem,
    read_checkpoint,
    read_model_states,
    resolve_checkpoint,
)
from megatron_ucp.errors import CheckpointFormatError
from megatron_ucp.format import dsformat as F
from megatron_ucp.format.integrity import recorded_checksums
from megatron_ucp.format.torchload import crc_problems, structure_problems
from megatron_ucp.plan.accounting import checksum
from megatron_ucp.plan.conversion import ParamPlan, ParamSpec

log = logging.getLogger(__name__)


def assemble_state(p: ParamPlan, state: str, cache: RankFileCache) -> torch.Tensor:
    """One state of one parameter, in its output shape, from its source fragments (a torch copy)."""
    return assemble_torch(p, state, cache)[0]


def _compare(path: Path, what: str, want: torch.Tensor, got: Any) -> Optional[str]:
    """A problem line when ``got`` is not ``want`` bit for bit (dtype and shape included)."""
    if not torch.is_tensor(got):
        return f"{path}: {what} missing"
    if tuple(got.shape) != tuple(want.shape):
        return f"{path}: {what} has shape {tuple(got.shape)}, the source {tuple(want.shape)}"
    if want.dtype != got.dtype:
        return f"{path}: {what} dtype {got.dtype}, source {want.dtype}"
    if not torch.equal(want, got):
        diff = (want != got).sum().item()
        return f"{path}: {diff} of {got.numel()} elements of {what} differ from the source"
    return None


@dataclass
class VerifyReport:
    folder: Path
    params: int = 0
    state_files: int = 0
    elements: int = 0
    compared_with: Optional[Path] = None
    problems: list[str] = field(default_factory=list)
    manifest: Optional[dict] = None
    checksummed: int = 0
    """State files whose checksum matched the manifest's."""
    step_files: int = 0
    """State files holding a step counter (checked by value, against each other and the source's ranks)."""

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self, listed: bool = False) -> str:
        """One line; ``listed``: the problems were printed above it (not repeated)."""
        if not self.ok:
            first = "listed above" if listed else f"first: {self.problems[0]}"
            return f"FAILED: {self.folder}: {len(self.problems)} problem(s); {first}"
        what = f"bit-exact against {self.compared_with}" if self.compared_with else "complete (shapes and files)"
        tensors = self.state_files - self.step_files
        counts = f"{tensors} tensors"
        if self.checksummed and self.checksummed == tensors:
            counts += ", each matching the manifest's checksum"
        elif self.checksummed:
            counts += f", {self.checksummed} of them matching the manifest's checksums (frozen parameters have none)"
        counts += f"; {self.step_files} step counters, checked by value"
        return (
            f"OK: {self.folder} is {what}: {self.params} params, {self.state_files} state files ({counts}), "
            f"{self.elements} elements"
        )


def native_tag_problems(tag_dir: Path, dp: Optional[int]) -> tuple[int, list[str]]:
    """A native tag read through, file by file: every ``.pt`` file's zip structure as ``torch.load`` judges it
    and every record's bytes against its CRC-32 (truncated, overwritten or half-copied files), and the number
    of optimizer files against the DP size the save recorded. Returns (files read, problems naming the file)."""
    problems: list[str] = []
    files = sorted(p for p in Path(tag_dir).iterdir() if p.suffix == ".pt" and p.is_file())
    for path in files:
        found = structure_problems(path)
        problems += [f"{path}: {problem}" for problem in found or crc_problems(path)]
    if dp is not None:
        count = rank_file_count_problem(Path(tag_dir), dp)
        if count is not None:
            problems.append(count)
    return len(files), problems


def twin_of(path: os.PathLike | str, tag: Optional[str] = None) -> tuple[Path, Optional[Path]]:
    """``(native tag folder, its universal twin or None)`` for what a user names: a checkpoint root (its tag
    ``tag``, or the one in ``latest``) or a native tag folder."""
    ck = resolve_checkpoint(Path(path), tag)
    twin = ck.tag_dir.parent / F.universal_tag(ck.tag)
    return ck.tag_dir, twin if twin.is_dir() else None


def _expected_shape(name: str, shape: tuple, uc_info: Optional[dict], entry: dict) -> tuple:
    if entry.get(F.VOCAB_TENSOR) and uc_info and uc_info.get(F.ORIGINAL_VOCAB_SIZE) is not None:
        return (int(uc_info[F.ORIGINAL_VOCAB_SIZE]), *shape[1:])
    return shape


def _check_sum(path: Path, record: Any, tensor: torch.Tensor, rows: Any, algorithm: str) -> Optional[str]:
    """A problem line when the file's tensors are not what the converter wrote."""
    if not isinstance(record, dict):
        return f"{path}: no checksum in the manifest (a file added after the conversion?)"
    if int(record.get("numel", -1)) != tensor.numel():
        return f"{path}: {tensor.numel()} elements, the manifest recorded {record.get('numel')} (truncated or replaced)"
    if checksum(tensor, 0, algorithm) != int(record.get("sum", -1)):
        return f"{path}: checksum differs from the manifest's: the data changed after the conversion (bit rot?)"
    if "rows_sum" in record and (
        not torch.is_tensor(rows)
        or rows.numel() != int(record.get("rows_numel", -1))
        or checksum(rows, tensor.numel(), algorithm) != int(record["rows_sum"])
    ):
        return f"{path}: '{F.VOCAB_PADDED_ROWS}' differs from the manifest's checksum"
    return None


def verify_universal(
    folder: os.PathLike | str, source: Optional[os.PathLike | str] = None, progress: bool = False
) -> VerifyReport:
    folder = Path(folder)
    report = VerifyReport(folder=folder)
    zero = folder / F.UNIVERSAL_ZERO_DIR
    model_file = folder / F.MODEL_STATES_FILE
    if not model_file.is_file():  # converted from ZeRO-3: every rank's model states, DP rank 0's first
        model_file = folder / F.zero3_model_file(0, 0)
    if not zero.is_dir() or not model_file.is_file():
        raise CheckpointFormatError(
            f"{folder}: not a universal checkpoint (needs {F.MODEL_STATES_FILE} or "
            f"{F.zero3_model_file(0, 0)}, and {F.UNIVERSAL_ZERO_DIR}/)",
            subject=folder,
        )
    if not (zero / F.UNIVERSAL_OPTIMIZER_STATE_FILE).is_file():
        report.problems.append(f"{zero / F.UNIVERSAL_OPTIMIZER_STATE_FILE}: missing")
    report.manifest = read_manifest(folder)
    sums = recorded_checksums(report.manifest)
    model = read_model_states(model_file, shapes_optional=_lists_experts(report.manifest))
    uc_info = model.universal_checkpoint_info
    expected_states = None
    if report.manifest is not None:
        expected_states = {
            int(g["index"]): set(g["states"]) | ({F.STEP_STATE} if g.get("step") else set())
            for g in report.manifest.get("groups", [])
        }
    param_groups = _whole_parameters(report.manifest) or model.param_groups
    listed = {p.name for group in param_groups for p in group}
    frozen = set((report.manifest or {}).get("frozen_params", []))
    present = set(list_zero_folder(zero))
    for name in sorted(present - listed - frozen):
        report.problems.append(f"{zero / name}: folder for a parameter the model states do not list")

    plan = cache = None
    if source is not None:
        ck = resolve_checkpoint(source)
        meta = read_checkpoint(ck.tag_dir)
        plan = plan_checkpoint(meta)
        cache = RankFileCache(list(meta.files.rank_files))
        report.compared_with = ck.tag_dir
        steps = meta.steps  # steps[rank][group]: every rank's, not only rank 0's

    for group in param_groups:
        group_files: Optional[set] = None
        group_step = None
        for spec in tqdm(group, desc="verify", disable=not progress, leave=False):
            pdir = zero / spec.name
            if spec.name not in present:
                report.problems.append(f"{pdir}: missing (parameter {spec.name!r} has no folder)")
                continue
            files = {f[:-3] for f in os.listdir(pdir) if f.endswith(".pt")}
            report.params += 1
            if F.FP32_STATE not in files:
                report.problems.append(f"{pdir}: no fp32.pt")
            want = expected_states.get(spec.group) if expected_states else group_files
            if want is not None and files != want:
                report.problems.append(f"{pdir}: state files {sorted(files)}, expected {sorted(want)}")
            group_files = group_files if group_files is not None else files
            for state in sorted(files):
                path = pdir / f"{state}.pt"
                try:
                    entry = load_torch_file(path)
                except CheckpointFormatError as exc:
                    report.problems.append(str(exc))
                    continue
                report.state_files += 1
                if state == F.STEP_STATE:
                    report.step_files += 1
                    value = float(entry)
                    if group_step is None:
                        group_step = value
                    elif value != group_step:
                        report.problems.append(f"{path}: step {value} differs from {group_step} in the same group")
                    if plan is not None:
                        differing = [
                            r
                            for r, rank_steps in enumerate(steps)
                            if rank_steps[spec.group] is not None and rank_steps[spec.group] != value
                        ]
                        if differing:
                            r = differing[0]
                            report.problems.append(
                                f"{path}: step {value}, source rank {r} "
                                f"({meta.files.rank_files[r].name}) has {steps[r][spec.group]}"
                                + (f" (and {len(differing) - 1} more rank(s))" if len(differing) > 1 else "")
                            )
                    continue
                tensor = entry.get(F.PARAM) if isinstance(entry, dict) else None
                if not torch.is_tensor(tensor):
                    report.problems.append(f"{path}: no '{F.PARAM}' tensor")
                    continue
                shape = _expected_shape(spec.name, spec.shape, uc_info, entry)
                if tuple(tensor.shape) != tuple(shape):
                    report.problems.append(f"{path}: shape {tuple(tensor.shape)}, expected {tuple(shape)}")
                    continue
                report.elements += tensor.numel()
                if sums is not None and spec.name not in frozen:
                    problem = _check_sum(
                        path,
                        sums.files.get(f"{spec.name}/{state}"),
                        tensor,
                        entry.get(F.VOCAB_PADDED_ROWS),
                        sums.algorithm,
                    )
                    if problem:
                        report.problems.append(problem)
                    else:
                        report.checksummed += 1
                if plan is not None and spec.name not in frozen:
                    p = plan.param(spec.name)
                    if state not in plan.groups[p.group].states:
                        report.problems.append(f"{path}: state {state!r} is not in the source")
                        continue
                    want_tensor, want_rows = assemble_torch(p, state, cache)
                    for problem in (
                        _compare(path, f"'{F.PARAM}'", want_tensor, tensor),
                        None
                        if want_rows is None
                        else _compare(
                            path,
                            f"'{F.VOCAB_PADDED_ROWS}' (the padded vocabulary rows)",
                            want_rows,
                            entry.get(F.VOCAB_PADDED_ROWS),
                        ),
                    ):
                        if problem:
                            report.problems.append(problem)
                elif F.VOCAB_PADDED_ROWS in entry:
                    rows = entry[F.VOCAB_PADDED_ROWS]
                    want_shape = (spec.shape[0] - tensor.shape[0], *spec.shape[1:]) if spec.shape else ()
                    if not torch.is_tensor(rows) or tuple(rows.shape) != tuple(want_shape):
                        report.problems.append(
                            f"{path}: '{F.VOCAB_PADDED_ROWS}' of shape "
                            f"{tuple(rows.shape) if torch.is_tensor(rows) else type(rows).__name__},"
                            f" expected {tuple(want_shape)}"
                        )
    for key in sorted(sums.files if sums is not None else ()):
        if not (zero / f"{key}.pt").is_file():
            report.problems.append(f"{zero / (key + '.pt')}: missing (the manifest recorded its checksum)")
    if plan is not None:
        for g in plan.groups:
            for p_name in g.param_names:
                for state in g.states:
                    if not (zero / p_name / f"{state}.pt").is_file():
                        report.problems.append(
                            f"{zero / p_name / (state + '.pt')}: missing (source has state {state!r})"
                        )
    log.debug(report.summary())
    return report


def _lists_experts(manifest: Optional[dict]) -> bool:
    """A mixture-of-experts folder: its experts under global names, listed by the manifest only."""
    return "experts" in ((manifest or {}).get("parallel") or {})


def _whole_parameters(manifest: Optional[dict]) -> Optional[list[list[ParamSpec]]]:
    """A TP/PP folder's whole parameters, from its manifest: its model-states files list one
    coordinate's TP slices (and one pipeline stage's parameters) each; a mixture-of-experts folder's, whose
    model states list one expert-parallel rank's experts under local names (or nothing, before DeepSpeed
    0.19). None for a DP-only dense folder."""
    parallel = (manifest or {}).get("parallel") or {}
    if int(parallel.get("tp", 1)) * int(parallel.get("pp", 1)) == 1 and not _lists_experts(manifest):
        return None
    groups: dict[int, list[ParamSpec]] = {}
    for name, info in manifest["params"].items():
        groups.setdefault(int(info["group"]), []).append(
            ParamSpec(name, int(info["group"]), tuple(info["source_shape"]))
        )
    return [groups[g] for g in sorted(groups)]

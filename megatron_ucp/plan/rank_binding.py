"""Which saved files belong together: each old rank file bound to its DP position and to its save (pure).

DeepSpeed loads a folder of individually sound files that do not belong together without a word:
two rank files swapped, one copied over another, a rank file or the model states of another run or
of another step. Every element then lands "exactly once", in the wrong place or from the wrong
save. Three signals bind the files, checked before any rank copies anything (the first two) or as
the masters are read (the third):

* what each file says it holds (:func:`file_problems`): ``param_slice_mappings`` (every fragment's
  start and length inside its partition) against the fragments the geometry puts at the file's
  position (:func:`expected_fragments`); ``partition_count``; the partitions' sizes and dtypes;
  and, saved through the hooks, its save record (the save's identity, its DP rank and size) and
  its recorded true lengths;
* what the files say together (:func:`cross_check`): one save identity (the model states' one) and
  one optimizer step per param group. The file that differs from the others is named, not its
  neighbour; where two files disagree with nothing to break the tie, both are;
* after the fp32 masters are read: each saved bf16 weight is one of the two bf16 values around its
  master (:func:`outside_bracket`), whatever rounding made it (DeepSpeed copies the masters into the
  weights, rounding to nearest, at the end of every step; fused optimizers may truncate or round
  stochastically). :func:`blame_weights` names the files whose ranges fail, or the model states
  when every file's do.

Everything here is pure: the hooks read the files, run these checks and share the verdict.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

from megatron_ucp.format import dsformat as F
from megatron_ucp.format.blockwise8bit import Blockwise8bit
from megatron_ucp.format.rawtensor import RawTensor
from megatron_ucp.plan.geometry import GroupGeometry

Fragments = tuple[tuple[str, int, int], ...]
"""A rank's fragments of one param group: (parameter name, start in the partition, elements), in order."""


def expected_fragments(shapes: Sequence[tuple[str, tuple[int, ...]]], geo: GroupGeometry, rank: int) -> Fragments:
    """The fragments ZeRO-1/2 puts in ``rank``'s partition of a group whose parameters lie in ``shapes``'
    order without padding between them (what ``param_slice_mappings`` records at that position)."""
    size = geo.partition_size
    lo, hi = rank * size, rank * size + geo.true_length(rank)
    out, offset = [], 0
    for name, shape in shapes:
        n = math.prod(shape)
        start, stop = max(lo, offset), min(hi, offset + n)
        if start < stop:
            out.append((name, start - lo, stop - start))
        offset += n
    return tuple(out)


def recorded_fragments(mappings: Any) -> Optional[Fragments]:
    """A file's ``param_slice_mappings`` of one group as :data:`Fragments` (sorted by start); None when
    it is not a mapping of names to (start, numel) addresses."""
    if not isinstance(mappings, Mapping):
        return None
    out = []
    for name, address in mappings.items():
        start, numel = getattr(address, "start", None), getattr(address, "numel", None)
        if not isinstance(start, int) or not isinstance(numel, int):
            return None
        out.append((str(name), start, numel))
    return tuple(sorted(out, key=lambda f: (f[1], f[0])))


@dataclass(frozen=True)
class FileExpectation:
    """What the file at one DP position of a save must hold (from the model states and the plan)."""

    position: int
    dp: int
    partition_sizes: tuple[int, ...]
    states: tuple[tuple[str, ...], ...]
    """Each group's optimizer tensor states (``exp_avg``, ...), as the save's first file holds them."""
    needs: tuple[int, ...]
    """Per group, how many leading elements of the fp32 partition will be read from this file."""
    fragments: Optional[tuple[Fragments, ...]] = None
    """Per group, the fragments at this position; None: not checked (a layout the plan does not derive)."""
    true_lengths: Optional[tuple[int, ...]] = None
    save_id: Optional[str] = None
    """The model states' save identity (saved through the hooks); None: saved without it."""
    unit: str = "param group"
    """What the file's partitions are of, in messages (ZeRO-3: ``sub-group``)."""
    partition_counts: Optional[tuple[int, ...]] = None
    """Per group, its number of partitions when not every group has ``dp`` (mixture of experts: the expert
    groups are partitioned over the expert-data-parallel group)."""
    algorithm: Optional[str] = None
    """The algorithm of the save's partition checksums (old rank 0's); None: saved without them."""

    def counts(self) -> tuple[int, ...]:
        return self.partition_counts or (self.dp,) * len(self.partition_sizes)


@dataclass(frozen=True)
class FileFacts:
    """One old rank file as one rank saw it: small, shared with every rank of the group."""

    position: int
    path: str
    steps: tuple[Any, ...] = ()
    """Each group's optimizer step (a number, or None)."""
    save_id: Optional[str] = None
    problems: tuple[str, ...] = ()
    """What is wrong with the file on its own, each naming it."""
    sums: Optional[tuple[Mapping[str, tuple[int, int]], ...]] = field(default=None, compare=False)
    """Per group, state -> (real elements, checksum) the save recorded (None: saved without them)."""
    scalars: tuple[tuple[tuple[str, Any], ...], ...] = ()
    """Per group, its states of one value per partition as (name, value), sorted by name."""


def _describe(t: Any) -> str:
    if isinstance(t, RawTensor):
        return f"{t.numel()} {t.dtype.name} elements" + ("" if t.dim() == 1 else f" in shape {tuple(t.shape)}")
    return "nothing" if t is None else f"a {type(t).__name__}"


def _flat_fp32(t: Any) -> bool:
    """A flat fp32 tensor of a file, or one stored in 8-bit blocks and read as its fp32 values."""
    if isinstance(t, Blockwise8bit):
        return True
    return isinstance(t, RawTensor) and t.dim() == 1 and t.is_contiguous() and t.dtype.name == "float32"


def save_record_of(optim: Mapping) -> Optional[Mapping]:
    """The hooks' save record in an optimizer state dict (None when saved without the hooks)."""
    record = optim.get(F.UCP_SAVE_RECORD)
    return record if isinstance(record, Mapping) else None


def file_problems(path: str, optim: Mapping, exp: FileExpectation) -> list[str]:
    """What is wrong with one old rank file's optimizer dict, on its own, at its position ``exp.position``
    (each message names ``path``). Empty: the file can be read at that position."""
    problems: list[str] = []
    count = optim.get(F.PARTITION_COUNT)
    counts = list(count) if isinstance(count, (list, tuple)) else [count]
    wanted = exp.counts()
    if exp.partition_counts is None and any(c != exp.dp for c in counts):
        problems.append(
            f"{path}: saved at DP={counts[0]}, the model states say DP={exp.dp} (a rank file of another save?)"
        )
    elif exp.partition_counts is not None and tuple(counts) != wanted:
        problems.append(
            f"{path}: its groups' partition counts are {counts}, a save at DP={exp.dp} with these experts has "
            f"{list(wanted)} (a rank file of another save?)"
        )
    fp32 = optim.get(F.SINGLE_PARTITION_OF_FP32_GROUPS)
    base = optim.get(F.BASE_OPTIMIZER_STATE)
    state = base.get("state", {}) if isinstance(base, Mapping) else {}
    groups = len(exp.partition_sizes)
    if not isinstance(fp32, (list, tuple)) or len(fp32) != groups:
        held = len(fp32) if isinstance(fp32, (list, tuple)) else 0
        wrong = f"{path}: {held} fp32 partitions for the model states' {groups} {exp.unit}s"
        return problems + [wrong] + _sum_problems(path, optim, exp)
    for g, size in enumerate(exp.partition_sizes):
        master = fp32[g]
        if not _flat_fp32(master) or master.numel() < exp.needs[g]:
            problems.append(
                f"{path}: {exp.unit} {g}'s fp32 partition holds {_describe(master)}, its first {exp.needs[g]} "
                "float32 are needed (truncated, or of another model?)"
            )
        states = state.get(g, {}) if isinstance(state, Mapping) else {}
        for name in exp.states[g]:
            t = states.get(name) if isinstance(states, Mapping) else None
            if not _flat_fp32(t) or t.numel() != size:
                over = f"a DP={exp.dp}" if wanted[g] == exp.dp else f"an expert-DP={wanted[g]}"
                problems.append(
                    f"{path}: {exp.unit} {g}'s {name!r} holds {_describe(t)}, not the {size} float32 elements "
                    f"of {over} partition"
                )
    recorded = _record_problems(path, optim, exp)
    if not recorded:  # a record that names another position says it all; else the fragments tell
        problems += _fragment_problems(path, optim.get(F.PARAM_SLICE_MAPPINGS), exp)
    return problems + recorded + _sum_problems(path, optim, exp)


def _sum_problems(path: str, optim: Mapping, exp: FileExpectation) -> list[str]:
    """A hooked save's partition checksums: in every file, of the save's algorithm, one per state of the position's
    real length."""
    if exp.algorithm is None:
        return []
    record = optim.get(F.ZERO_PARTITION_CHECKSUMS)
    sums = recorded_sums(optim, len(exp.partition_sizes))
    if sums is None or not isinstance(record, Mapping) or record.get("algorithm") != exp.algorithm:
        return [
            f"{path}: no {exp.algorithm} partition checksums for {len(exp.partition_sizes)} groups, "
            "although old rank 0's file has them (a rank file of another save?)"
        ]
    for g, real in enumerate(exp.true_lengths or ()):
        for state in (F.FP32_STATE, *exp.states[g]):
            entry = sums[g].get(state)
            if entry is None or entry[0] != real:
                return [f"{path}: {exp.unit} {g}'s recorded checksum of {state!r} is {entry!r}, not [{real}, <sum>]"]
    return []


def _fragment_problems(path: str, mappings: Any, exp: FileExpectation) -> list[str]:
    if exp.fragments is None:
        return []
    if not isinstance(mappings, (list, tuple)) or len(mappings) != len(exp.fragments):
        return [f"{path}: no param_slice_mappings for the {len(exp.fragments)} param groups"]
    for g, want in enumerate(exp.fragments):
        have = recorded_fragments(mappings[g])
        if have != tuple(sorted(want, key=lambda f: (f[1], f[0]))):
            return [
                f"{path}: holds param group {g}'s fragments {_show(have)}, but DP rank {exp.position}'s partition "
                f"holds {_show(want)}: a rank file of another position (swapped, or copied over this one?)"
            ]
    return []


def _show(fragments: Optional[Fragments], at_most: int = 2) -> str:
    if fragments is None:
        return "(unreadable)"
    if not fragments:
        return "(none: padding only)"
    shown = ", ".join(f"{name}[{start}:{start + n}]" for name, start, n in fragments[:at_most])
    return shown + (f" and {len(fragments) - at_most} more" if len(fragments) > at_most else "")


def _record_problems(path: str, optim: Mapping, exp: FileExpectation) -> list[str]:
    """A file of this save (its record carries the model states' identity) at the place it says."""
    record = save_record_of(optim)
    if record is None or exp.save_id is None or record.get("save_id") != exp.save_id:
        return []  # whose save a file is: cross_check decides, over every file
    problems = []
    if record.get("dp_rank") != exp.position or record.get("dp_size") != exp.dp:
        problems.append(
            f"{path}: its save record says DP rank {record.get('dp_rank')} of {record.get('dp_size')}, the folder "
            f"puts it at rank {exp.position} of {exp.dp}: a rank file of another position (swapped, or copied "
            "over this one?)"
        )
    lengths = optim.get(F.GROUP_TRUE_LENGTHS)
    if exp.true_lengths is not None and lengths is not None and tuple(lengths) != exp.true_lengths:
        problems.append(
            f"{path}: records true lengths {list(lengths)}, DP rank {exp.position} of the model states' "
            f"geometry holds {list(exp.true_lengths)}"
        )
    return problems


def recorded_sums(optim: Mapping, groups: int) -> Optional[tuple[Mapping[str, tuple[int, int]], ...]]:
    """The partition checksums a hooked save recorded, per group (None without a complete record)."""
    record = optim.get(F.ZERO_PARTITION_CHECKSUMS)
    entries = record.get("groups") if isinstance(record, Mapping) else None
    if not isinstance(entries, (list, tuple)) or len(entries) != groups:
        return None
    out = []
    for entry in entries:
        if not isinstance(entry, Mapping):
            return None
        sums = {}
        for state, value in entry.items():
            if not isinstance(value, (list, tuple)) or len(value) != 2:
                return None
            sums[str(state)] = (int(value[0]), int(value[1]))
        out.append(sums)
    return tuple(out)


def step_value(value: Any) -> Any:
    """An optimizer step as one value to compare (files, groups, folders): a one-element tensor's number (a step
    saved as a tensor is the same step as that number), another tensor's shape and values (its shape alone where
    its values are not in memory), else the value itself."""
    if hasattr(value, "numel") and hasattr(value, "shape"):
        if value.numel() == 1:
            return float(value)
        values = tuple(value.reshape(-1).tolist()) if hasattr(value, "tolist") else ()
        return ("tensor", tuple(value.shape), values)
    return value


# ------------------------------------------------------------------------------------------------
# across files: one save, one step
# ------------------------------------------------------------------------------------------------


def cross_check(
    model_states: str, model_save_id: Optional[str], files: Sequence[FileFacts], unit: str = "param group"
) -> list[str]:
    """What the files (each position once; files that could not be read left out) and the model states
    say together: problems naming the file(s) that differ from the others."""
    files = sorted({f.position: f for f in files if f.steps}.values(), key=lambda f: f.position)
    problems = _identity_problems(model_states, model_save_id, files)
    if problems:
        return problems  # files of another save: their steps say nothing more
    for g in range(max((len(f.steps) for f in files), default=0)):
        values = [f.steps[g] if g < len(f.steps) else None for f in files]
        problems += _odd_ones_out(files, values, f"{unit} {g}'s optimizer step")
    for g in range(max((len(f.scalars) for f in files), default=0)):
        values = [f.scalars[g] if g < len(f.scalars) else () for f in files]
        problems += _odd_ones_out(files, values, f"{unit} {g}'s states of one value per partition")
    return problems


def _identity_problems(model_states: str, model_id: Optional[str], files: Sequence[FileFacts]) -> list[str]:
    """One save identity for the model states and every file; the side that differs from the rest is named."""
    hooked = [f for f in files if f.save_id is not None]
    if model_id is None:
        if not hooked:
            return []
        if len(hooked) * 2 > len(files):
            return [
                f"{model_states}: carries no megatron-ucp save record, but {len(hooked)} of the {len(files)} rank "
                "files do: the model states of another save?"
            ]
        return [
            f"{f.path}: carries a megatron-ucp save record (save {f.save_id}), the model states and the other rank "
            "files do not: a rank file of another save?"
            for f in hooked
        ]
    odd = [f for f in files if f.save_id != model_id]
    if not odd:
        return []
    if len(files) == 1:
        return [f"{model_states} and {files[0].path}: of different saves ({model_id} and {files[0].save_id})"]
    majority, count = Counter(f.save_id for f in files).most_common(1)[0]
    if majority != model_id and count > 1 and count * 2 > len(files):
        saved = f"save {majority}" if majority is not None else "a save without the megatron-ucp record"
        return [
            f"{model_states}: from another save (save {model_id}); {count} of the {len(files)} rank files are of "
            f"{saved}"
        ]
    agree = len(files) - len(odd)
    return [
        f"{f.path}: carries no megatron-ucp save record, but the model states and {agree} rank file(s) of its save "
        "do: a rank file of another save (or saved without the hooks)?"
        if f.save_id is None
        else f"{f.path}: from another save (save {f.save_id}); the model states and {agree} rank file(s) are of "
        f"save {model_id}"
        for f in odd
    ]


def _odd_ones_out(files: Sequence[FileFacts], values: Sequence[Any], what: str) -> list[str]:
    counts = Counter(values)
    if len(counts) <= 1:
        return []
    (top, n), *rest = counts.most_common()
    if rest and rest[0][1] == n:  # a tie: nothing tells which side is right
        shown = ", ".join(f"{f.path}: {v}" for f, v in zip(files, values))
        return [f"the rank files disagree on {what} with no majority ({shown}): files of different saves?"]
    return [
        f"{f.path}: {what} is {v}, the other {n} rank file(s) say {top} (a rank file of another save?)"
        for f, v in zip(files, values)
        if v != top
    ]


SHOWN_PROBLEMS = 20


def binding_message(folder: Any, problems: Sequence[str], loaded: bool = False) -> str:
    """One error for every rank; ``loaded``: DeepSpeed's own load had already run (the job must stop)."""
    shown = "\n  ".join(problems[:SHOWN_PROBLEMS])
    more = f"\n  ... and {len(problems) - SHOWN_PROBLEMS} more" if len(problems) > SHOWN_PROBLEMS else ""
    state = "the engine is half-loaded: do not train on it" if loaded else "nothing was loaded"
    return (
        f"cannot resume from {folder}: its files are damaged or do not belong together ({len(problems)} problem(s)); "
        f"{state}:\n  {shown}{more}"
    )


# ------------------------------------------------------------------------------------------------
# the saved weights against the masters
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WeightTally:
    """Per old rank file (position): the elements compared and those outside their master's bracket."""

    checked: Mapping[int, int]
    missed: Mapping[int, int]


def blame_weights(model_states: str, paths: Mapping[int, str], tally: WeightTally) -> list[str]:
    """Who to name when saved bf16 weights are not their masters rounded: the files whose ranges miss,
    or the model states when every file compared misses (and more than one was)."""
    bad = sorted(r for r, n in tally.missed.items() if n)
    if not bad:
        return []
    compared = sorted(r for r, n in tally.checked.items() if n)
    if len(bad) == len(compared) and len(compared) > 1:
        return [
            f"{model_states}: its bf16 weights are not the rounded fp32 masters of any of the {len(compared)} rank "
            "files compared: the model states of another save (another run, or another step)?"
        ]
    where = " (or the model states)" if len(compared) == 1 else ""
    return [
        f"{paths.get(r, f'rank file {r}')}: {tally.missed[r]} of the {tally.checked[r]} saved bf16 weights its "
        f"elements are compared with are not its fp32 masters rounded: a rank file of another save, or of "
        f"another position{where}?"
        for r in bad
    ]

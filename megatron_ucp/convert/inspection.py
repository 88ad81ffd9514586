"""``megatron-ucp inspect``: what a checkpoint is, and what stock DeepSpeed would do with it.

Works from metadata alone: the model-states file's ``param_shapes`` and each rank file's
``param_slice_mappings`` / ``group_paddings`` (rank files are memory-mapped, no tensor bytes are
read), or just a list of group sizes and a DP size (``--group-numels``), which is how the
AuroraGPT-7B DP=768 case is answered without a checkpoint at hand.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from megatron_ucp.convert.execute import plan_checkpoint
from megatron_ucp.convert.universal import universal_state
from megatron_ucp.deepspeed.reader import read_checkpoint, resolve_checkpoint
from megatron_ucp.deepspeed.versions import stage3_stock_behaviour
from megatron_ucp.format import dsformat as F
from megatron_ucp.plan.conversion import ParamSpec
from megatron_ucp.plan.geometry import (
    GroupGeometry,
    PaddingStyle,
    StripCrash,
    stock_converter_crashes,
    stock_loader_crash_ranks,
)
from megatron_ucp.plan.param_geometry import SubGroupGeometry, stock_stage3_problems


@dataclass
class GroupReport:
    index: int
    params: Optional[int]
    numel: int
    padded_numel: int
    partition_size: int
    total_padding: int
    padding_only_ranks: list[int]
    recorded_paddings: Optional[list[int]] = None


@dataclass
class InspectReport:
    source: str
    dp: int
    ds_version: str
    optimizer: str
    zero_stage: Optional[int]
    padding_style: str
    saved_with_megatron_ucp: bool
    has_universal_checkpoint_info: Optional[bool]
    groups: list[GroupReport]
    stock_converter_crashes: list[dict]
    target_dps: list[int]
    stock_loader_crash_dps: list[int]
    universal_twin: Optional[str] = None
    notes: list[str] = field(default_factory=list)
    parallel: Optional[dict] = None
    """``{tp, pp, dp}`` of a TP/PP checkpoint; its ``groups`` are then those of coordinate (pp 0, tp 0)."""
    coordinates: list[dict] = field(default_factory=list)
    """Per model-parallel coordinate: its file, parameters and each group's geometry (TP/PP checkpoints)."""
    tp_layouts: dict[str, int] = field(default_factory=dict)
    """How many parameters TP divides each way (``split dim 1``, ``replicated``, ...)."""
    sub_groups: list[dict] = field(default_factory=list)
    """ZeRO-3: per optimizer sub-group, its size and the parameters with padding-only slices."""
    stock_stage3: list[dict] = field(default_factory=list)
    """ZeRO-3: what stock ``ds_to_universal`` of the release that saved it does wrong (empty: nothing)."""
    experts: Optional[str] = None
    """A mixture-of-experts save: its experts and EP (:meth:`~megatron_ucp.plan.experts.ExpertFacts.describe`);
    its expert groups' geometry is over expert-DP."""
    expert_groups: list[int] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def _ranges(values: Sequence[int]) -> str:
    """[1,2,3,7,9,10] -> '1-3, 7, 9-10' (short enough for 768 ranks)."""
    out, start, prev = [], None, None
    for v in list(values) + [None]:
        if start is None:
            start = prev = v
            continue
        if v is not None and v == prev + 1:
            prev = v
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        start = prev = v
    return ", ".join(out) if out else "none"


def inspect_geometry(
    groups: Sequence[GroupGeometry],
    style: PaddingStyle,
    target_dps: Sequence[int],
    *,
    source: str = "<metadata>",
    ds_version: str = "?",
    optimizer: str = "?",
    zero_stage: Optional[int] = None,
    saved_with_ucp: bool = False,
    has_uc_info: Optional[bool] = None,
    param_counts: Optional[Sequence[int]] = None,
    recorded: Optional[Sequence[Sequence[Optional[int]]]] = None,
) -> InspectReport:
    """Pure: the report for given group sizes at a DP size, with recorded paddings when known."""
    dp = groups[0].dp if groups else 0
    if recorded is not None:  # what the files really say beats what the version would have written
        crashes = [
            StripCrash(group=g, rank=r, padding=pad, state_numel=geo.partition_size)
            for g, geo in enumerate(groups)
            for r, pad in enumerate(recorded[g])
            if pad is not None and pad > geo.partition_size
        ]
    else:
        crashes = stock_converter_crashes(groups, style)
    reports = [
        GroupReport(
            index=g,
            params=param_counts[g] if param_counts else None,
            numel=geo.numel,
            padded_numel=geo.padded_numel,
            partition_size=geo.partition_size,
            total_padding=geo.total_padding,
            padding_only_ranks=geo.padding_only_ranks(),
            recorded_paddings=list(recorded[g]) if recorded is not None else None,
        )
        for g, geo in enumerate(groups)
    ]
    loader = [d for d in target_dps if stock_loader_crash_ranks(groups, d)]
    notes = []
    if has_uc_info is False:
        notes.append(
            "no universal_checkpoint_info in the client state: stock ds_to_universal refuses it unless "
            "--inject_missing_state is given (megatron-ucp does not need it)"
        )
    return InspectReport(
        source=source,
        dp=dp,
        ds_version=ds_version,
        optimizer=optimizer,
        zero_stage=zero_stage,
        padding_style=style.value,
        saved_with_megatron_ucp=saved_with_ucp,
        has_universal_checkpoint_info=has_uc_info,
        groups=reports,
        stock_converter_crashes=[
            {
                "group": c.group,
                "rank": c.rank,
                "padding": c.padding,
                "partition_size": c.state_numel,
                "raw_length": c.raw_length,
            }
            for c in crashes
        ],
        target_dps=list(target_dps),
        stock_loader_crash_dps=loader,
        notes=notes,
    )


def inspect_stage3(
    sub_groups: Sequence[Sequence[ParamSpec]], dp: int, ds_version: str, **facts: object
) -> InspectReport:
    """Pure: the report of a ZeRO-3 save (per-parameter partitions) from its sub-groups' shapes."""
    geos = [SubGroupGeometry(tuple(s.numel for s in specs), dp) for specs in sub_groups]
    rows = []
    for specs, geo in zip(sub_groups, geos):
        padded = geo.padding_only()
        rows.append(
            {
                "params": len(specs),
                "numel": geo.numel,
                "partition_size": geo.partition_size,
                "padding_only_params": len(padded),
                "padding_only_example": (
                    {"param": specs[padded[0][0]].name, "ranks": padded[0][1]} if padded else None
                ),
            }
        )
    reads_all, strips = stage3_stock_behaviour(ds_version)
    problems = stock_stage3_problems(geos, reads_all, strips)
    named = [
        {
            "sub_group": p.sub_group,
            "param": sub_groups[p.sub_group][p.param].name if p.param >= 0 else None,
            "what": p.what,
        }
        for p in problems
    ]
    return InspectReport(
        source=str(facts.get("source", "<metadata>")),
        dp=dp,
        ds_version=ds_version,
        optimizer=str(facts.get("optimizer", "?")),
        zero_stage=3,
        padding_style="per-parameter",
        saved_with_megatron_ucp=bool(facts.get("saved_with_ucp", False)),
        has_universal_checkpoint_info=facts.get("has_uc_info"),  # type: ignore[arg-type]
        groups=[],
        stock_converter_crashes=[],
        target_dps=[],
        stock_loader_crash_dps=[],
        sub_groups=rows,
        stock_stage3=named,
    )


def inspect_checkpoint(path: Path, tag: Optional[str], target_dps: Sequence[int]) -> InspectReport:
    ck = resolve_checkpoint(path, tag)
    meta = read_checkpoint(ck.tag_dir)
    # the checks convert runs before any byte moves (fragments inside partitions and tensors,
    # every element covered once, shapes against the mappings, TP slices against each other): a
    # checkpoint convert would refuse is refused here too, with the same message
    plan = plan_checkpoint(meta)
    if meta.files.partitioned_weights:
        report = inspect_stage3(
            meta.model.param_groups,
            meta.dp,
            meta.ds_version,
            source=str(ck.tag_dir),
            optimizer=meta.kind,
            saved_with_ucp=meta.saved_with_ucp,
            has_uc_info=meta.model.universal_checkpoint_info is not None,
        )
        if meta.model_parallel:
            report.parallel = {"tp": meta.tp, "pp": meta.pp, "dp": meta.dp}
        twin = ck.tag_dir.parent / F.universal_tag(ck.tag)
        report.universal_twin = f"{twin.name}: {universal_state(twin)}"
        return report
    reports = []
    for c in meta.coordinates:  # each coordinate has its own geometry, so its own stock crashes
        if meta.experts is not None:  # expert groups over expert-DP: the plan's geometry, checked against the files
            groups = [g.geometry for g in plan.groups]
        else:
            groups = []
            for g, specs in enumerate(c.model.param_groups):
                numel = sum(s.numel for s in specs)
                pad = c.layouts[0].groups[g].param_alignment_padding
                groups.append(GroupGeometry(numel=numel, dp=meta.dp, padded_numel=numel + pad))
        recorded = [[lay.groups[g].recorded_padding for lay in c.layouts] for g in range(len(groups))]
        reports.append(
            inspect_geometry(
                groups,
                meta.padding_style,
                target_dps if meta.experts is None else (),
                source=str(ck.tag_dir),
                ds_version=meta.ds_version,
                optimizer=meta.kind,
                zero_stage=meta.zero_stage,
                saved_with_ucp=meta.saved_with_ucp,
                has_uc_info=meta.model.universal_checkpoint_info is not None,
                param_counts=[len(s) for s in c.model.param_groups],
                recorded=recorded,
            )
        )
    report = reports[0]
    if meta.model_parallel:
        report.parallel = {"tp": meta.tp, "pp": meta.pp, "dp": meta.dp}
        report.coordinates = [
            {
                "pp": c.pp,
                "tp": c.tp,
                "file": c.model.path.name,
                "params": sum(len(g) for g in c.model.param_groups),
                "groups": [asdict(g) for g in r.groups],
                "stock_converter_crashes": r.stock_converter_crashes,
                "stock_loader_crash_dps": r.stock_loader_crash_dps,
            }
            for c, r in zip(meta.coordinates, reports)
        ]
        report.stock_converter_crashes = [
            dict(crash, pp=c.pp, tp=c.tp)
            for c, r in zip(meta.coordinates, reports)
            for crash in r.stock_converter_crashes
        ]
        report.stock_loader_crash_dps = sorted({d for r in reports for d in r.stock_loader_crash_dps})
    if meta.experts is not None:
        report.experts = meta.experts.describe()
        report.expert_groups = list(meta.experts.expert_groups)
        report.notes.append(
            "stock ds_to_universal merges every rank's experts under the local names they hold (DeepSpeed 0.19.5: "
            "RuntimeError: shape ... is invalid, twice the elements) or takes the expert files for a pipeline's "
            "layer files (0.16.9: AssertionError, Cannot find layer_01* files); megatron-ucp convert writes each "
            "expert under its global index"
        )
    for p in plan.params:
        if p.tp_layout:
            kind = p.tp_layout.split(", vocabulary")[0]
            report.tp_layouts[kind] = report.tp_layouts.get(kind, 0) + 1
    twin = ck.tag_dir.parent / F.universal_tag(ck.tag)
    report.universal_twin = f"{twin.name}: {universal_state(twin)}"
    return report


SHORT_RANGES = 100
"""Characters of DP sizes ``inspect`` prints before it summarises them (``--target-dp`` asks for a full list)."""


def summarised_ranges(values: Sequence[int], among: Sequence[int]) -> str:
    """:func:`_ranges` when short; else the first few ranges, and the sizes of ``among`` not in ``values``
    (when those are the short list) or their count."""
    full = _ranges(values)
    if len(full) <= SHORT_RANGES:
        return full
    head = ", ".join(full.split(", ")[:4])
    others = sorted(set(among) - set(values))
    rest = _ranges(others)
    if len(rest) <= SHORT_RANGES:
        return f"{head}, ... (every size but {rest})"
    return f"{head}, ... (in all {len(values)}; --target-dp RANGE lists the sizes asked about in full)"


def format_report(r: InspectReport, full_ranges: bool = False) -> str:
    """The text ``inspect`` prints; ``full_ranges``: every DP size listed, however long (``--target-dp``)."""
    listed = _ranges if full_ranges else (lambda values: summarised_ranges(values, r.target_dps))
    lines = [
        f"checkpoint:       {r.source}",
        f"DP size:          {r.dp}"
        if r.parallel is None
        else f"layout:           TP={r.parallel['tp']} x PP={r.parallel['pp']} x DP={r.dp} "
        f"({len(r.coordinates)} model-parallel coordinates, each with its own ZeRO geometry)",
        f"DeepSpeed:        {r.ds_version}",
        f"optimizer:        {r.optimizer}" + (f" (ZeRO stage {r.zero_stage})" if r.zero_stage else ""),
        f"group_paddings:   {r.padding_style}"
        + (" (saved with megatron-ucp: true lengths recorded)" if r.saved_with_megatron_ucp else ""),
    ]
    if r.experts:
        lines.insert(2, f"experts:          {r.experts}")
    if r.zero_stage == 3:
        return "\n".join(lines[:-1] + _stage3_lines(r))
    if r.universal_twin:
        lines.append(f"universal twin:   {r.universal_twin}")
    if r.tp_layouts:
        lines.append("TP layouts:       " + "; ".join(f"{kind}: {n}" for kind, n in sorted(r.tp_layouts.items())))
    for c in r.coordinates:
        sizes = ", ".join(f"group {g['index']} N={g['numel']:,} partition {g['partition_size']:,}" for g in c["groups"])
        lines.append(f"(pp {c['pp']}, tp {c['tp']}) {c['file']}: {c['params']} params; {sizes}")
    if r.coordinates:
        lines.append("groups of coordinate (pp 0, tp 0):")
    for g in r.groups:
        extra = f", {g.params} params" if g.params is not None else ""
        extra += " (one expert-parallel rank's experts, over expert-DP)" if g.index in r.expert_groups else ""
        lines.append(
            f"group {g.index}: N={g.numel:,}{extra}; partition {g.partition_size:,}; alignment padding "
            f"{g.total_padding:,}"
            + (
                f" (> partition: spans {len(g.padding_only_ranks)} rank(s))"
                if g.total_padding > g.partition_size
                else ""
            )
        )
        lines.append(f"  ranks holding only padding: {_ranges(g.padding_only_ranks)}")
    if r.stock_converter_crashes:
        c = r.stock_converter_crashes[0]
        lines.append(
            f"stock ds_to_universal: CRASHES (narrow(): length must be non-negative) - group {c['group']} "
            f"rank {c['rank']}: recorded padding {c['padding']} > partition {c['partition_size']} "
            f"(raw length {c['raw_length']}); megatron-ucp convert handles it"
        )
    elif r.experts:
        lines.append("stock ds_to_universal: FAILS on the expert groups (note below)")
    else:
        lines.append("stock ds_to_universal: ok (paddings within partitions)")
    lo, hi = (min(r.target_dps), max(r.target_dps)) if r.target_dps else (0, 0)
    crash = r.stock_loader_crash_dps
    if r.experts:
        lines.append("stock universal loader (load_universal): not predicted for expert groups")
    else:
        lines.append(
            f"stock universal loader (load_universal) over DP {lo}..{hi}: crashes (IndexError, all-padding "
            f"ranks) at {len(crash)} of {len(r.target_dps)} sizes: {listed(crash)}"
            + (f"; including this DP ({r.dp})" if r.dp in crash else "")
        )
    lines.extend(f"note: {n}" for n in r.notes)
    return "\n".join(lines)


def _stage3_lines(r: InspectReport) -> list[str]:
    """The ZeRO-3 part of the report: partitions per parameter, per sub-group."""
    lines = ["partitions:       per parameter (ceil(n/DP) elements each, tail padding on the last ranks)"]
    if r.universal_twin:
        lines.append(f"universal twin:   {r.universal_twin}")
    for g, row in enumerate(r.sub_groups):
        lines.append(
            f"sub-group {g}: N={row['numel']:,}, {row['params']} params; partition {row['partition_size']:,} per rank"
        )
        example = row["padding_only_example"]
        if example:
            lines.append(
                f"  {row['padding_only_params']} param(s) with padding-only slices, e.g. {example['param']} on ranks "
                f"{_ranges(example['ranks'])}"
            )
    if r.stock_stage3:
        first = r.stock_stage3[0]
        lines.append(
            f"stock ds_to_universal (DeepSpeed {r.ds_version}): WRONG in {len(r.stock_stage3)} place(s), e.g. "
            f"sub-group {first['sub_group']}{' ' + first['param'] if first['param'] else ''}: {first['what']}; "
            "megatron-ucp convert reads every sub-group and strips every slice's padding"
        )
    else:
        lines.append(f"stock ds_to_universal (DeepSpeed {r.ds_version}): ok")
    lines.extend(f"note: {n}" for n in r.notes)
    return lines

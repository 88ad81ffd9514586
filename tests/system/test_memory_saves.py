"""Memory saves and the restart from them, with real DeepSpeed (CPU, gloo): four ranks as four nodes (each its own
local folder, ``MEGATRON_UCP_NODE_NAMES``), a memory save every step, a durable save at step 10, the job dying after
step 14 (the memory save of step 13 taken at its start and committed by the writer threads before the crash); then a
restart on the survivors at the new node count.

* one node lost: the survivors resume from step 13 (that node's files from their replica), bit for bit, and the
  losses continue the uninterrupted run;
* two adjacent nodes lost (a node's copy and its replica): the durable step 10, said why;
* a flipped bit in a memory copy: its replica; in the copy and the replica: the durable tag;
* a job killed during a memory save (before it replicated): the previous generation.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from megatron_ucp.background.status import root_status
from megatron_ucp.background.status_text import format_status
from megatron_ucp.config import UcpConfig
from megatron_ucp.integration.node_memory import crc_of, local_folder
from tests.support.dsharness import TrainResult, TrainSpec, run_training
from tests.support.elastic_support import ElasticRuns, assert_losses_continue, assert_same_state, flip_a_data_bit
from tests.support.harness_layouts import HARNESS_LAYOUTS

pytestmark = pytest.mark.slow

NODES = ("n0", "n1", "n2", "n3")
STEPS = 16
DURABLE = 10
CRASH = 13
"""The newest memory save the crashed job committed: it dies after the next step."""


def _memory(base: Path) -> dict:
    return {"memory_save_interval": 1, "local_dir": str(base / "local" / "{node}")}


def _node_folder(base: Path, node: str) -> Path:
    """A node's memory-save folder of the checkpoint root ``base/ckpt``."""
    return local_folder(UcpConfig(**_memory(base)), base / "ckpt", node)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> ElasticRuns:
    return ElasticRuns(tmp_path_factory.mktemp("memory"))


def _reference(runs: ElasticRuns) -> TrainResult:
    return runs.get("reference", lambda f: run_training(TrainSpec(dp=4, steps=STEPS, plugin=True, timeout=300)))


def _crashed(runs: ElasticRuns, name: str = "crashed", env: dict | None = None) -> Path:
    """A job of four nodes that saved to memory every step and durably at step 10, dead after step 14 (its memory
    save of step 13 committed)."""

    def make(folder: Path) -> Path:
        result = run_training(
            TrainSpec(
                dp=4,
                steps=STEPS,
                save_dir=folder / "ckpt",
                save_at=(DURABLE,),
                memory_every=1,
                crash=(CRASH + 1, 1),
                expect_failure=True,
                dump_dir=folder / "dumps",
                plugin=True,
                plugin_kwargs=_memory(folder),
                env={"MEGATRON_UCP_NODE_NAMES": ",".join(NODES), **(env or {})},
                timeout=300,
            )
        )
        assert result.returncode != 0 and result.steps[-1] >= CRASH - 1, result.log[-3000:]
        return folder

    return runs.get(name, make)


def _restart(
    crashed: Path,
    folder: Path,
    survivors: tuple[str, ...],
    damage=lambda local: None,
    env: dict | None = None,
    fresh: tuple[str, ...] = (),
    plugin_kwargs: dict | None = None,
) -> TrainResult:
    """The survivors' restart: a private copy of the job's checkpoint root and node folders, the lost nodes'
    folders gone, ``damage`` done, one rank per survivor."""
    shutil.copytree(crashed / "ckpt", folder / "ckpt")
    for node in survivors:  # as they were, for this copy's root; a fresh node's is empty
        if node not in fresh:
            shutil.copytree(_node_folder(crashed, node), _node_folder(folder, node))
    damage(folder)
    return _resume(folder, survivors, folder / "dumps", env=env, plugin_kwargs=plugin_kwargs)


def _resume(
    base: Path,
    survivors: tuple[str, ...],
    dump_dir: Path,
    steps: int = STEPS,
    env: dict | None = None,
    plugin_kwargs: dict | None = None,
    **fields,
) -> TrainResult:
    """The survivors' run from the checkpoint root ``base/ckpt`` and their node folders under ``base``, one rank per
    survivor, memory saves on (``plugin_kwargs``: the hooks' settings, if others)."""
    return run_training(
        TrainSpec(
            dp=len(survivors),
            steps=steps,
            load_dir=base / "ckpt",
            save_dir=base / "ckpt",
            dump_dir=dump_dir,
            plugin=True,
            plugin_kwargs=plugin_kwargs or _memory(base),
            env={"MEGATRON_UCP_NODE_NAMES": ",".join(survivors), **(env or {})},
            timeout=300,
            **fields,
        )
    )


def _rank_file(base: Path, holder: str, node: int, step: int = CRASH) -> Path:
    return (
        _node_folder(base, holder)
        / f"iter_{step:07d}"
        / f"node{node}"
        / f"global_step{step}"
        / (f"bf16_zero_pp_rank_{node}_mp_rank_00_optim_states.pt")
    )


def _model_states(base: Path, holder: str = "n0", node: int = 0, step: int = CRASH) -> dict:
    path = _node_folder(base, holder) / f"iter_{step:07d}" / f"node{node}" / f"global_step{step}"
    return torch.load(path / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)


def _record(base: Path, holder: str = "n0", node: int = 0, step: int = CRASH) -> dict:
    return json.loads((_node_folder(base, holder) / f"iter_{step:07d}" / f"node{node}.json").read_text())


def _as_the_job_had(saved: Path, loaded: Path, step: int, state: bool = True, weights: bool = True) -> None:
    """After the load, in the dumps folder ``loaded``, what the job had at ``step`` (its dumps in ``saved``), bit for
    bit: every master and optimizer state (``state``) and the module on rank 0 (``weights``)."""
    if state:
        assert_same_state(saved / f"state_step{step}.pt", loaded / f"state_step{step}_loaded.pt")
    if weights:
        a, b = (
            torch.load(p, map_location="cpu", weights_only=False)["module"]
            for p in (saved / f"rank0_step{step}.pt", loaded / f"rank0_step{step}_loaded.pt")
        )
        assert a.keys() == b.keys() and a, (sorted(a), sorted(b))
        for name, tensor in a.items():
            assert tensor.dtype == b[name].dtype and torch.equal(tensor, b[name]), f"{name} differs after the load"


def test_a_lost_node_costs_only_the_steps_since_the_last_memory_save(runs: ElasticRuns, tmp_path: Path) -> None:
    """...and the memory save held none of the optimized weights (empty placeholders, its record saying so): the
    restart rebuilt them from the masters, every one as the job had it."""
    crashed = _crashed(runs)
    module = _model_states(crashed)["module"]
    assert module and all(t.numel() == 0 for t in module.values()), {k: t.shape for k, t in module.items()}
    assert _record(crashed)["weights_from_masters"] is True
    resumed = _restart(crashed, tmp_path, ("n0", "n2", "n3"))
    assert resumed.loaded_step == CRASH, resumed.log[-4000:]
    assert resumed.info["loaded_path"].startswith(str(tmp_path / "local" / "n0")), resumed.info["loaded_path"]
    log = resumed.rank_logs()[0]
    assert f"restarting from the memory save of iteration {CRASH} (global_step{CRASH}, saved by 4 node(s))" in log
    assert f"newer than the durable global_step{DURABLE} by 3 iteration(s); replicas used for node 1" in log
    assert "its weights to be rebuilt from the masters" in log
    _as_the_job_had(crashed / "dumps", tmp_path / "dumps", CRASH)
    assert_losses_continue(resumed, _reference(runs).loss_at)
    said = format_status(root_status(tmp_path / "ckpt"))  # what the morning's `megatron-ucp status` says
    assert "last restart with memory saves on its nodes (" in said and (
        f"): restarting from the memory save of iteration {CRASH}" in said
    ), said


def test_a_job_requeued_on_the_same_nodes_resumes_from_memory_at_the_same_size_bit_for_bit(
    runs: ElasticRuns, tmp_path: Path
) -> None:
    """No node lost (the job requeued in its allocation): the same-DP load of the memory save, its weights rebuilt from
    the masters, every master, state and weight as the job had them."""
    crashed = _crashed(runs)
    resumed = _restart(crashed, tmp_path, NODES)
    assert resumed.loaded_step == CRASH, resumed.log[-4000:]
    log = resumed.rank_logs()[0]
    assert "module weights rebuilt from the masters (one all-gather; the memory save left them to the masters)" in log
    _as_the_job_had(crashed / "dumps", tmp_path / "dumps", CRASH)
    assert_losses_continue(resumed, _reference(runs).loss_at)


def test_a_restart_that_would_read_the_weights_from_the_files_loads_the_durable_tag_saying_why(
    runs: ElasticRuns, tmp_path: Path
) -> None:
    """``module_read = full``: the load would read the weights from the memory save's files, which left them to the
    masters: refused before anything is loaded, the durable tag loaded, with the losses of the same restart on nodes
    that never held memory saves."""
    crashed = _crashed(runs)
    survivors, full = ("n0", "n2", "n3"), {"module_read": "full"}
    resumed = _restart(crashed, tmp_path / "memory", survivors, plugin_kwargs={**_memory(tmp_path / "memory"), **full})
    assert resumed.loaded_step == DURABLE, resumed.log[-4000:]
    log = resumed.rank_logs()[0]
    assert "this memory save left the model's weights to the fp32 masters, and this load would read them" in log
    assert f"loading the durable checkpoint global_step{DURABLE} instead" in log
    shutil.copytree(crashed / "ckpt", tmp_path / "durable" / "ckpt")
    durable = _resume(tmp_path / "durable", survivors, tmp_path / "durable" / "dumps", plugin_kwargs=full)
    assert durable.loaded_step == DURABLE and resumed.losses == durable.losses, (resumed.losses, durable.losses)


KEPT = {
    "masters-from-weights": (
        {"extra_config": {"zero_optimization": {"load_from_fp32_weights": False}}},
        {},
        "zero_optimization.load_from_fp32_weights is off: a load derives the masters from the weights",
    ),
    "module-read-full": ({}, {"module_read": "full"}, "module_read=full: a restart reads the module from the files"),
}
"""Jobs whose memory saves keep the weights: harness fields, the hooks' settings, what the first rank says."""


@pytest.mark.parametrize("case", sorted(KEPT))
def test_a_job_whose_restart_reads_the_weights_keeps_them_in_its_memory_saves(case: str, tmp_path: Path) -> None:
    """``load_from_fp32_weights`` off (a load takes the masters from the weights) or ``module_read = full`` (a restart
    reads the module from the files): the memory saves keep the weights, said why, and the restart from one at DP 3
    reads them, bit for bit."""
    fields, settings, said = KEPT[case]
    job = tmp_path / "job"
    crashed = run_training(
        TrainSpec(
            dp=4,
            steps=5,
            save_dir=job / "ckpt",
            memory_every=1,
            crash=(4, 1),
            expect_failure=True,
            dump_dir=job / "dumps",
            plugin=True,
            plugin_kwargs={**_memory(job), **settings},
            env={"MEGATRON_UCP_NODE_NAMES": ",".join(NODES)},
            timeout=300,
            **fields,
        )
    )
    assert crashed.returncode != 0, crashed.log[-3000:]
    assert crashed.rank_logs()[0].count(f"memory saves keep the model's weights in their files: {said}") == 1
    assert _record(job, step=3)["weights_from_masters"] is False
    assert all(t.numel() > 0 for t in _model_states(job, step=3)["module"].values())
    (job / "ckpt").mkdir(exist_ok=True)
    shutil.rmtree(job / "local" / "n1")
    resumed = _resume(
        job, ("n0", "n2", "n3"), tmp_path / "resumed", steps=4, plugin_kwargs={**_memory(job), **settings}, **fields
    )
    assert resumed.loaded_step == 3, resumed.log[-4000:]
    _as_the_job_had(job / "dumps", tmp_path / "resumed", 3)


def test_a_memory_save_keeps_the_weights_where_they_are_not_the_masters_rounded(tmp_path: Path) -> None:
    """Every rank changes one weight after step 2 (a job that edits its weights after the step): the memory save of
    step 2 keeps the weights, said why (the rank whose partition holds that weight sees it; every rank learns it)."""
    job = tmp_path / "job"
    result = run_training(
        TrainSpec(
            dp=4,
            steps=3,
            save_dir=job / "ckpt",
            memory_every=1,
            nudge=2,
            plugin=True,
            plugin_kwargs=_memory(job),
            env={"MEGATRON_UCP_NODE_NAMES": ",".join(NODES)},
            timeout=300,
        )
    )
    assert result.ok, result.log[-3000:]
    log = result.rank_logs()[0]
    said = "memory saves keep the model's weights in their files: "
    assert log.count(said) == 1, log[-3000:]
    assert f"{said}the live weights are not the fp32 masters rounded to nearest" in log or (
        f"{said}on 1 rank(s) the weights are not the masters rounded, or their check failed" in log
    ), log[-3000:]
    assert _record(job, step=2)["weights_from_masters"] is False
    assert all(t.numel() > 0 for t in _model_states(job, step=2)["module"].values())


def _with_a_dict_state(base: Path, step: int = CRASH) -> None:
    """Every copy of the memory save of ``step`` under ``base`` (each node's own and the replica it keeps) with a dict
    added to every group's state in every rank file (the shape of bitsandbytes' quantization state), its record's
    sizes and crc32 made anew: a state no copy places, which a same-DP load leaves to DeepSpeed's own load, unbound."""
    for node in NODES:
        gen = _node_folder(base, node) / f"iter_{step:07d}"
        for record_path in sorted(gen.glob("node*.json")):
            record = json.loads(record_path.read_text())
            folder = gen / f"node{record['node']}" / record["tag"]
            for name in [n for n in record["files"] if n.endswith("optim_states.pt")]:
                sd = torch.load(folder / name, weights_only=False)
                for state in sd["optimizer_state_dict"]["base_optimizer_state"]["state"].values():
                    state["quant_state"] = {"blocksize": 256}
                torch.save(sd, folder / name)
                record["files"][name] = [(folder / name).stat().st_size, crc_of(folder / name)]
            record_path.write_text(json.dumps(record))


def test_a_same_size_restart_left_to_deepspeeds_own_load_rebuilds_the_weights_from_the_masters(
    runs: ElasticRuns, tmp_path: Path
) -> None:
    """The job requeued on its four nodes, its memory save holding a state no copy places (the rank files then left
    unbound, to DeepSpeed's own load at the saved size): DeepSpeed loads the masters, the weights are rebuilt from
    them, every one as the job had it."""
    crashed = _crashed(runs)
    resumed = _restart(crashed, tmp_path, NODES, damage=_with_a_dict_state)
    assert resumed.loaded_step == CRASH, resumed.log[-4000:]
    log = resumed.rank_logs()[0]
    assert "keeps optimizer state that megatron-ucp cannot place at another DP size: 'quant_state'" in log
    assert f"global_step{CRASH}: module weights rebuilt from the masters (the memory save left them" in log
    _as_the_job_had(crashed / "dumps", tmp_path / "dumps", CRASH, state=False)
    assert_losses_continue(resumed, _reference(runs).loss_at)


def test_a_node_and_its_replica_lost_together_load_the_durable_tag_saying_why(
    runs: ElasticRuns, tmp_path: Path
) -> None:
    resumed = _restart(_crashed(runs), tmp_path, ("n0", "n3"))
    assert resumed.loaded_step == DURABLE, resumed.log[-4000:]
    log = resumed.rank_logs()[0]
    assert f"iteration {CRASH}: no survivor holds the files of node 1 (its copy and its replica on node 2)" in log
    assert f"none newer than the durable global_step{DURABLE} is whole" in log
    assert "no survivor holds the files of node 1" in format_status(root_status(tmp_path / "ckpt"))
    assert_losses_continue(resumed, _reference(runs).loss_at)


def test_a_flipped_bit_in_a_memory_copy_is_read_from_its_replica(runs: ElasticRuns, tmp_path: Path) -> None:
    crashed = _crashed(runs)
    resumed = _restart(
        crashed, tmp_path, ("n0", "n1", "n2"), damage=lambda base: flip_a_data_bit(_rank_file(base, "n0", 0))
    )
    assert resumed.loaded_step == CRASH, resumed.log[-4000:]
    log = resumed.rank_logs()[0]
    assert "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt of node 0 do not match their sums" in log
    assert "replicas used for node 0" in log
    assert_same_state(crashed / "dumps" / f"state_step{CRASH}.pt", tmp_path / "dumps" / f"state_step{CRASH}_loaded.pt")


def test_a_memory_save_damaged_in_its_copy_and_its_replica_gives_way_to_the_durable_tag(
    runs: ElasticRuns, tmp_path: Path
) -> None:
    def damage(base: Path) -> None:
        flip_a_data_bit(_rank_file(base, "n0", 0))
        flip_a_data_bit(_rank_file(base, "n1", 0))

    resumed = _restart(_crashed(runs), tmp_path, ("n0", "n1", "n2"), damage=damage)
    assert resumed.loaded_step == DURABLE, resumed.log[-4000:]
    assert (
        f"iteration {CRASH}: every copy of bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt is damaged (on n0, n1)"
        in (resumed.rank_logs()[0])
    )


def test_a_job_killed_during_a_memory_save_resumes_from_the_previous_generation(
    runs: ElasticRuns, tmp_path: Path
) -> None:
    """Rank 2 killed while its writer thread replicates the memory save of step 13: that node keeps the generation it
    was cutting (nothing ran after the kill); the others' commits break off, and each removes its part when its
    process lives long enough. The restart (node 1 lost) passes the cut generation over, saying why, and resumes from
    step 12, on the curve."""
    crashed = _crashed(runs, "killed", env={"MEGATRON_UCP_TEST_FAULT": f"memory {CRASH}: replicate:2:kill"})

    def held(node: str) -> list[str]:
        return sorted(p.name for p in _node_folder(crashed, node).iterdir() if p.name.startswith("iter_"))

    newest, cut = f"iter_{CRASH - 1:07d}", f"iter_{CRASH:07d}"
    assert held("n2") == [newest, cut], held("n2")  # the newest committed one, and the one cut
    assert held("n0") in ([newest], [newest, cut]), held("n0")
    resumed = _restart(crashed, tmp_path, ("n0", "n2", "n3"))
    assert resumed.loaded_step == CRASH - 1, resumed.log[-4000:]
    assert f"iteration {CRASH}: not committed (the job stopped while saving it)" in resumed.rank_logs()[0]
    assert_losses_continue(resumed, _reference(runs).loss_at)


LAYOUTS = {name: fields for name, fields in HARNESS_LAYOUTS.items() if name != "zero1-bf16"}  # bf16: above


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_zero_layout_resumes_from_memory_at_the_new_node_count_bit_for_bit(layout: str, tmp_path: Path) -> None:
    """Each other layout the fork trains (the fork's own: tests/integration): a memory save every step (the weights
    left to the masters but at ZeRO-3), the job dead after step 4 (its memory save of step 3 committed), a node lost,
    the survivors at DP 3 from step 3, every master, state and weight as saved."""
    fields = LAYOUTS[layout]
    crashed = run_training(
        TrainSpec(
            dp=4,
            steps=5,
            save_dir=tmp_path / "job" / "ckpt",
            memory_every=1,
            crash=(4, 1),
            expect_failure=True,
            dump_dir=tmp_path / "job" / "dumps",
            plugin=True,
            plugin_kwargs=_memory(tmp_path / "job"),
            env={"MEGATRON_UCP_NODE_NAMES": ",".join(NODES)},
            timeout=300,
            **fields,
        )
    )
    assert crashed.returncode != 0, crashed.log[-3000:]
    # the weights left to the masters but at ZeRO-3 (whose model states hold none)
    assert _record(tmp_path / "job", step=3)["weights_from_masters"] is (layout != "zero3")
    (tmp_path / "job" / "ckpt").mkdir(exist_ok=True)  # no durable save yet: the root exists, empty
    shutil.rmtree(tmp_path / "job" / "local" / "n1")
    resumed = _resume(tmp_path / "job", ("n0", "n2", "n3"), tmp_path / "resumed", steps=4, **fields)
    assert resumed.loaded_step == 3, resumed.log[-4000:]
    assert "newer than the durable checkpoint (none)" in resumed.rank_logs()[0]
    # ZeRO-3's module holds only its partitions: its masters (the state) are the weights
    _as_the_job_had(tmp_path / "job" / "dumps", tmp_path / "resumed", 3, weights=layout != "zero3")


def test_a_restart_whose_load_needs_the_universal_twin_loads_the_durable_tag_saying_why(tmp_path: Path) -> None:
    """A restart whose load goes through the universal twin (here ``--ucp-resume-route universal``; also a TP, PP or
    ZeRO-3 change), which would be converted into a folder each node holds alone: the durable tag, converted and
    loaded as without memory saves, and the reason said."""
    job = tmp_path / "job"
    crashed = run_training(
        TrainSpec(
            dp=4,
            optimizer="zero",
            steps=4,
            save_dir=job / "ckpt",
            save_at=(2,),
            memory_every=1,
            crash=(4, 1),
            expect_failure=True,
            plugin=True,
            plugin_kwargs=_memory(job),
            env={"MEGATRON_UCP_NODE_NAMES": ",".join(NODES)},
            timeout=300,
        )
    )
    assert crashed.returncode != 0, crashed.log[-3000:]
    shutil.rmtree(job / "local" / "n1")
    resumed = run_training(
        TrainSpec(
            dp=3,
            optimizer="zero",
            steps=4,
            load_dir=job / "ckpt",
            plugin=True,
            plugin_kwargs={**_memory(job), "resume_route": "universal"},
            env={"MEGATRON_UCP_NODE_NAMES": "n0,n2,n3"},
            timeout=300,
        )
    )
    assert resumed.loaded_step == 2, resumed.log[-4000:]
    log = resumed.rank_logs()[0]
    assert "restart: the memory save of iteration 3 was refused" in log and "only by the native routes" in log, log


def test_a_failed_memory_save_is_removed_said_and_training_goes_on_with_the_previous_one(tmp_path: Path) -> None:
    """A write of any type failing on one rank (here ``ValueError`` in rank 1's file of step 3), with the background
    conversion on: that memory save fails on every rank, is removed, the previous generation stays until the next
    commits; training goes on; only the durable save is converted (never a memory save's folder)."""
    fault = "write the memory save global_step3/*:1:ValueError"
    result = run_training(
        TrainSpec(
            dp=2,
            steps=5,
            save_dir=tmp_path / "ckpt",
            save_at=(2,),
            memory_every=1,
            plugin=True,
            plugin_kwargs={**_memory(tmp_path), "async_convert": True},
            env={"MEGATRON_UCP_NODE_NAMES": "n0,n1", "MEGATRON_UCP_TEST_FAULT": fault},
            timeout=300,
        )
    )
    assert result.ok and result.steps[-1] == 5, result.log[-3000:]
    log = result.rank_logs()[0]
    assert "the memory save of iteration 3 failed writing" in log and "ValueError" in log, log[-3000:]
    assert "memory save of iteration 4 (global_step4): 3 file(s) on 2 node(s)" in log
    for node in ("n0", "n1"):
        folder = _node_folder(tmp_path, node)
        assert sorted(p.name for p in folder.iterdir() if p.name.startswith("iter_")) == ["iter_0000004"]
        assert not list(folder.rglob(".ucp")) and not list(folder.rglob("*_universal"))
    assert (tmp_path / "ckpt" / "global_step2_universal").is_dir()


def test_a_rank_file_that_cannot_be_brought_to_its_reader_gives_way_to_the_durable_tag(
    runs: ElasticRuns, tmp_path: Path
) -> None:
    """The restart's binding asks for the rank files its ranks read; one that cannot be brought (here a fault on rank
    1) refuses the memory save on every rank, before DeepSpeed's load: the durable tag is loaded, saying why."""
    crashed = _crashed(runs)
    fault = {"MEGATRON_UCP_TEST_FAULT": f"memory restart global_step{CRASH}: fetch:1:OSError"}
    resumed = _restart(crashed, tmp_path, ("n0", "n2", "n3"), env=fault)
    assert resumed.loaded_step == DURABLE, resumed.log[-4000:]
    log = resumed.rank_logs()[0]
    assert f"restart: the memory save of iteration {CRASH} was refused" in log, log[-4000:]
    assert "bringing the memory save's rank files to the nodes that read them" in log
    reference = _reference(runs)
    for step in (DURABLE + 1, DURABLE + 2):  # the durable tag's state, untouched by the refused load (bf16 DP noise
        assert abs(resumed.loss_at(step) - reference.loss_at(step)) <= 1e-3, step  # grows over 6 steps at DP 3)


def test_fresh_nodes_joining_the_survivors_get_the_model_states_relayed_through_each_other(
    runs: ElasticRuns, tmp_path: Path
) -> None:
    """Three survivors and three fresh nodes (empty folders), DP 6: the model states, which five nodes lack, are spread
    in rounds (a node that received them sends them on), every rank file goes where it is read, and the job resumes
    from the memory save, bit for bit."""
    crashed = _crashed(runs)
    resumed = _restart(crashed, tmp_path, ("n0", "n2", "n3", "n4", "n5", "n6"), fresh=("n4", "n5", "n6"))
    assert resumed.loaded_step == CRASH, resumed.log[-4000:]
    assert f"restarting from the memory save of iteration {CRASH}" in resumed.rank_logs()[0]
    assert "in up to 3 round(s)" in resumed.rank_logs()[0]  # 1 holder -> 2 -> 4 -> 6 nodes
    assert_same_state(crashed / "dumps" / f"state_step{CRASH}.pt", tmp_path / "dumps" / f"state_step{CRASH}_loaded.pt")


def test_memory_saves_beside_asynchronous_durable_saves_resume_from_the_newest_bit_for_bit(tmp_path: Path) -> None:
    """Asynchronous durable saves (every 2 steps, written by their writer) and memory saves (every step, written and
    committed by theirs) in one job: each durable save waits for the memory save in flight, neither stalls the
    other's files; the job dies after step 6 (its asynchronous save still in flight), a node is lost, and the
    survivors resume from the memory save of step 5 (newer than the durable step 4), bit for bit."""
    job = tmp_path / "job"
    kwargs = {**_memory(job), "async_save": True}
    crashed = run_training(
        TrainSpec(
            dp=4,
            steps=8,
            save_dir=job / "ckpt",
            save_at=(2, 4, 6),
            memory_every=1,
            crash=(6, 1),
            expect_failure=True,
            dump_dir=job / "dumps",
            plugin=True,
            plugin_kwargs=kwargs,
            env={"MEGATRON_UCP_NODE_NAMES": ",".join(NODES)},
            timeout=300,
        )
    )
    assert crashed.returncode != 0, crashed.log[-3000:]
    # the asynchronous save of step 6 was in flight when rank 1 died of an exception: never committed
    assert (job / "ckpt" / "latest").read_text().strip() == "global_step4", crashed.log[-3000:]
    shutil.rmtree(job / "local" / "n1")
    resumed = _resume(job, ("n0", "n2", "n3"), tmp_path / "resumed", steps=8, plugin_kwargs=kwargs)
    said = resumed.rank_logs()[0]
    assert resumed.loaded_step == 5 and "restarting from the memory save of iteration 5" in said, said[-4000:]
    assert_same_state(job / "dumps" / "state_step5.pt", tmp_path / "resumed" / "state_step5_loaded.pt")
    assert resumed.ok and resumed.steps[-1] == 8, resumed.log[-3000:]


def test_a_second_node_lost_after_a_restart_from_memory_resumes_from_the_restarted_jobs_memory_save(
    runs: ElasticRuns, tmp_path: Path
) -> None:
    """The sequence a long job meets: four nodes, one lost, the three survivors restart from memory at DP 3 and take
    memory saves of their own on their new ring; then another node is lost (dying after step 15), and the two left
    resume from the DP 3 job's memory save of step 14 (the lost node's files from its replica), bit for bit."""
    crashed = _crashed(runs)
    survivors = ("n0", "n2", "n3")
    shutil.copytree(crashed / "ckpt", tmp_path / "ckpt")
    for node in survivors:
        shutil.copytree(_node_folder(crashed, node), _node_folder(tmp_path, node))
    second = run_training(
        TrainSpec(
            dp=3,
            steps=STEPS,
            load_dir=tmp_path / "ckpt",
            save_dir=tmp_path / "ckpt",
            memory_every=1,
            crash=(CRASH + 2, 1),
            expect_failure=True,
            dump_dir=tmp_path / "dumps",
            plugin=True,
            plugin_kwargs=_memory(tmp_path),
            env={"MEGATRON_UCP_NODE_NAMES": ",".join(survivors)},
            timeout=300,
        )
    )
    assert second.returncode != 0 and second.loaded_step == CRASH, second.log[-4000:]
    shutil.rmtree(_node_folder(tmp_path, "n3"))
    third = _resume(tmp_path, ("n0", "n2"), tmp_path / "third")
    said = third.rank_logs()[0]
    step = CRASH + 1
    assert third.loaded_step == step, third.log[-4000:]
    assert f"restarting from the memory save of iteration {step} (global_step{step}, saved by 3 node(s))" in said, said
    assert "replicas used for node 2" in said, said[-3000:]
    assert_same_state(tmp_path / "dumps" / f"state_step{step}.pt", tmp_path / "third" / f"state_step{step}_loaded.pt")
    assert third.ok and third.steps[-1] == STEPS, third.log[-3000:]


def test_a_rank_dying_with_its_memory_commit_in_flight_ends_the_job_and_the_restart_takes_the_previous_one(
    tmp_path: Path,
) -> None:
    """Rank 1's writer thread is held in the commit of the memory save of step 4 (taken at step 5's start) while its
    main thread trains step 5 and raises: the job dies of it (no rank waits for the commit it can no longer finish),
    the generation of step 4 stays uncommitted, and the survivors resume from the memory save of step 3, bit for bit,
    saying why step 4 was passed over."""
    job = tmp_path / "job"
    crashed = run_training(
        TrainSpec(
            dp=4,
            steps=7,
            save_dir=job / "ckpt",
            memory_every=1,
            crash=(5, 1),
            crash_in_commit=True,
            expect_failure=True,
            dump_dir=job / "dumps",
            plugin=True,
            plugin_kwargs=_memory(job),
            env={
                "MEGATRON_UCP_NODE_NAMES": ",".join(NODES),
                "MEGATRON_UCP_TEST_FAULT": "memory 4: replicate:1:pause600",
            },
            timeout=300,
        )
    )
    assert crashed.returncode not in (0, 124) and crashed.steps[-1] == 5, crashed.log[-3000:]
    assert "harness: rank 1 dies of an exception after step 5" in crashed.log, crashed.log[-3000:]
    (job / "ckpt").mkdir(exist_ok=True)
    shutil.rmtree(job / "local" / "n1")
    resumed = _resume(job, ("n0", "n2", "n3"), tmp_path / "resumed", steps=7)
    said = resumed.rank_logs()[0]
    assert resumed.loaded_step == 3 and "restarting from the memory save of iteration 3" in said, said[-4000:]
    assert "iteration 4: not committed" in said, said[-4000:]
    assert_same_state(job / "dumps" / "state_step3.pt", tmp_path / "resumed" / "state_step3_loaded.pt")
    assert resumed.ok and resumed.steps[-1] == 7, resumed.log[-3000:]

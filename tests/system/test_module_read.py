"""Each byte read once across the job (``module_read = distributed``, the default with the hooks).

A restart reads, on each rank, only its share: its optimizer partition ranges, the model-states
pickle, and its 1/DP range of the saved weights; the module's weights are rebuilt from the masters.

* Per-rank storage reads, exact: every rank loads its own private copy of the checkpoint, evicted
  from the page cache first (``UCP_HARNESS_PRIVATE_COPIES``), so what is cached of a copy afterwards
  (``mincore``, tests/support/page_cache.py) is what that rank read of each file. A model big enough
  for its files to span many pages (about 0.2M params).
  DP 4 -> 3 (native reshard) and a same-DP restart, each against ``module_read=full`` on the same
  files: the job reads the checkpoint about once, not once per rank.
* Exactly what DeepSpeed's own load gives (one same-DP launch trying several folders, each load's
  module digest compared with the module the file holds): clean stock and hooked saves (rebuilt),
  a save whose saved weights are the masters rounded otherwise than to nearest, and a hooked save
  whose model-states file was edited since (both read in full, with one warning naming the file).
* A rank that dies during the exchange: one clear error on every surviving rank, no training step.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
import torch

from tests.support.dsharness import TrainSpec, run_training
from tests.support.dsharness.checkpoints import model_states_file, rank_file
from tests.support.elastic_support import assert_losses_continue, private_copy, resume, ucp_lines
from tests.support.page_cache import evict, resident_bytes

pytestmark = pytest.mark.slow

TAG = "global_step2"
MEDIUM = {"hidden": 48, "vocab": 2048, "num_layers": 2}
"""~0.2M parameters: the module (bf16) spans ~100 pages, each rank's optimizer share many more."""


def _medium(ds_checkpoint, plugin: bool):
    return ds_checkpoint("bf16", 4, plugin=plugin, **MEDIUM)


def _private_copies(src: Path, base: Path, ranks: int) -> Path:
    """``base.rank<r>`` for every rank, evicted; returns ``base`` (the spec's load_dir, never read itself)."""
    for r in range(ranks):
        copy = base.with_name(f"{base.name}.rank{r}")
        evict(private_copy(src, copy))
    return base


def _reads(src: Path, folder: Path, dp: int, module_read: str, **fields) -> list[dict]:
    base = _private_copies(src, folder / "ckpt", dp)
    res = resume(
        dp,
        "bf16",
        base,
        folder,
        load_tag=TAG,
        plugin_kwargs={"module_read": module_read},
        env={"UCP_HARNESS_PRIVATE_COPIES": "1"},
        steps=3,
        **MEDIUM,
        **fields,
    )
    copies = [base.with_name(f"{base.name}.rank{r}") / TAG for r in range(dp)]
    names = sorted(p.name for p in copies[0].iterdir() if p.name.endswith("_states.pt"))
    return res, [{name: resident_bytes(copy / name) for name in names} for copy in copies]


def _size(path: Path) -> int:
    return path.stat().st_size


@pytest.mark.parametrize("dp", [3, 4], ids=["reshard", "same-dp"])
def test_each_rank_reads_its_share_and_the_job_reads_the_checkpoint_once(ds_checkpoint, tmp_path, dp: int):
    ck = _medium(ds_checkpoint, plugin=False)
    tag = ck.root / TAG
    checkpoint = sum(_size(p) for p in tag.iterdir() if p.is_file())
    module = _size(model_states_file(tag))
    optimizer = sum(_size(rank_file(tag, r)) for r in range(4))
    once, once_reads = _reads(ck.root, tmp_path / "distributed", dp, "distributed")
    full, full_reads = _reads(ck.root, tmp_path / "full", dp, "full")
    page, states = 4096, "mp_rank_00_model_states.pt"
    # every rank reads the whole model states in full mode; its pickle and 1/DP of the weights here
    assert all(r[states] >= module - page for r in full_reads), (full_reads, module)
    assert all(r[states] <= module / dp + 16 * page for r in once_reads), (once_reads, module)
    optimizer_reads = [sum(v for k, v in r.items() if k != states) for r in once_reads]
    assert all(r <= 1.05 * optimizer / dp + 8 * 4 * page for r in optimizer_reads), (optimizer_reads, optimizer)
    total = sum(sum(r.values()) for r in once_reads)
    assert total <= 1.05 * checkpoint + dp * 5 * 2 * page, (total, checkpoint)
    line = "module weights rebuilt from the masters"
    assert any(line in x for x in ucp_lines(once.log)) and not any(line in x for x in ucp_lines(full.log))
    for rank in range(dp):  # the same engine either way, module included
        a = torch.load(Path(once.dumps[f"rank{rank}_step2_loaded"]), weights_only=False)
        b = torch.load(Path(full.dumps[f"rank{rank}_step2_loaded"]), weights_only=False)
        assert a["module"].keys() == b["module"].keys()
        for name in a["module"]:
            assert torch.equal(a["module"][name], b["module"][name]), (rank, name)
        for x, y in zip(a["fp32"], b["fp32"], strict=True):
            assert torch.equal(x, y)
    assert once.losses == full.losses
    assert_losses_continue(once, ck.loss_at)


def _file_digest(model_states: Path) -> str:
    """The digest the harness takes of a loaded module (worker.module_digest), of the module a file holds."""
    module = torch.load(model_states, weights_only=False)["module"]
    h = hashlib.sha256()
    for name, tensor in module.items():
        flat = tensor.detach().contiguous().reshape(-1)
        h.update(f"{name}:{flat.dtype}:{flat.numel()};".encode())
        h.update(flat.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _round_otherwise(model_states: Path, masters: Path) -> None:
    """Eight saved weights replaced by the other bf16 value around their fp32 master (as a truncating or
    stochastically rounding optimizer might have left them): still the masters rounded, not to nearest."""
    sd = torch.load(model_states, weights_only=False)
    full = torch.load(masters, weights_only=False)  # the run's dump: each parameter's fp32 master
    name = next(n for n, t in sd["module"].items() if t.dtype == torch.bfloat16 and t.numel() > 64)
    weights, master = sd["module"][name].view(-1), full[name]["fp32"].reshape(-1)
    bits = master.view(torch.int32)
    inexact = ((bits & 0xFFFF) != 0).nonzero().reshape(-1)[:8]
    low = (bits[inexact] & ~0xFFFF).view(torch.float32).to(torch.bfloat16)
    high = ((bits[inexact] & ~0xFFFF) + 0x10000).view(torch.float32).to(torch.bfloat16)
    weights[inexact] = torch.where(weights[inexact] == low, high, low)
    torch.save(sd, model_states)


@pytest.mark.parametrize("opt", ["bf16", "zero"])
def test_a_restart_gives_exactly_what_deepspeeds_load_gives(ds_checkpoint, tmp_path, opt: str):
    """On every release of the matrix too (Makefile ELASTIC_TESTS), with the class stock trains there; the
    session's shared DP 4 saves of the small model."""
    stock, hooked = ds_checkpoint(opt, 4), ds_checkpoint(opt, 4, plugin=True)
    folders = {
        "stock": private_copy(stock.root, tmp_path / "stock"),
        "hooked": private_copy(hooked.root, tmp_path / "hooked"),
        "stock-rounded-otherwise": private_copy(stock.root, tmp_path / "stock-rounded-otherwise"),
        "hooked-edited": private_copy(hooked.root, tmp_path / "hooked-edited"),
    }
    _round_otherwise(model_states_file(folders["stock-rounded-otherwise"] / TAG), stock.dump("state_step2"))
    _round_otherwise(model_states_file(folders["hooked-edited"] / TAG), hooked.dump("state_step2"))
    attempts = [{"name": n, "dir": str(f), "tag": TAG, "digest": True} for n, f in folders.items()]
    attempts.append({"name": "stock-full", "dir": str(folders["stock"]), "tag": TAG, "digest": True,
                     "plugin_kwargs": {"module_read": "full"}})  # fmt: skip
    good = private_copy(hooked.root, tmp_path / "good")
    res = resume(4, opt, good, tmp_path / "run", load_tag=TAG, refuse=attempts, steps=3)
    for name, folder in folders.items():
        outcomes = res.refusals[name]
        assert all(o == ["loaded", _file_digest(model_states_file(folder / TAG))] for o in outcomes), (name, outcomes)
    assert res.refusals["stock-full"] == res.refusals["stock"]
    lines = ucp_lines(res.log)
    rebuilt = [x for x in lines if "rebuilt from the masters (one all-gather), proven equal" in x]
    read_in_full = [x for x in lines if "reading the module in full on every rank" in x]
    assert len(rebuilt) == 3, lines  # stock, hooked, and the real load
    assert len(read_in_full) == 2 and all("mp_rank_00_model_states.pt" in x for x in read_in_full), lines
    assert any("rounded-otherwise" in x for x in read_in_full) and any("hooked-edited" in x for x in read_in_full)
    assert res.loaded_step == 2 and res.steps == [3]
    assert_losses_continue(res, hooked.loss_at)


def test_a_rank_that_dies_in_the_exchange_stops_every_rank_with_one_error(ds_checkpoint, tmp_path):
    ck = ds_checkpoint("bf16", 4)
    root = private_copy(ck.root, tmp_path / "ckpt")
    res = run_training(
        TrainSpec(
            dp=3,
            optimizer="bf16",
            steps=4,
            load_dir=root,
            load_tag=TAG,
            plugin=True,
            expect_failure=True,
            timeout=600,
            env={"MEGATRON_UCP_TEST_DIE": "module exchange:2"},
        )
    )
    assert res.returncode != 0 and res.losses == [], res.log[-3000:]
    survivors = [section for section in res.log.split("===== rank ")[1:] if not section.startswith("2 ")]
    for section in survivors:
        assert "the engine is half-loaded: do not train on it" in section, section[-3000:]
    assert "(exit 17)" in res.log
    shutil.rmtree(root)

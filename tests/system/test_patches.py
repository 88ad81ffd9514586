"""patches/: the upstream diffs against DeepSpeed 0.19.8 and Megatron-DeepSpeed's entry script.

The DeepSpeed patches are applied (``git apply``) to a copy of the installed package, never to the
package itself; runs that need them put the copy first on PYTHONPATH and do NOT install
megatron-ucp's hooks, so everything checked here is DeepSpeed's own behaviour, patched or stock.

Scenario (tests/support/dsharness defaults): DP=4; the no-weight-decay group is 3 norm weights of size 3,
N = 9, alignment 8, padded 16, partition 4: rank 2 holds 1 real element, rank 3 none.
  stock save         group_paddings of that group [0, 0, 0, 7] -> stock ds_to_universal: narrow() crash
  stock load_universal at DP=4                                  -> IndexError on ranks 2 and 3
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import py_compile
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path
from typing import Optional

import pytest
import torch

from megatron_ucp.format import dsformat as F

REPO = Path(__file__).resolve().parents[2]
PATCHES = REPO / "patches"
DS_PATCH_DIR = PATCHES / "deepspeed-0.19.8"
MEGATRON_PATCH = PATCHES / "megatron-deepspeed" / "0001-install-megatron-ucp.patch"
MEGATRON_SNAPSHOT = Path(
    os.environ.get("MEGATRON_DEEPSPEED_DIR", "") or REPO.parent / "shared" / "third_party" / "megatron-deepspeed"
)
PATCHED_FOR = "0.19.8"
NORM_GROUP = 1  # harness: group 0 = weight decay, group 1 = the 3 norm weights


# ---- helpers: patches ------------------------------------------------------------------------------


def ds_patches() -> list[Path]:
    return sorted(DS_PATCH_DIR.glob("[0-9][0-9][0-9][0-9]-*.patch"))


def touched_files(patch: Path) -> list[str]:
    return re.findall(r"^diff --git a/(\S+) b/\S+$", patch.read_text(), flags=re.M)


def installed_deepspeed() -> Path:
    spec = importlib.util.find_spec("deepspeed")  # located, not imported
    assert spec is not None and spec.submodule_search_locations, "deepspeed is not installed"
    return Path(list(spec.submodule_search_locations)[0])


def installed_deepspeed_version() -> str:
    from importlib.metadata import version

    return version("deepspeed")


def git_apply(root: Path, patch: Path, *flags: str) -> subprocess.CompletedProcess:
    if shutil.which("git") is None:
        pytest.skip("git is not installed: cannot apply patches (git apply)")
    # root is never inside a work tree of ours, but make sure git does not look above it.
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(root.parent))
    return subprocess.run(
        ["git", "apply", "-p1", *flags, str(patch)], cwd=root, env=env, capture_output=True, text=True
    )


def copy_files(dest: Path, rel_paths: list[str]) -> Path:
    """Copy only the named files of the installed package (paths like deepspeed/x.py) under dest."""
    src_root = installed_deepspeed().parent
    for rel in rel_paths:
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src_root / rel, dest / rel)
    return dest


def require_patched_version() -> None:
    found = installed_deepspeed_version()
    if found != PATCHED_FOR:
        pytest.skip(f"the patches are for DeepSpeed {PATCHED_FOR}; {found} is installed")


def patched_deepspeed_root() -> Path:
    """A patched copy of the installed deepspeed package: ``<root>/deepspeed``.

    Kept in a stable place keyed by the installed package and the patches, so that DeepSpeed's
    JIT-built CPU comm op (built per source path, ~30 s) is built once, not once per session.
    Made atomically: copy + apply in a temporary sibling, then rename.
    """
    src = installed_deepspeed()
    h = hashlib.sha1(f"{src}|{installed_deepspeed_version()}".encode())
    for p in ds_patches():
        h.update(p.read_text().split("\ndiff --git ", 1)[-1].encode())  # the diff, not the header
        for rel in touched_files(p):
            h.update((src.parent / rel).read_bytes())
    cache = Path(os.environ.get("UCP_TEST_CACHE", Path.home() / ".cache" / "megatron-ucp-test-extensions"))
    root = cache / f"patched-deepspeed-{h.hexdigest()[:12]}"
    marker = root / "deepspeed" / ".megatron-ucp-patched"
    if marker.exists():
        return root
    tmp = root.with_name(f"{root.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shutil.copytree(src, tmp / "deepspeed", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for p in ds_patches():
        r = git_apply(tmp, p)
        assert r.returncode == 0, f"{p.name} does not apply:\n{r.stderr}"
    (tmp / "deepspeed" / ".megatron-ucp-patched").write_text("\n".join(p.name for p in ds_patches()))
    try:
        tmp.rename(root)
    except OSError:  # someone else made it first
        shutil.rmtree(tmp, ignore_errors=True)
    assert marker.exists()
    return root


# ---- helpers: runs and checkpoints -------------------------------------------------------------------


def child_env(deepspeed_root: Optional[Path]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_UCP")}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(deepspeed_root)] if deepspeed_root else [])
    if not env["PYTHONPATH"]:
        del env["PYTHONPATH"]
    return env


def ds_to_universal(tag_dir: Path, output: Path, deepspeed_root: Optional[Path]) -> subprocess.CompletedProcess:
    """DeepSpeed's own converter, from the patched copy or (deepspeed_root=None) the installed package."""
    cmd = [
        sys.executable,
        "-m",
        "deepspeed.checkpoint.ds_to_universal",
        "--input_folder",
        str(tag_dir),
        "--output_folder",
        str(output),
        "--inject_missing_state",
        "--num_extract_workers",
        "1",
        "--num_merge_workers",
        "1",
    ]
    return subprocess.run(
        cmd, env=child_env(deepspeed_root), cwd=tag_dir.parent, capture_output=True, text=True, timeout=600
    )


def train(deepspeed_root: Optional[Path], **kwargs):
    """A harness run with the patched copy first on the ranks' PYTHONPATH (no megatron-ucp hooks)."""
    from tests.support.dsharness import TrainSpec, run_training

    env = {}
    if deepspeed_root is not None:
        env = {"PYTHONPATH": str(deepspeed_root), "TORCH_EXTENSIONS_DIR": str(deepspeed_root / "torch_extensions")}
    return run_training(TrainSpec(dp=4, env=env, **kwargs))


def rank_files(tag_dir: Path) -> list[Path]:
    files = {int(m["dp"]): tag_dir / name for name in os.listdir(tag_dir) if (m := F.OPTIM_FILE_RE.match(name))}
    return [files[r] for r in sorted(files)]


def optim_sd(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)[F.OPTIMIZER_STATE_DICT]


def group_numels() -> list[int]:
    from tests.support.dsharness import build_model, tiny_model_param_groups

    return [sum(p.numel() for p in g["params"]) for g in tiny_model_param_groups(build_model())]


def expected_geometry(n: int, dp: int, rank: int, align_factor: int = 2) -> tuple[int, int]:
    """(partition size, true length) written out independently of megatron_ucp.plan.geometry."""
    alignment = align_factor * dp
    padded = -(-n // alignment) * alignment
    size = padded // dp
    return size, min(max(n - rank * size, 0), size)


def assert_records_geometry(tag_dir: Path, dp: int = 4) -> list[dict]:
    numels = group_numels()
    sds = [optim_sd(f) for f in rank_files(tag_dir)]
    assert len(sds) == dp
    for rank, sd in enumerate(sds):
        sizes, trues = zip(*(expected_geometry(n, dp, rank) for n in numels))
        assert sd[F.GROUP_TRUE_LENGTHS] == list(trues), rank
        assert sd[F.GROUP_PADDINGS] == [s - t for s, t in zip(sizes, trues, strict=True)], rank
        assert sd[F.ZERO_PARTITION_INFO] == {
            "version": F.ZERO_PARTITION_INFO_VERSION,
            "dp_size": dp,
            "dp_rank": rank,
            "alignment": 2 * dp,
            "group_numels": numels,
            "padded_group_numels": numels,
            "partition_sizes": list(sizes),
        }, rank
    # the scenario this file is about: the norm group leaves rank 3 with padding only
    assert [sd[F.GROUP_TRUE_LENGTHS][NORM_GROUP] for sd in sds] == [4, 4, 1, 0]
    return sds


def universal_tensors(root: Path) -> dict[str, object]:
    tag = (root / F.LATEST_UNIVERSAL).read_text().strip()
    zero = root / tag / F.UNIVERSAL_ZERO_DIR
    out = {}
    for folder in sorted(p for p in zero.iterdir() if p.is_dir()):
        for f in sorted(folder.glob("*.pt")):
            value = torch.load(f, weights_only=False)
            out[f"{folder.name}/{f.stem}"] = value[F.PARAM] if isinstance(value, dict) else value
    return out


def same_value(a, b) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        a, b = torch.as_tensor(a), torch.as_tensor(b)
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return a == b


# ---- fast tests: the patch files themselves ----------------------------------------------------------


def test_patch_set_is_complete_and_documented():
    names = [p.name for p in ds_patches()]
    assert len(names) == 4, names
    for p in ds_patches() + [MEGATRON_PATCH]:
        text = p.read_text()
        header = text.split("\ndiff --git ", 1)[0]
        for section in ("Subject:", "What", "Why", "How tested"):
            assert re.search(rf"^{section}", header, flags=re.M), f"{p.name}: header lacks {section!r}"
        assert touched_files(p), f"{p.name} has no diff"
        for rel in touched_files(p):
            assert not rel.startswith(("/", "..")), rel
    assert (PATCHES / "README.md").is_file()


def test_deepspeed_patches_apply_cleanly_in_order(tmp_path):
    require_patched_version()
    rels = sorted({rel for p in ds_patches() for rel in touched_files(p)})
    root = copy_files(tmp_path / "pristine", rels)
    for p in ds_patches():
        check = git_apply(root, p, "--check", "--verbose")
        assert check.returncode == 0, f"{p.name}:\n{check.stderr}"
        assert "with fuzz" not in check.stderr and "offset" not in check.stderr.lower(), check.stderr
        assert git_apply(root, p).returncode == 0
    for rel in rels:
        py_compile.compile(str(root / rel), doraise=True)
    # and they come out again exactly (nothing half-applied)
    for p in reversed(ds_patches()):
        assert git_apply(root, p, "-R").returncode == 0, p.name
    src = installed_deepspeed().parent
    for rel in rels:
        assert (root / rel).read_bytes() == (src / rel).read_bytes(), rel


@pytest.mark.parametrize("index", [0, 2, 3])
def test_independent_patches_apply_alone(tmp_path, index):
    """1/4, 3/4 and 4/4 are independent fixes (2/4 uses the constants that 1/4 adds)."""
    require_patched_version()
    patch = ds_patches()[index]
    root = copy_files(tmp_path, touched_files(patch))
    r = git_apply(root, patch, "--check")
    assert r.returncode == 0, r.stderr


def test_megatron_patch_applies_to_pretrain_gpt_alcf(tmp_path):
    """Against the pinned snapshot of argonne-lcf/Megatron-DeepSpeed (MEGATRON_DEEPSPEED_DIR, default
    ../shared/third_party/megatron-deepspeed); tests/integration runs the patched script for real."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    source = MEGATRON_SNAPSHOT / "pretrain_gpt_alcf.py"
    if not source.is_file():
        pytest.skip(f"no Megatron-DeepSpeed snapshot at {MEGATRON_SNAPSHOT} (set MEGATRON_DEEPSPEED_DIR)")
    script = tmp_path / "pretrain_gpt_alcf.py"
    script.write_text(source.read_text())
    r = git_apply(tmp_path, MEGATRON_PATCH, "--check", "--verbose")
    assert r.returncode == 0, r.stderr
    assert git_apply(tmp_path, MEGATRON_PATCH).returncode == 0
    py_compile.compile(str(script), doraise=True)
    text = script.read_text()
    assert text.index("import megatron_ucp") > text.index("import deepspeed\n")
    assert text.index("megatron_ucp.install()") < text.index("def main(")


def _added_lines(patch: Path) -> str:
    return "\n".join(
        line[1:] for line in patch.read_text().splitlines() if line.startswith("+") and not line.startswith("+++")
    )


@pytest.mark.parametrize(
    "env_value,available,expect_install",
    [(None, True, True), ("1", True, True), ("0", True, False), (None, False, False)],
)
def test_megatron_patch_snippet_behaviour(monkeypatch, env_value, available, expect_install):
    """The lines the patch adds: install() when the package is there, unless MEGATRON_UCP=0;
    a missing package is not an error."""
    calls = []
    if available:
        fake = types.ModuleType("megatron_ucp")
        fake.install = lambda *a, **k: calls.append((a, k))
        monkeypatch.setitem(sys.modules, "megatron_ucp", fake)
    else:
        monkeypatch.setitem(sys.modules, "megatron_ucp", None)  # import raises ImportError
    if env_value is None:
        monkeypatch.delenv("MEGATRON_UCP", raising=False)
    else:
        monkeypatch.setenv("MEGATRON_UCP", env_value)
    exec(compile(_added_lines(MEGATRON_PATCH), "snippet", "exec"), {"os": os})
    assert calls == ([((), {})] if expect_install else [])


def test_real_install_is_callable_without_arguments():
    """The Megatron patch calls megatron_ucp.install() with no arguments (settings from the env)."""
    import inspect

    import megatron_ucp

    sig = inspect.signature(megatron_ucp.install)
    assert all(
        p.default is not inspect.Parameter.empty or p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
        for p in sig.parameters.values()
    )


# ---- slow tests: real DeepSpeed, CPU, gloo, 4 processes --------------------------------------------

slow = pytest.mark.slow


@pytest.fixture(scope="module")
def patched_ds() -> Path:
    require_patched_version()
    return patched_deepspeed_root()


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("patches")


@pytest.fixture(scope="module")
def bf16_patched(patched_ds, work):
    """Patched BF16_Optimizer, DP=4: 4 steps, saved at step 2 (no hooks)."""
    root = work / "bf16_patched"
    res = train(patched_ds, optimizer="bf16", steps=4, save_dir=root, save_at=(2,), dump_dir=work / "bf16_dumps")
    assert res.optimizer_class == "BF16_Optimizer"
    return root, res


@pytest.fixture(scope="module")
def bf16_universal(bf16_patched, work):
    """The patched save converted by the STOCK (installed) ds_to_universal."""
    root, _ = bf16_patched
    out = work / "bf16_universal"
    r = ds_to_universal(root / "global_step2", out / "global_step2_universal", deepspeed_root=None)
    assert r.returncode == 0, r.stderr[-4000:]
    return out


@pytest.fixture(scope="module")
def zero_patched(patched_ds, work):
    """Patched DeepSpeedZeroOptimizer (bf16, ZeRO-1), DP=4: 3 steps, saved at step 2 (no hooks)."""
    root = work / "zero_patched"
    res = train(patched_ds, optimizer="zero", steps=3, save_dir=root, save_at=(2,))
    assert res.optimizer_class == "DeepSpeedZeroOptimizer"
    return root, res


@slow
def test_patched_bf16_save_records_per_rank_geometry(patched_ds, bf16_patched):
    root, res = bf16_patched
    assert res.info.get("ds_version") == PATCHED_FOR
    assert_records_geometry(root / "global_step2")


@slow
def test_patched_bf16_training_is_bit_identical_to_stock(bf16_patched, work):
    """Patch 1/4 changes bookkeeping only: same fp32 masters and optimizer states as stock at step 2."""
    from tests.support.ckpt_cache import built_checkpoint

    stock = torch.load(built_checkpoint(optimizer="bf16", dp=4).dump, weights_only=False)
    patched = torch.load(work / "bf16_dumps" / "state_step2.pt", weights_only=False)
    assert stock.keys() == patched.keys()
    for name in stock:
        for key in stock[name]:
            assert same_value(stock[name][key], patched[name][key]), (name, key)


@slow
def test_stock_converter_converts_patched_bf16_checkpoint(bf16_universal):
    tensors = universal_tensors(bf16_universal)
    norms = [k for k in tensors if "layernorm" in k and k.endswith("/fp32")]
    assert len(norms) == 3 and all(tensors[k].shape == (3,) for k in norms)


@slow
def test_patched_converter_converts_stock_bf16_checkpoint(patched_ds, bf16_universal, work):
    """Patch 3/4 on checkpoints that already exist (last-rank padding 7 > partition 4)."""
    from tests.support.ckpt_cache import built_checkpoint

    stock_tag = built_checkpoint(optimizer="bf16", dp=4).root / "global_step2"
    assert [optim_sd(f)[F.GROUP_PADDINGS][NORM_GROUP] for f in rank_files(stock_tag)] == [0, 0, 0, 7]
    unpatched = ds_to_universal(stock_tag, work / "stock_conv_unpatched" / "global_step2_universal", None)
    assert unpatched.returncode != 0 and "narrow(): length must be non-negative" in unpatched.stderr, unpatched.stderr[
        -2000:
    ]
    out = work / "stock_conv_patched"
    patched = ds_to_universal(stock_tag, out / "global_step2_universal", patched_ds)
    assert patched.returncode == 0, patched.stderr[-4000:]
    # same training state at step 2: the old checkpoint converts to exactly what the new one does
    old, new = universal_tensors(out), universal_tensors(bf16_universal)
    assert old.keys() == new.keys()
    for key in old:
        assert same_value(old[key], new[key]), key


@slow
def test_patched_universal_load_with_padding_only_ranks_bf16(patched_ds, bf16_patched, bf16_universal, work):
    """Patch 4/4: DP=4 load where rank 3 holds padding only in the norm group; training continues
    exactly as the uninterrupted run, and the next save is consistent and converts again."""
    _, reference = bf16_patched
    root = work / "bf16_resumed"
    dumps = work / "bf16_resumed_dumps"
    res = train(
        patched_ds,
        optimizer="bf16",
        steps=4,
        load_dir=bf16_universal,
        load_universal=True,
        save_dir=root,
        save_at=(4,),
        dump_dir=dumps,
    )
    assert res.loaded_step == 2
    assert res.steps == [3, 4]
    assert res.losses == [reference.loss_at(3), reference.loss_at(4)]
    for rank in range(4):
        loaded = torch.load(dumps / f"rank{rank}_step2_loaded.pt", weights_only=False)
        for g, state in enumerate(loaded["optim_state"]):
            assert set(state) == {"exp_avg", "exp_avg_sq", "step"}, (rank, g, set(state))
            assert float(state["step"]) == 2.0, (rank, g)
            assert state["exp_avg"].shape == loaded["fp32"][g].shape
    padding_only = torch.load(dumps / "rank3_step2_loaded.pt", weights_only=False)["optim_state"][NORM_GROUP]
    assert not padding_only["exp_avg"].any() and not padding_only["exp_avg_sq"].any()
    # the next save: every rank at step 4 in every group, and it converts
    for f in rank_files(root / "global_step4"):
        states = optim_sd(f)[F.BASE_OPTIMIZER_STATE]["state"]
        assert [float(states[g]["step"]) for g in sorted(states)] == [4.0, 4.0], f.name
    r = ds_to_universal(root / "global_step4", work / "bf16_resumed_universal" / "global_step4_universal", None)
    assert r.returncode == 0, r.stderr[-4000:]


@slow
def test_stock_universal_load_fails_with_padding_only_ranks(bf16_universal):
    """Control: without patch 4/4 the same load dies, so the test above tests something."""
    from tests.support.dsharness import TrainSpec, run_training

    res = run_training(
        TrainSpec(
            dp=4,
            optimizer="bf16",
            steps=3,
            load_dir=bf16_universal,
            load_universal=True,
            expect_failure=True,
            env={"PYTHONPATH": ""},
        )
    )
    assert res.returncode != 0
    assert "IndexError: list index out of range" in res.log and "steps[0]" in res.log, res.log[-3000:]
    rank3 = res.log.split("===== rank 3 ", 1)[-1]
    assert "IndexError: list index out of range" in rank3  # the rank whose norm partition is all padding


@slow
def test_patched_zero_optimizer_records_geometry_and_loads_universal(patched_ds, zero_patched, work):
    root, reference = zero_patched
    assert_records_geometry(root / "global_step2")
    out = work / "zero_universal"
    r = ds_to_universal(root / "global_step2", out / "global_step2_universal", deepspeed_root=None)
    assert r.returncode == 0, r.stderr[-4000:]
    res = train(patched_ds, optimizer="zero", steps=3, load_dir=out, load_universal=True)
    assert res.loaded_step == 2 and res.losses == [reference.loss_at(3)]


@slow
@pytest.mark.parametrize("optimizer", ["bf16", "zero"])
def test_hooks_and_patches_agree(optimizer, request):
    """Stock DeepSpeed + megatron-ucp hooks vs patched DeepSpeed without hooks: the same recorded
    keys on every rank, and the same tensors."""
    from tests.support.ckpt_cache import built_checkpoint

    patched_root, _ = request.getfixturevalue(f"{optimizer}_patched")
    hooked_tag = built_checkpoint(optimizer=optimizer, dp=4, plugin=True).root / "global_step2"
    patched_files, hooked_files = rank_files(patched_root / "global_step2"), rank_files(hooked_tag)
    assert [f.name for f in patched_files] == [f.name for f in hooked_files]
    for pf, hf in zip(patched_files, hooked_files, strict=True):
        p, h = optim_sd(pf), optim_sd(hf)
        for key in (F.GROUP_PADDINGS, F.GROUP_TRUE_LENGTHS, F.ZERO_PARTITION_INFO):
            assert p[key] == h[key], (pf.name, key, p[key], h[key])
        for g, (pt, ht) in enumerate(
            zip(p[F.SINGLE_PARTITION_OF_FP32_GROUPS], h[F.SINGLE_PARTITION_OF_FP32_GROUPS], strict=True)
        ):
            assert same_value(pt, ht), (pf.name, g)

"""``megatron-ucp export-hf`` on checkpoints the synthetic writer makes as DeepSpeed saves a Megatron llama model
(the proof against the real fork's forward is tests/integration: these check the folder, the tensors, the refusals
and the background export, in seconds).

* the export loads in ``transformers`` with no network, and every tensor is its master's rows, rebuilt here
  independently of the exporter's row plan (``query_key_value`` viewed as ``[nkv, nq / nkv + 2, head_dim, h]``);
  the bf16 export is torch's rounding of the fp32 one;
* the same model saved at DP 2 and DP 3 exports byte for byte the same;
* a model the export cannot map is refused before anything is converted or written;
* the background converter exports each converted tag, keeps the last N, and a failed export reaches ``status`` in
  its own words.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from megatron_ucp.background import queue as B
from megatron_ucp.background.status import root_status
from megatron_ucp.background.status_text import format_status
from megatron_ucp.background.store import ConverterSettings, read_queue
from megatron_ucp.background.trigger import trigger, wait_for_converter
from megatron_ucp.cli import main as cli_main
from megatron_ucp.config import UcpConfig
from megatron_ucp.integration.save import async_trigger
from megatron_ucp.plan.llama_shapes import LlamaShape
from megatron_ucp.synthetic.writer import SyntheticSpec, write_checkpoint

transformers = pytest.importorskip("transformers")
SHAPE = dict(layers=2, hidden=64, ffn=96, heads=8, kv_heads=2, vocab=384, original_vocab=257)


def _synthetic(root: Path, experts: int = 0, swiglu: bool = True, **kw) -> Path:
    shape = LlamaShape(**SHAPE, experts=experts, swiglu=swiglu)
    return write_checkpoint(root, SyntheticSpec(shape=shape, **kw), progress=False).tag_dir


def _export(*argv: str) -> int:
    return cli_main(["-q", "export-hf", *argv, "--no-progress"])


@pytest.fixture(scope="module")
def tp2(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hf") / "tp2"
    _synthetic(root, tp=2, dp=2)
    assert _export(str(root), "--dtype", "fp32") == 0
    return root


def _master(root: Path, name: str) -> torch.Tensor:
    return torch.load(root / "global_step100_universal" / "zero" / name / "fp32.pt", weights_only=False)["param"]


def test_export_loads_offline_and_holds_every_master_row(tp2):
    import huggingface_hub.constants

    assert huggingface_hub.constants.HF_HUB_OFFLINE is True  # read at its import: tests/conftest.py set it first
    out = tp2 / "global_step100_hf"
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert all(mode & 0o044 == 0o044 for mode in modes.values()), modes  # a shared file system's group reads them
    assert json.loads((out / "ucp_export.json").read_text())["masters_checked"] == 2 * 6 + 3
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    hf = dict(model.named_parameters())
    assert len(hf) == 2 * 9 + 3 and model.config.num_key_value_heads == 2 and model.config.vocab_size == 257
    pre = "language_model.encoder.layers."
    for i in range(2):
        qkv = _master(tp2, f"{pre}{i}.self_attention.query_key_value.weight").view(2, 6, 8, 64)
        gate, up = _master(tp2, f"{pre}{i}.mlp.dense_h_to_4h.weight").chunk(2)
        want = {
            "self_attn.q_proj": qkv[:, :4].reshape(64, 64),
            "self_attn.k_proj": qkv[:, 4].reshape(16, 64),
            "self_attn.v_proj": qkv[:, 5].reshape(16, 64),
            "self_attn.o_proj": _master(tp2, f"{pre}{i}.self_attention.dense.weight"),
            "mlp.gate_proj": gate,
            "mlp.up_proj": up,
            "mlp.down_proj": _master(tp2, f"{pre}{i}.mlp.dense_4h_to_h.weight"),
            "input_layernorm": _master(tp2, f"{pre}{i}.input_layernorm.weight"),
            "post_attention_layernorm": _master(tp2, f"{pre}{i}.post_attention_layernorm.weight"),
        }
        for part, tensor in want.items():
            assert torch.equal(hf[f"model.layers.{i}.{part}.weight"], tensor), (i, part)
    assert torch.equal(hf["model.embed_tokens.weight"], _master(tp2, "language_model.embedding.word_embeddings.weight"))
    assert torch.equal(hf["lm_head.weight"], _master(tp2, "language_model.output_layer.weight"))
    assert torch.equal(hf["model.norm.weight"], _master(tp2, "language_model.encoder.final_layernorm.weight"))
    logits = model(torch.tensor([[1, 5, 256, 3]])).logits
    assert logits.shape == (1, 4, 257) and torch.isfinite(logits).all()

    assert _export(str(tp2), "--output", str(tp2 / "bf16"), "--max-shard-size", "0.00005") == 0
    bf16 = transformers.AutoModelForCausalLM.from_pretrained(tp2 / "bf16", dtype=torch.bfloat16)
    assert len(json.loads((tp2 / "bf16" / "model.safetensors.index.json").read_text())["weight_map"]) == len(hf)
    assert len(list((tp2 / "bf16").glob("model-*.safetensors"))) > 1
    for name, tensor in bf16.named_parameters():
        assert torch.equal(tensor, hf[name].to(torch.bfloat16)), name


def test_an_existing_export_is_replaced_only_with_force(tp2, capsys):
    out = tp2 / "global_step100_hf"
    before = (out / "ucp_export.json").stat().st_mtime_ns
    assert _export(str(tp2), "--dtype", "fp32") == 2
    assert "already exists; pass --force" in capsys.readouterr().err
    assert _export(str(tp2), "--dtype", "fp32", "--force") == 0
    assert (out / "ucp_export.json").stat().st_mtime_ns != before
    assert not [p for p in tp2.iterdir() if p.name.startswith(".")]


def test_exports_do_not_depend_on_the_dp_size_that_saved(tmp_path):
    for dp in (2, 3):
        _synthetic(tmp_path / f"dp{dp}", dp=dp)
        assert _export(str(tmp_path / f"dp{dp}")) == 0
    files = sorted(p.name for p in (tmp_path / "dp2" / "global_step100_hf").iterdir() if p.name != "ucp_export.json")
    for name in files:
        a, b = (tmp_path / f"dp{dp}" / "global_step100_hf" / name for dp in (2, 3))
        assert a.read_bytes() == b.read_bytes(), name


@pytest.mark.parametrize(
    "kw, why",
    [
        (dict(experts=4, ds_version="0.19.5"), "mixture of experts (--num-experts [4])"),
        (dict(swiglu=False), "the MLP is not SwiGLU (--swiglu off)"),
    ],
    ids=["moe", "gelu"],
)
def test_a_model_the_export_cannot_map_is_refused_before_anything_is_written(tmp_path, capsys, kw, why):
    tag_dir = _synthetic(tmp_path / "ckpt", dp=2, **kw)
    listing = sorted(p.name for p in tag_dir.parent.iterdir())
    assert _export(str(tag_dir.parent)) == 2
    err = capsys.readouterr().err
    assert f"{tag_dir}: cannot export as a Hugging Face LlamaForCausalLM: {why}" in err
    assert sorted(p.name for p in tag_dir.parent.iterdir()) == listing


def test_background_export_follows_each_conversion_and_its_failure_reaches_status(tmp_path, monkeypatch, caplog):
    root, moe = tmp_path / "dense", tmp_path / "moe"
    settings = ConverterSettings(keep_last=1, export_hf=True)
    for iteration in (10, 20):
        _synthetic(root, dp=2, iteration=iteration)
        trigger(root, f"global_step{iteration}", 0, 1, settings)
        assert wait_for_converter(root, 0, timeout=120)
    assert (root / "global_step20_hf" / "ucp_export.json").is_file()
    assert not (root / "global_step10_hf").exists()  # keep_last=1, as the universal folders
    said = [e for e in read_queue(root).events if e.job == B.EXPORT_HF]
    assert [(e.tag, e.kind) for e in said] == [
        ("global_step10", B.EventKind.COMPLETE),
        ("global_step20", B.EventKind.COMPLETE),
        ("global_step10", B.EventKind.REMOVED),
    ]
    assert [t.hf_export for t in root_status(root).tags] == ["removed", "complete"]

    _synthetic(moe, dp=2, experts=4, ds_version="0.19.5")
    trigger(moe, "global_step100", 0, 1, settings)
    assert wait_for_converter(moe, 0, timeout=120)
    status = root_status(moe)
    assert status.latest_converted and status.tags[0].hf_export == "failed"
    text = format_status(status)
    assert "HF export" in text.splitlines()[1]
    assert "global_step100: failed (export-hf): " in text and "mixture of experts (--num-experts [4])" in text
    # and the training's exit says it in the export's own words (the job's end-of-run wait, as the runner calls it)
    monkeypatch.setitem(async_trigger._state, "config", UcpConfig(async_convert=True, export_hf=True))
    monkeypatch.setitem(async_trigger._state, "launched", {(str(moe), 0): ["global_step100"]})
    with caplog.at_level(logging.INFO, logger="megatron_ucp"):
        async_trigger.wait_at_end_of_run()
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(said) == 1 and said[0].startswith("megatron-ucp: background export-hf: "), said
    assert "global_step100" in said[0] and "mixture of experts (--num-experts [4])" in said[0], said

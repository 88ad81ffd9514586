"""Which tag folder a load reads (format/paths.tag_to_load), and the converter's settings on its command line."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from megatron_ucp.errors import CheckpointFormatError
from megatron_ucp.format import dsformat as F
from megatron_ucp.format.paths import TagToLoad, tag_to_load


def _root(tmp_path: Path, latest: str | None, pointer: str | None, twin_complete: bool) -> Path:
    root = tmp_path / "ck"
    (root / "global_step4").mkdir(parents=True)
    if twin_complete:
        zero = root / "global_step4_universal" / F.UNIVERSAL_ZERO_DIR
        zero.mkdir(parents=True)
        (zero / F.UNIVERSAL_OPTIMIZER_STATE_FILE).write_text("")
    if latest is not None:
        (root / F.LATEST).write_text(latest)
    if pointer is not None:
        (root / F.LATEST_UNIVERSAL).write_text(pointer)
    return root


def test_a_tag_named_is_the_tag_read(tmp_path: Path):
    root = _root(tmp_path, "global_step4", None, False)
    assert tag_to_load(root, "global_step2", universal=True) == TagToLoad("global_step2", None)


def test_without_universal_the_tag_latest_names(tmp_path: Path):
    root = _root(tmp_path, "global_step4", "global_step2_universal", True)
    assert tag_to_load(root, None, universal=False) == TagToLoad("global_step4", F.LATEST)


def test_with_universal_latest_universal_while_it_names_latests_twin(tmp_path: Path):
    root = _root(tmp_path, "global_step4", "global_step4_universal", True)
    assert tag_to_load(root, None, universal=True) == TagToLoad("global_step4_universal", F.LATEST_UNIVERSAL)


def test_with_universal_a_lagging_latest_universal_is_passed_over_for_latest(tmp_path: Path):
    root = _root(tmp_path, "global_step4", "global_step2_universal", True)
    target = tag_to_load(root, None, universal=True)
    assert target == TagToLoad("global_step4", F.LATEST, ("global_step4", "global_step2_universal"))


def test_no_pointer_no_tag_and_a_garbage_pointer_is_named(tmp_path: Path):
    root = _root(tmp_path, None, None, False)
    assert tag_to_load(root, None, universal=False).tag is None
    (root / F.LATEST).write_bytes(b"\x00\x01 not a tag")
    with pytest.raises(CheckpointFormatError, match="not a tag name"):
        tag_to_load(root, None, universal=False)


def test_the_converter_reads_the_settings_the_trigger_writes():
    from megatron_ucp.background.converter import _add_settings
    from megatron_ucp.background.store import ConverterSettings

    for settings in (ConverterSettings(), ConverterSettings(keep_last=0, export_hf=True, nice=-3, job_id="j")):
        parser = argparse.ArgumentParser()
        _add_settings(parser)
        args = parser.parse_args(settings.argv())
        assert ConverterSettings(**{name: getattr(args, name) for name, _ in ConverterSettings.OPTIONS}) == settings

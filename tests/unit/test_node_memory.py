"""Memory saves' node-local folders (integration/node_memory.py): which node each rank is on, where its folder is,
what a folder's records say it holds, each file checked against its crc32."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from megatron_ucp.config import UcpConfig
from megatron_ucp.integration.node_memory import (
    COMMITTED,
    FileSum,
    Nodes,
    committed_save,
    crc_of,
    generation,
    local_folder,
    node_files,
    node_name,
    read_holdings,
    verify,
    write_record,
)


def test_nodes_are_the_ranks_that_share_a_name_in_order_of_their_first_rank() -> None:
    nodes = Nodes(("b", "b", "a", "a", "c"))
    assert nodes.names == ("b", "a", "c") and nodes.count == 3
    assert [nodes.index(r) for r in range(5)] == [0, 0, 1, 1, 2]
    assert nodes.ranks(1) == (2, 3) and nodes.leader(2) == 4


def test_the_node_names_variable_overrides_the_host_and_names_every_rank(monkeypatch) -> None:
    monkeypatch.setenv("MEGATRON_UCP_NODE_NAMES", "n0,n0,n1")
    assert node_name(2) == "n1"
    with pytest.raises(ValueError, match="names no node for global rank 3"):
        node_name(3)


def test_the_local_folder_is_named_after_the_root_under_the_users_or_the_given_folder(tmp_path: Path) -> None:
    default = local_folder(UcpConfig(), tmp_path / "ckpt", "host1")
    assert default.parent == Path(f"/dev/shm/megatron-ucp-{os.getuid()}") and default.name.startswith("ckpt-")
    assert default != local_folder(UcpConfig(), tmp_path / "other" / "ckpt", "host1")  # another root, another folder
    given = local_folder(UcpConfig(local_dir=str(tmp_path / "{node}")), tmp_path / "ckpt", "n2")
    assert given.parent == tmp_path / "n2" and given.name == default.name  # two roots never share a folder


def test_a_folder_holds_what_its_records_say_and_a_changed_file_is_damaged(tmp_path: Path) -> None:
    gen = generation(tmp_path, 13)
    where = node_files(gen, 1, "global_step13")
    where.mkdir(parents=True)
    sums = []
    for i, data in enumerate((b"abc", b"defg")):
        (where / f"f{i}.pt").write_bytes(data)
        sums.append(FileSum(f"f{i}.pt", 1, len(data), crc_of(where / f"f{i}.pt")))
    write_record(gen, 1, 4, "global_step13", "id", sums, replica=True, origin="root-id")
    (held,), records = read_holdings(tmp_path, "n2")  # the records alone: nothing read
    assert (held.step, held.node, held.nodes, held.replica, held.committed) == (13, 1, 4, True, False)
    assert held.files == {"f0.pt", "f1.pt"} and not held.damaged and held.origin == "root-id"
    assert records[(13, 1, "id")]["save_id"] == "id"
    (gen / COMMITTED).write_text(json.dumps({"iteration": 13, "save_id": "another"}))
    assert committed_save(gen) == "another" and not read_holdings(tmp_path, "n2")[0][0].committed  # not this save
    (gen / COMMITTED).write_text(json.dumps({"iteration": 13, "save_id": "id"}))
    (held,), records = read_holdings(tmp_path, "n2")
    assert held.committed and verify(tmp_path, held, records[(13, 1, "id")]).damaged == frozenset()
    (where / "f1.pt").write_bytes(b"defh")  # same size, another byte
    (where / "f0.pt").unlink()
    checked = verify(tmp_path, held, records[(13, 1, "id")])
    assert checked.damaged == {"f0.pt", "f1.pt"} and checked.sound == frozenset()
    (gen / "node1.json").write_text("{")  # a record that cannot be read is left out, said
    assert read_holdings(tmp_path, "n2")[0] == []


def test_a_memory_save_needs_room_for_another_generation_like_the_newest(tmp_path: Path, monkeypatch) -> None:
    from megatron_ucp.integration.save import memory_save

    newest = generation(tmp_path, 12)
    newest.mkdir()
    (newest / "f.pt").write_bytes(b"x" * 1000)
    (generation(tmp_path, 14)).mkdir()  # a stale one of an earlier run: gone
    monkeypatch.setattr(memory_save.shutil, "disk_usage", lambda path: type("U", (), {"free": 500})())
    said = memory_save._prepare(tmp_path, generation(tmp_path, 13) / "node0", 13)
    assert said == f"{tmp_path}: 500 B free, the last memory save holds 1.0 kB"
    assert not generation(tmp_path, 14).exists() and (generation(tmp_path, 13) / "node0").is_dir()
    monkeypatch.setattr(memory_save.shutil, "disk_usage", lambda path: type("U", (), {"free": 10**6})())
    assert memory_save._prepare(tmp_path, generation(tmp_path, 13) / "node0", 13) is None

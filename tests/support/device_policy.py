"""Where megatron-ucp may place tensors and which backends it may name: one policy, checked twice.

``tests/unit/test_device_placement.py`` scans the source against it; ``device_violations`` checks
what the recording accelerator (``tests/support/device_recorder.py``) saw a real run do.
Each listed place says why the host is right there.
"""

from __future__ import annotations

from typing import Any

HOST_ON_PURPOSE = {
    ("deepspeed/torch_files.py", "load_torch_file"): "checkpoint files are read into host memory (mapped)",
    (
        "integration/resume/native/reshard.py",
        "load_native_partitions",
    ): "the ledger is filled on the host, moved to device() for the one all-reduce",
    (
        "integration/resume/universal/partition_load.py",
        "load_universal_partitions",
    ): "the ledger is filled on the host, moved to device() for the one all-reduce",
    ("plan/accounting.py", "new_table"): "default of the host-side ledger table",
    ("format/torchfile.py", "persistent_id"): "torch's own record of where a saved storage lived",
    ("background/trigger.py", "converter_env"): "the background converter process is CPU-only by design",
    (
        "integration/collectives.py",
        "tensor_device",
    ): "a host group's tallies (the memory saves' gloo group, beside the job's accelerator backend)",
}

BACKEND_ON_PURPOSE = {
    (
        "convert/distributed.py",
        "convert_distributed",
        "'gloo'",
    ): "the offline converter's own process group: host files, host tensors, no engine",
    (
        "integration/save/memory_save.py",
        "_memory_group",
        "'gloo'",
    ): "the memory saves' own group: their commit runs in the writer thread beside training, on host files, and must "
    "never share a group (or the accelerator's backend) with the collectives training issues meanwhile",
}

GROUPS_ON_PURPOSE = {("integration/save/memory_save.py", "_memory_group")}
"""The one process group the hooks make (above: the memory saves' own)."""


def device_violations(events: list[dict[str, Any]], accelerator: str) -> list[dict[str, Any]]:
    """The recorded events that break the policy: a placement on neither the accelerator's device
    (spelled ``accelerator``) nor the host at a listed place; a collective on a tensor not placed
    through the accelerator; a process group made by the hooks."""
    bad = []
    for event in events:
        where = (event.get("file"), event.get("function"))
        if event["kind"] == "place":
            host_here = event["device"] == "cpu" and where in HOST_ON_PURPOSE
            if event["device"] != accelerator and not host_here:
                bad.append(event)
        elif event["kind"] == "collective" and event["tensors"] and not event["through_accelerator"]:
            bad.append(event)
        elif event["kind"] == "group" and where not in GROUPS_ON_PURPOSE:
            bad.append(event)
    return bad

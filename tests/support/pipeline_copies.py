"""DeepSpeed's own ``PipelineModule`` saved through the asynchronous save's capture, three times into one reused host
slot: ``python -m tests.support.pipeline_copies PORT [DEVICE]`` prints ``WRONG <json>``, every (save, layer, key) whose
written file does not hold that layer's tensor in a storage of its own size (one process; DEVICE ``cuda``: the layers
on the GPU and the host buffers pinned, as an asynchronous save on an accelerator takes them).

``PipelineModule.save_state_dict`` clones each layer to the CPU, saves the clone and frees it before the next layer's
(0.19.8's expert and model-state saves too): the next clone may take a freed one's address (tests/system/
test_async_save.py; tests/device/gpu_checks.py on a GPU, where the pinned buffers do not come from the allocator the
clones do, so that even the first save meets freed addresses).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace


def wrong_layers(device: str) -> list[list]:
    import deepspeed
    import torch
    from deepspeed.accelerator import get_accelerator
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    from megatron_ucp.integration.save import async_save
    from megatron_ucp.integration.save.commit import OpenSave
    from megatron_ucp.integration.save.host_copy import HostBuffers, HostCopy, written_form

    deepspeed.init_distributed("nccl" if device == "cuda" else "gloo")
    torch.manual_seed(0)
    layers = [torch.nn.Linear(256, 256 - 8 * (i % 2)).to(device) for i in range(6)]  # clones of two sizes
    pipe = PipelineModule(layers=layers, num_stages=1, partition_method="uniform")
    pipe.checkpoint_parallel_write_pipeline = False  # the engine sets it from its config
    engine = TorchCheckpointEngine()
    slot = HostBuffers(pin=get_accelerator().pin_memory if device != "cpu" else None)
    out, wrong = Path(tempfile.mkdtemp()), []
    for n in range(3):  # the slot reused, save after save, the weights changed in between
        flight = async_save.InFlight(OpenSave(out, f"global_step{n}", True, None), None)
        host = HostCopy(slot)
        capture = async_save._capture(engine.save, flight, host)
        through = SimpleNamespace(
            save=capture, makedirs=engine.makedirs, preserves_storage_sharing=engine.preserves_storage_sharing
        )
        pipe.save_state_dict(str(out / f"global_step{n}"), through)
        host.finish(get_accelerator().synchronize)
        for save, copied, path in flight.files:
            save(written_form(copied), path)
            layer = int(Path(path).name.split("_")[1].split("-")[0])
            loaded = torch.load(path, weights_only=True)
            for key, want in layers[layer].state_dict().items():
                got = loaded[key]
                if not (torch.equal(got, want.cpu()) and got.untyped_storage().nbytes() == want.nbytes):
                    wrong.append([n, layer, key])
        with torch.no_grad():
            for layer in layers:
                layer.weight.add_(1.0)
    return wrong


if __name__ == "__main__":
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    print("WRONG " + json.dumps(wrong_layers(sys.argv[2] if len(sys.argv) > 2 else "cpu")), flush=True)

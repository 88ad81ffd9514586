"""Every Python process of a peer-suite run (tests/peer/run_peer.py): its stacks on SIGUSR1, in a file of its own named
by its rank once it has one; and, in the hooked modes, megatron-ucp's hooks installed (``UCP_PEER_HOOKS=1``). For a
test that opens a save's files itself right after ``save_checkpoint`` (``UCP_PEER_WAIT_AFTER_SAVE=1``, set by the
runner for those tests in the asynchronous mode), each save is followed by ``megatron_ucp.wait_for_saves()``, as the
docs tell such a script to do: the test then checks the files the asynchronous save wrote."""

import faulthandler
import os
import signal
import threading

_FOLDER = os.environ.get("UCP_PEER_STACKS")


def _register() -> None:
    """This process's stacks into ``<folder>/pid-<pid>.txt`` on SIGUSR1, renamed ``rank-<r>-pid-<pid>.txt`` once the
    rank is known (DeepSpeed's test harness sets ``RANK`` after the fork)."""
    path = os.path.join(_FOLDER, f"pid-{os.getpid()}.txt")
    handle = open(path, "w")
    faulthandler.register(signal.SIGUSR1, file=handle, all_threads=True, chain=False)

    def name_by_rank() -> None:
        for _ in range(600):
            rank = os.environ.get("RANK")
            if rank is not None:
                os.rename(path, os.path.join(_FOLDER, f"rank-{rank}-pid-{os.getpid()}.txt"))
                return
            threading.Event().wait(1.0)

    threading.Thread(target=name_by_rank, daemon=True).start()


if _FOLDER:
    _register()
    os.register_at_fork(after_in_child=_register)

if os.environ.get("UCP_PEER_FP16") == "1":  # a CPU edit: DeepSpeed's CPU accelerator says fp16 works (torch runs it)
    from deepspeed.accelerator import cpu_accelerator

    cpu_accelerator.CPU_Accelerator.is_fp16_supported = lambda self: True

if os.environ.get("UCP_PEER_HOOKS") == "1":
    import megatron_ucp

    megatron_ucp.install()
    if os.environ.get("UCP_PEER_WAIT_AFTER_SAVE") == "1":
        import functools

        from deepspeed.runtime.engine import DeepSpeedEngine

        def _waiting(save_checkpoint):
            @functools.wraps(save_checkpoint)
            def save_then_wait(self, *args, **kwargs):
                saved = save_checkpoint(self, *args, **kwargs)
                megatron_ucp.wait_for_saves()
                return saved

            return save_then_wait

        DeepSpeedEngine.save_checkpoint = _waiting(DeepSpeedEngine.save_checkpoint)

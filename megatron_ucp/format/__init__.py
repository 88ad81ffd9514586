"""Bytes only: torch's zip format read and written without torch, raw tensors, pickles with
stand-ins, file-system helpers, tag files, DeepSpeed's key names, and the integrity checksum.

Knows nothing of ZeRO partitions or plans. Imports: ``megatron_ucp.errors`` and its own modules.
"""

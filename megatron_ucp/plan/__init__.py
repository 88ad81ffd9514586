"""Pure decisions, no I/O: partition geometry, the parallel layout and DeepSpeed's rank <-> file
numbering, the conversion plan and its checks, what a resume should do, how the runner adjusts a
launch, and the load ledger. Every branch is tested in
milliseconds.

Imports: ``format`` (names and the checksum), ``errors``, ``config``.
"""

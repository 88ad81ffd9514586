"""``make demo``: a CPU walk-through of megatron-ucp (train at one DP size, resume at another).

Not part of the installed package; run from the repository root as ``python -m demo``.
"""

"""Synthetic DeepSpeed checkpoints: what a real save of any llama shape at any (TP, DP) writes,
without the run (benchmarks at DP = 768 and 7B shapes; ``megatron-ucp synthesize``)."""

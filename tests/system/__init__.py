"""Real DeepSpeed runs (CPU, gloo, several processes), the CLI and the converter on real checkpoints."""

"""What the tests share: the DeepSpeed harness, cached checkpoints, model shapes, result summaries."""

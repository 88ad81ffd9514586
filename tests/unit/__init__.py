"""Pure tests: no processes, no DeepSpeed, no files beyond tmp; milliseconds each."""

"""The universal route: a tag's universal twin (converted when needed) loaded by DeepSpeed's universal mode with
our partition loader. Imports nothing of the native routes."""

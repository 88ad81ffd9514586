"""Exports of a checkpoint for other tools: a Hugging Face model (``export-hf``), from the universal folder."""

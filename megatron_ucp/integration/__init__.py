"""Into the training process: the ``PatchSet`` that installs and removes the DeepSpeed hooks
(``install``), the hooks themselves (save-time records, the elastic load, the async trigger),
and the zero-edit runner for Megatron-DeepSpeed scripts (``run``).

Imports: every layer below. ``install``/``uninstall`` are re-exported by ``megatron_ucp``.
"""

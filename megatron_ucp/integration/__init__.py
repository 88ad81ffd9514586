"""Into the training process: installing and removing the DeepSpeed hooks (``install``: the
runtime surface checked, then each hook module replaces its entries through one ``PatchSet``), the
hooks themselves (save-time records, the elastic load, the async trigger), the live model's layout
at load time, and the zero-edit runner for Megatron-DeepSpeed scripts (``run``). DeepSpeed itself
is reached only through :mod:`megatron_ucp.deepspeed.surface`.

Imports: every layer below. ``install``/``uninstall`` are re-exported by ``megatron_ucp``.
"""

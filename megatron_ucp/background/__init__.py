"""Asynchronous conversion after every save: the queue's decisions (``queue``, pure), the
converter process and the files it shares with the trigger under ``<root>/.ucp/``
(``converter``), and what a checkpoint root holds, tag by tag (``status``).

Imports: ``convert``, ``deepspeed``, ``plan``, ``format``, ``errors``, ``config``.
"""

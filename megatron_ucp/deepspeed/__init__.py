"""What DeepSpeed's files and versions mean: the supported releases and how they differ
(``versions``), and the one reader of rank files and model states into checkpoint metadata
(``reader``).

Imports: ``plan`` (the metadata is expressed in plan terms), ``format``, ``errors``.
"""

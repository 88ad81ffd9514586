"""What DeepSpeed's files, versions and runtime mean: the supported releases and how they differ
(``versions``), the one reader of rank files and model states into checkpoint metadata
(``reader``), and the runtime internals the hooks read or replace, one table checked at install
(``surface``). The only package that imports DeepSpeed.

Imports: ``plan`` (the metadata is expressed in plan terms), ``format``, ``errors``.
"""

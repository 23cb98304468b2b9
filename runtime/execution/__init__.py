"""Execution of compiled moves: a plan compiled for one rank (``program``, ``step_program``), and
the code that runs it: a reshard on the calling rank (``executor``), an optimizer step's buckets
(``buckets``), Muon's matrix moves (``matrix_moves``), and every rank at once in one process
(``simulate``).
"""

"""Execution of compiled moves: a plan compiled for one rank (``program``, ``step_program``), the
one runner of its moves (``run``: a rank's walk of a plan, point-to-point exchanges, the start of
every collective), and its drivers: a reshard on the calling rank (``executor``), an optimizer
step's buckets (``buckets``), Muon's matrix moves (``matrix_moves``), and every rank at once in
one process (``simulate``); the ranks' agreement on a program before it runs (``agreement``).
"""

"""Execution of compiled moves: a plan compiled for one rank (``program``, ``step_program``, and a
reshard's plan as a step program of one leg, ``reshard_program``), the walker of its legs and the
start of every collective and exchange (``run``), and the one driver of them, the bucket runner
(``buckets``, naming its buckets per caller with ``names``), which runs a reshard on the calling
rank (``executor``), an optimizer step's buckets, Muon's matrix moves (``matrix_moves``), and
every rank at once in one process (``simulate``); the ranks' agreement on a program before it
runs (``agreement``).
"""

"""Measurement: what collectives really sent (``stats``), the machine's collective costs
(``calibrate``) and matrix-product rate (``flops``) for the cost model.
"""

"""Communication: the collectives (one call per kind, bounded waits), the process groups along mesh
axes, point-to-point exchanges, and the cross-rank checks of declared replication.

Every ``torch.distributed`` call of the project is made from this package or through it.
"""

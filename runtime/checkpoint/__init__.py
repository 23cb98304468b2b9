"""Checkpoints of sharded tensors and optimizer states, loadable under any other mesh and layout.

    runtime.checkpoint.save("ckpt", optimizer=optimizer)             # parameters and states
    runtime.checkpoint.save("ckpt", {"buf": LocalPiece(piece, layout, shape)})
    report = runtime.checkpoint.load("ckpt", optimizer=other_optimizer)   # another mesh, other layouts

Every rank writes the pieces it stores (one holder per replicated piece) to its own file; a
metadata file (JSON) records each tensor's layout, shape and dtype and, for every piece, its
box of the global tensor, its byte range and a CRC-32 per block, which covers what the piece is
(tensor, dtype, shape, rank file, box) before its bytes; the file carries the SHA-256 of its
other fields, so an edited or swapped entry is refused (``metadata``). A save is committed by
atomically replacing the metadata file, so a save that fails or crashes leaves the previous
checkpoint intact, and every rank's error says whether the new one was committed (``commit``).
A load reads the checksum blocks its target pieces' byte runs touch, and checks them; every
path it reads stays inside the checkpoint (``paths``). Values are stored in global coordinates
(``items``): flat ZeRO chunks, CAME's row and column statistics and partial layouts included.
Save and load are collective over the default process group: every rank calls them.
"""

from runtime.checkpoint.errors import CheckpointError
from runtime.checkpoint.items import LocalPiece, state_key
from runtime.checkpoint.loading import LoadReport, load, verify
from runtime.checkpoint.metadata import Metadata, read_metadata
from runtime.checkpoint.saving import save

__all__ = [
    "CheckpointError",
    "LoadReport",
    "LocalPiece",
    "Metadata",
    "load",
    "read_metadata",
    "save",
    "state_key",
    "verify",
]

"""One byte of facts per block of a prompt: its own metadata checks and what its state allows,
as :func:`~kvfsm.lookup._group_pass.group_pass` writes them and reasons read them back."""

from __future__ import annotations

from kvfsm.lookup._paths import (
    REACHES_COMPRESSED,
    REACHES_RAW,
    READABLE_COMPRESSED,
    READABLE_RAW,
)

#: The block's hash is in the map (every other bit is clear without it).
FOUND = 1
#: Layer 3, position: the block found by hash is recorded at the position this prompt needs.
PLACED = 2
#: Layer 1, integrity: every sub-block is written.
WHOLE = 4
#: Layer 2, kernel interface: written under the layout the reading kernel declares.
LAYOUT = 8
#: The restore-path code of the block's state (``RestorePaths.code``), shifted above.
CODE_SHIFT = 4
READ_RAW = READABLE_RAW << CODE_SHIFT
READ_COMPRESSED = READABLE_COMPRESSED << CODE_SHIFT
TO_RAW = REACHES_RAW << CODE_SHIFT
TO_COMPRESSED = REACHES_COMPRESSED << CODE_SHIFT
READABLE = READ_RAW | READ_COMPRESSED
#: Every metadata check passed (the state's form is checked separately).
SOUND = FOUND | PLACED | WHOLE | LAYOUT

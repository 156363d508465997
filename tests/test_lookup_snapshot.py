"""A verdict's snapshot of the core (:mod:`kvfsm.lookup._snapshot`): what explaining it later
reads, as it was at the lookup."""

from __future__ import annotations

import numpy as np
import pytest

from kvfsm.lookup import DeviceProfile, Level
from kvfsm.spec import Event
from tests.lookup_models import DENSE, engine, group_eval, tokens


@pytest.mark.usefixtures("jit_backend")
def test_a_snapshot_keeps_each_blocks_state_and_failed_check_as_they_were() -> None:
    """An evaluation's snapshot (what explaining it later reads of the core) holds each found
    block's lifecycle state and whether its recorded check had failed, as they were when it
    was taken: none for a missing block, and unchanged by later moves and checks."""
    eng = engine(DENSE)
    prompt = eng.prompt(tokens(161))
    eng.commit(prompt)
    eng.lookup(prompt, level=Level.FULL)  # every block's checksum recorded as passed
    core = eng.core
    group = core.group("attn")
    high, low = (words.copy() for words in prompt.words(16))
    high[7], low[7] = np.uint64(12345), np.uint64(678)  # a hash no block has
    ids = core.lookup_words("attn", high, low)
    core.fire("attn", [int(ids[3])], Event.SPILL_BEGIN)
    core.fire("attn", [int(ids[3])], Event.SPILL_DONE)
    core.record_checks("attn", [int(ids[5])], [False])
    found = ids >= 0
    states_then = np.where(found, group.states[np.where(found, ids, 0)], 0)
    assert states_then[3] != states_then[0]
    evaluation = group_eval(group, high, low, np.array([0, 64, 160], dtype=np.int64),
                            level=Level.STANDARD, kernel_layout=None, profile=DeviceProfile())
    evaluation.freeze()
    # Later changes to the core: another block spilled, another check failed.
    core.fire("attn", [int(ids[0])], Event.SPILL_BEGIN)
    core.fire("attn", [int(ids[0])], Event.SPILL_DONE)
    core.record_checks("attn", [int(ids[1])], [False])
    frozen = evaluation.frozen()
    assert frozen.states.tolist() == states_then.tolist()
    assert frozen.failed_checks is not None
    assert np.flatnonzero(frozen.failed_checks).tolist() == [5]

"""The event log's lines for leases' reads, formatted many at a time by one compiled pass: the
same text as one line at a time, each lease's runs on one line, and as replay reads them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfsm import CoreConfig, Engine, EventLog
from kvfsm._jit import settings as jit
from kvfsm.obs import replay
from kvfsm.obs._read_lines import (
    GIVE_BACK,
    GIVE_BACK_LINE,
    LEASE,
    LEASE_LINE,
    PINS,
    PINS_LINE,
    READS,
    READS_LINE,
    TAKE,
    TAKE_LINE,
    TAKE_READ,
    TAKE_READ_LINE,
    give_back_line,
    name_table,
    reads_line,
    reads_lines,
)

_INT64 = st.integers(0, 2**63 - 1)
_GROUPS = ["history", "swa", 'a "quoted" név']  # JSON escapes the last to ASCII
_RUN = st.tuples(st.integers(0, len(_GROUPS) - 1), _INT64, st.integers(1, 2**62), _INT64)
#: Each kind of line the pass writes, by its ``type``.
_KINDS = {READS: READS_LINE, PINS: PINS_LINE, TAKE: TAKE_LINE, TAKE_READ: TAKE_READ_LINE,
          LEASE: LEASE_LINE, GIVE_BACK: GIVE_BACK_LINE}


@settings(deadline=None)  # the first example may compile the kernel
@given(leases=st.lists(st.tuples(st.sampled_from(sorted(_KINDS)),
                                 st.lists(_RUN, min_size=1, max_size=4)), max_size=8),
       seq=st.integers(0, 2**62), compiled=st.booleans())
def test_leases_formatted_together_are_the_lines_formatted_one_by_one(
        leases: list[tuple[str, list[tuple[int, int, int, int]]]], seq: int,
        compiled: bool) -> None:
    """For any leases' lines of any kind, runs (group, first id, count, last number) or a
    give-back (the take's number: its one run's first id), at any sequence number, with
    compiled kernels on or off: the lines formatted in one pass are the lines formatted one
    at a time, numbered in turn, each parsing to its runs or its take."""
    if compiled and not jit.available:
        compiled = False
    leases = [(kind, runs[:1] if kind == GIVE_BACK else runs) for kind, runs in leases]
    names = [json.dumps(group) for group in _GROUPS]
    name_bytes, name_starts = name_table(names)
    rows = np.array([run for _, lease in leases for run in lease],
                    dtype=np.int64).reshape(-1, 4)
    ends = np.cumsum([len(lease) for _, lease in leases], dtype=np.int64)
    kinds = np.array([_KINDS[kind] for kind, _ in leases], dtype=np.int64)
    with jit.using(compiled):
        text = reads_lines(rows, ends, seq, name_bytes, name_starts, kinds)
    expected = [give_back_line(seq + k, lease[0][1]) if kind == GIVE_BACK else
                reads_line(seq + k, [(names[g], first, count, last)
                                     for g, first, count, last in lease], kind)
                for k, (kind, lease) in enumerate(leases)]
    assert text == "\n".join(expected)
    for k, line in enumerate(text.splitlines()):
        kind, lease = leases[k]
        told: dict[str, Any] = {"take": lease[0][1]} if kind == GIVE_BACK else \
            {"runs": [[_GROUPS[g], first, count, last] for g, first, count, last in lease]}
        assert json.loads(line) == {"seq": seq + k, "type": kind, **told}


@pytest.mark.parametrize("compiled", [True, False])
def test_many_leases_in_one_batch_are_logged_in_order_and_replay(tmp_path: Path,
                                                                 compiled: bool) -> None:
    """Leases taken, validated and given back one after another with no move between (a
    serving loop's usual batch) are written as a lease line each (its take, read and
    give-back at once, a run per group holding blocks), in the order of the leases,
    numbered in turn; the log replays clean with every group's read and pins counted."""
    if compiled and not jit.available:
        pytest.skip("numba is not installed")
    path = tmp_path / "events.jsonl"
    with jit.using(compiled), EventLog(path, flush_every=10_000) as log:
        eng = Engine("deepseek_v4_like", CoreConfig(device_blocks=96, backend="numpy"),
                     event_log=log)
        prompts = [eng.prompt(np.random.default_rng(seed).integers(0, 50_000, 300))
                   for seed in (1, 2)]
        for prompt in prompts:
            eng.commit(prompt)
        held = []
        for _ in range(3):
            for prompt in prompts:
                _, lease = eng.lookup_and_lease(prompt)
                with lease:
                    lease.validate()
                    held.append([(group, lease.blocks(group).tolist(),
                                  lease.epochs(group).tolist()) for group in lease.groups])
        eng.close()
    lines = [record for record in map(json.loads, path.read_text().splitlines()[1:])
             if record["type"] != "chain"]
    assert [line["seq"] for line in lines] == list(range(len(lines)))
    assert not any(line["type"] in ("read", "reads", "pins", "take", "take_read", "give_back")
                   for line in lines)
    reads = [line for line in lines if line["type"] == "lease"]
    assert len(reads) == len(held) == 6
    for line, lease in zip(reads, held, strict=True):
        expected = [each for each in lease if each[1]]
        assert len(line["runs"]) == len(expected) == 3
        for (group, first, count, epoch), (name, ids, epochs) in zip(line["runs"], expected,
                                                                     strict=True):
            assert group == name
            assert list(range(first, first + count)) == ids
            assert epochs == [epoch] * count
    result = replay(path)
    assert result.accepted and result.reads == 6 * 3 and result.pins == 2 * 6 * 3

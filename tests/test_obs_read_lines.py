"""The event log's read lines for runs, formatted many at a time by one compiled pass: the same
text as one line at a time, and as the general formatter's JSON."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfsm import CoreConfig, Engine, EventLog
from kvfsm._jit import settings as jit
from kvfsm.obs import replay
from kvfsm.obs._read_lines import name_table, run_lines, run_read_line

_INT64 = st.integers(0, 2**63 - 1)
_GROUPS = ["history", "swa", 'a "quoted" név']  # JSON escapes the last to ASCII


@settings(deadline=None)  # the first example may compile the kernel
@given(rows=st.lists(st.tuples(st.integers(0, len(_GROUPS) - 1), _INT64, st.integers(1, 9),
                               _INT64), max_size=12),
       seq=st.integers(0, 2**62), compiled=st.booleans())
def test_runs_formatted_together_are_the_lines_formatted_one_by_one(
        rows: list[tuple[int, int, int, int]], seq: int, compiled: bool) -> None:
    """For any runs (group, first id, count, epoch), at any sequence number, with compiled
    kernels on or off: the lines formatted in one pass are the lines formatted one at a time,
    numbered in turn, each parsing to its read's ids and epochs."""
    if compiled and not jit.available:
        compiled = False
    names = [json.dumps(group) for group in _GROUPS]
    name_bytes, name_starts = name_table(names)
    # Counts keep first + count within int64, as a group's ids are.
    table = np.array([(g, min(first, 2**62), count, epoch) for g, first, count, epoch in rows],
                     dtype=np.int64).reshape(-1, 4)
    with jit.using(compiled):
        text = run_lines(table, seq, name_bytes, name_starts)
    expected = [run_read_line(seq + r, names[g], first, count, epoch)
                for r, (g, first, count, epoch) in enumerate(table.tolist())]
    assert text == "\n".join(expected)
    for r, line in enumerate(text.splitlines()):
        group, first, count, epoch = table[r].tolist()
        parsed = json.loads(line)
        assert parsed["seq"] == seq + r and parsed["group"] == _GROUPS[group]
        if count >= 3:
            assert parsed["ids_runs"] == [[first, count]]
            assert parsed["epochs_runs"] == [[epoch, count]]
        else:
            assert parsed["ids"] == list(range(first, first + count))
            assert parsed["epochs"] == [epoch] * count


@pytest.mark.parametrize("compiled", [True, False])
def test_many_leases_in_one_batch_are_logged_in_order_and_replay(tmp_path: Path,
                                                                 compiled: bool) -> None:
    """Leases validated one after another with no move between (a serving loop's usual
    batch) are written as one line per group holding blocks, in the order of the leases,
    numbered in turn; the log replays clean with every read counted."""
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
    lines = [json.loads(line) for line in path.read_text().splitlines()[1:]]
    assert [line["seq"] for line in lines] == list(range(len(lines)))
    reads = [line for line in lines if line["type"] == "read"]
    expected = [each for lease in held for each in lease if each[1]]
    assert len(reads) == len(expected) == 6 * 3
    for line, (group, ids, epochs) in zip(reads, expected, strict=True):
        assert line["group"] == group
        first, count = line["ids_runs"][0]
        assert list(range(first, first + count)) == ids
        assert line["epochs_runs"] == [[epochs[0], count]] and set(epochs) == {epochs[0]}
    result = replay(path)
    assert result.accepted and result.reads == len(expected)

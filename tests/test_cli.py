"""The `kvfsm` command: exit codes and the lines it prints."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

from kvfsm.cli import main
from kvfsm.spec import shipped_specs_dir

FULL_KV = shipped_specs_dir() / "lifecycles" / "full_kv.toml"
INSTALL_HINT = 'pip install "kvfsm[diagrams]"'


def test_spec_check_shipped_is_clean(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["spec", "check"]) == 0
    out = capsys.readouterr().out
    assert out.count("\nok ") + out.startswith("ok ") == 9


def test_spec_check_folder(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["spec", "check", str(shipped_specs_dir())]) == 0


def test_spec_check_reports_file_table_row_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(FULL_KV.read_text().replace('guards = ["no_pins"]', 'guards = ["no_pin"]', 1))
    assert main(["spec", "check", str(bad)]) == 1
    err = capsys.readouterr().err
    assert f"{bad}: rows: #6 (line " in err
    assert "unknown guard 'no_pin'" in err


def test_spec_check_reports_checker_violations(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "unpinned_evict.toml"
    bad.write_text(
        FULL_KV.read_text().replace(
            'event = "evict"\ndest = "free"\nguards = ["no_pins"]\n',
            'event = "evict"\ndest = "free"\n',
        )
    )
    assert main(["spec", "check", str(bad)]) == 1
    err = capsys.readouterr().err
    assert f"{bad}: checker: pinned_is_readable:" in err
    assert "(pinned): evict -> 'free'" in err


def test_spec_check_model_declarations(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dense = shipped_specs_dir() / "models" / "dense.toml"
    assert main(["spec", "check", str(dense)]) == 0
    assert capsys.readouterr().out.startswith(f"ok {dense}: model dense: 1 group(s): attn (full)")
    bad = tmp_path / "bad_model.toml"
    bad.write_text(dense.read_text().replace("alignment = 256", "alignment = 48"))
    assert main(["spec", "check", str(bad)]) == 1
    err = capsys.readouterr().err
    assert f"{bad}: groups: #1 (attn): 'layout.alignment' must be a power of two, got 48" in err
    # A model may follow a lifecycle checked in the same run, not only a shipped one.
    (tmp_path / "mine.toml").write_text(FULL_KV.read_text().replace('"full_kv"', '"mine"', 1))
    bad.write_text(dense.read_text().replace('lifecycle = "full_kv"', 'lifecycle = "mine"'))
    assert main(["spec", "check", str(tmp_path)]) == 0


def test_spec_check_missing_path(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["spec", "check", "no/such/dir"]) == 2
    assert "no/such/dir: no such file or folder" in capsys.readouterr().err


def test_diagram_to_file_and_stdout(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "full.mmd"
    assert main(["diagram", str(FULL_KV), "--format", "mermaid", "-o", str(target)]) == 0
    assert target.read_text().startswith("---\nfull_kv")
    assert main(["diagram", "sliding_window"]) == 0
    assert "stateDiagram-v2" in capsys.readouterr().out


def test_diagram_unknown_spec(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["diagram", "nope"]) == 2
    assert "neither a spec file nor a shipped lifecycle" in capsys.readouterr().err


def test_bench_fsm_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "fsm", "--json", "--blocks", "20000"]) == 0
    figures = json.loads(capsys.readouterr().out)
    for key in (
        "batched_per_s",
        "scalar_per_s",
        "transitions_per_s",
        "ratio_batched_vs_transitions",
    ):
        assert figures[key] > 0
    assert figures["ratio_batched_vs_transitions"] == pytest.approx(
        figures["batched_per_s"] / figures["transitions_per_s"]
    )


def test_demo_writes_diagrams(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "-o", str(tmp_path)]) == 0
    assert sorted(p.stem for p in tmp_path.glob("*.mmd")) == [
        "compressed",
        "full_kv",
        "recurrent",
        "sliding_window",
        "sparse_index",
    ]


def test_demo_shows_hit_versus_usable_under_faults(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["demo", "-o", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "a prefix hit is not a usable cache" in out
    rows = {line.split("  ")[1].strip(): line for line in out.splitlines()
            if line.startswith("  ") and "fault" not in line.split("  ")[1]}
    clean = next(line for line in out.splitlines() if line.strip().startswith("no fault"))
    assert clean.split()[2:5] == ["1024", "1024", "1024"]
    flipped = next(line for line in out.splitlines() if "flipped" in line)
    assert "checksum_mismatch" in flipped
    assert rows  # every fault printed a row


def test_tools_bench_runs_every_measurement(capsys: pytest.CaptureFixture[str]) -> None:
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "tools" / "bench.py"
    spec = importlib.util.spec_from_file_location("tools_bench", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--quick"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) == {"fsm", "state", "lookup"}


def error_line(err: str) -> str:
    """The one line an error printed: no traceback, no continuation lines."""
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize(
    ("argv", "flag", "value"),
    [
        (["bench", "lookup", "--tokens", "0"], "--tokens", "0"),
        (["bench", "lookup", "--tokens", "-5"], "--tokens", "-5"),
        (["bench", "fsm", "--blocks", "0"], "--blocks", "0"),
        (["bench", "state", "--blocks", "-1"], "--blocks", "-1"),
        (["spec", "check", "--objects", "0"], "--objects", "0"),
        (["spec", "check", "--objects", "-1"], "--objects", "-1"),
    ],
)
def test_integer_flags_below_one_are_usage_errors(
    argv: list[str], flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert f"error: argument {flag}: must be an integer >= 1, got {value!r}" in captured.err


def test_diagram_dot_without_graphviz_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Without the graphviz package, transitions falls back to Mermaid; that must not reach a .dot.
    monkeypatch.setitem(sys.modules, "graphviz", None)
    backend = importlib.import_module("transitions.extensions.diagrams_graphviz")
    monkeypatch.setattr(backend, "pgv", None)
    target = tmp_path / "x.dot"
    assert main(["diagram", "full_kv", "--format", "dot", "-o", str(target)]) == 2
    line = error_line(capsys.readouterr().err)
    assert line.startswith("kvfsm: error: ") and INSTALL_HINT in line
    assert not target.exists()


def test_diagram_creates_missing_parent_folders(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "missing" / "dir" / "x.mmd"
    assert main(["diagram", "full_kv", "-o", str(target)]) == 0
    assert "stateDiagram-v2" in target.read_text()
    assert capsys.readouterr().out == f"wrote {target} ({target.stat().st_size} bytes)\n"


def test_diagram_unwritable_output_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["diagram", "full_kv", "-o", str(tmp_path)]) == 1  # a folder, not a file
    line = error_line(capsys.readouterr().err)
    assert line.startswith(f"kvfsm: error: cannot write {tmp_path}: ")


def test_demo_output_that_is_a_file_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    taken = tmp_path / "taken"
    taken.write_text("")
    assert main(["demo", "-o", str(taken)]) == 1
    assert error_line(capsys.readouterr().err).startswith(
        f"kvfsm: error: cannot create folder {taken}: ")


def test_bench_too_large_for_memory_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "fsm", "--quiet", "--blocks", str(10**15)]) == 1
    line = error_line(capsys.readouterr().err)
    assert line.startswith("kvfsm: error: bench fsm: not enough memory for --blocks " + str(10**15))


def test_bench_fsm_reports_progress_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "fsm", "--json", "--blocks", "2000"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["blocks"] == 2000
    progress = captured.err.splitlines()
    assert "bench fsm: batched fire of 2000 blocks..." in progress
    assert all(line.startswith("bench fsm: ") for line in progress)
    assert main(["bench", "fsm", "--quiet", "--blocks", "2000"]) == 0
    assert capsys.readouterr().err == ""


def test_invalid_spec_prints_every_problem_as_an_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = tmp_path / "empty.toml"
    empty.write_text("")
    assert main(["diagram", str(empty)]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 3  # no [lifecycle], no [states], no [[rows]]
    for line in lines:
        assert line.startswith(f"kvfsm: error: {empty}: "), line


def test_diagram_of_a_model_declaration_says_what_it_is(
    capsys: pytest.CaptureFixture[str],
) -> None:
    dense = shipped_specs_dir() / "models" / "dense.toml"
    assert main(["diagram", str(dense)]) == 2
    line = error_line(capsys.readouterr().err)
    assert line.startswith(f"kvfsm: error: {dense}: a model declaration, not a lifecycle spec")

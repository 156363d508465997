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
    shipped = len(list((shipped_specs_dir() / "lifecycles").glob("*.toml"))) + \
        len(list((shipped_specs_dir() / "models").glob("*.toml")))
    assert out.count("\nok ") + out.startswith("ok ") == shipped == 12


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


def test_demo_serves_and_writes_report_and_diagrams(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for package in ("transformers", "torch", "matplotlib", "prometheus_client", "tqdm"):
        pytest.importorskip(package)
    torch = pytest.importorskip("torch")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(["demo", "--quick", "--model", "gpt_oss", "-o", str(tmp_path)]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "shipped specs checked exhaustively, clean" in out
    assert "GPT-OSS [full (full), sliding (sliding_window)]" in out
    assert "hit rate" in out and "usable rate" in out and "kvfsm 0/" in out
    assert sorted(p.stem for p in tmp_path.glob("*.mmd")) == [
        "compressed",
        "full_kv",
        "recurrent",
        "sliding_window",
        "sparse_index",
    ]
    for name in ("report.md", "report.json", "metrics.prom", "overview.png",
                 "gpt_oss_hit_vs_usable.png", "gpt_oss_token_sources.png"):
        assert (tmp_path / name).stat().st_size > 0, name


def test_demo_without_transformers_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers fails
    target = tmp_path / "out"
    assert main(["demo", "-o", str(target)]) == 2
    captured = capsys.readouterr()
    line = error_line(captured.err)
    assert line.startswith("kvfsm: error: ") and 'pip install "kvfsm[serve]"' in line
    assert "transformers" in line
    assert captured.out == "" and not target.exists()


def test_demo_faults_writes_diagrams(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--faults", "-o", str(tmp_path)]) == 0
    assert sorted(p.stem for p in tmp_path.glob("*.mmd")) == [
        "compressed",
        "full_kv",
        "recurrent",
        "sliding_window",
        "sparse_index",
    ]


def test_demo_faults_shows_hit_versus_usable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["demo", "--faults", "-o", str(tmp_path)]) == 0
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
    assert main(["demo", "--faults", "-o", str(taken)]) == 1
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


# ------------------------------------------------------------------------- model from-config


def test_model_from_config_tiny_prints_the_shipped_declaration(
    capsys: pytest.CaptureFixture[str],
) -> None:
    pytest.importorskip("transformers")
    assert main(["model", "from-config", "--model-type", "gpt_oss", "--tiny"]) == 0
    captured = capsys.readouterr()
    shipped = shipped_specs_dir() / "models" / "tiny_gpt_oss.toml"
    assert captured.out == shipped.read_text(encoding="utf-8")
    assert captured.err == ""


def test_model_from_config_reads_a_config_json_and_writes_a_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A config.json as transformers saves it, with --set overrides (JSON literals) applied
    before the config is built, written with -o and loadable as a declaration."""
    pytest.importorskip("transformers")
    from kvfsm.serve import tiny_config
    from kvfsm.spec import load_model

    source = tmp_path / "config.json"
    source.write_text(tiny_config("qwen3_next").to_json_string(), encoding="utf-8")
    target = tmp_path / "out" / "qwen.toml"
    argv = ["model", "from-config", str(source), "--set", "linear_conv_kernel_dim=3",
            "--set", 'layer_types=["linear_attention","full_attention","linear_attention",'
            '"full_attention"]', "--block-size", "32", "--checkpoint-interval", "64",
            "--name", "qwen", "-o", str(target)]
    assert main(argv) == 0
    assert capsys.readouterr().out == (
        f"wrote {target}: model qwen: full (full), linear (recurrent)\n")
    text = target.read_text(encoding="utf-8")
    assert text.startswith(f"# Generated by `kvfsm model from-config {source} --set ")
    model = load_model(target)
    assert model.group("full").shape == (2, 2, 2, 32, 16)
    linear = model.group("linear")
    assert linear.shape == (2 * (128 * 3 + 4 * 16 * 16),)
    assert (linear.block_size, linear.checkpoint_interval) == (32, 64)


@pytest.mark.parametrize(
    ("argv", "code", "message"),
    [
        (["no/such/config.json"], 1, "cannot read no/such/config.json: "),
        (["--model-type", "mamba"], 2,
         "unsupported model_type 'mamba': kvfsm declares gpt_oss, qwen3_next, deepseek_v4, "
         "llama, mistral, qwen3, gemma2, gemma3_text"),
        ([], 2, "model from-config: give a CONFIG_JSON or a --model-type"),
        (["x.json", "--model-type", "gpt_oss"], 2, "give CONFIG_JSON or --model-type, not both"),
        (["--model-type", "gpt_oss", "--set", "slidng_window=8"], 2,
         "--set slidng_window: gpt_oss configs have no key 'slidng_window'"),
        (["--model-type", "gpt_oss", "--tiny", "--set", 'sliding_window="x"'], 2,
         "gpt_oss config (--set): 'sliding_window' must be an int >= 1 or null, got 'x'"),
        (["--model-type", "qwen3_next", "--tiny", "--checkpoint-interval", "24"], 2,
         "checkpoint_interval 24 is not a multiple of 16"),
    ],
)
def test_model_from_config_errors_are_one_line(
    argv: list[str], code: int, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("transformers")
    assert main(["model", "from-config", *argv]) == code
    captured = capsys.readouterr()
    assert captured.out == ""
    line = error_line(captured.err)
    assert line.startswith("kvfsm: error: ") and message in line, line


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "not valid JSON: "),
        ("[1, 2]", "a config must be a JSON object, got list"),
        ('{"hidden_size": 64}', "no 'model_type' key"),
    ],
)
def test_model_from_config_bad_json_is_one_line(
    tmp_path: Path, content: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("transformers")
    source = tmp_path / "config.json"
    source.write_text(content, encoding="utf-8")
    assert main(["model", "from-config", str(source)]) == 2
    line = error_line(capsys.readouterr().err)
    assert line.startswith(f"kvfsm: error: {source}: {message}"), line


@pytest.mark.parametrize("setting", ["sliding_window", "=3", "sliding_window=abc"])
def test_model_from_config_bad_set_is_a_usage_error(
    setting: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["model", "from-config", "--model-type", "gpt_oss", "--set", setting])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "error: argument --set: " in err
    if setting.endswith("abc"):
        assert "'abc' is not a JSON literal" in err and "quote strings" in err
    else:
        assert f"expected KEY=VALUE, got {setting!r}" in err


# -- replay ------------------------------------------------------------------------------------


def _event_log(tmp_path: Path) -> Path:
    """A log of a small run on the dense model: four blocks written, two spilled to host."""
    import numpy as np

    from kvfsm import CoreConfig, EventLog, StateCore, shipped_models
    from kvfsm.spec import Event

    core = StateCore(shipped_models()["dense"],
                     CoreConfig(device_blocks=4, host_blocks=4, backend="numpy"))
    path = tmp_path / "events.jsonl"
    with EventLog(path) as log:
        log.attach(core)
        keys = np.arange(1, 5, dtype=np.uint64)
        ids = core.allocate("attn", np.arange(4), keys, keys)
        core.fire("attn", ids, Event.WRITE_BEGIN)
        core.write("attn", ids, np.zeros((4, core.group("attn").decl.payload_bytes), np.uint8))
        core.fire("attn", ids, Event.WRITE_DONE)
        core.record_read("attn", ids)
        core.fire("attn", ids[:2], Event.SPILL_BEGIN)
        core.fire("attn", ids[:2], Event.SPILL_DONE)
    return path


def test_replay_accepts_a_real_log(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _event_log(tmp_path)
    assert main(["replay", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"accepted {path}: 5 moves (16 block moves) and 1 reads")
    assert main(["replay", str(path), "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert (figures["accepted"], figures["moves"], figures["violation"]) == (True, 5, None)


def test_replay_rejects_a_tampered_log_naming_the_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _event_log(tmp_path)
    lines = path.read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if '"event":"write_done"' in line)
    lines[at] = lines[at].replace('"epochs":[2,', '"epochs":[7,')  # write_done's epochs
    path.write_text("\n".join(lines) + "\n")
    assert main(["replay", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"rejected {path}: line {at + 1}: epoch: group 'attn' block 0: "
                          "logged epoch 7 after write_done, expected 2")
    assert main(["replay", str(path), "--json"]) == 1
    violation = json.loads(capsys.readouterr().out)["violation"]
    assert (violation["line"], violation["check"]) == (at + 1, "epoch")


def test_replay_a_truncated_log_is_rejected_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _event_log(tmp_path)
    path.write_text(path.read_text()[:-25])
    assert main(["replay", str(path)]) == 1
    err = capsys.readouterr().err
    assert "line 9: malformed: not JSON" in err and "Traceback" not in err  # the chain line


def test_replay_with_a_given_lifecycle(tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    path = _event_log(tmp_path)
    assert main(["replay", str(path), "--lifecycle", f"full_kv={FULL_KV}"]) == 0
    other = tmp_path / "full_kv.toml"
    other.write_text(FULL_KV.read_text().replace(
        'event = "evict"\ndest = "free"\nguards = ["no_pins"]\n',
        'event = "evict"\ndest = "free"\n', 1))
    capsys.readouterr()
    assert main(["replay", str(path), "--lifecycle", f"full_kv={other}"]) == 1
    assert "line 1: header: group 'attn': the log was written with other 'full_kv' tables" \
        in capsys.readouterr().err


@pytest.mark.parametrize(("args", "words"), [
    (["--lifecycle", "sliding_window=" + str(FULL_KV)], "that spec is lifecycle 'full_kv'"),
    (["--lifecycle", "full_kv=/no/such.toml"], "cannot read"),
    (["--lifecycle", "full_kv"], "expected NAME=PATH"),
])
def test_replay_bad_lifecycles_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                      args: list[str], words: str) -> None:
    path = _event_log(tmp_path)
    try:
        code = main(["replay", str(path), *args])
    except SystemExit as exc:  # argparse's usage errors
        code = exc.code
    assert code == 2
    assert words in capsys.readouterr().err


def test_replay_takes_several_logs_and_fails_on_any_rejected(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``kvfsm replay events/*.jsonl``: every log replayed on its own, each one's summary
    printed; exit 1 when any is rejected; ``--json`` gives a list, one entry per log."""
    good = _event_log(tmp_path)
    bad = tmp_path / "bad.jsonl"
    lines = good.read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if '"event":"write_done"' in line)
    lines[at] = lines[at].replace('"epochs":[2,', '"epochs":[7,')
    bad.write_text("\n".join(lines) + "\n")
    assert main(["replay", str(good), str(good)]) == 0
    assert capsys.readouterr().out.count("accepted") == 2
    assert main(["replay", str(good), str(bad)]) == 1
    captured = capsys.readouterr()
    assert f"accepted {good}" in captured.out and f"rejected {bad}" in captured.err
    assert main(["replay", str(good), str(bad), "--json"]) == 1
    listed = json.loads(capsys.readouterr().out)
    assert [(f["log"], f["accepted"]) for f in listed] == [(str(good), True), (str(bad), False)]
    assert main(["replay", str(good), str(tmp_path / "missing.jsonl")]) == 2


def test_the_help_says_what_kvfsm_is(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "``" not in out and "prefix hit is never taken for a usable" in out


def test_replay_an_unreadable_file_exits_2(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", str(tmp_path / "missing.jsonl")]) == 2
    assert "cannot read" in capsys.readouterr().err
    assert main(["replay", str(tmp_path)]) == 2  # a folder

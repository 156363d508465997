"""kvfsm: a prefix hit is never taken for a usable KV cache. Check lifecycle specs, draw
their diagrams, measure, declare models from their configs, run the serving demo, replay event
logs."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tomllib
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Final

import attrs

from kvfsm import __version__
from kvfsm._errors import KvfsmError, SpecError
from kvfsm.fsm import FORMATS, Bounds, check_lifecycle, compile_lifecycle, diagram
from kvfsm.spec import (
    Lifecycle,
    load_lifecycle,
    load_model,
    shipped_lifecycles,
    shipped_specs_dir,
    spec_files,
)

_EXIT_CODES = """\
exit status: 0 done and clean; 1 a check found problems, or a file or folder could not be read,
written or created, or a bench ran out of memory; 2 the command cannot run as asked (a bad flag,
an unknown or invalid spec, a missing optional package)."""


#: ``kvfsm bench --blocks`` when not given: objects per batch (fsm, state), blocks restored.
_BENCH_BLOCKS = 1_000_000
_RESTORE_BLOCKS = 64


def positive_int(text: str) -> int:
    """The argparse type of every count flag: an integer of 1 or more (0 would run vacuously)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


@contextlib.contextmanager
def _doing(action: str, path: Path) -> Iterator[None]:
    """Re-raise an OSError with what was being done to which path, for main() to print."""
    try:
        yield
    except OSError as exc:
        raise OSError(exc.errno, f"cannot {action} {path}: {exc.strerror or exc}") from exc


def _resolve_lifecycle(spec: str) -> Lifecycle:
    """A spec path, or the name of a shipped lifecycle."""
    shipped = shipped_lifecycles()
    if Path(spec).exists():
        if _is_model(Path(spec)):
            raise KvfsmError(
                f"{spec}: a model declaration, not a lifecycle spec; draw one of the lifecycles "
                f"its groups follow (shipped: {sorted(shipped)})"
            )
        return load_lifecycle(spec)
    if spec in shipped:
        return shipped[spec]
    raise KvfsmError(f"{spec}: neither a spec file nor a shipped lifecycle ({sorted(shipped)})")


def _is_model(path: Path) -> bool:
    """A model declaration has a top-level ``[model]`` table. Anything else, including a file that
    cannot be read or parsed, goes to the lifecycle loader, which reports why."""
    try:
        doc = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return False
    return isinstance(doc.get("model"), dict)


def _spec_check(paths: Sequence[str], objects: int, out: list[str]) -> bool:
    """Validate and exhaustively check each lifecycle spec, validate each model declaration;
    append report lines; True when all clean."""
    files = spec_files(paths or [shipped_specs_dir()])
    if not files:
        out.append("no spec files found")
        return False
    models = [path for path in files if _is_model(path)]
    # A model may follow a shipped lifecycle or one of the lifecycles checked in this run.
    known: dict[str, Lifecycle] = shipped_lifecycles() if models else {}
    clean = True
    for path in files:
        if path in models:
            continue
        try:
            lifecycle = load_lifecycle(path)
        except SpecError as err:
            clean = False
            out.extend(str(problem) for problem in err.problems)
            continue
        known[lifecycle.name] = lifecycle
        result = check_lifecycle(compile_lifecycle(lifecycle), Bounds(objects=objects))
        if result.ok:
            out.append(
                f"ok {path}: {lifecycle.name}: {len(lifecycle.states)} states, "
                f"{len(lifecycle.rows)} rows; checker explored {result.configurations} "
                f"configurations, {result.transitions} transitions of {objects} objects"
            )
        for violation in result.violations:
            clean = False
            lines = str(violation).splitlines()
            out.append(f"{path}: checker: {violation.invariant}: {lines[0]}")
            out.extend(f"    {line}" for line in lines[1:])
    for path in models:
        try:
            model = load_model(path, known)
        except SpecError as err:
            clean = False
            out.extend(str(problem) for problem in err.problems)
            continue
        groups = ", ".join(f"{g.name} ({g.kind.value})" for g in model.groups)
        out.append(
            f"ok {path}: model {model.name}: {len(model.groups)} group(s): {groups}; "
            f"LCM block size {model.lcm_block_size}"
        )
    return clean


def _cmd_spec_check(args: argparse.Namespace) -> int:
    lines: list[str] = []
    clean = _spec_check(args.paths, args.objects, lines)
    print("\n".join(lines), file=sys.stdout if clean else sys.stderr)
    return 0 if clean else 1


def _cmd_diagram(args: argparse.Namespace) -> int:
    if args.format in ("png", "svg") and args.output is None:
        raise KvfsmError(f"--format {args.format} needs -o FILE (or -o - for stdout)")
    data = diagram(_resolve_lifecycle(args.spec), args.format)
    if args.output == "-" or args.output is None:
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
    else:
        # Drawn before anything is created, so a refused format leaves no empty folders behind.
        target = Path(args.output)
        with _doing("write", target):
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
        print(f"wrote {target} ({len(data)} bytes)")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from kvfsm.bench import (
        LENGTHS,
        POOL_SIZES,
        bench_fsm,
        bench_lookup,
        bench_restore,
        bench_state,
        restore_table,
    )

    def progress(line: str) -> None:
        # stderr, so stdout stays the figures alone (parseable with --json).
        print(line, file=sys.stderr, flush=True)

    report = None if args.quiet else progress
    blocks = args.blocks
    if blocks is None:
        blocks = _RESTORE_BLOCKS if args.what == "restore" else _BENCH_BLOCKS
    flag, size = ("--tokens", args.tokens) if args.what == "lookup" else ("--blocks", blocks)
    figures: Mapping[str, object]
    try:
        if args.what == "lookup":
            figures = bench_lookup(
                tokens=args.tokens, progress=report,
                lengths=LENGTHS if args.lengths is None else args.lengths,
                pool_sizes=POOL_SIZES if args.pool_sizes is None else args.pool_sizes)
        elif args.what == "restore":
            figures = bench_restore(blocks=blocks, block_bytes=args.block_bytes,
                                    workers=args.workers, remote=args.remote, progress=report)
        else:
            run = {"fsm": bench_fsm, "state": bench_state}[args.what]
            figures = run(blocks=blocks, progress=report)
    except MemoryError as exc:
        raise MemoryError(
            f"bench {args.what}: not enough memory for {flag} {size} ({exc})") from exc
    if args.json:
        print(json.dumps(figures, indent=2))
    elif args.what == "restore":
        print("\n".join(restore_table(figures)))
    else:
        for key, value in figures.items():
            if isinstance(value, dict):
                shown = json.dumps(value)
            else:
                shown = f"{value:,.3f}" if isinstance(value, float) else str(value)
            print(f"{key:32s} {shown}")
    return 0


def _sizes(text: str) -> tuple[int, ...]:
    """A comma-separated list of sizes >= 1 (``none``: an empty list)."""
    if text.strip().lower() == "none":
        return ()
    try:
        sizes = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers or 'none', got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return sizes


def _demo_specs(out_dir: Path, lines: list[str]) -> bool:
    """Check every shipped spec (report lines into ``lines``) and write the lifecycle diagrams
    (mermaid) into ``out_dir``; True when the specs are clean."""
    clean = _spec_check([], 3, lines)
    for name, lifecycle in shipped_lifecycles().items():
        target = out_dir / f"{name}.mmd"
        with _doing("write", target):
            target.write_bytes(diagram(lifecycle, "mermaid"))
        lines.append(f"wrote {target}")
    return clean


def _cmd_demo_faults(out_dir: Path) -> int:
    lines: list[str] = []
    clean = _demo_specs(out_dir, lines)
    print("kvfsm demo: lifecycle tables of every cache-object kind, checked exhaustively")
    print("\n".join(lines))
    from kvfsm._demo_faults import fault_report

    print("\nkvfsm demo: a prefix hit is not a usable cache")
    print("\n".join(fault_report()))
    return 0 if clean else 1


def _demo_command(args: argparse.Namespace) -> str:
    """The command line that regenerates this report, for its header."""
    import shlex

    words = ["kvfsm", "demo"]
    if args.quick:
        words.append("--quick")
    for model_type in args.model or ():
        words += ["--model", model_type]
    if args.seed:
        words += ["--seed", str(args.seed)]
    if args.remote != "auto":
        words += ["--remote", args.remote]
    return shlex.join(words)


#: What a demo run writes into its folder: an earlier run's files of these names go first,
#: so no stale plot or event log of a model this run does not serve stays beside the new
#: report (nothing else in the folder is touched).
_DEMO_OUTPUTS: Final = ("*_hit_vs_usable.png", "*_token_sources.png", "overview.png",
                        "report.md", "report.json", "metrics.prom", "*.mmd", "events/*.jsonl")


def _clear_demo_outputs(out_dir: Path) -> None:
    for pattern in _DEMO_OUTPUTS:
        for path in out_dir.glob(pattern):
            if path.is_file():
                path.unlink()


def _cmd_demo(args: argparse.Namespace) -> int:
    out_dir = Path(args.output)
    if not args.faults:
        from kvfsm.serve._demo import DemoSettings, quick_settings, require_serve_packages

        # Before anything is created or run: the packages, then the settings (their checks).
        require_serve_packages()
        settings = quick_settings() if args.quick else DemoSettings()
        if args.model:
            settings = attrs.evolve(settings, models=tuple(dict.fromkeys(args.model)))
        settings = attrs.evolve(settings, seed=args.seed, remote=args.remote)
    with _doing("create folder", out_dir):  # first, so a bad -o fails before any work
        out_dir.mkdir(parents=True, exist_ok=True)
        _clear_demo_outputs(out_dir)
    if args.faults:
        return _cmd_demo_faults(out_dir)
    from kvfsm.serve._demo import run_demo
    from kvfsm.serve._report import demo_figures, summary_lines, to_json, write_outputs

    lines: list[str] = []
    clean = _demo_specs(out_dir, lines)
    problems = [line for line in lines if not line.startswith(("ok ", "wrote "))]
    demo = run_demo(settings, progress_bar=False if args.quiet else None,
                    events=out_dir / "events")
    if not demo.models:
        raise KvfsmError("kvfsm.serve serves none of the models asked for: " + "; ".join(
            f"{model_type}: {why}" for model_type, why in demo.skipped.items()))
    figures = demo_figures(demo)
    figures["specs_clean"] = clean
    with _doing("write into", out_dir):
        written = write_outputs(demo, figures, out_dir, command=_demo_command(args))
    if args.json:
        print(json.dumps(to_json(figures), indent=2))
    else:
        checked = sum(line.startswith("ok ") for line in lines)
        print(f"kvfsm demo: {checked} shipped specs checked exhaustively"
              + (", clean" if clean else f", {len(problems)} problem(s)")
              + f"; lifecycle diagrams in {out_dir}/")
        print("\n".join(problems + summary_lines(figures)))
        print(f"wrote {', '.join(path.name for path in written)} in {out_dir}/")
    if figures["kvfsm_wrong"]:
        print(f"kvfsm demo: {figures['kvfsm_wrong']} kvfsm output(s) differ from recomputing",
              file=sys.stderr)
    if figures["event_logs_rejected"]:
        print(f"kvfsm demo: {figures['event_logs_rejected']} event log(s) rejected by replay",
              file=sys.stderr)
    return 0 if clean and not figures["kvfsm_wrong"] and not figures["event_logs_rejected"] \
        else 1


def config_setting(text: str) -> tuple[str, object, str]:
    """The argparse type of ``--set``: ``KEY=VALUE`` with VALUE a JSON literal, as
    ``(key, value, text)``."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key.isidentifier():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(
            f"{key}: {raw!r} is not a JSON literal (numbers, true/false/null, [lists], "
            f"{{objects}}; quote strings: {key}='\"text\"')"
        ) from None
    return (key, value, text)


def _from_config_command(args: argparse.Namespace) -> str:
    """The command line that regenerates this output, for the generated file's header."""
    import shlex

    words = ["kvfsm", "model", "from-config"]
    words += [args.config] if args.config is not None else ["--model-type", args.model_type]
    if args.tiny:
        words.append("--tiny")
    for _key, _value, text in args.set:
        words += ["--set", text]
    if args.block_size != 16:
        words += ["--block-size", str(args.block_size)]
    if args.checkpoint_interval is not None:
        words += ["--checkpoint-interval", str(args.checkpoint_interval)]
    if args.name is not None:
        words += ["--name", args.name]
    return shlex.join(words)


def _load_config(args: argparse.Namespace) -> object:
    """The transformers config that ``model from-config`` was asked to declare. Its raw keys are
    checked first (``check_config_keys``): a ``CONFIG_JSON`` must give every key that sets the
    cache's shape, and every numeric key, ``--set`` ones included, must be in range."""
    from kvfsm.serve._declare import check_config_keys, shape_keys
    from kvfsm.serve._tiny import check_model_type, config_class, tiny_settings

    if args.config is not None and args.model_type is not None:
        raise KvfsmError("model from-config: give CONFIG_JSON or --model-type, not both")
    if args.config is None and args.model_type is None:
        raise KvfsmError("model from-config: give a CONFIG_JSON or a --model-type")
    if args.tiny and args.model_type is None:
        raise KvfsmError(
            "model from-config: --tiny needs --model-type (a CONFIG_JSON is used as is)"
        )
    given: dict[str, object] = {}
    if args.config is not None:
        path = Path(args.config)
        with _doing("read", path):
            text = path.read_text(encoding="utf-8")
        try:
            given = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise KvfsmError(f"{path}: not valid JSON: {exc}") from None
        if not isinstance(given, dict):
            raise KvfsmError(f"{path}: a config must be a JSON object, got {type(given).__name__}")
        if "model_type" not in given:
            raise KvfsmError(f"{path}: no 'model_type' key; is it a transformers config.json?")
        model_type = check_model_type(given["model_type"])
    else:
        model_type = check_model_type(args.model_type)
        given = tiny_settings(model_type) if args.tiny else {}
    cls = config_class(model_type)
    known = (set(cls().to_dict()) | set(getattr(cls, "attribute_map", {})) | set(given)
             | shape_keys(model_type))
    for key, _value, _text in args.set:
        if key not in known:
            raise KvfsmError(f"--set {key}: {model_type} configs have no key {key!r}")
    settings = {**given, **{key: value for key, value, _text in args.set}}
    source = args.config if args.config is not None else "(--set)"
    check_config_keys(model_type, settings, source=source, required=args.config is not None)
    try:
        if args.config is not None:
            return cls.from_dict(settings)
        return cls(**settings)
    except Exception as exc:  # transformers' validation errors share no base class
        raise KvfsmError(f"{model_type} config: {' '.join(str(exc).split())}") from None


def _cmd_model_from_config(args: argparse.Namespace) -> int:
    from kvfsm.serve import declaration_toml
    from kvfsm.serve._declare import snapshot_notes
    from kvfsm.spec import parse_model

    config = _load_config(args)
    name = args.name
    if name is None and args.tiny:
        name = f"tiny_{args.model_type}"
    text = declaration_toml(
        config, block_size=args.block_size, name=name,
        checkpoint_interval=args.checkpoint_interval, generated_by=_from_config_command(args),
    )
    model = parse_model(text, source="<model from-config>")  # refuse to print what cannot load
    for note in snapshot_notes(model):  # the cost of a recurrent group's snapshots, up front
        print(f"kvfsm: note: {note}", file=sys.stderr)
    if args.output is None or args.output == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return 0
    target = Path(args.output)
    with _doing("write", target):
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")
    groups = ", ".join(f"{g.name} ({g.kind.value})" for g in model.groups)
    print(f"wrote {target}: model {model.name}: {groups}")
    return 0


def lifecycle_setting(text: str) -> tuple[str, str]:
    """The argparse type of ``replay --lifecycle``: ``NAME=PATH`` as ``(name, path)``."""
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    return name.strip(), path.strip()


def _cmd_replay(args: argparse.Namespace) -> int:
    from kvfsm.obs import replay

    given: dict[str, Lifecycle] = {}
    for name, path in args.lifecycle:
        lifecycle = load_lifecycle(path)
        if lifecycle.name != name:
            raise KvfsmError(f"--lifecycle {name}={path}: that spec is lifecycle "
                             f"{lifecycle.name!r}, not {name!r}")
        given[name] = lifecycle
    code = 0
    figures = []
    for log in args.log:
        try:
            result = replay(log, given)
        except OSError as exc:
            # Unreadable is not rejected: exit 2, the replay could not run.
            print(f"kvfsm: error: cannot read {log}: {exc.strerror or exc}", file=sys.stderr)
            code = 2
            continue
        figures.append({"log": str(log), **result.to_json()})
        if not args.json:
            print(result.summary(), file=sys.stdout if result.accepted else sys.stderr)
        if not result.accepted and code == 0:
            code = 1
    if args.json:
        print(json.dumps(figures[0] if len(args.log) == 1 and figures else figures, indent=2))
    return code


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvfsm", description=__doc__, epilog=_EXIT_CODES)
    parser.add_argument("--version", action="version", version=f"kvfsm {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    spec = commands.add_parser("spec", help="work with lifecycle specs")
    spec_commands = spec.add_subparsers(dest="spec_command", required=True)
    check = spec_commands.add_parser(
        "check", help="validate specs and run the bounded exhaustive checker"
    )
    check.add_argument("paths", nargs="*", help="spec files or folders (default: shipped specs)")
    check.add_argument("--objects", type=positive_int, default=3,
                       help="objects in the checked pool (>= 1; default 3)")
    check.set_defaults(run=_cmd_spec_check)

    draw = commands.add_parser("diagram", help="draw a lifecycle")
    draw.add_argument("spec", help="a spec file or the name of a shipped lifecycle")
    draw.add_argument("--format", "-f", choices=FORMATS, default="mermaid")
    draw.add_argument("-o", "--output",
                      help="output file, its missing parent folders created ('-' or omitted: "
                      "stdout; png and svg need -o)")
    draw.set_defaults(run=_cmd_diagram)

    bench = commands.add_parser(
        "bench", help="measure",
        description="Measure; progress lines go to stderr, the figures alone to stdout.")
    bench.add_argument("what", choices=["fsm", "state", "lookup", "restore"],
                       help="fsm: the lifecycle tables alone; state: the state core's bytes per "
                       "block and its allocate-write-free throughput; lookup: the verdict of a "
                       "long prompt against a hit-only per-block walk; restore: disk, remote and "
                       "host restores into the device pool against raw reads of the same bytes")
    bench.add_argument("--json", action="store_true", help="print JSON")
    bench.add_argument("-q", "--quiet", action="store_true",
                       help="print no progress lines on stderr")
    bench.add_argument("--blocks", type=positive_int, default=None,
                       help="objects per batch (fsm, state; >= 1; default 1000000) or blocks "
                       "restored (restore; default 64)")
    bench.add_argument("--tokens", type=positive_int, default=131_072,
                       help="prompt tokens (lookup; >= 1)")
    bench.add_argument("--lengths", type=_sizes, default=None,
                       help="lookup: prompt lengths of the per-length table (comma-separated; "
                       "'none' leaves it out; default 1024 to 524288 tokens)")
    bench.add_argument("--pool-sizes", type=_sizes, default=None,
                       help="lookup: pool sizes (blocks per group) of the pool-size table "
                       "(comma-separated; 'none' leaves it out; default 10000, 100000, "
                       "1000000)")
    bench.add_argument("--block-bytes", type=positive_int, default=1 << 20,
                       help="bytes per block (restore; a multiple of 64; default 1048576)")
    bench.add_argument("--workers", type=positive_int, default=2,
                       help="restore worker threads of the engine (restore; default 2)")
    bench.add_argument("--remote", choices=["auto", "mooncake", "redis", "none"],
                       default="auto",
                       help="remote store to measure (restore; auto: Mooncake, else Redis, "
                       "else none)")
    bench.set_defaults(run=_cmd_bench)

    model = commands.add_parser("model", help="work with model declarations")
    model_commands = model.add_subparsers(dest="model_command", required=True)
    from_config = model_commands.add_parser(
        "from-config", help="declare the cache groups of a transformers model from its config",
        description="Print (or write) the kvfsm model declaration of a transformers config: "
        "every cache state the architecture keeps becomes a group of the right kind "
        "(gpt_oss, qwen3_next, deepseek_v4, llama, mistral, qwen3, gemma2, gemma3_text; see "
        "docs/models.md), its header stating each group's bytes. Needs transformers.")
    from_config.add_argument("config", nargs="?", metavar="CONFIG_JSON",
                             help="a transformers config.json")
    from_config.add_argument("--model-type", metavar="T",
                             help="start from transformers' default config of this model_type "
                             "instead of a file")
    from_config.add_argument("--tiny", action="store_true",
                             help="with --model-type: the tiny stand-in config (kvfsm.serve."
                             "tiny_config), named tiny_T")
    from_config.add_argument("--set", action="append", default=[], type=config_setting,
                             metavar="KEY=VALUE",
                             help="override a config key before the config is built; VALUE is "
                             "a JSON literal (repeatable)")
    from_config.add_argument("--block-size", type=positive_int, default=16,
                             help="tokens per block of the per-token groups (>= 1; default 16)")
    from_config.add_argument("--checkpoint-interval", type=positive_int,
                             help="tokens between recurrent snapshots, a multiple of the "
                             "block size (default: every block); the output's header states a "
                             "snapshot's bytes and the interval at which snapshots cost no more "
                             "per token than the other groups")
    from_config.add_argument("--name", help="the model's name (default: the model_type)")
    from_config.add_argument("-o", "--output",
                             help="output file, its missing parent folders created ('-' or "
                             "omitted: stdout)")
    from_config.set_defaults(run=_cmd_model_from_config)

    demo = commands.add_parser(
        "demo", help="the main job on embedded defaults",
        description="Serve tiny real transformers models (every architecture kvfsm.serve "
        "serves) with no cache, a hit-only cache and kvfsm's verdict on one seeded faulted "
        "workload, compare each request with recomputing, and print a short report per model. "
        "Writes report.md, report.json, PNG plots, metrics.prom (Prometheus text) and the "
        "lifecycle diagrams into -o DIR; a progress bar on stderr. Needs the serve extra: "
        'pip install "kvfsm[serve]".')
    demo.add_argument("-o", "--output", default="kvfsm-demo",
                      help="folder for the report, plots, metrics and diagrams, created if "
                      "missing (default kvfsm-demo)")
    demo.add_argument("--json", action="store_true",
                      help="print the figures as JSON instead of the report")
    demo.add_argument("--quick", action="store_true",
                      help="a small workload (a few seconds per model), for tests")
    demo.add_argument("--model", action="append", metavar="T",
                      choices=["deepseek_v4", "qwen3_next", "gpt_oss"],
                      help="serve only this model type (repeatable; default: every one "
                      "kvfsm.serve serves)")
    demo.add_argument("--seed", type=int, default=0, help="workload and weights seed")
    demo.add_argument("--remote", choices=["auto", "mooncake", "redis", "none"], default="auto",
                      help="the remote tier below disk, its server started on 127.0.0.1 for the "
                      "run and stopped at its end (auto: Mooncake if its client and "
                      "mooncake_master are installed, else Redis if redis-server and the redis "
                      "client are, else none: host and disk only; the report says which)")
    demo.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    demo.add_argument("--faults", action="store_true",
                      help="instead: the verdict-only fault table on the DeepSeek-style "
                      "declaration (no models served, no extra packages)")
    demo.set_defaults(run=_cmd_demo)

    replay = commands.add_parser(
        "replay", help="check an event log against the lifecycle tables",
        description="Re-fire an event log (kvfsm.obs.EventLog) through the lifecycle tables "
        "and check every line: each event has a row from the logged state, which is the "
        "replayed one, into the logged state; epochs move as the rows say; reads are of "
        "readable blocks at their current epoch; no tier holds more blocks than its capacity. "
        "Several logs are replayed one after the other (e.g. a demo's events/*.jsonl). "
        "Exit 0: every log accepted; 1: one was rejected (the first bad line of each is "
        "printed on stderr with its number); 2: a log cannot be read or a --lifecycle is "
        "bad.")
    replay.add_argument("log", metavar="LOG", nargs="+",
                        help="event logs (JSON Lines), each replayed on its own")
    replay.add_argument("--lifecycle", action="append", default=[], type=lifecycle_setting,
                        metavar="NAME=PATH",
                        help="replay groups following lifecycle NAME with the spec at PATH "
                        "instead of the shipped one (repeatable)")
    replay.add_argument("--json", action="store_true", help="print the result as JSON")
    replay.set_defaults(run=_cmd_replay)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; errors print as ``kvfsm: error: ...`` on stderr, never as a traceback
    (usage errors exit 2 from argparse itself)."""
    args = build_parser().parse_args(argv)
    try:
        code: int = args.run(args)
    except SpecError as err:
        # One line per problem, each marked, so no line of the report reads as output.
        for problem in err.problems:
            print(f"kvfsm: error: {problem}", file=sys.stderr)
        return 2
    except KvfsmError as err:
        print(f"kvfsm: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        # _doing() put what and where into strerror; a bare OSError names its file itself.
        where = f"{err.filename}: " if err.filename is not None else ""
        print(f"kvfsm: error: {where}{err.strerror or err}", file=sys.stderr)
        return 1
    except MemoryError as err:
        print(f"kvfsm: error: {err or 'out of memory'}", file=sys.stderr)
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main())

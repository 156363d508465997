"""The ``kvfsm`` command."""

from __future__ import annotations

import argparse
import json
import sys
import tomllib
from collections.abc import Sequence
from pathlib import Path

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


def _resolve_lifecycle(spec: str) -> Lifecycle:
    """A spec path, or the name of a shipped lifecycle."""
    if Path(spec).exists():
        return load_lifecycle(spec)
    shipped = shipped_lifecycles()
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
    known = set(shipped_lifecycles()) if models else set()
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
        known.add(lifecycle.name)
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
    data = diagram(_resolve_lifecycle(args.spec), args.format)
    if args.output in (None, "-"):
        if args.format in ("png", "svg") and args.output is None:
            raise KvfsmError(f"--format {args.format} needs -o FILE")
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
    else:
        Path(args.output).write_bytes(data)
        print(f"wrote {args.output} ({len(data)} bytes)")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from kvfsm.bench import bench_fsm, bench_lookup, bench_state

    if args.what == "lookup":
        figures = bench_lookup(tokens=args.tokens)
    else:
        figures = {"fsm": bench_fsm, "state": bench_state}[args.what](blocks=args.blocks)
    if args.json:
        print(json.dumps(figures, indent=2))
    else:
        for key, value in figures.items():
            shown = f"{value:,.3f}" if isinstance(value, float) else str(value)
            print(f"{key:32s} {shown}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    lines: list[str] = []
    clean = _spec_check([], 3, lines)
    print("kvfsm demo: lifecycle tables of every cache-object kind, checked exhaustively")
    print("\n".join(lines))
    out_dir = Path(args.output)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, lifecycle in shipped_lifecycles().items():
        target = out_dir / f"{name}.mmd"
        target.write_bytes(diagram(lifecycle, "mermaid"))
        print(f"wrote {target}")
    from kvfsm._demo_faults import fault_report

    print("\nkvfsm demo: a prefix hit is not a usable cache")
    print("\n".join(fault_report()))
    return 0 if clean else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvfsm", description=__doc__)
    parser.add_argument("--version", action="version", version=f"kvfsm {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    spec = commands.add_parser("spec", help="work with lifecycle specs")
    spec_commands = spec.add_subparsers(dest="spec_command", required=True)
    check = spec_commands.add_parser(
        "check", help="validate specs and run the bounded exhaustive checker"
    )
    check.add_argument("paths", nargs="*", help="spec files or folders (default: shipped specs)")
    check.add_argument("--objects", type=int, default=3, help="objects in the checked pool")
    check.set_defaults(run=_cmd_spec_check)

    draw = commands.add_parser("diagram", help="draw a lifecycle")
    draw.add_argument("spec", help="a spec file or the name of a shipped lifecycle")
    draw.add_argument("--format", "-f", choices=FORMATS, default="mermaid")
    draw.add_argument("-o", "--output", help="output file ('-' or omitted: stdout)")
    draw.set_defaults(run=_cmd_diagram)

    bench = commands.add_parser("bench", help="measure")
    bench.add_argument("what", choices=["fsm", "state", "lookup"],
                       help="fsm: the lifecycle tables alone; state: the state core's bytes per "
                       "block and its allocate-write-free throughput; lookup: the verdict of a "
                       "long prompt against a hit-only per-block walk")
    bench.add_argument("--json", action="store_true", help="print JSON")
    bench.add_argument("--blocks", type=int, default=1_000_000, help="objects per batch")
    bench.add_argument("--tokens", type=int, default=131_072, help="prompt tokens (lookup)")
    bench.set_defaults(run=_cmd_bench)

    demo = commands.add_parser("demo", help="the main job on embedded defaults")
    demo.add_argument("-o", "--output", default="kvfsm-demo", help="folder for diagrams")
    demo.set_defaults(run=_cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code: int = args.run(args)
    except KvfsmError as err:
        print(f"kvfsm: error: {err}", file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":
    sys.exit(main())

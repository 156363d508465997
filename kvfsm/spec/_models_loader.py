"""Read a model declaration (TOML) into a validated :class:`ModelDecl`.

As with lifecycle specs, every problem is collected before raising, each as
``file: table: row: message``: the table is ``model`` or ``groups`` and a group's row is its
position and name (``#2 (swa)``).
"""

from __future__ import annotations

import hashlib
import math
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from kvfsm._errors import SpecError
from kvfsm.spec._loader import _Problems, read_spec_text
from kvfsm.spec._model import Lifecycle
from kvfsm.spec._models import (
    DTYPES,
    ITEMSIZE,
    MAX_BLOCK_BYTES,
    MAX_SUB_BLOCKS,
    GroupDecl,
    Layout,
    ModelDecl,
)
from kvfsm.spec._shipped import shipped_lifecycles, shipped_specs_dir, spec_files
from kvfsm.spec._vocabulary import GroupKind

_TOP_KEYS = frozenset({"model", "groups"})
_MODEL_KEYS = ("name", "description", "layout_version")
_GROUP_KEYS = ("name", "kind", "lifecycle", "block_size", "shape", "dtype", "layout")
_LAYOUT_KEYS = ("dim_order", "alignment", "padding")
#: The keys only one kind carries; each is required on that kind and refused on the others.
_KIND_KEYS: Final = {
    GroupKind.FULL: (),
    GroupKind.SLIDING_WINDOW: ("window",),
    GroupKind.COMPRESSED: ("sub_blocks",),
    GroupKind.SPARSE_INDEX: ("target_group", "top_k"),
    GroupKind.RECURRENT: ("checkpoint_interval",),
}
_KIND_OF_KEY: Final = {key: kind for kind, keys in _KIND_KEYS.items() for key in keys}
#: Keys that were part of the schema once, and why they are gone.
_REMOVED_KEYS: Final = {
    "tail_tokens": (
        "'tail_tokens' is no longer a key: a compressed group of block size C needs raw tokens "
        "only after its last full block (floor(L/C)*C up to L), and the recent raw tokens a "
        "layer attends belong to its sliding_window group"
    ),
}
_KIND_NAMES: Final = tuple(kind.value for kind in GroupKind)
# Group names become keys of state arrays, metrics labels and file names (fullmatch: with `$`
# a trailing newline would still match).
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class _Reader:
    """Reads the keys of one table, recording a problem for each missing or mistyped value."""

    def __init__(
        self, body: dict[str, Any], table: str, row: str, problems: _Problems, prefix: str = ""
    ) -> None:
        self.body = body
        self.table = table
        self.row = row
        self.problems = problems
        self.prefix = prefix

    def add(self, message: str) -> None:
        self.problems.add(self.table, self.row, message)

    def _get(self, key: str, kind: type) -> Any | None:
        name = self.prefix + key
        if key not in self.body:
            self.add(f"missing {name!r}")
            return None
        value = self.body[key]
        # bool is an int subclass in Python; `block_size = true` is still a mistake.
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            article = "an" if kind is int else "a"
            self.add(f"{name!r} must be {article} {kind.__name__}, got {type(value).__name__}")
            return None
        return value

    def text(self, key: str, *, empty_ok: bool = False) -> str | None:
        value: str | None = self._get(key, str)
        if value is not None and not empty_ok and not value.strip():
            self.add(f"{self.prefix + key!r} must not be empty")
            return None
        return value

    def integer(self, key: str, *, minimum: int = 1) -> int | None:
        value: int | None = self._get(key, int)
        if value is not None and value < minimum:
            self.add(f"{self.prefix + key!r} must be >= {minimum}, got {value}")
            return None
        return value

    def sizes(self, key: str) -> tuple[int, ...] | None:
        """A non-empty list of positive ints."""
        value = self._get(key, list)
        if value is None:
            return None
        if not value or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value
        ):
            self.add(f"{self.prefix + key!r} must be a non-empty list of ints >= 1, got {value!r}")
            return None
        return tuple(value)

    def names(self, key: str) -> tuple[str, ...] | None:
        """A non-empty list of distinct non-empty strings."""
        value = self._get(key, list)
        if value is None:
            return None
        if not value or not all(isinstance(v, str) and v for v in value):
            self.add(f"{self.prefix + key!r} must be a non-empty list of names, got {value!r}")
            return None
        if len(set(value)) != len(value):
            self.add(f"{self.prefix + key!r} names a dimension twice: {value!r}")
            return None
        return tuple(value)


def load_model(path: str | Path, lifecycles: Mapping[str, Lifecycle] | None = None) -> ModelDecl:
    """Load and validate the model declaration at ``path``; raises :class:`SpecError`.

    ``lifecycles`` are the lifecycles a group may follow, by name (default: the shipped ones).
    """
    path = Path(path)
    return parse_model(read_spec_text(path), source=str(path), lifecycles=lifecycles)


def parse_model(
    text: str, *, source: str = "<string>", lifecycles: Mapping[str, Lifecycle] | None = None
) -> ModelDecl:
    """Parse and validate model declaration text; ``source`` names it in error messages and
    ``lifecycles`` are the lifecycles a group may follow, by name (default: the shipped ones).
    A group's kind must be its lifecycle's kind."""
    if lifecycles is not None and not isinstance(lifecycles, Mapping):
        # Names alone cannot be checked against the groups' kinds.
        raise TypeError(
            "lifecycles must map names to Lifecycle values (e.g. shipped_lifecycles()), "
            f"got {type(lifecycles).__name__}"
        )
    problems = _Problems(source)
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        problems.add("-", "-", f"TOML syntax error: {exc}")
        raise SpecError(problems.items) from exc
    known = shipped_lifecycles() if lifecycles is None else lifecycles

    for key in sorted(set(doc) - _TOP_KEYS):
        problems.add(
            key, "-", f"unknown top-level table {key!r}; expected one of {sorted(_TOP_KEYS)}"
        )
    header = _read_header(doc.get("model"), problems)
    groups = _read_groups(doc.get("groups"), known, problems)
    problems.raise_if_any()
    name, description, layout_version = header
    return ModelDecl(
        name=name,
        description=description,
        layout_version=layout_version,
        groups=tuple(groups),
        source=source,
        spec_hash=hashlib.sha256(text.encode("utf-8")).hexdigest(),
    )


def shipped_models() -> dict[str, ModelDecl]:
    """Every shipped model declaration, by name."""
    known = shipped_lifecycles()
    out: dict[str, ModelDecl] = {}
    for path in spec_files([shipped_specs_dir() / "models"]):
        model = load_model(path, known)
        out[model.name] = model
    return out


def _read_header(raw: Any, problems: _Problems) -> tuple[str, str, int]:
    if raw is None:
        problems.add("model", "-", f"missing [model] table with {', '.join(_MODEL_KEYS)}")
        return ("", "", 0)
    if not isinstance(raw, dict):
        problems.add("model", "-", "[model] must be a table")
        return ("", "", 0)
    for key in sorted(set(raw) - set(_MODEL_KEYS)):
        problems.add("model", key, f"unknown key {key!r}; expected {list(_MODEL_KEYS)}")
    # The row of a header problem is the key it is about, as in the lifecycle loader.
    name = _Reader(raw, "model", "name", problems).text("name")
    description = _Reader(raw, "model", "description", problems).text("description")
    version = _Reader(raw, "model", "layout_version", problems).integer("layout_version")
    return (name or "", description or "", version or 0)


def _read_groups(
    raw: Any, lifecycles: Mapping[str, Lifecycle], problems: _Problems
) -> list[GroupDecl]:
    if raw is None:
        problems.add("groups", "-", "missing [[groups]]: a model declares at least one group")
        return []
    if not isinstance(raw, list) or not raw:
        problems.add("groups", "-", "groups must be a non-empty array of [[groups]] tables")
        return []
    groups: list[GroupDecl] = []
    # Every name and kind as written, so a group with a problem of its own does not also make
    # each sparse index that targets it look wrong.
    declared: dict[str, GroupKind | None] = {}
    first_label: dict[str, str] = {}
    targets: list[tuple[str, str, str]] = []
    for position, body in enumerate(raw, start=1):
        name = body.get("name") if isinstance(body, dict) else None
        # A name with a line break or other control character is quoted, so each problem
        # stays on one line.
        shown = name if isinstance(name, str) and name.isprintable() else repr(name)
        label = f"#{position} ({shown})" if isinstance(name, str) else f"#{position}"
        if not isinstance(body, dict):
            problems.add("groups", label, "must be a table ([[groups]])")
            continue
        before = len(problems.items)
        group = _read_group(body, label, lifecycles, problems)
        if isinstance(name, str):
            if name in first_label:
                problems.add(
                    "groups", label, f"duplicate group name {name!r}: already {first_label[name]}"
                )
            else:
                first_label[name] = label
                kind = body.get("kind")
                declared[name] = GroupKind(kind) if kind in _KIND_NAMES else None
        target = body.get("target_group")
        if isinstance(name, str) and body.get("kind") == "sparse_index" and isinstance(target, str):
            targets.append((label, name, target))
        if group is not None and len(problems.items) == before:
            groups.append(GroupDecl(**group))
    for label, name, target in targets:
        if target == name:
            problems.add("groups", label, f"target_group {target!r} is this group itself")
        elif target not in declared:
            problems.add("groups", label, f"target_group {target!r} is not a group of this model")
        elif declared[target] is GroupKind.SPARSE_INDEX:
            problems.add("groups", label, f"target_group {target!r} is itself a sparse_index group")
    return groups


def _read_group(
    body: dict[str, Any], label: str, lifecycles: Mapping[str, Lifecycle], problems: _Problems
) -> dict[str, Any] | None:
    """The fields of one group as GroupDecl keyword arguments, or None when one is missing."""
    read = _Reader(body, "groups", label, problems)
    for key in sorted(set(body) & set(_REMOVED_KEYS)):
        read.add(_REMOVED_KEYS[key])
    for key in sorted(set(body) - set(_GROUP_KEYS) - set(_KIND_OF_KEY) - set(_REMOVED_KEYS)):
        read.add(f"unknown key {key!r}; expected {[*_GROUP_KEYS, *_KIND_OF_KEY]}")
    name = read.text("name")
    if name is not None and not _NAME.fullmatch(name):
        read.add(f"group name {name!r} must be letters, digits and '_', not starting with a digit")
        name = None
    kind_name = read.text("kind")
    kind = None
    if kind_name is not None:
        if kind_name in _KIND_NAMES:
            kind = GroupKind(kind_name)
        else:
            read.add(f"'kind': unknown value {kind_name!r}; expected one of {list(_KIND_NAMES)}")
    lifecycle = read.text("lifecycle")
    if lifecycle is not None and lifecycle not in lifecycles:
        read.add(f"unknown lifecycle {lifecycle!r}; known: {sorted(lifecycles)}")
        lifecycle = None
    elif lifecycle is not None and kind is not None and lifecycles[lifecycle].kind is not kind:
        follows = lifecycles[lifecycle].kind.value
        read.add(
            f"group {body.get('name')!r} has kind {kind.value!r} but its lifecycle "
            f"{lifecycle!r} is for kind {follows!r}: a group follows a lifecycle of its own kind"
        )
        lifecycle = None
    block_size = read.integer("block_size")
    shape = read.sizes("shape")
    dtype = read.text("dtype")
    if dtype is not None and dtype not in DTYPES:
        read.add(f"unknown dtype {dtype!r}; expected one of {list(DTYPES)}")
        dtype = None
    layout = _read_layout(body, read)
    if layout is not None and shape is not None and len(layout.dim_order) != len(shape) + 1:
        read.add(
            f"'layout.dim_order' names {len(layout.dim_order)} dimensions but a block has "
            f"{len(shape) + 1} (the block dimension plus 'shape' {list(shape)})"
        )
    elif layout is not None and shape is not None and block_size is not None \
            and "token" in layout.dim_order:
        # A dimension named "token" holds one entry per token of the block.
        tokens = shape[layout.dim_order.index("token") - 1]
        if tokens != block_size:
            read.add(f"'shape' gives the 'token' dimension {tokens} entries but a block holds "
                     f"'block_size' {block_size} tokens")
    if shape is not None and dtype is not None:
        _check_block_bytes(body.get("name"), shape, dtype, layout, read)
    extra = _read_kind_keys(body, kind, block_size, read) if kind is not None else None
    fields = {
        "name": name,
        "kind": kind,
        "lifecycle": lifecycle,
        "block_size": block_size,
        "shape": shape,
        "dtype": dtype,
        "layout": layout,
    }
    if extra is None or any(value is None for value in fields.values()):
        return None
    return fields | extra


def _check_block_bytes(
    name: Any, shape: tuple[int, ...], dtype: str, layout: Layout | None, read: _Reader
) -> None:
    """Refuse a block over :data:`MAX_BLOCK_BYTES` here, not as a MemoryError in the pools."""
    size = math.prod(shape) * ITEMSIZE[dtype]
    if layout is not None:
        size = -(-(size + layout.padding) // layout.alignment) * layout.alignment
    if size > MAX_BLOCK_BYTES:
        read.add(
            f"one block of group {name!r} takes {size} bytes ({size / (1 << 30):.3g} GiB), over "
            f"the {MAX_BLOCK_BYTES}-byte cap (MAX_BLOCK_BYTES, "
            f"{MAX_BLOCK_BYTES / (1 << 30):g} GiB): check 'shape'"
        )


def _read_layout(body: dict[str, Any], read: _Reader) -> Layout | None:
    raw = body.get("layout")
    if raw is None:
        read.add("missing [groups.layout] table with " + ", ".join(_LAYOUT_KEYS))
        return None
    if not isinstance(raw, dict):
        read.add(f"'layout' must be a table ([groups.layout]), got {type(raw).__name__}")
        return None
    layout = _Reader(raw, read.table, read.row, read.problems, prefix="layout.")
    for key in sorted(set(raw) - set(_LAYOUT_KEYS)):
        layout.add(f"unknown key 'layout.{key}'; expected {list(_LAYOUT_KEYS)}")
    dim_order = layout.names("dim_order")
    if dim_order is not None and "block" not in dim_order:
        layout.add(f"'layout.dim_order' must name the 'block' dimension, got {list(dim_order)}")
        dim_order = None
    alignment = layout.integer("alignment")
    if alignment is not None and alignment & (alignment - 1):
        layout.add(f"'layout.alignment' must be a power of two, got {alignment}")
        alignment = None
    padding = layout.integer("padding", minimum=0)
    if dim_order is None or alignment is None or padding is None:
        return None
    return Layout(dim_order=dim_order, alignment=alignment, padding=padding)


def _read_kind_keys(
    body: dict[str, Any], kind: GroupKind, block_size: int | None, read: _Reader
) -> dict[str, Any] | None:
    """The keys only ``kind`` carries, each required; those of other kinds are refused."""
    before = len(read.problems.items)
    for key in sorted(set(body) & set(_KIND_OF_KEY)):
        if _KIND_OF_KEY[key] is not kind:
            read.add(
                f"{key!r} applies only to kind {_KIND_OF_KEY[key].value!r}, not {kind.value!r}"
            )
    out: dict[str, Any] = {}
    if kind is GroupKind.SLIDING_WINDOW:
        out["window"] = read.integer("window")
    elif kind is GroupKind.COMPRESSED:
        sub_blocks = out["sub_blocks"] = read.integer("sub_blocks")
        if sub_blocks is not None and sub_blocks > MAX_SUB_BLOCKS:
            read.add(f"'sub_blocks' must be <= {MAX_SUB_BLOCKS}, got {sub_blocks}")
        elif sub_blocks is not None and block_size is not None and block_size % sub_blocks:
            read.add(f"block_size {block_size} is not a multiple of sub_blocks {sub_blocks}")
    elif kind is GroupKind.SPARSE_INDEX:
        out["target_group"] = read.text("target_group")
        out["top_k"] = read.integer("top_k")
    elif kind is GroupKind.RECURRENT:
        interval = out["checkpoint_interval"] = read.integer("checkpoint_interval")
        if interval is not None and block_size is not None and interval % block_size:
            read.add(
                f"checkpoint_interval {interval} is not a multiple of block_size {block_size}: "
                "a snapshot must fall on a block boundary"
            )
    if len(read.problems.items) != before:
        return None
    return out

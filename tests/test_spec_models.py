"""Tests of model declarations: the shipped models, block sizes and alignment, and many malformed
declarations, each built by one small textual edit of a valid one."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

from kvfsm._errors import SpecError, SpecProblem
from kvfsm.spec import (
    MAX_BLOCK_BYTES,
    GroupDecl,
    GroupKind,
    Layout,
    ModelDecl,
    load_model,
    parse_model,
    shipped_lifecycles,
    shipped_models,
    shipped_specs_dir,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
SOURCE = "mini_model.toml"
LIFECYCLES = shipped_lifecycles()

LAYOUT = """
[groups.layout]
dim_order = ["block", "token", "kv", "head", "dim"]
alignment = 256
padding = 0
"""

# One group of every kind, so each kind-specific key has a row to be edited in.
VALID_MODEL = (
    """\
[model]
name = "mini"
description = "One group of every kind, for the declaration tests."
layout_version = 1

[[groups]]
name = "attn"
kind = "full"
lifecycle = "full_kv"
block_size = 16
shape = [16, 2, 2, 16]
dtype = "float16"
"""
    + LAYOUT
    + """
[[groups]]
name = "swa"
kind = "sliding_window"
lifecycle = "sliding_window"
block_size = 16
shape = [16, 2, 2, 16]
dtype = "float16"
window = 128
"""
    + LAYOUT
    + """
[[groups]]
name = "hist"
kind = "compressed"
lifecycle = "compressed"
block_size = 64
shape = [64, 32]
dtype = "float16"
sub_blocks = 4

[groups.layout]
dim_order = ["block", "token", "latent"]
alignment = 256
padding = 0

[[groups]]
name = "idx"
kind = "sparse_index"
lifecycle = "sparse_index"
block_size = 16
shape = [16, 8, 2]
dtype = "int32"
target_group = "hist"
top_k = 8

[groups.layout]
dim_order = ["block", "token", "topk", "ref"]
alignment = 256
padding = 0

[[groups]]
name = "rec"
kind = "recurrent"
lifecycle = "recurrent"
block_size = 32
shape = [2, 16, 16]
dtype = "float32"
checkpoint_interval = 128

[groups.layout]
dim_order = ["block", "head", "key", "value"]
alignment = 256
padding = 0
"""
)

HEADER = 'name = "mini"\n'
ATTN = 'name = "attn"\nkind = "full"\nlifecycle = "full_kv"\nblock_size = 16\n'
SWA_WINDOW = "window = 128\n"
HIST_SUB_BLOCKS = "sub_blocks = 4\n"
IDX_TARGET = 'target_group = "hist"\n'
REC_INTERVAL = "checkpoint_interval = 128\n"
HIST_LAYOUT = 'dim_order = ["block", "token", "latent"]\n'
FIRST_LAYOUT = LAYOUT.strip() + "\n"
# A copy of the idx group named idx2, to append as a sixth group.
SECOND_INDEX = VALID_MODEL[
    VALID_MODEL.index('[[groups]]\nname = "idx"') : VALID_MODEL.index('[[groups]]\nname = "rec"')
].replace('"idx"', '"idx2"')


def edit(old: str, new: str, text: str = VALID_MODEL) -> str:
    """``text`` with the first occurrence of ``old`` replaced by ``new``."""
    assert old in text, f"anchor not found: {old!r}"
    return text.replace(old, new, 1)


def parse(text: str) -> ModelDecl:
    return parse_model(text, source=SOURCE, lifecycles=LIFECYCLES)


def find_problem(err: SpecError, table: str, row: str, message: str) -> SpecProblem:
    for problem in err.problems:
        if problem.table == table and row in problem.row and message in problem.message:
            assert problem.file == SOURCE
            return problem
    listed = "\n".join(str(p) for p in err.problems)
    raise AssertionError(f"no problem ({table}, {row}, ...{message}...) among:\n{listed}")


# ------------------------------------------------------------------------------ valid models


def test_valid_model_parses() -> None:
    model = parse(VALID_MODEL)
    assert model.name == "mini"
    assert model.layout_version == 1
    assert model.source == SOURCE
    assert len(model.spec_hash) == 64
    assert model.group_names == ("attn", "swa", "hist", "idx", "rec")
    assert [g.kind for g in model.groups] == list(GroupKind)
    swa = model.group("swa")
    assert swa.window == 128 and swa.sub_blocks is None and swa.top_k is None
    hist = model.group("hist")
    assert hist.sub_blocks == 4
    idx = model.group("idx")
    assert (idx.target_group, idx.top_k, idx.dtype) == ("hist", 8, "int32")
    assert model.group("rec").checkpoint_interval == 128
    assert model.group("attn").layout == Layout(("block", "token", "kv", "head", "dim"), 256, 0)
    assert model.group("attn").shape == (16, 2, 2, 16)
    assert model.lcm_block_size == 64
    with pytest.raises(KeyError, match="no group 'nope'"):
        model.group("nope")


@pytest.mark.parametrize(("dtype", "itemsize"), [("bfloat16", 2), ("float8_e4m3fn", 1),
                                                 ("float8_e5m2", 1), ("float32", 4)])
def test_kv_cache_dtypes_without_a_numpy_dtype_are_declared(dtype: str, itemsize: int) -> None:
    """bfloat16 (most models' KV cache in vLLM) and the float8 KV types are declared and sized
    like any other: pools hold bytes, the dtype names the layout."""
    model = parse(edit('dtype = "float16"', f'dtype = "{dtype}"'))
    attn = model.group("attn")
    assert attn.dtype == dtype and attn.itemsize == itemsize
    assert attn.payload_bytes == 16 * 2 * 2 * 16 * itemsize


def test_default_lifecycles_are_the_shipped_ones() -> None:
    assert parse_model(VALID_MODEL).name == "mini"
    some = {name: LIFECYCLES[name] for name in ("sliding_window", "compressed")}
    with pytest.raises(SpecError, match="unknown lifecycle 'full_kv'"):
        parse_model(VALID_MODEL, lifecycles=some)


def test_lifecycles_are_given_as_values_not_names() -> None:
    """Names alone cannot be checked against the groups' kinds."""
    with pytest.raises(TypeError, match="must map names to Lifecycle values"):
        parse_model(VALID_MODEL, lifecycles=list(LIFECYCLES))  # type: ignore[arg-type]


def test_group_kind_must_be_its_lifecycle_kind() -> None:
    """A lifecycle renamed is still checked by its declared kind, not by its name."""
    renamed = {"mine": LIFECYCLES["sparse_index"], **LIFECYCLES}
    with pytest.raises(SpecError) as info:
        parse_model(edit('lifecycle = "full_kv"', 'lifecycle = "mine"'), source=SOURCE,
                    lifecycles=renamed)
    problem = find_problem(info.value, "groups", "#1 (attn)", "group 'attn' has kind 'full'")
    assert "lifecycle 'mine' is for kind 'sparse_index'" in problem.message
    assert len(info.value.problems) == 1


EXPECTED_SHIPPED = {
    "dense": [("attn", GroupKind.FULL, "full_kv")],
    "gpt_oss_like": [
        ("full", GroupKind.FULL, "full_kv"),
        ("swa", GroupKind.SLIDING_WINDOW, "sliding_window"),
    ],
    "deepseek_v4_like": [
        ("history", GroupKind.COMPRESSED, "compressed"),
        ("swa", GroupKind.SLIDING_WINDOW, "sliding_window"),
        ("index", GroupKind.SPARSE_INDEX, "sparse_index"),
    ],
    "qwen3_next_like": [
        ("attn", GroupKind.FULL, "full_kv"),
        ("delta", GroupKind.RECURRENT, "recurrent"),
    ],
    # Generated from the tiny transformers configs (`kvfsm model from-config --tiny`).
    "tiny_gpt_oss": [
        ("full", GroupKind.FULL, "full_kv"),
        ("sliding", GroupKind.SLIDING_WINDOW, "sliding_window"),
    ],
    "tiny_qwen3_next": [
        ("full", GroupKind.FULL, "full_kv"),
        ("linear", GroupKind.RECURRENT, "recurrent"),
    ],
    "tiny_deepseek_v4": [
        ("sliding", GroupKind.SLIDING_WINDOW, "sliding_window"),
        ("csa", GroupKind.COMPRESSED, "compressed"),
        ("csa_index", GroupKind.COMPRESSED, "compressed"),
        ("csa_overlap", GroupKind.RECURRENT, "recurrent"),
        ("hca", GroupKind.COMPRESSED, "compressed"),
    ],
}


def test_shipped_models_load_with_their_groups() -> None:
    models = shipped_models()
    assert sorted(models) == sorted(EXPECTED_SHIPPED)
    lifecycles = shipped_lifecycles()
    for name, groups in EXPECTED_SHIPPED.items():
        model = models[name]
        assert [(g.name, g.kind, g.lifecycle) for g in model.groups] == groups
        assert model.source == str(shipped_specs_dir() / "models" / f"{name}.toml")
        for group in model.groups:
            assert group.lifecycle in lifecycles
            assert group.block_bytes % group.layout.alignment == 0


def test_shipped_kind_specific_values() -> None:
    models = shipped_models()
    assert models["gpt_oss_like"].group("swa").window == 128
    deepseek = models["deepseek_v4_like"]
    history = deepseek.group("history")
    assert (history.block_size, history.sub_blocks) == (64, 4)
    assert deepseek.group("swa").window == 128
    assert deepseek.group("swa").block_size == 16
    assert (deepseek.group("index").target_group, deepseek.group("index").top_k) == ("history", 8)
    assert deepseek.lcm_block_size == 64
    delta = models["qwen3_next_like"].group("delta")
    assert delta.checkpoint_interval is not None
    assert delta.checkpoint_interval % delta.block_size == 0


def test_docs_list_every_shipped_model() -> None:
    page = (REPO_ROOT / "docs" / "models.md").read_text(encoding="utf-8")
    for model in shipped_models().values():
        assert f"`{model.name}` {model.lcm_block_size}" in page, model.name


def _group(shape: tuple[int, ...], dtype: str, alignment: int, padding: int) -> GroupDecl:
    layout = Layout(tuple(f"d{i}" for i in range(len(shape) + 1)), alignment, padding)
    return GroupDecl("g", GroupKind.FULL, "full_kv", 16, shape, dtype, layout)


@pytest.mark.parametrize(
    ("shape", "dtype", "alignment", "padding", "payload", "block"),
    [
        ((16, 2, 2, 16), "float16", 256, 0, 2048, 2048),
        ((16, 2, 2, 16), "float16", 256, 1, 2049, 2304),
        ((3, 5), "int8", 64, 0, 15, 64),
        ((3, 5), "float32", 16, 4, 64, 64),
        ((7,), "int32", 1, 0, 28, 28),
        ((100,), "uint8", 4096, 0, 100, 4096),
    ],
)
def test_block_bytes_round_up_to_alignment(
    shape: tuple[int, ...], dtype: str, alignment: int, padding: int, payload: int, block: int
) -> None:
    group = _group(shape, dtype, alignment, padding)
    assert group.payload_bytes == payload
    assert group.block_bytes == block
    assert group.block_bytes % alignment == 0
    assert 0 <= group.block_bytes - group.payload_bytes < alignment


def test_lcm_of_block_sizes() -> None:
    text = edit(REC_INTERVAL, "checkpoint_interval = 96\n")
    model = parse(edit("block_size = 32\n", "block_size = 48\n", text))
    assert model.lcm_block_size == 192  # lcm(16, 64, 48)


# ------------------------------------------------------------------------------ malformed models

# (id, declaration text, expected table, expected row substring, message substring)
MALFORMED: list[tuple[str, str, str, str, str]] = [
    ("toml-syntax", edit(HEADER, 'name = "mini\n'), "-", "-", "TOML syntax error"),
    ("missing-model-table", edit("[model]\n", "[modle]\n"), "model", "-", "missing [model]"),
    ("unknown-top-table", VALID_MODEL + "\n[extra]\nx = 1\n", "extra", "-", "unknown top-level"),
    ("missing-model-name", edit(HEADER, ""), "model", "name", "missing 'name'"),
    ("unknown-model-key", edit(HEADER, HEADER + "size = 3\n"), "model", "size", "unknown key"),
    (
        "layout-version-bool",
        edit("layout_version = 1", "layout_version = true"),
        "model", "layout_version", "'layout_version' must be an int, got bool",
    ),
    (
        "layout-version-zero",
        edit("layout_version = 1", "layout_version = 0"),
        "model", "layout_version", "must be >= 1, got 0",
    ),
    (
        "no-groups",
        VALID_MODEL[: VALID_MODEL.index("[[groups]]")],
        "groups", "-", "missing [[groups]]",
    ),
    (
        "groups-empty",
        "groups = []\n" + VALID_MODEL[: VALID_MODEL.index("[[groups]]")],
        "groups", "-", "non-empty array",
    ),
    (
        "unknown-group-key",
        edit(ATTN, ATTN + "colour = 3\n"),
        "groups", "#1 (attn)", "unknown key 'colour'",
    ),
    (
        "missing-block-size",
        edit(ATTN, ATTN.replace("block_size = 16\n", "")),
        "groups", "#1 (attn)", "missing 'block_size'",
    ),
    (
        "block-size-bool",
        edit(ATTN, ATTN.replace("16", "true")),
        "groups", "#1 (attn)", "'block_size' must be an int, got bool",
    ),
    (
        "block-size-zero",
        edit(ATTN, ATTN.replace("16", "0")),
        "groups", "#1 (attn)", "'block_size' must be >= 1",
    ),
    (
        "block-size-float",
        edit(ATTN, ATTN.replace("16", "16.0")),
        "groups", "#1 (attn)", "must be an int, got float",
    ),
    (
        "shape-zero",
        edit("shape = [16, 2, 2, 16]", "shape = [16, 0, 2, 16]"),
        "groups", "#1 (attn)", "'shape' must be a non-empty list",
    ),
    (
        "shape-empty",
        edit("shape = [64, 32]", "shape = []"),
        "groups", "#3 (hist)", "'shape' must be a non-empty list",
    ),
    (
        "unknown-kind",
        edit('kind = "full"', 'kind = "dense"'),
        "groups", "#1 (attn)", "'kind': unknown value 'dense'",
    ),
    (
        "unknown-lifecycle",
        edit('lifecycle = "full_kv"', 'lifecycle = "full"'),
        "groups", "#1 (attn)", "unknown lifecycle 'full'",
    ),
    (
        "token-dimension-not-the-block-size",
        edit("shape = [16, 2, 2, 16]", "shape = [8, 2, 2, 16]"),
        "groups", "#1 (attn)", "'token' dimension 8 entries but a block holds 'block_size' 16",
    ),
    (
        "unknown-dtype",
        edit('dtype = "float16"', 'dtype = "bfloat8"'),
        "groups", "#1 (attn)", "unknown dtype 'bfloat8'",
    ),
    (
        "bad-group-name",
        edit('name = "attn"', 'name = "2 attn"'),
        "groups", "#1 (2 attn)", "letters, digits and '_'",
    ),
    (
        "duplicate-group",
        edit('name = "swa"', 'name = "attn"'),
        "groups", "#2 (attn)", "duplicate group name 'attn': already #1 (attn)",
    ),
    ("missing-layout", edit(FIRST_LAYOUT, ""), "groups", "#1 (attn)", "missing [groups.layout]"),
    (
        "alignment-not-power-of-two",
        edit("alignment = 256", "alignment = 48"),
        "groups", "#1 (attn)", "'layout.alignment' must be a power of two, got 48",
    ),
    (
        "alignment-zero",
        edit("alignment = 256", "alignment = 0"),
        "groups", "#1 (attn)", "'layout.alignment' must be >= 1",
    ),
    (
        "padding-negative",
        edit("padding = 0", "padding = -4"),
        "groups", "#1 (attn)", "'layout.padding' must be >= 0",
    ),
    (
        "unknown-layout-key",
        edit("padding = 0", "padding = 0\nstride = 8"),
        "groups", "#1 (attn)", "unknown key 'layout.stride'",
    ),
    (
        "dim-order-length",
        edit(HIST_LAYOUT, 'dim_order = ["block", "token"]\n'),
        "groups", "#3 (hist)", "'layout.dim_order' names 2 dimensions but a block has 3",
    ),
    (
        "dim-order-no-block",
        edit(HIST_LAYOUT, 'dim_order = ["blk", "token", "latent"]\n'),
        "groups", "#3 (hist)", "must name the 'block' dimension",
    ),
    (
        "dim-order-repeat",
        edit(HIST_LAYOUT, 'dim_order = ["block", "token", "token"]\n'),
        "groups", "#3 (hist)", "names a dimension twice",
    ),
    (
        "window-on-full",
        edit(ATTN, ATTN + "window = 64\n"),
        "groups", "#1 (attn)", "'window' applies only to kind 'sliding_window', not 'full'",
    ),
    (
        "top-k-on-compressed",
        edit(HIST_SUB_BLOCKS, HIST_SUB_BLOCKS + "top_k = 4\n"),
        "groups", "#3 (hist)", "'top_k' applies only to kind 'sparse_index'",
    ),
    ("window-missing", edit(SWA_WINDOW, ""), "groups", "#2 (swa)", "missing 'window'"),
    (
        "window-zero",
        edit(SWA_WINDOW, "window = 0\n"),
        "groups", "#2 (swa)", "'window' must be >= 1, got 0",
    ),
    (
        "tail-tokens-is-no-longer-a-key",
        edit(HIST_SUB_BLOCKS, HIST_SUB_BLOCKS + "tail_tokens = 64\n"),
        "groups", "#3 (hist)", "'tail_tokens' is no longer a key",
    ),
    (
        "kind-differs-from-lifecycle-kind",
        edit('lifecycle = "full_kv"', 'lifecycle = "sliding_window"'),
        "groups", "#1 (attn)",
        "group 'attn' has kind 'full' but its lifecycle 'sliding_window' is for kind "
        "'sliding_window'",
    ),
    (
        "index-follows-a-kv-lifecycle",
        edit('lifecycle = "sparse_index"', 'lifecycle = "full_kv"'),
        "groups", "#4 (idx)",
        "group 'idx' has kind 'sparse_index' but its lifecycle 'full_kv' is for kind 'full'",
    ),
    (
        "group-name-trailing-newline",
        edit('name = "attn"', 'name = "attn\\n"'),
        "groups", "#1 ('attn\\n')", "letters, digits and '_'",
    ),
    (
        "block-over-the-byte-cap",
        edit("shape = [64, 32]", f"shape = [{1 << 40}, {1 << 20}]"),
        "groups", "#3 (hist)",
        f"one block of group 'hist' takes {(1 << 61)} bytes (2.15e+09 GiB), over the "
        f"{MAX_BLOCK_BYTES}-byte cap",
    ),
    (
        "sub-blocks-not-divisor",
        edit(HIST_SUB_BLOCKS, "sub_blocks = 3\n"),
        "groups", "#3 (hist)", "block_size 64 is not a multiple of sub_blocks 3",
    ),
    (
        "sub-blocks-too-many",
        edit(HIST_SUB_BLOCKS, "sub_blocks = 32\n"),
        "groups", "#3 (hist)", "'sub_blocks' must be <= 16",
    ),
    ("top-k-missing", edit("top_k = 8\n", ""), "groups", "#4 (idx)", "missing 'top_k'"),
    (
        "target-unknown",
        edit(IDX_TARGET, 'target_group = "hst"\n'),
        "groups", "#4 (idx)", "target_group 'hst' is not a group of this model",
    ),
    (
        "target-itself",
        edit(IDX_TARGET, 'target_group = "idx"\n'),
        "groups", "#4 (idx)", "target_group 'idx' is this group itself",
    ),
    (
        "target-is-sparse-index",
        edit(IDX_TARGET, 'target_group = "idx2"\n') + "\n" + SECOND_INDEX,
        "groups", "#4 (idx)", "target_group 'idx2' is itself a sparse_index group",
    ),
    (
        "checkpoint-missing",
        edit(REC_INTERVAL, ""),
        "groups", "#5 (rec)", "missing 'checkpoint_interval'",
    ),
    (
        "checkpoint-not-multiple",
        edit(REC_INTERVAL, "checkpoint_interval = 100\n"),
        "groups", "#5 (rec)", "checkpoint_interval 100 is not a multiple of block_size 32",
    ),
    (
        "group-not-table",
        edit(
            "[model]\n",
            "groups = [1]\n[model]\n",
            VALID_MODEL[: VALID_MODEL.index("[[groups]]")],
        ),
        "groups", "#1", "must be a table",
    ),
]


@pytest.mark.parametrize(
    ("text", "table", "row", "message"),
    [case[1:] for case in MALFORMED],
    ids=[case[0] for case in MALFORMED],
)
def test_malformed_model_is_rejected(text: str, table: str, row: str, message: str) -> None:
    with pytest.raises(SpecError) as info:
        parse(text)
    find_problem(info.value, table, row, message)
    assert len(str(info.value).splitlines()) == len(info.value.problems)  # one line each


def test_every_problem_is_reported_at_once() -> None:
    text = edit("layout_version = 1", 'layout_version = "1"')
    text = edit('dtype = "float16"', 'dtype = "float64"', text)
    text = edit(SWA_WINDOW, "window = 0\n", text)
    text = edit("alignment = 256", "alignment = 100", edit(HIST_LAYOUT, "", text))
    text = edit(REC_INTERVAL, "checkpoint_interval = 48\n", text)
    with pytest.raises(SpecError) as info:
        parse(text)
    err = info.value
    find_problem(err, "model", "layout_version", "must be an int, got str")
    find_problem(err, "groups", "#1 (attn)", "unknown dtype 'float64'")
    find_problem(err, "groups", "#2 (swa)", "'window' must be >= 1")
    find_problem(err, "groups", "#1 (attn)", "power of two, got 100")
    find_problem(err, "groups", "#3 (hist)", "missing 'layout.dim_order'")
    find_problem(err, "groups", "#5 (rec)", "not a multiple of block_size 32")
    assert len(err.problems) == 6
    assert str(err).splitlines()[0].startswith(f"{SOURCE}: model: layout_version: ")


def test_a_broken_target_does_not_cascade() -> None:
    """The index's target has a problem of its own; the index is not also blamed for it."""
    with pytest.raises(SpecError) as info:
        parse(edit("block_size = 64\n", "block_size = -64\n"))
    assert [(p.row, p.message) for p in info.value.problems] == [
        ("#3 (hist)", "'block_size' must be >= 1, got -64")
    ]


def test_tail_tokens_is_gone_from_the_declaration() -> None:
    assert "tail_tokens" not in attrs.fields_dict(GroupDecl)
    with pytest.raises(SpecError) as info:
        parse(edit(HIST_SUB_BLOCKS, HIST_SUB_BLOCKS + "tail_tokens = 64\n"))
    (problem,) = info.value.problems
    assert "sliding_window group" in problem.message
    assert "unknown key" not in problem.message


def _attn_of_last_dim(last: int) -> str:
    """VALID_MODEL with attn's block 16 x 2 x 2 x ``last`` float16 (128 * last bytes)."""
    return edit("shape = [16, 2, 2, 16]", f"shape = [16, 2, 2, {last}]")


def test_block_byte_cap_is_inclusive() -> None:
    at_cap = MAX_BLOCK_BYTES // 128
    assert parse(_attn_of_last_dim(at_cap)).group("attn").block_bytes == MAX_BLOCK_BYTES
    with pytest.raises(SpecError) as info:
        parse(_attn_of_last_dim(at_cap + 2))
    (problem,) = info.value.problems
    assert problem.row == "#1 (attn)"
    assert f"takes {MAX_BLOCK_BYTES + 256} bytes" in problem.message


def test_padding_and_alignment_count_towards_the_byte_cap() -> None:
    at_cap = _attn_of_last_dim(MAX_BLOCK_BYTES // 128)
    with pytest.raises(SpecError, match=f"takes {MAX_BLOCK_BYTES + 256} bytes"):
        parse(edit("padding = 0", "padding = 1", at_cap))


def test_load_model_reads_files(tmp_path: Path) -> None:
    path = tmp_path / "mini.toml"
    path.write_text(VALID_MODEL, encoding="utf-8")
    assert load_model(path, LIFECYCLES).source == str(path)
    with pytest.raises(SpecError, match="cannot read"):
        load_model(tmp_path / "missing.toml", LIFECYCLES)
    path.write_bytes(b"\xff\xfe")
    with pytest.raises(SpecError, match="not UTF-8"):
        load_model(path, LIFECYCLES)

"""kvfsm as an SGLang HiCache storage backend: the per-pool rule and page identity here, and
the backend itself through SGLang's own backend factory (``tests/sglang_scenarios.py``).

The SGLang scenarios run in-process where SGLang imports, else in a subprocess with the
interpreter ``KVFSM_PEERS_PYTHON`` names (``.ci/run`` builds that environment), and are skipped
only where neither is available.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvfsm.integrations.sglang import (
    StoragePool,
    VerifiedPages,
    namespace_digest,
    page_pool,
    pool_for_policy,
    restorable_prefix,
    servable,
)
from kvfsm.spec import GroupKind
from tests import sglang_scenarios as scenarios
from tests.doc_figures import integers, page, section, table

ROOT = Path(__file__).resolve().parents[1]
PEERS_PYTHON = "KVFSM_PEERS_PYTHON"
#: Generous: the scenarios take ~30 s on two cores (~7 s importing SGLang, ~16 s starting and
#: closing Mooncake clients).
SCENARIO_TIMEOUT_S = 600

verified_vectors = st.lists(st.booleans(), min_size=0, max_size=24)


def _policy_statement(policy: str, trailing: int, verified: list[bool], length: int) -> bool:
    """SGLang's documented hit policies, page by page: ``all_pages`` needs every page of
    ``[0, length)``; ``trailing_pages`` the last ``trailing`` of them."""
    start = 0 if policy == "all_pages" else max(0, length - max(1, trailing))
    return all(verified[start:length])


# -- the per-pool rule ----------------------------------------------------------------------


@given(verified_vectors, st.sampled_from(["all_pages", "trailing_pages"]),
       st.integers(0, 6))
def test_servable_is_sglang_policy(verified: list[bool], policy: str, trailing: int) -> None:
    """For every length L and either policy, kvfsm's kind rule (full, recurrent or sliding
    window over one-page blocks) serves L exactly where SGLang's policy says the pool's pages
    are there."""
    pool = pool_for_policy("pool", policy, trailing)
    ok = servable(pool, np.array(verified, dtype=np.bool_))
    expected = [_policy_statement(policy, trailing, verified, n)
                for n in range(1, len(verified) + 1)]
    assert ok.tolist() == expected


@given(st.integers(0, 16).flatmap(lambda n: st.tuples(
    st.lists(st.booleans(), min_size=n, max_size=n),
    st.lists(st.tuples(st.sampled_from(["all_pages", "trailing_pages"]), st.integers(0, 4),
                       st.lists(st.booleans(), min_size=n, max_size=n)), max_size=3))))
def test_restorable_prefix_ands_every_pool(case: tuple[list[bool], list[Any]]) -> None:
    """A length is restorable exactly where every KV page before it verified and every pool's
    policy holds at it; each pool's boundary is the longest length it serves within the KV
    pages, and the answer's pages the longest restorable length."""
    kv, pools = case
    checked = [(pool_for_policy(f"p{i}", policy, trailing), np.array(v, dtype=np.bool_))
               for i, (policy, trailing, v) in enumerate(pools)]
    answer = restorable_prefix(np.array(kv, dtype=np.bool_), checked)
    kv_ok = [all(kv[:n]) for n in range(1, len(kv) + 1)]
    per_pool = [[kv_ok[n - 1] and _policy_statement(policy, trailing, v, n)
                 for n in range(1, len(kv) + 1)] for policy, trailing, v in pools]
    expected = [n for n in range(1, len(kv) + 1)
                if kv_ok[n - 1] and all(ok[n - 1] for ok in per_pool)]
    assert list(answer.lengths) == expected
    assert answer.pages == (expected[-1] if expected else 0)
    for i, ok in enumerate(per_pool):
        longest = max((n for n in range(1, len(kv) + 1) if ok[n - 1]), default=0)
        assert answer.boundaries.get(f"p{i}", 0) == longest


def test_trailing_state_lengths_are_not_downward_closed() -> None:
    # A state at 4 and 8 pages only (checkpoints): 4 and 8 restorable, nothing between.
    state = np.zeros(8, dtype=np.bool_)
    state[[3, 7]] = True
    answer = restorable_prefix(np.ones(8, dtype=np.bool_),
                               [(pool_for_policy("mamba", "trailing_pages", 1), state)])
    assert answer.lengths == (4, 8)
    assert dict(answer.boundaries) == {"mamba": 8, "kv": 8}


def test_unknown_policy_and_bad_pool_are_refused() -> None:
    with pytest.raises(ValueError, match="block_groups"):
        pool_for_policy("c4", "block_groups", 1)
    with pytest.raises(ValueError, match="kind compressed"):
        StoragePool("x", GroupKind.COMPRESSED)
    with pytest.raises(ValueError, match="8 pages verified for 3 keys"):
        restorable_prefix(np.ones(3, dtype=np.bool_),
                          [(pool_for_policy("m", "all_pages", 1), np.ones(8, dtype=np.bool_))])


# -- page identity --------------------------------------------------------------------------


def _pool(**changes: Any) -> Any:
    fields: dict[str, Any] = {"tp_shard": "tp0of1", "layout": "layer_first", "dtype": "float16",
                              "page_elements": 256, "itemsize": 2, "page_tokens": 4}
    fields.update(changes)
    return page_pool(str(fields.pop("name", "kv")), **fields)


def test_a_page_is_named_by_model_pool_shard_layout_and_sglang_key() -> None:
    model = namespace_digest({"model": "a", "salt": ""})
    key = _pool().key(model, "abc")
    assert key == _pool().key(model, "abc")
    assert (key.token_start, key.token_end) == (0, 4)
    assert _pool().page_bytes == 512
    assert set(key.name) <= set("0123456789abcdef-")
    others = [
        _pool().key(namespace_digest({"model": "b", "salt": ""}), "abc"),
        _pool().key(namespace_digest({"model": "a", "salt": "s"}), "abc"),
        _pool(name="mamba").key(model, "abc"),
        _pool(tp_shard="tp1of2").key(model, "abc"),
        _pool(layout="page_first").key(model, "abc"),
        _pool(dtype="bfloat16").key(model, "abc"),
        _pool(page_elements=128).key(model, "abc"),
        _pool(page_tokens=8).key(model, "abc"),
        _pool(format_tag="mxfp8").key(model, "abc"),
        _pool().key(model, "abd"),
    ]
    names = {key.name, *(other.name for other in others)}
    assert len(names) == len(others) + 1


def test_namespace_ignores_field_order_and_bad_geometry_is_refused() -> None:
    assert namespace_digest({"a": 1, "b": 2}) == namespace_digest({"b": 2, "a": 1})
    assert len(namespace_digest({})) == 16
    with pytest.raises(ValueError, match="a page needs"):
        _pool(page_elements=0)


# -- staging of verified bytes --------------------------------------------------------------


def test_verified_pages_keep_the_most_recent_within_capacity() -> None:
    staged = VerifiedPages(capacity_bytes=20)
    for name in "abc":
        staged.add(name, np.full(8, ord(name), dtype=np.uint8))
    assert staged.get("a") is None  # 24 bytes asked, 20 kept: the oldest went
    page_b = staged.get("b")
    assert page_b is not None and page_b.tolist() == [ord("b")] * 8
    staged.add("d", np.zeros(8, dtype=np.uint8))  # "b" was used last: "c" goes
    assert staged.get("c") is None and staged.get("b") is not None
    staged.add("huge", np.zeros(64, dtype=np.uint8))
    assert staged.get("huge") is None and staged.bytes_used == 16
    staged.clear()
    assert staged.bytes_used == 0 and staged.get("b") is None
    with pytest.raises(ValueError, match=">= 0"):
        VerifiedPages(-1)


# -- the backend inside SGLang --------------------------------------------------------------


@pytest.fixture(scope="module")
def sglang_results() -> dict[str, Any]:
    """Every SGLang scenario's results: in-process where SGLang imports, else through the
    interpreter ``KVFSM_PEERS_PYTHON`` names."""
    if importlib.util.find_spec("sglang") is not None:
        return scenarios.run_all()
    python = os.environ.get(PEERS_PYTHON)
    if not python:
        pytest.skip(f"SGLang does not import here and {PEERS_PYTHON} is not set (.ci/run sets "
                    "it to an environment with SGLang 0.5.23)")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    done = subprocess.run([python, str(ROOT / "tests" / "sglang_scenarios.py")], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=SCENARIO_TIMEOUT_S,
                          check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    results: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return results


def test_sglang_factory_builds_the_backend(sglang_results: dict[str, Any]) -> None:
    life = sglang_results["lifecycle"]
    assert life["backend_class"] == "KvfsmStorage"
    assert life["no_tier_error"].startswith("TierError: the kvfsm HiCache backend needs")


def test_faults_are_never_reported_or_read(sglang_results: dict[str, Any]) -> None:
    """Per fault on one page: kvfsm counts only the pages before it and reads none of it;
    SGLang's stock file backend counts every file it finds."""
    table = sglang_results["faults"]
    lines = [f"{'fault':<9} {'stock exists':>12} {'kvfsm exists':>12}  stock get / kvfsm get"]
    for fault, row in table.items():
        lines.append(f"{fault:<9} {row['stock']['exists']:>12} {row['kvfsm']['exists']:>12}  "
                     f"{row['stock']['get']} / {row['kvfsm']['get']}")
    sys.stdout.write("\n" + "\n".join(lines) + "\n")
    assert table["none"]["kvfsm"] == {**table["none"]["kvfsm"], "exists": scenarios.PAGES,
                                      "get": "ok"}
    assert table["none"]["stock"] == {"exists": scenarios.PAGES, "get": "ok"}
    for fault in ("flipped", "torn", "missing", "foreign"):
        assert table[fault]["kvfsm"]["exists"] == scenarios.FAULT_PAGE, fault
        assert table[fault]["kvfsm"]["get"] == f"refused at {scenarios.FAULT_PAGE}", fault
    # What stock SGLang does with the same files: counts them, then serves or raises.
    for fault in ("flipped", "torn", "foreign"):
        assert table[fault]["stock"]["exists"] == scenarios.PAGES, fault
    assert table["flipped"]["stock"]["get"] == f"wrong bytes at {scenarios.FAULT_PAGE}"
    assert table["foreign"]["stock"]["get"] == f"wrong bytes at {scenarios.FAULT_PAGE}"
    assert table["torn"]["stock"]["get"].startswith("raised")
    assert table["flipped"]["kvfsm"]["counts"]["CORRUPT"] == 1
    assert table["torn"]["kvfsm"]["counts"]["CORRUPT"] == 1
    assert table["foreign"]["kvfsm"]["counts"]["FOREIGN"] == 1


def test_hybrid_restorable_lengths_need_the_state(sglang_results: dict[str, Any]) -> None:
    """KV plus a state pool kept at pages 4 and 8: both backends answer [4, 8] clean; with the
    state at 8 flipped kvfsm answers [4] and reads it back refused, stock still [4, 8]."""
    hybrid = sglang_results["hybrid"]
    for side in ("stock", "kvfsm"):
        assert hybrid[side]["written"] == {"mamba": [True, True]}
        assert hybrid[side]["clean"] == {"kv_hit_pages": 8, "restorable": list(
            scenarios.CHECKPOINTS)}
    assert hybrid["kvfsm"]["state_flipped"] == {"kv_hit_pages": 4, "restorable": [4]}
    assert hybrid["stock"]["state_flipped"] == {"kv_hit_pages": 8, "restorable": [4, 8]}
    assert hybrid["kvfsm"]["v2_read"] == [True, False]
    assert hybrid["kvfsm"]["v2_first_equal"]


def test_v1_pages_survive_a_restart_and_stay_per_model(sglang_results: dict[str, Any]) -> None:
    life = sglang_results["lifecycle"]
    assert life["stored"] == [True] * scenarios.PAGES
    assert life["exists_after_restart"] == scenarios.PAGES
    assert life["loaded"] == [True] * scenarios.PAGES and life["equal"]
    assert life["staged_reads"] == scenarios.PAGES  # the read took the bytes the check read
    assert life["other_model_exists"] == 0


def test_a_bad_tier_field_is_refused_by_name(sglang_results: dict[str, Any]) -> None:
    error = sglang_results["lifecycle"]["bad_field_error"]
    assert error.startswith("TierError:") and "'kvfsm_mooncake_segment_bytes'" in error
    assert "'lots'" in error


# -- several SGLang instances sharing one store ---------------------------------------------


def _shared(results: dict[str, Any], store: str) -> dict[str, Any]:
    """The ``store`` (mooncake, redis) scenarios' results, or a skip saying why they did not
    run (the client or the server is not installed where SGLang runs)."""
    found: dict[str, Any] = results[store]
    if "unavailable" in found:
        if os.environ.get("CI") == "true":  # .ci/run installs both: a skip there is a bug
            pytest.fail(f"{store} scenarios did not run under CI: {found['unavailable']}")
        pytest.skip(f"{store} is not usable where the SGLang scenarios run: "
                    f"{found['unavailable']}")
    return found


def test_mooncake_instances_share_pages(sglang_results: dict[str, Any]) -> None:
    """Instance B, its own Mooncake client, same model and shard, finds every page instance A
    wrote (``batch_exists`` and ``batch_exists_v2``) and reads them byte-identical, through
    kvfsm and through SGLang's stock Mooncake backend alike: sharing loses no reuse."""
    mooncake = _shared(sglang_results, "mooncake")
    every = list(range(1, scenarios.PAGES + 1))
    for side in ("stock", "kvfsm"):
        shared = mooncake[side]["shared"]
        assert shared["written"] == scenarios.PAGES, side
        assert shared["exists"] == scenarios.PAGES, side
        assert shared["exists_v2"] == {"kv_hit_pages": scenarios.PAGES, "restorable": every}
        assert shared["get_v1"] == "ok", side
    kvfsm = mooncake["kvfsm"]["shared"]
    assert kvfsm["get"] == "ok"
    # B read each page from the store once, to check it; both reads took the checked bytes.
    assert kvfsm["reader_counts"]["OK"] == scenarios.PAGES


def test_mooncake_other_models_pages_are_never_reported(sglang_results: dict[str, Any]) -> None:
    """Instances of other models write pages under the names instance A then asks for. kvfsm
    reports and serves none of them. SGLang's stock backend keeps models apart by a key prefix
    made of the served name with "/" turned into "-": a model named "test-model-a" lands in
    "test/model-a"'s pages, which it then reports and serves."""
    mooncake = _shared(sglang_results, "mooncake")
    for row in scenarios.OTHER_MODELS:
        for side in ("stock", "kvfsm"):
            assert mooncake[side]["other_models"][row]["written"] == scenarios.PAGES
        assert mooncake["kvfsm"]["other_models"][row]["exists"] == 0, row
        assert mooncake["kvfsm"]["other_models"][row]["served"] == 0, row
    stock = mooncake["stock"]["other_models"]
    assert (stock["other_name"]["exists"], stock["other_name"]["served"]) == (0, 0)
    assert stock["dashed_name"]["exists"] == scenarios.PAGES
    assert stock["dashed_name"]["served"] == scenarios.PAGES


def test_mooncake_damaged_values_end_the_prefix(sglang_results: dict[str, Any]) -> None:
    """A byte flipped in page 4's stored value, or the value removed, behind the backends'
    backs: kvfsm reports the 4 pages before it and refuses it on read. The stock backend
    stops at a removed value but reports and serves the flipped one."""
    mooncake = _shared(sglang_results, "mooncake")
    faults = mooncake["kvfsm"]["faults"]
    for fault in ("flipped", "evicted"):
        assert faults[fault] == {"exists": scenarios.FAULT_PAGE,
                                 "get_v1": f"refused at {scenarios.FAULT_PAGE}"}, fault
    assert faults["reader_counts"]["CORRUPT"] == 1
    stock = mooncake["stock"]["faults"]
    assert stock["flipped"] == {"exists": scenarios.PAGES,
                                "get_v1": f"wrong bytes at {scenarios.FAULT_PAGE}"}
    assert stock["evicted"] == {"exists": scenarios.FAULT_PAGE,
                                "get_v1": f"refused at {scenarios.FAULT_PAGE}"}


def test_redis_instances_share_pages(sglang_results: dict[str, Any]) -> None:
    """Two kvfsm instances on one Redis server: B finds and reads A's pages whole, and stops
    at a flipped value."""
    redis = _shared(sglang_results, "redis")
    assert redis == {"exists": scenarios.PAGES, "get": "ok",
                     "flipped_exists": scenarios.FAULT_PAGE,
                     "flipped_get_v1": f"refused at {scenarios.FAULT_PAGE}"}


def test_backend_module_needs_sglang_only_when_used() -> None:
    # The package imports without SGLang; the backend class loads on first use.
    module = importlib.import_module("kvfsm.integrations.sglang")
    with pytest.raises(AttributeError, match="no attribute 'Nothing'"):
        _ = module.Nothing


# -- docs/integrations.md's figures are these scenarios' -----------------------------------

SGLANG_DOC = section(page("integrations.md"),
                     "SGLang: kvfsm's stored tiers as a HiCache storage backend")


def _doc_read(cell: str) -> tuple[str, int | None]:
    """A read-back cell of the page's tables as (what happened, the page count or page)."""
    raised = re.search(r"raises `(\w+)`", cell)
    if raised:
        return f"raised {raised.group(1)}", None
    for kind in ("wrong bytes", "refused", "served"):
        if kind in cell:
            return kind, integers(cell)[0]
    return "ok", integers(cell)[0]  # "all 8 correct", "8 byte-identical"


def _ran_read(get: str) -> tuple[str, int | None]:
    """A scenario's read-back answer as :func:`_doc_read` reads the page's."""
    if get == "ok":
        return "ok", scenarios.PAGES
    if get.startswith("raised"):
        return get, None
    kind, _, at = get.rpartition(" at ")
    return kind, int(at)


def test_docs_fault_table_is_the_runs(sglang_results: dict[str, Any]) -> None:
    """The page's fault table, a row per fault in the scenarios' order: pages each backend
    reported and what reading them back gave."""
    rows = table(SGLANG_DOC, f"fault on page {scenarios.FAULT_PAGE}")
    faults = sglang_results["faults"]
    assert [row[0].split()[0] for row in rows][:1] == ["none"] and len(rows) == len(faults)
    for row, (fault, sides) in zip(rows, faults.items(), strict=True):
        ran = [(sides[side]["exists"], _ran_read(sides[side]["get"]))
               for side in ("stock", "kvfsm")]
        documented = [(integers(row[1])[0], _doc_read(row[2])),
                      (integers(row[3])[0], _doc_read(row[4]))]
        assert documented == ran, (fault, row)
    text = " ".join(SGLANG_DOC.split())
    assert (f"stores the same {scenarios.PAGES} pages through each, damages the stored copy of "
            f"page {scenarios.FAULT_PAGE} (0-based)") in text


def test_docs_hybrid_figures_are_the_runs(sglang_results: dict[str, Any]) -> None:
    hybrid = sglang_results["hybrid"]
    text = " ".join(SGLANG_DOC.split())
    clean = {side: hybrid[side]["clean"]["restorable"] for side in ("stock", "kvfsm")}
    assert clean["stock"] == clean["kvfsm"]
    stock, kvfsm = hybrid["stock"]["state_flipped"], hybrid["kvfsm"]["state_flipped"]
    for quoted in (f"both backends answer `restorable_prefix_pages = {clean['kvfsm']}`",
                   f"still answers `{stock['restorable']}` (`kv_hit_pages` "
                   f"{stock['kv_hit_pages']})",
                   f"kvfsm answers `{kvfsm['restorable']}` (`kv_hit_pages` "
                   f"{kvfsm['kv_hit_pages']})",
                   f"the two states returns `{hybrid['kvfsm']['v2_read']}`"):
        assert quoted in text, quoted


def test_docs_shared_store_table_is_the_runs(sglang_results: dict[str, Any]) -> None:
    """The page's shared-store table (B, the two other models, a flipped and a removed value)
    and its Redis sentence are these runs'."""
    mooncake = _shared(sglang_results, "mooncake")
    rows = table(SGLANG_DOC, "scenario | stock: pages reported")
    assert len(rows) == 2 + len(scenarios.OTHER_MODELS) + 1
    ran: list[list[tuple[list[int], tuple[str, int | None]]]] = []
    shared = {side: mooncake[side]["shared"] for side in ("stock", "kvfsm")}
    ran.append([([s["exists"], s["exists_v2"]["kv_hit_pages"]], _ran_read(s["get_v1"]))
                for s in shared.values()])
    for name in scenarios.OTHER_MODELS:
        other = [mooncake[side]["other_models"][name] for side in ("stock", "kvfsm")]
        ran.append([([o["exists"]], ("served", o["served"])) for o in other])
    for fault in ("flipped", "evicted"):
        faults = [mooncake[side]["faults"][fault] for side in ("stock", "kvfsm")]
        ran.append([([f["exists"]], _ran_read(f["get_v1"])) for f in faults])
    for row, expected in zip(rows, ran, strict=True):
        documented = [(integers(row[1]), _doc_read(row[2])),
                      (integers(row[3]), _doc_read(row[4]))]
        assert documented == expected, row
    redis = _shared(sglang_results, "redis")
    assert (f"{redis['exists']} pages found and read byte-identical, {redis['flipped_exists']} "
            f"with page {scenarios.FAULT_PAGE} flipped") in " ".join(SGLANG_DOC.split())


def test_docs_times_name_keys_of_the_results(sglang_results: dict[str, Any]) -> None:
    for key in ("total_s", "import_s", "mooncake_s"):
        assert f"`{key}`" in SGLANG_DOC, key
        assert isinstance(sglang_results[key], float), key


#: A default as the extra-config tables write it: ``(default 64 GiB)``, ``(default 10)``.
DEFAULT = re.compile(r"\(default (\d+(?:\.\d+)?) ?(MiB|GiB)?[);]")
UNITS = {"": 1, "MiB": 1 << 20, "GiB": 1 << 30}


@pytest.mark.parametrize("title", ["Switching it on",
                                   "One Mooncake Store shared by several SGLang instances"])
def test_docs_extra_config_tables_give_the_defaults(sglang_results: dict[str, Any],
                                                    title: str) -> None:
    """Each default the page's extra-config tables quote is the backend's for that field."""
    defaults = sglang_results["defaults"]
    quoted = 0
    for field, meaning in table(section(SGLANG_DOC, title), "extra-config field"):
        name = re.fullmatch(r"`(\w+)`", field).group(1)  # type: ignore[union-attr]
        for figure, unit in DEFAULT.findall(meaning):
            assert defaults.get(name) == float(figure) * UNITS[unit], (name, figure, unit)
            quoted += 1
        host = re.search(r"\(default `([\d.]+)`", meaning)
        if host:
            assert defaults.get(name) == host.group(1), name
            quoted += 1
    assert quoted

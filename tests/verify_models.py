"""Small model declarations and helpers shared by the verdict tests."""

from __future__ import annotations

import numpy as np

from kvfsm import Engine
from kvfsm.spec import ModelDecl, parse_model
from kvfsm.state import CoreConfig

LAYOUT = """
[groups.layout]
dim_order = ["block", "token", "dim"]
alignment = 256
padding = 0
"""


def group(name: str, kind: str, lifecycle: str, block: int, extra: str = "") -> str:
    return f"""
[[groups]]
name = "{name}"
kind = "{kind}"
lifecycle = "{lifecycle}"
block_size = {block}
shape = [{block}, 8]
dtype = "float16"
{extra}
{LAYOUT}"""


def model(name: str, *groups: str) -> ModelDecl:
    text = f'[model]\nname = "{name}"\ndescription = "test"\nlayout_version = 1\n' + \
        "".join(groups)
    return parse_model(text, source=f"<{name}>")


FULL = group("attn", "full", "full_kv", 16)
SWA = group("swa", "sliding_window", "sliding_window", 16, "window = 64")
HISTORY = group("history", "compressed", "compressed", 64, "tail_tokens = 64\nsub_blocks = 4")
INDEX = group("index", "sparse_index", "sparse_index", 16,
              'target_group = "history"\ntop_k = 4')
DELTA = group("delta", "recurrent", "recurrent", 16, "checkpoint_interval = 64")
WIDE = group("wide", "full", "full_kv", 24)

DENSE = model("t_dense", FULL)
SWA_ONLY = model("t_swa", SWA)
GPT_OSS = model("t_gpt_oss", FULL, SWA)
TWO_SIZES = model("t_two_sizes", FULL, WIDE)
QWEN = model("t_qwen", FULL, DELTA)
DEEPSEEK = model("t_deepseek", HISTORY, SWA, INDEX)
FOUR = model("t_four", HISTORY, SWA, INDEX, DELTA)


def engine(decl: ModelDecl, device: int = 64, host: int = 16) -> Engine:
    return Engine(decl, CoreConfig(device_blocks=device, host_blocks=host, backend="numpy"))


def tokens(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, n)


def block_id(eng: Engine, group: str, prompt_tokens: np.ndarray, index: int) -> int:
    """The id of block ``index`` of ``group`` for a prompt (must be cached)."""
    prompt = eng.prompt(prompt_tokens)
    size = eng.core.group(group).decl.block_size
    high, low = prompt.words(size)
    found = int(eng.core.lookup_words(group, high[index : index + 1], low[index : index + 1])[0])
    assert found >= 0, f"{group} block {index} not cached"
    return found

"""The seven-request chat the serve tests replay: a shared 40-token system prompt, three users,
two or three turns each (each turn extends the user's previous prompt); 57 to 99 tokens, none a
multiple of 16."""

from __future__ import annotations

import numpy as np


def chat_prompts(seed: int = 7) -> tuple[list[int], dict[str, list[int]]]:
    """``(system prompt, {request id: prompt})`` in serving order: A1, B1, A2, C1, B2, A3, C2."""
    rng = np.random.default_rng(seed)

    def draw(n: int) -> list[int]:
        return [int(t) for t in rng.integers(0, 1000, n)]

    system = draw(40)
    a1 = system + draw(17)
    b1 = system + draw(23)
    a2 = a1 + draw(28)
    c1 = system + draw(31)
    b2 = b1 + draw(31)
    a3 = a2 + draw(14)
    c2 = c1 + draw(18)
    return system, {"A1": a1, "B1": b1, "A2": a2, "C1": c1, "B2": b2, "A3": a3, "C2": c2}

"""Tiny, deterministic stand-ins of the architectures kvfsm declares.

``tiny_config(model_type)`` is a transformers config with the real architecture's cache
structure at toy size: 4 layers, hidden size 64, head dim 16 (32 where the architecture sets its
head dim apart from ``hidden_size / heads``), a vocabulary of 1000. Nothing is downloaded;
``tiny_model(model_type, seed)`` builds the model from it with seeded random weights, on the CPU,
in float32 and in eval mode. A 64-token forward takes well under a second on a CPU.

The hybrid architectures (:data:`HYBRID_MODEL_TYPES`, each with a shipped
``specs/models/tiny_<T>.toml``):

* ``gpt_oss``: layers alternate sliding-window (16 tokens) and full attention, 2 KV heads.
* ``qwen3_next``: three Gated DeltaNet (linear attention) layers, then one gated full-attention
  layer; the linear layers run on transformers' PyTorch fallbacks (no ``fla`` or
  ``causal_conv1d`` needed).
* ``deepseek_v4``: one sliding-window layer, two compressed sparse attention (CSA, compress
  rate 4, lightning indexer) layers and one heavily compressed attention (HCA) layer, at rate 16
  instead of the real 128 so that short prompts already have HCA entries. ``index_topk`` is 256:
  at least every compressed entry of a 1024-token prompt (1024 / 4), so the indexer keeps every
  causal entry and the model's output does not depend on how a prompt is split into forwards.

The dense and sliding-window families (:data:`DENSE_MODEL_TYPES`), 4 query and 2 KV heads:

* ``llama``: every layer full attention.
* ``mistral``: every layer a 24-token sliding window (``sliding_window=None`` makes them full);
  head dim derived from ``hidden_size / num_attention_heads``.
* ``qwen3``: dense, as the released Qwen3 models (``use_sliding_window=True`` with
  ``max_window_layers`` turns the layers from there on to sliding windows), head dim 32.
* ``gemma2``: alternating sliding-window (16 tokens) and full layers, head dim 32.
* ``gemma3_text``: three sliding-window (24 tokens) layers per full layer
  (``sliding_window_pattern`` 4: the real models' 5:1 at 4 layers), head dim 32, 1 KV head.

transformers' Llama and Mistral configs have no ``layer_types`` (their cache infers them: every
layer sliding when ``sliding_window`` is set, else full); the tiny ones carry that list as
``config.layer_types``, which ``CacheAdapter`` reads.

transformers and torch are imported inside the functions: ``import kvfsm`` needs neither.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Final

from kvfsm._errors import KvfsmError

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedConfig

#: The hybrid architectures, each with a shipped tiny declaration, in documentation order.
HYBRID_MODEL_TYPES: Final = ("gpt_oss", "qwen3_next", "deepseek_v4")
#: The dense and sliding-window families (groups ``full`` and ``sliding`` only).
DENSE_MODEL_TYPES: Final = ("llama", "mistral", "qwen3", "gemma2", "gemma3_text")
#: The architectures kvfsm can declare (and build tiny stand-ins of), in documentation order.
SUPPORTED_MODEL_TYPES: Final = HYBRID_MODEL_TYPES + DENSE_MODEL_TYPES

#: Model types refused on purpose, with why (the error says it).
REFUSED_MODEL_TYPES: Final[Mapping[str, str]] = MappingProxyType({
    "gemma3": "the multimodal Gemma 3: its image tokens are placeholders whose K/V depend on the "
              "image, which a prompt's token ids do not identify, so a prefix hash cannot tell "
              "two images apart; for text-only serving declare its text_config (model_type "
              "gemma3_text)",
})

#: Families whose transformers config has no ``layer_types`` (see the module docstring).
_INFERRED_LAYER_TYPES: Final = ("llama", "mistral")

_COMMON: Final[dict[str, Any]] = {
    "vocab_size": 1000,
    "hidden_size": 64,
    "head_dim": 16,
    "num_hidden_layers": 4,
    "max_position_embeddings": 4096,
}

_TINY: Final[dict[str, dict[str, Any]]] = {
    "gpt_oss": {
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 64,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": 16,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
    },
    "qwen3_next": {
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 64,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_conv_kernel_dim": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    },
    "deepseek_v4": {
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "q_lora_rank": 32,
        "o_groups": 2,
        "o_lora_rank": 16,
        "index_n_heads": 2,
        "index_head_dim": 16,
        "index_topk": 256,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "hc_mult": 2,
        "sliding_window": 32,
        "partial_rotary_factor": 0.5,
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        "layer_types": [
            "sliding_attention",
            "compressed_sparse_attention",
            "heavily_compressed_attention",
            "compressed_sparse_attention",
        ],
        "mlp_layer_types": ["moe"] * 4,
    },
    "llama": {
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 64,
    },
    "mistral": {
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 64,
        "head_dim": None,
        "sliding_window": 24,
    },
    "qwen3": {
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 64,
        "head_dim": 32,
    },
    "gemma2": {
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 64,
        "head_dim": 32,
        "query_pre_attn_scalar": 32,
        "sliding_window": 16,
    },
    "gemma3_text": {
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "intermediate_size": 64,
        "head_dim": 32,
        "query_pre_attn_scalar": 32,
        "sliding_window": 24,
        "sliding_window_pattern": 4,
    },
}

#: Slow-decay Gated DeltaNet heads for the tiny qwen3_next (see :func:`tiny_model`).
_SLOW_DECAY_RANGE: Final = (0.001, 0.05)


def check_model_type(model_type: object) -> str:
    """``model_type`` itself when kvfsm supports it, else a :class:`KvfsmError` naming those
    it does (and why, for a model type refused on purpose)."""
    if isinstance(model_type, str) and model_type in REFUSED_MODEL_TYPES:
        raise KvfsmError(f"model_type {model_type!r} is not declarable: "
                         f"{REFUSED_MODEL_TYPES[model_type]}")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise KvfsmError(
            f"unsupported model_type {model_type!r}: kvfsm declares "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    assert isinstance(model_type, str)
    return model_type


def tiny_settings(model_type: str) -> dict[str, Any]:
    """The keyword arguments :func:`tiny_config` passes to the config class (a fresh copy)."""
    check_model_type(model_type)
    settings: dict[str, Any] = {**_COMMON, **_TINY[model_type]}
    return {k: (list(v) if isinstance(v, list) else dict(v) if isinstance(v, dict) else v)
            for k, v in settings.items()}


def config_class(model_type: str) -> type[PreTrainedConfig]:
    """transformers' config class of a supported ``model_type``."""
    check_model_type(model_type)
    try:
        from transformers import CONFIG_MAPPING
    except ImportError as exc:
        raise KvfsmError(
            f"declaring a {model_type} model from its config needs transformers "
            "(pip install transformers)"
        ) from exc
    try:
        cls: type[PreTrainedConfig] = CONFIG_MAPPING[model_type]
    except KeyError as exc:
        raise KvfsmError(
            f"this transformers has no {model_type!r} architecture; upgrade transformers"
        ) from exc
    return cls


def tiny_config(model_type: str, **overrides: Any) -> PreTrainedConfig:
    """A tiny config of ``model_type`` (one of :data:`SUPPORTED_MODEL_TYPES`); ``overrides``
    replace settings before the config is built, so values derived from them follow. A Llama or
    Mistral config gets ``layer_types`` afterwards: the list transformers' cache infers.

    The same arguments always give an equal config; nothing is downloaded.
    """
    cls = config_class(model_type)
    config = cls(**{**tiny_settings(model_type), **overrides})
    if model_type in _INFERRED_LAYER_TYPES and getattr(config, "layer_types", None) is None:
        # Set after the config is built: Mistral's config warns of a layer_types argument.
        kind = "full_attention" if getattr(config, "sliding_window", None) is None else (
            "sliding_attention")
        config.layer_types = [kind] * config.num_hidden_layers
    return config


def tiny_model(model_type: str, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """The causal LM of :func:`tiny_config` (with ``overrides``) with weights drawn after
    ``torch.manual_seed(seed)``, float32, eager attention, on the CPU, in eval mode.

    One post-init step for ``qwen3_next``, so that an error in the recurrent state shows: every
    Gated DeltaNet layer's state decays per token by ``exp(-A * softplus(a + dt_bias))``, and
    transformers' init (``A`` uniform in [0.01, 16], ``dt_bias`` 1) makes most heads forget in a
    few tokens, so even a zeroed state barely moves the logits (about 0.01 against logits of about
    0.8, 64 tokens after the state was zeroed). Here ``A_log`` is set to
    ``log(linspace(0.001, 0.05, heads))`` and ``dt_bias`` to 0 in every linear layer: the heads
    remember for tens to thousands of tokens, and zeroing the state moves the logits by about
    0.25. The other architectures are left as transformers initialises them.
    """
    import torch
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type, **overrides)
    torch.manual_seed(seed)
    auto: Any = AutoModelForCausalLM  # from_config is untyped
    model = auto.from_config(config, attn_implementation="eager", dtype=torch.float32)
    if model_type == "qwen3_next":
        low, high = _SLOW_DECAY_RANGE
        with torch.no_grad():
            for module in model.modules():
                if hasattr(module, "A_log") and hasattr(module, "dt_bias"):
                    heads = module.A_log.numel()
                    module.A_log.copy_(torch.linspace(low, high, heads).log())
                    module.dt_bias.zero_()
    model.eval()
    result: torch.nn.Module = model
    return result

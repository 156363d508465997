"""The kvfsm settings a vLLM engine passes its mirror, and the identity of the model it serves.

Settings come from ``kv_transfer_config.kv_connector_extra_config["kvfsm"]`` when a connector is
configured, else from ``additional_config["kvfsm"]`` (:func:`settings_of`); unknown keys and wrong
types are an error naming where they came from. The model identity (:func:`model_identity`) is
the cache namespace by default: two engines share stored prefixes only when they compute the
same KV for the same tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from kvfsm._errors import KvfsmError
from kvfsm.lookup import as_level
from kvfsm.tiers import MooncakeTier, RedisTier, StoredTier


class MirrorSettingsError(KvfsmError):
    """A kvfsm setting passed through vLLM's config is missing, unknown or of the wrong type."""


#: Default bytes of the disk tier a mirror opens when given a directory.
DEFAULT_DISK_BYTES = 1 << 30
#: Default memory a mirror's Mooncake client lends the store.
DEFAULT_SEGMENT_BYTES = 256 << 20
#: URL schemes of the remote tiers a mirror opens (``remote``), by store.
REMOTE_SCHEMES = ("mooncake://", "redis://")


#: The types each setting accepts (bools are refused where numbers are expected).
_SETTING_TYPES: Mapping[str, type | tuple[type, ...]] = {
    "name": str, "level": str, "device_headroom": (int, float), "host_blocks": int,
    "disk_dir": (str, type(None)), "disk_bytes": int, "disk_blocks": int,
    "remote": (str, type(None)), "remote_blocks": int, "remote_prefix": str,
    "remote_segment_bytes": int, "remote_local_hostname": str,
    "namespace": (str, type(None)), "restore_wait_s": (int, float),
    "metrics_port": (int, type(None)), "metrics_host": str}


@attrs.frozen
class MirrorSettings:
    """How the mirror's engine is built (the ``kvfsm`` keys of ``kv_connector_extra_config``
    or of ``additional_config["kvfsm"]``)."""

    #: Registry name: the scheduler and the connector of one vLLM engine share the mirror.
    name: str = "default"
    #: Verification level of the lookups that cap hits and claims.
    level: str = "standard"
    #: kvfsm device slots per group, as a multiple of vLLM's blocks.
    device_headroom: float = 2.0
    #: Host slots per group (the first offload tier; 0: none).
    host_blocks: int = 0
    #: Directory of a disk tier below host (None: none) and its size cap.
    disk_dir: str | None = None
    disk_bytes: int = DEFAULT_DISK_BYTES
    #: Logical blocks per group that may be known only on disk.
    disk_blocks: int = 0
    #: A shared store below disk, by URL: ``mooncake://HOST:PORT`` (a Mooncake Store master;
    #: this process mounts a segment and lends it memory) or ``redis://HOST:PORT[/DB]``; None:
    #: none. Other vLLM engines serving the same model find the prefixes put there.
    remote: str | None = None
    #: Logical blocks per group that may be known only in the remote store, and the key prefix
    #: of this engine's values there.
    remote_blocks: int = 0
    remote_prefix: str = "kvfsm/"
    #: Mooncake only: the memory this process lends the store for values, and the address
    #: other hosts reach that segment at (loopback serves one host only).
    remote_segment_bytes: int = DEFAULT_SEGMENT_BYTES
    remote_local_hostname: str = "127.0.0.1"
    #: The cache namespace: engines share stored prefixes only within one. None (the
    #: default): vLLM's model identity (:func:`model_identity`), so an engine serving another
    #: model (or revision, dtype, KV cache dtype, quantization, parallel split) never finds
    #: this one's values. Set it only to share between deployments known to serve the same
    #: weights under different paths.
    namespace: str | None = None
    #: Seconds the connector waits for a restore before claiming only what already landed.
    restore_wait_s: float = 1.0
    #: Serve the mirror engine's Prometheus metrics (``kvfsm_lookups_total``, hit and usable
    #: tokens, restores by outcome, transitions, ...) at ``http://metrics_host:metrics_port/
    #: metrics`` from the process the engine runs in (vLLM's engine core); None: no metrics.
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], where: str) -> MirrorSettings:
        """Settings from a config mapping; unknown keys and wrong types are a
        :class:`MirrorSettingsError` naming ``where``."""
        fields = {field.name: field for field in attrs.fields(cls)}
        unknown = sorted(set(values) - set(fields))
        if unknown:
            raise MirrorSettingsError(f"{where}: unknown kvfsm settings {unknown}; known: "
                                      f"{sorted(fields)}")
        for key, value in values.items():
            expected = _SETTING_TYPES[key]
            if not isinstance(value, expected) or isinstance(value, bool):
                raise MirrorSettingsError(f"{where}: kvfsm setting {key}={value!r} has the "
                                          "wrong type")
        settings = cls(**values)
        try:
            as_level(settings.level)  # an unknown level fails here, not at the first request
        except (KvfsmError, ValueError) as exc:
            raise MirrorSettingsError(f"{where}: {exc}") from exc
        if settings.device_headroom < 1:
            raise MirrorSettingsError(f"{where}: device_headroom must be >= 1")
        if settings.remote is not None:
            if not settings.remote.startswith(REMOTE_SCHEMES):
                raise MirrorSettingsError(f"{where}: remote={settings.remote!r} must start "
                                          f"with one of {list(REMOTE_SCHEMES)}")
            if settings.disk_dir is None:
                # Copies reach the remote store from disk (device -> host -> disk -> remote).
                raise MirrorSettingsError(f"{where}: a remote store needs disk_dir too: "
                                          "copies move down to it through disk")
        if settings.remote_segment_bytes <= 0:
            raise MirrorSettingsError(f"{where}: remote_segment_bytes must be > 0")
        for key in ("host_blocks", "disk_blocks", "remote_blocks", "disk_bytes"):
            if getattr(settings, key) < 0:
                raise MirrorSettingsError(f"{where}: {key} must be >= 0")
        if settings.metrics_port is not None and not 0 < settings.metrics_port < 65536:
            raise MirrorSettingsError(f"{where}: metrics_port must be a port number "
                                      "(1..65535) or None")
        if settings.namespace == "":
            raise MirrorSettingsError(f"{where}: namespace must not be empty (None: the "
                                      "model's identity)")
        return settings


def model_identity(vllm_config: Any) -> str:
    """What names the KV a vLLM engine computes, beyond its cache's geometry: the model (path
    or hub id) and revision, the model's and the KV cache's element types, quantization and
    the tensor / pipeline parallel split. Two engines share stored prefixes only when these
    agree (or one ``namespace`` is set for both)."""
    model = vllm_config.model_config
    cache = getattr(vllm_config, "cache_config", None)
    parallel = getattr(vllm_config, "parallel_config", None)
    fields = {
        "model": getattr(model, "model", None), "revision": getattr(model, "revision", None),
        "dtype": str(getattr(model, "dtype", None)),
        "quantization": getattr(model, "quantization", None),
        "kv_cache_dtype": getattr(cache, "cache_dtype", None),
        "tensor_parallel": getattr(parallel, "tensor_parallel_size", 1),
        "pipeline_parallel": getattr(parallel, "pipeline_parallel_size", 1)}
    return ";".join(f"{key}={fields[key]}" for key in sorted(fields))


def remote_tier(settings: MirrorSettings) -> StoredTier:
    """The remote tier ``settings.remote`` names (``mooncake://HOST:PORT`` or ``redis://...``)."""
    url = settings.remote or ""
    if url.startswith("mooncake://"):
        return MooncakeTier(url.removeprefix("mooncake://"), prefix=settings.remote_prefix,
                            global_segment_bytes=settings.remote_segment_bytes,
                            local_hostname=settings.remote_local_hostname)
    return RedisTier(url, prefix=settings.remote_prefix)


def settings_of(vllm_config: Any) -> MirrorSettings:
    """The kvfsm settings in ``vllm_config``: ``kv_transfer_config.kv_connector_extra_config
    ["kvfsm"]`` when a connector is configured, else ``additional_config["kvfsm"]``, else the
    defaults."""
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    extra = getattr(transfer, "kv_connector_extra_config", None) or {}
    if "kvfsm" in extra:
        return MirrorSettings.from_mapping(extra["kvfsm"], "kv_connector_extra_config.kvfsm")
    additional = getattr(vllm_config, "additional_config", None) or {}
    if "kvfsm" in additional:
        return MirrorSettings.from_mapping(additional["kvfsm"], "additional_config.kvfsm")
    return MirrorSettings()

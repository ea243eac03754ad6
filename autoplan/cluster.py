"""Cluster descriptions: devices, links, and how many of each.

A `ClusterSpec` is `num_nodes x gpus_per_node` identical devices. Inside a node GPUs talk over
`intra_node` links (NVLink); between nodes over `inter_node` links (InfiniBand). Link bandwidths are
per GPU and per direction, in bytes/s; latencies in seconds (the alpha of alpha-beta costs).

Three ways to get one:
- a preset device in shorthand: `128x8xh100` (nodes x GPUs per node x device) or `8xh200` (one node);
- a YAML or JSON file (see `ClusterSpec.from_json` for the keys);
- in code, from the dataclasses below.

Memory capacities are the datasheet figures in decimal bytes (80 GB = 80e9 B); the physical HBM is a
little larger, and the difference is left as headroom for the CUDA context and allocator slack.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from autoplan.errors import ConfigError

SHORTHAND_EXAMPLE = "128x8xh100"
_SHORTHAND_RE = re.compile(r"^(?:(\d+)x)?(\d+)x([a-z][a-z0-9_.-]*)$", re.IGNORECASE)


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator: peak dense FLOP/s per dtype, HBM capacity and bandwidth, and their source."""

    name: str
    peak_flops: tuple[tuple[str, float], ...]  # (dtype, dense FLOP/s), e.g. ("bfloat16", 989e12)
    memory_bytes: float
    memory_bandwidth_bytes_per_s: float
    source: str = ""

    def __post_init__(self) -> None:
        _require_positive(f"device {self.name!r} memory_bytes", self.memory_bytes)
        _require_positive(f"device {self.name!r} memory_bandwidth_bytes_per_s", self.memory_bandwidth_bytes_per_s)
        if not self.peak_flops:
            raise ConfigError(f"device {self.name!r} needs peak_flops for at least one dtype, e.g. {{'bfloat16': 989e12}}")
        for dtype, flops in self.peak_flops:
            _require_positive(f"device {self.name!r} peak_flops[{dtype!r}]", flops)

    def peak_flops_for(self, dtype: str) -> float:
        """Peak dense FLOP/s for `dtype` ('bfloat16', 'float16', 'float32', ...)."""
        table = dict(self.peak_flops)
        if dtype not in table:
            raise ConfigError(f"device {self.name!r} has no peak FLOP/s for {dtype!r}; it has {sorted(table)}")
        return table[dtype]

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "peak_flops": dict(self.peak_flops),
            "memory_bytes": self.memory_bytes,
            "memory_bandwidth_bytes_per_s": self.memory_bandwidth_bytes_per_s,
            "source": self.source,
        }

    @classmethod
    def from_json(cls, data: dict) -> "DeviceSpec":
        _check_keys("device", data, {"name", "peak_flops", "memory_bytes", "memory_bandwidth_bytes_per_s", "source"})
        flops = data.get("peak_flops")
        if not isinstance(flops, dict):
            raise ConfigError(f"device peak_flops must be a mapping dtype -> FLOP/s, got {flops!r}")
        return cls(
            name=str(data.get("name", "custom")),
            peak_flops=tuple((str(k), _number(f"peak_flops[{k}]", v)) for k, v in flops.items()),
            memory_bytes=_number("memory_bytes", data.get("memory_bytes")),
            memory_bandwidth_bytes_per_s=_number("memory_bandwidth_bytes_per_s", data.get("memory_bandwidth_bytes_per_s")),
            source=str(data.get("source", "")),
        )


@dataclass(frozen=True)
class LinkSpec:
    """A link class: bandwidth per GPU per direction (bytes/s) and per-message latency (s)."""

    bandwidth_bytes_per_s: float
    latency_s: float

    def __post_init__(self) -> None:
        _require_positive("link bandwidth_bytes_per_s", self.bandwidth_bytes_per_s)
        if self.latency_s < 0:
            raise ConfigError(f"link latency_s must be >= 0, got {self.latency_s!r}")

    def to_json(self) -> dict:
        return {"bandwidth_bytes_per_s": self.bandwidth_bytes_per_s, "latency_s": self.latency_s}

    @classmethod
    def from_json(cls, data: dict, what: str = "link") -> "LinkSpec":
        if not isinstance(data, dict):
            raise ConfigError(f"{what} must be a mapping with bandwidth_bytes_per_s and latency_s, got {data!r}")
        _check_keys(what, data, {"bandwidth_bytes_per_s", "latency_s"})
        return cls(
            bandwidth_bytes_per_s=_number(f"{what}.bandwidth_bytes_per_s", data.get("bandwidth_bytes_per_s")),
            latency_s=_number(f"{what}.latency_s", data.get("latency_s")),
        )


@dataclass(frozen=True)
class ClusterSpec:
    """`num_nodes` x `gpus_per_node` identical devices with two classes of links."""

    num_nodes: int
    gpus_per_node: int
    device: DeviceSpec
    intra_node: LinkSpec
    inter_node: LinkSpec
    name: str = field(default="")

    def __post_init__(self) -> None:
        for what, value in (("num_nodes", self.num_nodes), ("gpus_per_node", self.gpus_per_node)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"cluster {what} must be a positive integer, got {value!r}")

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.gpus_per_node

    def describe(self) -> str:
        return f"{self.num_nodes} x {self.gpus_per_node} x {self.device.name} ({self.world_size} devices)"

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "num_nodes": self.num_nodes,
            "gpus_per_node": self.gpus_per_node,
            "device": self.device.to_json(),
            "intra_node": self.intra_node.to_json(),
            "inter_node": self.inter_node.to_json(),
        }

    @classmethod
    def from_json(cls, data: dict) -> "ClusterSpec":
        """Keys: num_nodes (or nodes), gpus_per_node, device (a preset name or a mapping),
        intra_node and inter_node ({bandwidth_bytes_per_s, latency_s}; default to the preset's
        links when device is a preset name), name."""
        if not isinstance(data, dict):
            raise ConfigError(f"a cluster file must hold a mapping, got {type(data).__name__}")
        _check_keys("cluster", data, {"name", "num_nodes", "nodes", "gpus_per_node", "device", "intra_node", "inter_node"})
        device_data = data.get("device")
        base = preset(device_data) if isinstance(device_data, str) else None
        device = base.device if base else DeviceSpec.from_json(device_data or {})
        intra = LinkSpec.from_json(data["intra_node"], "intra_node") if "intra_node" in data else _default_link(base, "intra_node")
        inter = LinkSpec.from_json(data["inter_node"], "inter_node") if "inter_node" in data else _default_link(base, "inter_node")
        return cls(
            num_nodes=int(_number("num_nodes", data.get("num_nodes", data.get("nodes", 1)))),
            gpus_per_node=int(_number("gpus_per_node", data.get("gpus_per_node", base.gpus_per_node if base else None))),
            device=device,
            intra_node=intra,
            inter_node=inter,
            name=str(data.get("name", "")),
        )

    def with_nodes(self, num_nodes: int, gpus_per_node: int | None = None) -> "ClusterSpec":
        gpn = self.gpus_per_node if gpus_per_node is None else gpus_per_node
        name = f"{num_nodes}x{gpn}x{self.device.name}"
        return ClusterSpec(num_nodes, gpn, self.device, self.intra_node, self.inter_node, name)


def _presets() -> dict[str, ClusterSpec]:
    """Single-node presets; the number of nodes comes from the shorthand."""
    a100 = DeviceSpec(
        "a100-80g",
        (("bfloat16", 312e12), ("float16", 312e12), ("tfloat32", 156e12), ("float32", 19.5e12)),
        memory_bytes=80e9,
        memory_bandwidth_bytes_per_s=2.039e12,
        source="NVIDIA A100 80GB SXM datasheet (dense Tensor Core peaks, HBM2e 2,039 GB/s)",
    )
    hopper_flops = (("bfloat16", 989.4e12), ("float16", 989.4e12), ("tfloat32", 494.7e12), ("float32", 66.9e12))
    h100 = DeviceSpec("h100", hopper_flops, 80e9, 3.35e12, "NVIDIA H100 SXM5 datasheet (dense peaks, HBM3 3.35 TB/s)")
    h200 = DeviceSpec("h200", hopper_flops, 141e9, 4.8e12, "NVIDIA H200 SXM datasheet (dense peaks, HBM3e 4.8 TB/s)")
    cpu = DeviceSpec(
        "cpu",
        (("float32", 1e11), ("bfloat16", 5e10)),
        memory_bytes=16e9,
        memory_bandwidth_bytes_per_s=2e10,
        source="nominal figures for a 2-core x86 CI machine; measure the real ones with `autoplan profile`",
    )
    # NVLink3: 600 GB/s bidirectional per GPU -> 300 GB/s per direction; 8 HDR (200 Gb/s) NICs per
    # DGX A100 node -> 25 GB/s per GPU (Narayanan et al., SC'21, section 5.1).
    nvlink3, hdr = LinkSpec(300e9, 5e-6), LinkSpec(25e9, 10e-6)
    # NVLink4: 900 GB/s bidirectional -> 450 GB/s per direction; 8 NDR (400 Gb/s) NICs -> 50 GB/s per GPU.
    nvlink4, ndr = LinkSpec(450e9, 5e-6), LinkSpec(50e9, 10e-6)
    loopback = LinkSpec(2e9, 50e-6)  # gloo over loopback TCP on one host, nominal
    return {
        "a100-80g": ClusterSpec(1, 8, a100, nvlink3, hdr, "a100-80g"),
        "h100": ClusterSpec(1, 8, h100, nvlink4, ndr, "h100"),
        "h200": ClusterSpec(1, 8, h200, nvlink4, ndr, "h200"),
        "cpu": ClusterSpec(1, 1, cpu, loopback, loopback, "cpu"),
    }


PRESET_ALIASES = {"a100": "a100-80g", "a100-80gb": "a100-80g", "h100-80g": "h100", "h100-sxm": "h100", "h200-sxm": "h200"}


def preset_names() -> list[str]:
    return sorted(_presets())


def preset(name: str) -> ClusterSpec:
    """The one-node preset for a device name ('h100', 'a100-80g', 'h200', 'cpu')."""
    key = PRESET_ALIASES.get(name.lower(), name.lower())
    presets = _presets()
    if key not in presets:
        raise ConfigError(f"unknown device {name!r}; known devices: {', '.join(sorted(presets))}")
    return presets[key]


def parse_cluster(text: str) -> ClusterSpec:
    """A cluster from shorthand (`128x8xh100`, `8xh200`) or from a YAML/JSON file path."""
    path = Path(text)
    if path.suffix.lower() in (".json", ".yaml", ".yml") or path.is_file():
        return load_cluster_file(path)
    match = _SHORTHAND_RE.match(text.strip())
    if not match:
        raise ConfigError(
            f"cluster {text!r} is not of the form NODESxGPUSxDEVICE (e.g. {SHORTHAND_EXAMPLE}), "
            f"GPUSxDEVICE (e.g. 8xh100) or a .yaml/.json file; devices: {', '.join(preset_names())}"
        )
    nodes, gpus, device = int(match.group(1) or 1), int(match.group(2)), match.group(3)
    if nodes < 1 or gpus < 1:
        raise ConfigError(f"cluster {text!r} needs at least 1 node and 1 GPU per node (e.g. {SHORTHAND_EXAMPLE})")
    base = preset(device)
    return base.with_nodes(nodes, gpus)


def load_cluster_file(path: str | Path) -> ClusterSpec:
    """Read a cluster from YAML or JSON (keys documented in `ClusterSpec.from_json`)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"cluster file {str(path)!r} does not exist")
    text = path.read_text()
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"cluster file {str(path)!r} is not valid JSON: {exc}") from exc
    else:
        import yaml  # lazily: only file-based clusters need it

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"cluster file {str(path)!r} is not valid YAML: {exc}") from exc
    spec = ClusterSpec.from_json(data)
    return spec if spec.name else ClusterSpec(**{**spec.__dict__, "name": path.stem})


def _default_link(base: ClusterSpec | None, which: str) -> LinkSpec:
    if base is None:
        raise ConfigError(f"cluster file needs {which} {{bandwidth_bytes_per_s, latency_s}} when device is not a preset name")
    return getattr(base, which)


def _number(what: str, value) -> float:
    """Accept ints, floats and numeric strings (YAML 1.1 reads '80e9' as a string)."""
    if isinstance(value, bool) or value is None:
        raise ConfigError(f"{what} must be a number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{what} must be a number, got {value!r}") from None


def _require_positive(what: str, value: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise ConfigError(f"{what} must be a positive number, got {value!r}")


def _check_keys(what: str, data: dict, allowed: set[str]) -> None:
    unknown = set(data) - allowed
    if unknown:
        raise ConfigError(f"{what} has unknown keys {sorted(unknown)}; allowed keys: {sorted(allowed)}")

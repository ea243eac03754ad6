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

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from autoplan.errors import ConfigError
from autoplan.validate import (check_int, check_keys, check_mapping, check_number, check_str, parse_mapping, path_kind,
                               read_text, shown)

SHORTHAND_EXAMPLE = "128x8xh100"
# The largest world size planned for: the search enumerates divisors of it, and the largest clusters
# built have about 10^5 GPUs (xAI Colossus: 100,000 H100s in 2024).
MAX_WORLD_SIZE = 2**20
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
        check_str("device name", self.name)
        check_number(f"device {self.name!r} memory_bytes", self.memory_bytes)
        check_number(f"device {self.name!r} memory_bandwidth_bytes_per_s", self.memory_bandwidth_bytes_per_s)
        if not self.peak_flops:
            raise ConfigError(f"device {self.name!r} needs peak_flops for at least one dtype, e.g. {{'bfloat16': 989e12}}")
        for dtype, flops in self.peak_flops:
            check_number(f"device {self.name!r} peak_flops[{dtype!r}]", flops)

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
        check_mapping("cluster device (a preset name such as 'h100', or a mapping)", data)
        check_keys("device", data, {"name", "peak_flops", "memory_bytes", "memory_bandwidth_bytes_per_s", "source"},
                   {"peak_flops", "memory_bytes", "memory_bandwidth_bytes_per_s"})
        flops = data["peak_flops"]
        if not isinstance(flops, dict):
            raise ConfigError(f"device peak_flops={shown(flops)}: expected a mapping dtype -> FLOP/s, e.g. "
                              f"{{bfloat16: 989e12}}")
        return cls(
            name=check_str("device name", data.get("name", "custom")),
            peak_flops=tuple((str(k), _number(f"peak_flops[{k}]", v)) for k, v in flops.items()),
            memory_bytes=_number("memory_bytes", data["memory_bytes"]),
            memory_bandwidth_bytes_per_s=_number("memory_bandwidth_bytes_per_s", data["memory_bandwidth_bytes_per_s"]),
            source=check_str("device source", data.get("source", "")),
        )


@dataclass(frozen=True)
class LinkSpec:
    """A link class: bandwidth per GPU per direction (bytes/s) and per-message latency (s)."""

    bandwidth_bytes_per_s: float
    latency_s: float

    def __post_init__(self) -> None:
        check_number("link bandwidth_bytes_per_s", self.bandwidth_bytes_per_s)
        check_number("link latency_s", self.latency_s, strict=False)

    def to_json(self) -> dict:
        return {"bandwidth_bytes_per_s": self.bandwidth_bytes_per_s, "latency_s": self.latency_s}

    @classmethod
    def from_json(cls, data: dict, what: str = "link") -> "LinkSpec":
        check_mapping(f"{what} (with bandwidth_bytes_per_s and latency_s)", data)
        check_keys(what, data, {"bandwidth_bytes_per_s", "latency_s"}, {"bandwidth_bytes_per_s", "latency_s"})
        return cls(
            bandwidth_bytes_per_s=_number(f"{what}.bandwidth_bytes_per_s", data["bandwidth_bytes_per_s"]),
            latency_s=_number(f"{what}.latency_s", data["latency_s"]),
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
            check_int(f"cluster {what}", value)
        if self.world_size > MAX_WORLD_SIZE:
            raise ConfigError(f"cluster {self.num_nodes} x {self.gpus_per_node} = {self.world_size:,} devices: expected "
                              f"at most {MAX_WORLD_SIZE:,} (the search enumerates the divisors of the world size); "
                              f"plan for fewer devices")
        check_str("cluster name", self.name)

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
        check_mapping("cluster", data)
        check_keys("cluster", data, {"name", "num_nodes", "nodes", "gpus_per_node", "device", "intra_node", "inter_node"},
                   {"device"})
        if "nodes" in data and "num_nodes" in data:
            raise ConfigError("cluster gives both 'nodes' and 'num_nodes'; keep one")
        device_data = data["device"]
        base = preset(device_data) if isinstance(device_data, str) else None
        device = base.device if base else DeviceSpec.from_json(device_data)
        intra = LinkSpec.from_json(data["intra_node"], "intra_node") if "intra_node" in data else _default_link(base, "intra_node")
        inter = LinkSpec.from_json(data["inter_node"], "inter_node") if "inter_node" in data else _default_link(base, "inter_node")
        if "gpus_per_node" not in data and base is None:
            raise ConfigError("cluster needs gpus_per_node when device is not a preset name")
        return cls(
            num_nodes=check_int("cluster num_nodes", data.get("num_nodes", data.get("nodes", 1))),
            gpus_per_node=check_int("cluster gpus_per_node", data.get("gpus_per_node", base.gpus_per_node if base else 0)),
            device=device,
            intra_node=intra,
            inter_node=inter,
            name=check_str("cluster name", data.get("name", "")),
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
    check_str("device", name)
    key = PRESET_ALIASES.get(name.lower(), name.lower())
    presets = _presets()
    if key not in presets:
        raise ConfigError(f"unknown device {name!r}; known devices: {', '.join(sorted(presets))}")
    return presets[key]


def parse_cluster(text: str) -> ClusterSpec:
    """A cluster from shorthand (`128x8xh100`, `8xh200`) or from a YAML/JSON file path."""
    check_str("cluster (a shorthand such as 128x8xh100 or a file path)", text)
    path = Path(text)
    if path.suffix.lower() in (".json", ".yaml", ".yml") or path_kind(path) == "file":
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
    text = read_text(path, "cluster file")
    # a file whose name says neither is read as YAML, which also reads JSON
    data = parse_mapping(path, text, "cluster file", yaml_file=path.suffix.lower() != ".json")
    spec = ClusterSpec.from_json(data)
    return spec if spec.name else ClusterSpec(**{**spec.__dict__, "name": path.stem})


def _default_link(base: ClusterSpec | None, which: str) -> LinkSpec:
    if base is None:
        raise ConfigError(f"cluster file needs {which} {{bandwidth_bytes_per_s, latency_s}} when device is not a preset name")
    return getattr(base, which)


def _number(what: str, value) -> float:
    """Ints, floats and numeric strings (YAML 1.1 reads '80e9' as a string) as a float; the range (and
    finiteness) is checked by the dataclass the number goes into."""
    if isinstance(value, (int, float, str)) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:  # an int beyond the float range: refused as not finite where it is checked
            return math.inf
        except ValueError:
            pass
    raise ConfigError(f"{what}={shown(value)}: expected a number (e.g. 80e9)")


def cluster_mismatch(planned: ClusterSpec, given: ClusterSpec) -> str | None:
    """Why a plan made for `planned` must not run on `given`, or None. The device and the layout
    (nodes x GPUs per node) decide every time and memory limit the plan was priced and fitted under,
    so both must be the plan's; the links may differ (a hardware profile calibrates them)."""
    same_layout = (planned.num_nodes, planned.gpus_per_node) == (given.num_nodes, given.gpus_per_node)
    if planned.device.name == given.device.name and same_layout:
        return None
    return (f"the plan was made for {planned.describe()} but the cluster given is {given.describe()}; "
            f"search again for this cluster, or run on the plan's (pass plan.cluster)")

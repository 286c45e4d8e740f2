"""Devices and the links between them: bandwidth and latency matrices (pure numpy).

A `Topology` is n devices with `bandwidth[i, j]` (bytes/s) and `latency[i, j]` (s) for
sending from device i to device j. Device indices are positions in the list of devices
the mesh is built from (`jaxhybrid.make_mesh(devices=...)`), so a node topology
`nodes(2, 4, ...)` means devices 0-3 share node 0 and 4-7 node 1.

Spec strings (`Topology.from_spec`, the `--topology` flag):

    uniform:N:BW[:LAT]                      N devices, every link BW (latency LAT)
    AxB:intra=BW,inter=BW[,intra_lat=LAT,inter_lat=LAT]
                                            A nodes of B devices
    default                                 this host (`Topology.default()`)

BW is a number with a unit: B/s, KB/s, MB/s, GB/s, TB/s (powers of 1000), KiB/s .. TiB/s
(powers of 1024), or bits: Mb/s, Gb/s, Gbps (divided by 8) — e.g. "10Gbps" for 10 GbE.
LAT is a number with s, ms, us or ns. Example: "2x4:intra=300GB/s,inter=12GB/s".
"""
from __future__ import annotations

import dataclasses
import re
from typing import Sequence

import numpy as np

DEFAULT_INTRA_LATENCY = 5e-6    # s; NVLink/PCIe-class message latency
DEFAULT_INTER_LATENCY = 20e-6   # s; InfiniBand/Ethernet-class
# Bandwidth assumed by `Topology.default()` for links between devices of this host. A
# planning default, not a measurement: NVLink-class for accelerators, memcpy-class for
# the simulated CPU devices of one process.
DEFAULT_BANDWIDTH = {"gpu": 100e9, "tpu": 100e9, "cpu": 10e9}

_RATE_UNITS = {"b/s": 1, "kb/s": 1e3, "mb/s": 1e6, "gb/s": 1e9, "tb/s": 1e12,
               "kib/s": 2.0 ** 10, "mib/s": 2.0 ** 20, "gib/s": 2.0 ** 30, "tib/s": 2.0 ** 40}
_BIT_RATE = {"Kb/s": 1e3 / 8, "Mb/s": 1e6 / 8, "Gb/s": 1e9 / 8, "Tb/s": 1e12 / 8}
_SIZE_UNITS = {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
               "kib": 2.0 ** 10, "mib": 2.0 ** 20, "gib": 2.0 ** 30, "tib": 2.0 ** 40}
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
_NUM = r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*"

SPEC_GRAMMAR = ("'uniform:N:BW[:LAT]' or 'AxB:intra=BW,inter=BW[,intra_lat=LAT,inter_lat=LAT]' "
                "or 'default', e.g. '2x4:intra=300GB/s,inter=12GB/s'")


def _is_number(value, what: str) -> bool:
    """True for a plain number; a bool (True would read as 1 byte, 1 B/s, 1 s) is refused."""
    if isinstance(value, (bool, np.bool_)):
        example = {"size": "'2GB'", "bandwidth": "'12GB/s'", "latency": "'5us'"}[what]
        raise ValueError(f"{what} {value!r} is a bool; write a number or e.g. {example}.")
    return isinstance(value, (int, float, np.number))


def parse_bandwidth(text: str | float) -> float:
    """'12GB/s' / '12GBps' -> 12e9 bytes/s; '10Gbps' / '10Gb/s' -> 1.25e9 (bits). Numbers
    pass through."""
    if _is_number(text, "bandwidth"):
        return _positive(float(text), "bandwidth")
    m = re.fullmatch(_NUM + r"([A-Za-z/]+)\s*", str(text))
    if m:
        unit = m.group(2)
        # Case matters only to tell bits ("Gb/s") from bytes ("GB/s"); in the "ps" forms
        # b is bits and B bytes ("100MBps" was read as bits, 8x too slow).
        if unit.endswith("ps") and unit[-3:-2] in ("b", "B"):
            per_byte = _RATE_UNITS.get(f"{unit[:-3].lower()}b/s")
            scale = per_byte and per_byte / (8 if unit[-3] == "b" else 1)
        else:
            scale = _BIT_RATE.get(unit) or _RATE_UNITS.get(unit.lower())
        if scale:
            return _positive(float(m.group(1)) * scale, "bandwidth")
    raise ValueError(f"cannot read bandwidth {text!r}; write e.g. '12GB/s', '300GB/s', "
                     f"'10Gbps' (units B/s KB/s MB/s GB/s TB/s, KiB/s..TiB/s, Mb/s Gb/s; MBps bytes, Mbps bits).")


def parse_bytes(text: str | float) -> float:
    """'2GB' -> 2e9, '1.5GiB' -> 1.5 * 2**30. Numbers pass through."""
    if _is_number(text, "size"):
        return _positive(float(text), "size")
    m = re.fullmatch(_NUM + r"([A-Za-z]*)\s*", str(text))
    if m and (m.group(2) == "" or m.group(2).lower() in _SIZE_UNITS):
        return _positive(float(m.group(1)) * _SIZE_UNITS.get(m.group(2).lower(), 1), "size")
    if m and m.group(2).lower() in ("k", "m", "g", "t"):   # '8G': which 8G is not said
        n, u = m.group(1), m.group(2).upper()
        dec, binary = (float(n) * _SIZE_UNITS[f"{u.lower()}{s}"] for s in ("b", "ib"))
        raise ValueError(f"cannot read size {text!r}; write '{n}{u}B' ({dec:g} bytes) or "
                         f"'{n}{u}iB' ({binary:g} bytes).")
    if str(text).strip().startswith("-"):
        raise ValueError(f"size {text!r} must be > 0; write e.g. '2GB' or '512MiB'.")
    raise ValueError(f"cannot read size {text!r}; write e.g. '2GB', '512MiB' or a number of bytes.")


def parse_time(text: str | float) -> float:
    """'5us' -> 5e-6 s. Numbers (seconds, >= 0) pass through."""
    if _is_number(text, "latency"):
        if not float(text) >= 0:
            raise ValueError(f"latency {text!r} must be >= 0 seconds; write e.g. 5e-6 or '5us'.")
        return float(text)
    m = re.fullmatch(_NUM + r"([a-z]+)\s*", str(text))
    if m and m.group(2) in _TIME_UNITS:
        return float(m.group(1)) * _TIME_UNITS[m.group(2)]
    raise ValueError(f"cannot read latency {text!r}; write e.g. '5us', '0.02ms' (units s ms us ns).")


def _positive(x: float, what: str) -> float:
    if not x > 0:
        raise ValueError(f"{what} must be > 0, got {x}.")
    return x


@dataclasses.dataclass(frozen=True, eq=False)
class Topology:
    """n devices; `bandwidth[i, j]` bytes/s and `latency[i, j]` s from device i to j.
    The diagonal is ignored (a device sends to itself for free)."""
    bandwidth: np.ndarray
    latency: np.ndarray
    description: str = ""

    def __post_init__(self):
        bw = np.array(self.bandwidth, float)
        lat = np.array(self.latency, float)
        if bw.ndim != 2 or bw.shape[0] != bw.shape[1] or bw.shape[0] < 1:
            raise ValueError(f"Topology: bandwidth must be a square [n, n] matrix, got shape {bw.shape}.")
        if lat.shape != bw.shape:
            raise ValueError(f"Topology: latency shape {lat.shape} must match bandwidth {bw.shape}.")
        off = ~np.eye(len(bw), dtype=bool)
        if (bw[off] <= 0).any() or np.isnan(bw).any():
            raise ValueError("Topology: every off-diagonal bandwidth must be > 0 bytes/s.")
        if (lat < 0).any() or np.isnan(lat).any():
            raise ValueError("Topology: latencies must be >= 0 seconds.")
        np.fill_diagonal(bw, np.inf)
        np.fill_diagonal(lat, 0.0)
        object.__setattr__(self, "bandwidth", bw)
        object.__setattr__(self, "latency", lat)

    @property
    def n(self) -> int:
        return int(self.bandwidth.shape[0])

    def __len__(self) -> int:
        return self.n

    def __repr__(self) -> str:
        return f"Topology({self.description or f'{self.n} devices'})"

    # --- constructors ---------------------------------------------------------------
    @classmethod
    def uniform(cls, n: int, bandwidth: float | str, latency: float | str = DEFAULT_INTRA_LATENCY):
        bw, lat = parse_bandwidth(bandwidth), parse_time(latency)
        if n < 1:
            raise ValueError(f"Topology.uniform: n={n} must be >= 1.")
        return cls(np.full((n, n), bw), np.full((n, n), lat),
                   f"uniform:{n}:{_fmt_rate(bw)}")

    @classmethod
    def nodes(cls, num_nodes: int, devices_per_node: int, intra_bandwidth: float | str,
              inter_bandwidth: float | str, intra_latency: float | str = DEFAULT_INTRA_LATENCY,
              inter_latency: float | str = DEFAULT_INTER_LATENCY):
        """Devices node-major: device d sits on node d // devices_per_node."""
        if num_nodes < 1 or devices_per_node < 1:
            raise ValueError(f"Topology.nodes: need num_nodes >= 1 and devices_per_node >= 1, "
                             f"got {num_nodes}, {devices_per_node}.")
        node = np.arange(num_nodes * devices_per_node) // devices_per_node
        same = node[:, None] == node[None, :]
        bw = np.where(same, parse_bandwidth(intra_bandwidth), parse_bandwidth(inter_bandwidth))
        lat = np.where(same, parse_time(intra_latency), parse_time(inter_latency))
        return cls(bw, lat, f"{num_nodes}x{devices_per_node}:intra={_fmt_rate(bw[same].max())},"
                            f"inter={_fmt_rate(bw[~same].min()) if (~same).any() else '-'}")

    @classmethod
    def from_matrix(cls, bandwidth, latency=None):
        bw = np.asarray(bandwidth, float)
        lat = np.zeros_like(bw) if latency is None else np.asarray(latency, float)
        return cls(bw, lat, f"matrix:{bw.shape[0]}")

    @classmethod
    def default(cls):
        """This host: `jax.device_count()` devices, all links DEFAULT_BANDWIDTH of the
        platform (an assumption; pass a spec or matrix for a real network)."""
        import jax  # only here: the rest of planning runs without jax
        platform = jax.devices()[0].platform
        return cls.uniform(jax.device_count(), DEFAULT_BANDWIDTH.get(platform, 10e9))

    @classmethod
    def from_spec(cls, spec: str):
        """Parses the compact grammar in the module docstring."""
        s = str(spec).strip()
        try:
            if s == "default":
                return cls.default()
            if s.startswith("uniform:"):
                parts = s.split(":")
                if len(parts) not in (3, 4):
                    raise ValueError("uniform takes N:BW[:LAT]")
                lat = parse_time(parts[3]) if len(parts) == 4 else DEFAULT_INTRA_LATENCY
                return cls.uniform(_int(parts[1]), parts[2], lat)
            m = re.fullmatch(r"(\d+)x(\d+):(.+)", s)
            if m:
                kv = {}
                for item in m.group(3).split(","):
                    if "=" not in item:
                        raise ValueError(f"expected key=value, got {item!r}")
                    k, v = (t.strip() for t in item.split("=", 1))
                    if k not in ("intra", "inter", "intra_lat", "inter_lat"):
                        raise ValueError(f"unknown key {k!r} (intra, inter, intra_lat, inter_lat)")
                    if k in kv:   # the last one silently won
                        raise ValueError(f"{k}= given twice")
                    kv[k] = v
                if "intra" not in kv or "inter" not in kv:
                    raise ValueError("both intra= and inter= bandwidths are required")
                return cls.nodes(int(m.group(1)), int(m.group(2)), kv["intra"], kv["inter"],
                                 kv.get("intra_lat", DEFAULT_INTRA_LATENCY),
                                 kv.get("inter_lat", DEFAULT_INTER_LATENCY))
        except ValueError as e:
            raise ValueError(f"bad topology spec {spec!r}: {str(e).rstrip('.')}. Grammar: "
                             f"{SPEC_GRAMMAR}.") from None
        raise ValueError(f"bad topology spec {spec!r}. Grammar: {SPEC_GRAMMAR}.")

    # --- costs ----------------------------------------------------------------------
    def _check(self, devices: Sequence[int]) -> np.ndarray:
        d = np.asarray(devices, int).reshape(-1)
        if d.size and (d.min() < 0 or d.max() >= self.n):
            raise ValueError(f"Topology: device index out of range 0..{self.n - 1}: {list(d)}.")
        return d

    def transfer_time(self, i: int, j: int, nbytes: float) -> float:
        """One message of nbytes from device i to device j: latency + bytes / bandwidth."""
        self._check([i, j])
        if i == j or nbytes <= 0:
            return 0.0
        return float(self.latency[i, j] + nbytes / self.bandwidth[i, j])

    def ring_coefficients(self, devices: Sequence[int]) -> tuple[float, float]:
        """(seconds per byte, fixed seconds) of a ring all-reduce over `devices` in that
        ring order, so that time = per_byte * nbytes + fixed (linear in bytes; the
        partition DP relies on that)."""
        d = self._check(devices)
        k = len(d)
        if k <= 1:
            return 0.0, 0.0
        nxt = np.roll(d, -1)
        slowest = self.bandwidth[d, nxt].min()
        worst_lat = self.latency[d, nxt].max()
        # Reduce-scatter + all-gather: 2(k-1) steps, each moving nbytes/k over every link
        # at once, so the slowest link in the ring sets the pace of every step.
        return 2.0 * (k - 1) / k / slowest, 2.0 * (k - 1) * worst_lat

    def allreduce_time(self, devices: Sequence[int], nbytes: float) -> float:
        """Ring all-reduce of nbytes over `devices` (ring in the given order):
        2(k-1)/k * nbytes / slowest ring link + 2(k-1) * largest ring latency."""
        per_byte, fixed = self.ring_coefficients(devices)
        return 0.0 if nbytes <= 0 else float(per_byte * nbytes + fixed)

    def is_uniform(self) -> bool:
        """All off-diagonal links alike (device mapping cannot matter)."""
        off = ~np.eye(self.n, dtype=bool)
        return self.n <= 1 or (np.ptp(self.bandwidth[off]) == 0 and np.ptp(self.latency[off]) == 0)


def _int(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise ValueError(f"device count {text!r} must be a positive integer")
    return int(text)


def _fmt_rate(bw: float) -> str:
    for unit, scale in (("TB/s", 1e12), ("GB/s", 1e9), ("MB/s", 1e6), ("KB/s", 1e3)):
        if bw >= scale:
            return f"{bw / scale:g}{unit}"
    return f"{bw:g}B/s"


def fmt_bytes(n: float) -> str:
    """Human-readable decimal size."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}B"

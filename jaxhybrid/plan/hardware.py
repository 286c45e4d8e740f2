"""Device and cluster presets for projecting step times onto hardware we do not have.

A `Hardware` is one kind of device in nodes of `devices_per_node`, joined inside a node by
NVLink-class links and between nodes by each node's network cards. Layer times on it
follow a roofline with an efficiency factor:

    time = max(flops / (peak_flops * efficiency), bytes * bytes_scale / mem_bandwidth)
           + layer_overhead

`efficiency` is the fraction of the datasheet peak that real training kernels reach. We
set it from published mixed-precision training throughput: ResNet-50 at ~1,300 img/s on
one V100 (NVIDIA's TensorFlow/MXNet AMP numbers) is ~32 TFLOP/s (24.6 GFLOP per image
forward+backward), ~26% of 125 TFLOP/s; A100 (~2,700 img/s) and H100 (~5,000 img/s)
land at ~20-25% and ~15%. We use 0.30 / 0.30 / 0.25: the roofline takes the max of the
compute and memory terms per layer (not their sum), so a slightly higher factor than the
end-to-end MFU. `bytes_scale` converts the float32 bytes that profiling counts to the
training dtype (0.5: fp16/bf16 mixed precision). `layer_overhead` stands for kernel-launch
and framework time per layer and pass.

Memory per device: `memory * memory_fraction` is usable (the rest: framework, workspace,
fragmentation). Parameters cost `param_state_bytes(optimizer_states)` bytes each: mixed
precision keeps a 16-bit copy (2) + 16-bit gradient (2) + float32 master (4) + float32
optimizer states (4 each).

Engine overheads (`jaxhybrid.plan.hybrid` adds them to pipelined configs, pipe > 1):
`tick_overhead` seconds of fixed work per device per lock-step tick (loop step, branch
dispatch, the `ppermute` rendezvous) and `tick_param_bytes` bytes moved per element of
the device's packed parameter buffer per tick (jaxhybrid's runtime adds the whole
gradient buffer into its accumulator every tick, also in idle slots, and copies stage
weights out of the packed buffer) at `mem_bandwidth`; `tick_latency` seconds per tick
that are waiting, not work (the tick's collectives' rendezvous of all devices, the loop
step): they add to the tick's length once, not to every device's share of the cores;
`task_overhead` seconds of engine work per F/B/W task (branch dispatch, packing outputs
and residuals, stash and inbox writes), `weight_task_overhead` more per W task (the
split backward's weight half reads its stash, gradient and cross rows and rebuilds its
residuals: 10-14 us at width 8 on the 2-core host), `collective_overhead` per device
per collective the tick issues, `launch_overhead` per device per step (launch, buffers
zeroed, final reductions); `lockstep_slots`, how many devices compute at once inside the lock-step
program (0: `compute_slots`; on XLA CPU the simulated devices of a pipelined program
run nearly one at a time even where a data-parallel program overlaps them), divided by
devices ** `lockstep_contention`: every tick ends in a rendezvous of all the program's
devices, so the more device threads share the cores, the more of each tick goes to
switching between them and refilling caches (8 simulated devices on 2 cores, 1F1B at
M = 8, microbatch 4: the layers' profiled work per second of the step's layer time
falls from 2.2 at 2 devices to 1.5 at 8 at width 256, from 1.4 to 1.0 at width 384; the
engine's own cost per device per tick at width 8 rises from 9.5 us to 17 us). All
are 0 for the GPU presets, which model an engine whose per-tick costs vanish next to the layers' (see
docs/projection.md); `measured_device` sets them from calibration runs (the validation
bench on the simulated CPU devices, `jaxhybrid.bench.projection_bench`).

Network (see `jaxhybrid.plan.hybrid` for how collectives use it): `p2p_bandwidth` between
two devices of a node (pipeline sends), `allreduce_bandwidth` the bus bandwidth one
ring/tree all-reduce gets inside a node, `inter_bandwidth` a node's network cards
together (per direction), shared by every collective that leaves the node.

Sources (datasheets; the all-reduce figures are our assumptions, below the NVLink totals):
  V100 (DGX-1, V100-SXM2-32GB): 125 TFLOP/s fp16 tensor, 900 GB/s HBM2, 32 GB; NVLink2
    hybrid cube-mesh, 6 links x 25 GB/s per direction per GPU, a neighbour pair shares
    1-2 links (p2p 25 GB/s assumed), all-reduce ~100 GB/s assumed (NVIDIA DGX-1 V100
    white paper); 4x EDR InfiniBand 100 Gb/s per node = 50 GB/s.
  A100 (DGX A100 40GB): 312 TFLOP/s bf16 dense, 1.555 TB/s HBM2, 40 GB; NVLink3 via
    NVSwitch 12 x 25 = 300 GB/s per direction, all-reduce ~200 GB/s assumed; 8x HDR
    200 Gb/s per node = 200 GB/s.
  H100 (DGX H100): 989 TFLOP/s bf16 dense, 3.35 TB/s HBM3, 80 GB; NVLink4 18 x 25 =
    450 GB/s per direction, all-reduce ~350 GB/s assumed; 8x NDR 400 Gb/s per node =
    400 GB/s.
"""
from __future__ import annotations

import dataclasses
import math
import numbers


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One device kind in a cluster of nodes. `peak_flops=None` means "use the LayerCost
    times as they are" (costs measured on this very device, e.g. the simulated CPU
    devices of the validation bench); `mem_bandwidth` may then still be given (it prices
    the engine's buffer traffic and the optimizer update)."""
    name: str
    peak_flops: float | None
    mem_bandwidth: float | None
    memory: float
    devices_per_node: int
    p2p_bandwidth: float
    allreduce_bandwidth: float
    inter_bandwidth: float
    intra_latency: float = 5e-6
    inter_latency: float = 10e-6
    efficiency: float = 0.3
    bytes_scale: float = 0.5
    layer_overhead: float = 0.0
    memory_fraction: float = 0.9
    grad_bytes: float = 2.0          # bytes per parameter in the gradient all-reduce
    weight_bytes: float = 8.0        # per parameter: 16-bit copy + 16-bit grad + fp32 master
    compute_slots: float = math.inf  # devices that can compute at the same time (see hybrid)
    tick_overhead: float = 0.0       # fixed work per device per lock-step tick (pipe > 1)
    tick_param_bytes: float = 0.0    # bytes per packed parameter element per device per tick
    tick_latency: float = 0.0        # per tick on the critical path, not work (pipe > 1)
    task_overhead: float = 0.0       # engine work per F/B/W task a device runs (pipe > 1)
    weight_task_overhead: float = 0.0  # and more per W task (split backward, pipe > 1)
    collective_overhead: float = 0.0  # engine work per device per collective issued (pipe > 1)
    launch_overhead: float = 0.0     # engine work per device per step (pipe > 1)
    lockstep_slots: float = 0.0      # devices computing at once in the lock-step program
                                     # (pipe > 1); 0: compute_slots
    lockstep_contention: float = 0.0  # those slots fall as devices^-contention
    step_overhead: float = 0.0       # fixed cost per training step
    description: str = ""

    def __post_init__(self):
        for f in ("memory", "p2p_bandwidth", "allreduce_bandwidth", "inter_bandwidth",
                  "efficiency", "bytes_scale", "memory_fraction", "compute_slots"):
            if not getattr(self, f) > 0:
                raise ValueError(f"Hardware {self.name!r}: {f}={getattr(self, f)} must be > 0.")
        if self.peak_flops is not None and self.mem_bandwidth is None:
            raise ValueError(f"Hardware {self.name!r}: peak_flops needs mem_bandwidth too (or "
                             f"give neither peak: then the costs' own measured times are used).")
        for f in ("peak_flops", "mem_bandwidth"):
            if getattr(self, f) is not None and not getattr(self, f) > 0:
                raise ValueError(f"Hardware {self.name!r}: {f}={getattr(self, f)} must be > 0.")
        for f in ("tick_overhead", "tick_param_bytes", "tick_latency", "step_overhead",
                  "layer_overhead", "task_overhead", "collective_overhead", "launch_overhead",
                  "weight_task_overhead",
                  "lockstep_slots", "lockstep_contention"):
            if not getattr(self, f) >= 0:
                raise ValueError(f"Hardware {self.name!r}: {f}={getattr(self, f)} must be >= 0.")
        if self.tick_param_bytes and self.mem_bandwidth is None:
            raise ValueError(f"Hardware {self.name!r}: tick_param_bytes needs mem_bandwidth.")
        dpn = self.devices_per_node
        if isinstance(dpn, bool) or not isinstance(dpn, numbers.Integral) or dpn < 1:
            raise ValueError(f"Hardware {self.name!r}: devices_per_node={dpn!r} must be an int "
                             f">= 1.")
        for f in ("efficiency", "memory_fraction"):   # 30 for 30% was 100x the peak
            if not getattr(self, f) <= 1:
                raise ValueError(f"Hardware {self.name!r}: {f}={getattr(self, f)} is a fraction: "
                                 f"give a number in (0, 1], e.g. 0.3 for 30%.")

    @property
    def uses_measured_times(self) -> bool:
        return self.peak_flops is None

    def compute_time(self, flops: float, nbytes: float) -> float:
        """Roofline time of one kernel group (a layer's forward or backward)."""
        if self.uses_measured_times:
            raise ValueError(f"Hardware {self.name!r} has no peak numbers; it uses measured times.")
        return (max(flops / (self.peak_flops * self.efficiency),
                    nbytes * self.bytes_scale / self.mem_bandwidth) + self.layer_overhead)

    def param_state_bytes(self, optimizer_states: int) -> float:
        """Bytes kept per parameter: weights, gradient, master copy and optimizer states."""
        return self.weight_bytes + 4.0 * optimizer_states

    @property
    def usable_memory(self) -> float:
        return self.memory * self.memory_fraction

    def replace(self, **kw) -> "Hardware":
        return dataclasses.replace(self, **kw)


PRESETS: dict[str, Hardware] = {
    "v100_dgx1": Hardware(
        "v100_dgx1", peak_flops=125e12, mem_bandwidth=900e9, memory=32e9, devices_per_node=8,
        p2p_bandwidth=25e9, allreduce_bandwidth=100e9, inter_bandwidth=50e9,
        intra_latency=5e-6, inter_latency=10e-6, efficiency=0.30, layer_overhead=20e-6,
        description="DGX-1: 8x V100-SXM2-32GB, NVLink2 cube-mesh, 4x EDR IB per node"),
    "a100_dgx": Hardware(
        "a100_dgx", peak_flops=312e12, mem_bandwidth=1555e9, memory=40e9, devices_per_node=8,
        p2p_bandwidth=300e9, allreduce_bandwidth=200e9, inter_bandwidth=200e9,
        intra_latency=3e-6, inter_latency=8e-6, efficiency=0.30, layer_overhead=15e-6,
        description="DGX A100: 8x A100-SXM4-40GB, NVSwitch, 8x HDR IB per node"),
    "h100_dgx": Hardware(
        "h100_dgx", peak_flops=989e12, mem_bandwidth=3350e9, memory=80e9, devices_per_node=8,
        p2p_bandwidth=450e9, allreduce_bandwidth=350e9, inter_bandwidth=400e9,
        intra_latency=3e-6, inter_latency=6e-6, efficiency=0.25, layer_overhead=10e-6,
        description="DGX H100: 8x H100-SXM5-80GB, NVSwitch, 8x NDR IB per node"),
}


def measured_device(name: str = "measured", *, memory: float = 16e9, devices_per_node: int = 8,
                    bandwidth: float = 10e9, mem_bandwidth: float | None = None,
                    latency: float = 5e-6, **kw) -> Hardware:
    """A device whose layer times are the costs' own measured times (`plan.profile(...,
    measure=True)` on that device): no roofline, no scaling. `bandwidth` serves every
    link (p2p, all-reduce, between nodes: one host, DEFAULT_BANDWIDTH["cpu"] of
    `jaxhybrid.plan.topology` by default); float32 throughout (bytes_scale 1, 4-byte
    gradients, 8 bytes of weight + gradient per parameter plus 4 per optimizer
    state); other fields by keyword
    (compute_slots, tick_overhead, tick_param_bytes, step_overhead, ...)."""
    base = dict(peak_flops=None, mem_bandwidth=mem_bandwidth, memory=memory,
                devices_per_node=devices_per_node, p2p_bandwidth=bandwidth,
                allreduce_bandwidth=bandwidth, inter_bandwidth=bandwidth, intra_latency=latency,
                inter_latency=latency, bytes_scale=1.0, grad_bytes=4.0, weight_bytes=8.0,
                description="layer times as measured on the device itself")
    return Hardware(name, **{**base, **kw})


def get_hardware(name: str | Hardware) -> Hardware:
    """A preset by name ("v100_dgx1", "a100_dgx", "h100_dgx", or "measured": the costs' own
    measured times, see `measured_device`), or a Hardware as is."""
    if isinstance(name, Hardware):
        return name
    if name == "measured":
        return measured_device()
    if name not in PRESETS:
        raise ValueError(f"unknown hardware {name!r}; choose one of "
                         f"{', '.join([*PRESETS, 'measured'])}.")
    return PRESETS[name]

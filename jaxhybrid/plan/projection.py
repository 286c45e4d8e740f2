"""The result of the projection's search (`hybrid.search`): every configuration tried
per device count, the best data-parallel-only and the best hybrid (pipe > 1 or model
> 1) one, the crossover, the table, JSON and the time-to-accuracy plot."""
from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from jaxhybrid.plan.stat_efficiency import StatEfficiency

if TYPE_CHECKING:
    from jaxhybrid.plan.hybrid import Estimate


@dataclasses.dataclass
class Projection:
    """Every configuration tried (`rows`, feasible or not) for each device count."""
    model: str
    hardware: str
    devices: list
    per_worker_batch: int
    stat: StatEfficiency
    rows: list

    def best(self, n: int, hybrid: bool | None = None) -> Estimate | None:
        """Fastest feasible config on n devices: DP-only (hybrid=False), pipe > 1 or
        model > 1 (hybrid=True) or any (None)."""
        ok = [r for r in self.rows if r.devices == n and r.feasible and
              (hybrid is None or r.hybrid == hybrid)]
        return min(ok, key=lambda r: r.time_to_accuracy) if ok else None

    def summary(self) -> list[dict]:
        out = []
        for n in self.devices:
            dp, hy = self.best(n, False), self.best(n, True)
            sp = dp.time_to_accuracy / hy.time_to_accuracy if dp and hy else math.nan
            out.append(dict(devices=n, dp=dp, hybrid=hy, speedup=sp,
                            winner="hybrid" if hy and (not dp or sp > 1) else ("dp" if dp else "-")))
        return out

    @property
    def crossover(self) -> int | None:
        """Smallest N where the best hybrid config beats the best DP-only one."""
        return next((s["devices"] for s in self.summary() if s["winner"] == "hybrid"), None)

    def at_scale(self) -> dict:
        """Best DP-only time over all N against the best hybrid time over all N (Pal et
        al.'s comparison: what each strategy can achieve at scale)."""
        pick = lambda h: min((r for r in self.rows if r.feasible and r.hybrid == h),  # noqa: E731
                             key=lambda r: r.time_to_accuracy, default=None)
        dp, hy = pick(False), pick(True)
        sp = dp.time_to_accuracy / hy.time_to_accuracy if dp and hy else math.nan
        return dict(dp=dp, hybrid=hy, speedup=sp, gain_percent=(sp - 1) * 100)

    def table(self) -> str:
        def cfg(e):
            return "-" if e is None else f"{e.layout} M={e.num_microbatches}"

        def hrs(e):
            return "-" if e is None else f"{e.time_to_accuracy / 3600:.3g}"
        head = (f"{self.model} on {self.hardware}, per-worker batch {self.per_worker_batch}; "
                f"{self.stat.describe()}\n"
                f"{'N':>6} | {'best DP':>14} {'step ms':>8} {'epochs':>7} {'hours':>8} | "
                f"{'best hybrid':>15} {'step ms':>8} {'epochs':>7} {'hours':>8} | speedup")
        def num(value, spec):   # "-" where nothing fits (it printed nan)
            return "-" if value is None or not math.isfinite(value) else format(value, spec)
        lines = [head]
        for s in self.summary():
            dp, hy = s["dp"], s["hybrid"]
            ms = lambda e: num(e and e.step_time * 1e3, ".2f")   # noqa: E731
            ep = lambda e: num(e and e.epochs, ".1f")            # noqa: E731
            lines.append(
                f"{s['devices']:>6} | {cfg(dp):>14} {ms(dp):>8} {ep(dp):>7} {hrs(dp):>8} | "
                f"{cfg(hy):>15} {ms(hy):>8} {ep(hy):>7} {hrs(hy):>8} | "
                f"{num(s['speedup'], '.3f')}")
            if not dp and not hy:     # say why, from the config spread over most devices
                tried = [r for r in self.rows if r.devices == s["devices"]]
                r = max(tried, key=lambda r: (r.pipe * r.model, r.num_microbatches))
                lines.append(f"{'':>6} | nothing fits of {len(tried)} configs; e.g. {cfg(r)}: "
                             f"{r.reason}")
        a = self.at_scale()
        crossover = (f"crossover N = {self.crossover}" if self.crossover is not None else
                     f"no crossover (hybrid wins at no N in {','.join(map(str, self.devices))})")
        lines.append(f"{crossover}; at scale: best DP {hrs(a['dp'])} h "
                     f"({cfg(a['dp'])}, N={a['dp'].devices if a['dp'] else '-'}), best hybrid "
                     f"{hrs(a['hybrid'])} h ({cfg(a['hybrid'])}, N="
                     f"{a['hybrid'].devices if a['hybrid'] else '-'}): speedup {num(a['speedup'], '.3f')} "
                     f"({num(a['gain_percent'], '+.1f')}%)")
        return "\n".join(lines)

    def to_json(self) -> dict:
        conv = lambda e: e.to_dict() if hasattr(e, "to_dict") else e  # noqa: E731
        clean = lambda x: None if isinstance(x, float) and not math.isfinite(x) else x  # noqa: E731
        return dict(model=self.model, hardware=self.hardware, devices=self.devices,
                    per_worker_batch=self.per_worker_batch, stat_efficiency=self.stat.to_dict(),
                    crossover=self.crossover,
                    at_scale={k: clean(conv(v)) for k, v in self.at_scale().items()},
                    summary=[{k: clean(conv(v)) for k, v in s.items()} for s in self.summary()],
                    configs=[r.to_dict() for r in self.rows])

    def plot(self, path: str) -> None:
        """PNG: time to accuracy vs N (log-log), best DP-only vs best hybrid."""
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6.4, 4.4))
        for hybrid, label, style in ((False, "data parallel only", "o-"), (True, "hybrid (pipe or model > 1)", "s-")):
            pts = [(n, e.time_to_accuracy / 3600) for n in self.devices
                   if (e := self.best(n, hybrid)) is not None]
            if pts:
                ax.plot(*zip(*pts), style, label=label)
        if self.crossover:
            ax.axvline(self.crossover, color="gray", ls=":", label=f"crossover N={self.crossover}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("devices N")
        ax.set_ylabel("time to accuracy (hours)")
        ax.set_title(f"{self.model} on {self.hardware} (b={self.per_worker_batch} per worker)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)

"""The learning curve of an RL planner's run: CSV, PNG and, when installed, TensorBoard events.

The planners keep the curve in `plan.meta[planner]["curve"]` as rows (iteration, plans scored,
seconds, mean objective of the iteration's sampled plans, best objective so far of the plans that
fit (empty until one does); objective values are the fast path's, finite for infeasible plans)."""

from __future__ import annotations

import csv
from pathlib import Path

from hetplan.errors import HetplanError
from hetplan.io.serde import atomic_write
from hetplan.plan import Plan

COLUMNS = ("iteration", "plans_scored", "seconds", "mean_value", "best_value")


def curve_rows(plan: Plan) -> list[list[float]]:
    body = plan.meta.get(plan.planner) if plan.meta else None
    rows = body.get("curve") if body else None
    if not rows:
        raise HetplanError(f"--curve: planner {plan.planner!r} keeps no learning curve; only the RL planners "
                           "(reinforce, ppo, heterps) do")
    return [list(r) for r in rows]


def write_curve(plan: Plan, prefix: str | Path) -> list[str]:
    """Write PREFIX.csv and PREFIX.png (and PREFIX-tb/ if tensorboard is installed); the paths.
    Both or neither: when the picture cannot be written (a full disk), the table goes again."""
    rows = curve_rows(plan)
    prefix = Path(prefix)
    csv_path = prefix.with_name(prefix.name + ".csv")
    atomic_write(csv_path, lambda tmp: _write_csv(tmp, rows), "the learning curve's table")
    try:
        png = _write_png(plan, rows, prefix)
    except BaseException:
        csv_path.unlink(missing_ok=True)
        raise
    out = [str(csv_path), str(png)]
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard is optional
        return out
    tb = prefix.with_name(prefix.name + "-tb")
    writer = SummaryWriter(str(tb))
    for r in rows:
        writer.add_scalar("objective/mean", r[3], int(r[0]))
        if r[4] is not None:
            writer.add_scalar("objective/best", r[4], int(r[0]))
    writer.close()
    out.append(str(tb))
    return out


def _write_csv(path: Path, rows: list[list[float]]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(COLUMNS)
        w.writerows(rows)


def _write_png(plan: Plan, rows: list[list[float]], prefix: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    it = [r[0] for r in rows]
    ax.plot(it, [r[3] for r in rows], lw=0.8, alpha=0.6, label="mean of the iteration's plans")
    ax.plot(it, [float("nan") if r[4] is None else r[4] for r in rows], lw=1.6, label="best so far (fits)")
    ax.set_xlabel("iteration")
    ax.set_ylabel(f"objective ({plan.objective}; fast path, lower is better)")
    ax.set_yscale("log")
    ax.set_title(f"{plan.planner} on {plan.graph or 'graph'} / {plan.cluster or 'cluster'}")
    ax.legend()
    fig.tight_layout()
    png = prefix.with_name(prefix.name + ".png")
    try:
        atomic_write(png, lambda tmp: fig.savefig(tmp, dpi=110, format="png"), "the learning curve")
    finally:
        plt.close(fig)
    return png

"""Draw a simulated schedule: a PNG Gantt chart (matplotlib, Agg) and a plain-text chart.

One row per pipeline rank, time on x. Colour = pipe (model chunk for interleaved 1F1B); forward
boxes light, backward boxes dark, weight-gradient boxes hatched; the micro-batch number is
written in each box; gaps are idle time. Gradient all-reduces, when they take time, appear as
thin grey bars under each rank.
"""

from __future__ import annotations

from megatron_chimera.atomic import atomic_write
from megatron_chimera.schedules.actions import BACKWARD, FORWARD, WEIGHT, Schedule
from megatron_chimera.schedules.simulate import SimResult

_TEXT_FILL = {FORWARD: "-", BACKWARD: "=", WEIGHT: "~"}


def _lane(schedule: Schedule, pipe: int, stage: int) -> int:
    """What a box's colour and label prefix tell apart: the pipe, the model chunk when a pipe
    has more stages than ranks (interleaved 1F1B, a V pipe's way down and back up), or both
    (BitPipe: pipe x chunks + chunk)."""
    chunks = max(1, schedule.num_stages // schedule.num_ranks)
    return pipe * chunks + stage // schedule.num_ranks


def _lane_name(schedule: Schedule) -> str | None:
    chunked = schedule.num_stages > schedule.num_ranks
    if schedule.num_pipes > 1:
        return "pipe-chunk" if chunked else "pipe"
    return "chunk" if chunked else None


def chart_title(schedule: Schedule, result: SimResult) -> str:
    """Title line: schedule, sizes, makespan and bubble ratio."""
    return (
        f"{schedule.describe()} | makespan {result.makespan:g} | "
        f"bubble ratio {result.bubble_ratio:.3f}"
    )


def text_chart(schedule: Schedule, result: SimResult, max_width: int = 160) -> str:
    """Character Gantt chart: a box per action, ``.`` for idle time.

    A box starts with its kind (``F``/``B``/``W``), then pipe (model chunk for interleaved) and
    micro-batch as far as they fit (``F1:12``, ``F12``, ``F``), and is filled with ``-`` (F),
    ``=`` (B) or ``~`` (W).
    """
    events = result.events
    span = result.compute_span
    if not events or span <= 0:
        return "(empty schedule)"
    shortest = min((e.end - e.start for e in events if e.end > e.start), default=span)
    scale = min(2.0 / shortest, max_width / span)  # characters per time unit
    width = max(1, round(span * scale))
    lane_name = _lane_name(schedule)
    rows = [chart_title(schedule, result)]
    for rank in range(schedule.num_ranks):
        cells = ["."] * width
        for e in result.events_of_rank(rank):
            lo = min(width - 1, round(e.start * scale))
            hi = max(lo + 1, min(width, round(e.end * scale)))
            labels = [f"{e.kind}{e.microbatch}", e.kind]
            if lane_name:
                labels.insert(0, f"{e.kind}{_lane(schedule, e.pipe, e.stage)}:{e.microbatch}")
            label = next(x for x in labels if len(x) <= hi - lo or x == e.kind)
            box = (label + _TEXT_FILL[e.kind] * (hi - lo))[: hi - lo]
            cells[lo:hi] = list(box)
        rows.append(f"rank {rank:>2} |{''.join(cells)}|")
    rows.append(
        f"legend: F/B/W = forward / backward / weight gradient, [{lane_name or 'pipe'}:]"
        "micro-batch, '.' = idle; "
        f"{scale:g} chars per time unit"
    )
    return "\n".join(rows)


def plot_schedule(schedule: Schedule, result: SimResult, path: str, dpi: int = 110) -> None:
    """Write the Gantt chart of ``result`` to the PNG ``path`` (atomically: temp file + rename)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    span = max(result.makespan, 1e-9)
    ranks = schedule.num_ranks
    fig_w = min(40.0, max(8.0, 0.25 * len(result.events) / max(ranks, 1) + 4))
    fig, ax = plt.subplots(figsize=(fig_w, 1.0 + 0.55 * ranks))
    lane_name = _lane_name(schedule) or "pipe"
    lanes = max(_lane(schedule, p, s) for p in range(schedule.num_pipes)
                for s in range(schedule.num_stages)) + 1
    cmap = plt.get_cmap("tab10" if lanes <= 10 else "tab20")
    shortest = min((e.end - e.start for e in result.events if e.end > e.start), default=span)
    box_points = shortest / span * 0.8 * fig_w * 72  # width of the shortest box
    digits = len(str(max(schedule.num_microbatches - 1, 0)))
    font = max(3.0, min(9.0, box_points / (0.7 * digits + 0.4)))
    for e in result.events:
        y = ranks - 1 - e.rank
        colour = cmap(_lane(schedule, e.pipe, e.stage) % cmap.N)
        alpha = {FORWARD: 0.45, BACKWARD: 0.95, WEIGHT: 0.7}[e.kind]
        ax.barh(
            y, e.end - e.start, left=e.start, height=0.8, color=colour, alpha=alpha,
            edgecolor="black", linewidth=0.4, hatch="///" if e.kind == WEIGHT else None,
        )
        ax.text(
            (e.start + e.end) / 2, y, str(e.microbatch), ha="center", va="center",
            fontsize=font, color="white" if e.kind == BACKWARD else "black",
        )
    for ar in result.allreduces:
        if ar.end > ar.start:
            for rank in ar.ranks:
                ax.barh(ranks - 1 - rank - 0.47, ar.end - ar.start, left=ar.start, height=0.1,
                        color="grey")
    ax.set_yticks(range(ranks))
    ax.set_yticklabels([f"rank {r}" for r in reversed(range(ranks))])
    ax.set_xlim(0, span)
    ax.set_ylim(-0.6, ranks - 0.4)
    ax.set_xlabel("time")
    ax.set_title(chart_title(schedule, result), fontsize=9)
    handles = [
        Patch(color=cmap(lane % cmap.N), label=f"{lane_name} {lane}") for lane in range(lanes)
    ]
    handles += [
        Patch(facecolor="white", edgecolor="black", alpha=0.45, label="F (light)"),
        Patch(facecolor="grey", edgecolor="black", label="B (dark)"),
    ]
    if schedule.split_backward:
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="///", label="W"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    fig.tight_layout()
    try:
        atomic_write(path, lambda handle: fig.savefig(handle, format="png", dpi=dpi))
    finally:
        plt.close(fig)

"""The placement picture of plan mode (`plan.png`).

One row per module, one cell per rank. A module's cells are in its colour, shaded by PP stage
(alternating dark/light) and DP lane (alternating slightly); a black box outlines its island.
Vertical separators inside a row mark group boundaries: thin white every tp ranks (TP groups),
grey every tp*cp ranks (TP x CP groups), thick black every tp*cp*dp ranks (PP stages). Separators
denser than the figure can show are left out. In worlds of up to 128 ranks the lower part of
each row shows the single cells and, for modules with CP, each rank's CP index. Dashed red lines
mark node boundaries; a lower panel shows each rank's estimated memory against the device's.
"""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.colors import to_rgb  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

COLORS = {"vision": "tab:green", "projector": "tab:orange", "llm": "tab:blue"}
MAX_LINES = 256
"""Most separators of one kind drawn in a row."""
MAX_LABELLED = 128
"""Largest world whose cells are drawn one by one, with their CP index."""


def _cells(layouts, world_size: int) -> np.ndarray:
    """RGB image [modules, world_size, 3]: white where a module does not run."""
    image = np.ones((len(layouts), world_size, 3))
    for row, (m, lay) in enumerate(layouts.items()):
        base = np.array(to_rgb(COLORS.get(m, "tab:purple")))
        local = np.arange(lay.num_ranks)
        stage = local // (lay.tp * lay.cp * lay.dp)
        lane = local // (lay.tp * lay.cp) % lay.dp
        light = 0.45 * (stage % 2) + 0.15 * (lane % 2)
        image[row, lay.rank_offset:lay.rank_offset + lay.num_ranks] = (base + (1 - base)
                                                                       * light[:, None])
    return image


def draw_plan(layouts, world_size: int, path, gpus_per_node: int | None = None,
              memory_gib: list[float] | None = None, device_memory_gib: float | None = None,
              cp_notes: dict[str, str] | None = None) -> None:
    """Write `plan_figure(...)` to `path` (PNG)."""
    fig = plan_figure(layouts, world_size, gpus_per_node, memory_gib, device_memory_gib, cp_notes)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plan_figure(layouts, world_size: int, gpus_per_node: int | None = None,
                memory_gib: list[float] | None = None, device_memory_gib: float | None = None,
                cp_notes: dict[str, str] | None = None):
    """The placement picture of `layouts` over `world_size` ranks (a matplotlib Figure).

    With `gpus_per_node`, dashed red lines mark node boundaries in every panel; with
    `memory_gib` (one estimate per rank) a lower panel shows each rank's estimated memory as a
    bar (red where it exceeds `device_memory_gib`, drawn as a line); `cp_notes` (module -> text,
    `hcp.preflight.plan_mode.cp_notes`: encoder CP, dynamic CP) is written on the module's row."""
    rows = len(layouts)
    panels = 2 if memory_gib is not None else 1
    fig, axes = plt.subplots(panels, 1, sharex=True, squeeze=False,
                             figsize=(min(24, max(10, world_size / 5)),
                                      1.4 + 1.1 * rows + 2.2 * (panels - 1)),
                             gridspec_kw={"height_ratios": [1.1 * rows, 2.2][:panels]})
    ax = axes[0, 0]
    ax.imshow(_cells(layouts, world_size), aspect="auto", interpolation="nearest",
              extent=(0, world_size, rows, 0))
    for row, (m, lay) in enumerate(layouts.items()):
        lo, hi = lay.rank_offset, lay.rank_offset + lay.num_ranks
        for step, color, width in ((lay.tp, "white", 0.6), (lay.tp * lay.cp, "0.35", 1.4),
                                   (lay.tp * lay.cp * lay.dp, "black", 2.8)):
            if 1 < step < lay.num_ranks and lay.num_ranks // step <= MAX_LINES:
                ax.vlines(np.arange(lo + step, hi, step), row + 0.04, row + 0.96, colors=color,
                          linewidth=width)
        ax.add_patch(Rectangle((lo, row), hi - lo, 1, fill=False, edgecolor="black", linewidth=2))
        if world_size <= MAX_LABELLED:
            ax.vlines(np.arange(lo + 1, hi), row + 0.7, row + 0.96, colors="white", linewidth=0.3)
            if lay.cp > 1:
                for r in range(lo, hi):
                    ax.text(r + 0.5, row + 0.83, str((r - lo) // lay.tp % lay.cp), ha="center",
                            va="center", fontsize=6)
        if cp_notes and m in cp_notes:
            ax.text(lo + 0.01 * world_size, row + 0.12, cp_notes[m], ha="left", va="center",
                    fontsize=8, fontstyle="italic",
                    bbox={"facecolor": "white", "alpha": 0.8, "linewidth": 0, "pad": 1})
        stage_width = lay.num_ranks / lay.pp
        for s in range(lay.pp):
            if stage_width >= world_size / 40:
                ax.text(lo + (s + 0.5) * stage_width, row + 0.3, f"pp{s}", ha="center", va="center",
                        fontsize=9, fontweight="bold", color="black",
                        bbox={"facecolor": "white", "alpha": 0.7, "linewidth": 0, "pad": 1})
    nodes = (np.arange(gpus_per_node, world_size, gpus_per_node)
             if gpus_per_node and world_size // gpus_per_node <= MAX_LINES else np.zeros(0))
    for a in axes[:, 0]:
        for x in nodes:
            a.axvline(x, color="red", linestyle="dashed", linewidth=1.2)
    ax.set_yticks(np.arange(rows) + 0.5)
    ax.set_yticklabels([f"{m}\ntp{l.tp} cp{l.cp} dp{l.dp} pp{l.pp}" for m, l in layouts.items()],
                       fontsize=9)
    ax.set_xlim(0, world_size)
    placement = ("colocated"
                 if all(l.num_ranks == world_size for l in layouts.values()) else "non-colocated")
    node_note = (f"; red dashes: node boundaries ({gpus_per_node} GPUs per node)" if len(nodes)
                 else "")
    ax.set_title(f"{placement} placement over {world_size} ranks. Separators: white = TP group, "
                 "grey = TP x CP group, black = PP stage;\ndigits: CP index; shade: PP stage "
                 f"(strong), DP lane (light){node_note}", fontsize=9)
    if memory_gib is not None:
        mem = axes[1, 0]
        over = device_memory_gib is not None and max(memory_gib) > device_memory_gib
        colors = ["tab:red"
                  if device_memory_gib is not None and g > device_memory_gib else "tab:gray"
                  for g in memory_gib]
        mem.bar(np.arange(world_size) + 0.5, memory_gib, width=1.0, color=colors, linewidth=0)
        if device_memory_gib is not None:
            mem.axhline(device_memory_gib, color="black", linewidth=1.2)
            mem.text(0.2, device_memory_gib, f" device {device_memory_gib:g} GiB", va="bottom",
                     fontsize=8)
        mem.set_ylim(0, max(max(memory_gib), device_memory_gib or 0) * 1.15)
        mem.set_ylabel("est. memory\nper rank (GiB)", fontsize=9)
        mem.set_title("estimated memory per rank against the device's" +
                      (" (red: does not fit)" if over else ""), fontsize=9)
        axes[1, 0].set_xlabel("rank")
    else:
        ax.set_xlabel("rank")
    fig.tight_layout()
    return fig

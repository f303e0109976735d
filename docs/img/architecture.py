"""Draws docs/img/architecture.png: kvmem's data flow, from a write (top row) to a chat (bottom row).

Run: python docs/img/architecture.py (needs matplotlib).
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

W, H = 2.4, 1.15  # box width and height, in axis units
PAD = 0.12  # gap between an arrow's end and a box

WRITE = "#dbeafe"
STORE = "#fde68a"
READ = "#dcfce7"
# name: (x, y, title, detail, colour); the top row writes, the bottom row answers a chat
BOXES = {
    "ingest": (0.0, 2.6, "ingest", "facts from a conversation,\nMem0 add / import", WRITE),
    "encode": (3.2, 2.6, "encode", "one forward pass behind\nwindow + neighbours:\npre-RoPE K, raw V", WRITE),
    "store": (6.4, 2.6, "store", "KV segments + rows\n(SQLite or PostgreSQL;\nlocal dir or object store)", STORE),
    "serve": (0.0, 0.0, "serve", "OpenAI chat API,\nMem0 API, tenants,\nreplicas", READ),
    "retrieve": (3.2, 0.0, "retrieve", "embed the question,\nper-user FAISS top-k", READ),
    "compose": (6.4, 0.0, "compose", "[header][fact_1..k] at\ncontiguous positions,\nchunked RoPE", READ),
    "inject": (9.6, 0.0, "inject", "KV into the engine's cache\n(transformers cache or\nvLLM paged blocks)", READ),
    "generate": (12.8, 0.0, "generate", "prefill only the query,\ndecode", READ),
}
ARROWS = [
    ("ingest", "encode", ""),
    ("encode", "store", "one commit"),
    ("serve", "retrieve", "question"),
    ("store", "retrieve", "embeddings"),
    ("retrieve", "compose", "fact ids"),
    ("store", "compose", "the k facts' KV"),
    ("compose", "inject", ""),
    ("inject", "generate", ""),
]


def centre(name: str) -> tuple[float, float]:
    x, y, *_ = BOXES[name]
    return x + W / 2, y + H / 2


def edge(name: str, toward: tuple[float, float]) -> tuple[float, float]:
    """The point where the line from a box's centre toward a point leaves the box (plus PAD)."""
    cx, cy = centre(name)
    dx, dy = toward[0] - cx, toward[1] - cy
    t = min((W / 2 + PAD) / abs(dx) if dx else 1e9, (H / 2 + PAD) / abs(dy) if dy else 1e9)
    return cx + t * dx, cy + t * dy


def main() -> None:
    fig, ax = plt.subplots(figsize=(13, 4.6))
    for x, y, title, detail, colour in BOXES.values():
        ax.add_patch(FancyBboxPatch((x, y), W, H, boxstyle="round,pad=0.06", fc=colour, ec="#374151", lw=1.2))
        ax.text(x + W / 2, y + H - 0.18, title, ha="center", va="center", fontsize=11, weight="bold")
        ax.text(x + W / 2, y + H / 2 - 0.15, detail, ha="center", va="center", fontsize=7.5)
    for a, b, label in ARROWS:
        (x0, y0), (x1, y1) = edge(a, centre(b)), edge(b, centre(a))
        ax.add_patch(
            FancyArrowPatch(
                (x0, y0), (x1, y1), arrowstyle="-|>", mutation_scale=14, lw=1.3, color="#374151", shrinkA=0, shrinkB=0
            )
        )
        if label:
            ax.text(
                (x0 + x1) / 2,
                (y0 + y1) / 2 + 0.12,
                label,
                ha="center",
                fontsize=7.5,
                style="italic",
                color="#1f2937",
                bbox={"fc": "white", "ec": "none", "pad": 0.5},
            )
    # the answer goes back to the client: under the chat row, from generate to serve
    gx, _ = centre("generate")
    sx, _ = centre("serve")
    y = -PAD
    ax.add_patch(
        FancyArrowPatch(
            (gx, y),
            (sx, y),
            connectionstyle="bar,fraction=-0.04",
            arrowstyle="-|>",
            mutation_scale=14,
            lw=1.3,
            color="#374151",
            shrinkA=0,
            shrinkB=0,
        )
    )
    ax.text((gx + sx) / 2, -0.9, "answer (streamed)", ha="center", fontsize=7.5, style="italic", color="#1f2937")
    ax.text(0.0, 4.0, "write: once per fact, at ingest or on add", fontsize=9, color="#1d4ed8")
    ax.text(9.6, 1.5, "chat: per request;\nonly the query is prefilled", fontsize=9, color="#15803d")
    ax.set_xlim(-0.3, 15.5)
    ax.set_ylim(-1.1, 4.3)
    ax.axis("off")
    fig.tight_layout()
    fig.savefig(Path(__file__).with_name("architecture.png"), dpi=130)


if __name__ == "__main__":
    main()

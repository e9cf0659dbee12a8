"""Draw two of the book's diagrams as SVG files in book/figures/ (matplotlib only).

Usage: python scripts/make_diagrams.py

- heads_split_merge.svg: how ``split_heads`` / ``merge_heads`` (attnbook.multihead) reshape a tensor
- blocks_encoder_decoder.svg: ``EncoderBlock`` and ``DecoderBlock`` (attnbook.blocks), post-norm vs pre-norm

The output is byte-identical from run to run (fixed ``svg.hashsalt``, no date or matplotlib version in the metadata).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib.patches import Circle, FancyBboxPatch, Rectangle

OUT = Path(__file__).resolve().parent.parent / "book" / "figures"
HEADS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52"]  # one colour per head
ATTN, CROSS, FFN, NORM, IO = "#d6e4f5", "#dcefd8", "#fde3c4", "#fff4c2", "#eeeeee"
EDGE, TEXT = "#333333", "#111111"
plt.rcParams.update({"svg.hashsalt": "attnbook", "font.size": 11, "font.family": "DejaVu Sans"})


def canvas(width, height, inches_per_unit=0.22):
    """A figure whose data coordinates are ``[0, width] x [0, height]``, one unit equal in x and y."""
    fig = plt.figure(figsize=(width * inches_per_unit, height * inches_per_unit), facecolor="white")
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, width)
    ax.set_ylim(0, height)
    ax.axis("off")
    return fig, ax


def box(ax, cx, cy, w, h, text, color, fontsize=10, weight="normal"):
    ax.add_patch(FancyBboxPatch((cx - w / 2, cy - h / 2), w, h, boxstyle="round,pad=0,rounding_size=0.3",
                                fc=color, ec=EDGE, lw=1.1))
    ax.text(cx, cy, text, ha="center", va="center", fontsize=fontsize, weight=weight, color=TEXT)


def arrow(ax, *points, color=EDGE, lw=1.3):
    """A polyline through ``points`` with an arrowhead at the last one."""
    xs, ys = zip(*points, strict=True)
    ax.plot(xs[:-1], ys[:-1], color=color, lw=lw, solid_capstyle="butt")
    ax.annotate("", xy=points[-1], xytext=points[-2],
                arrowprops={"arrowstyle": "-|>", "color": color, "lw": lw, "shrinkA": 0, "shrinkB": 0,
                            "mutation_scale": 10})


def oplus(ax, cx, cy, r=0.45):
    ax.add_patch(Circle((cx, cy), r, fc="white", ec=EDGE, lw=1.2, zorder=3))
    ax.plot([cx - r, cx + r], [cy, cy], color=EDGE, lw=1.2, zorder=4)
    ax.plot([cx, cx], [cy - r, cy + r], color=EDGE, lw=1.2, zorder=4)


def grid(ax, x0, y_top, colors, cell=1.0, gap=0.0, group=None):
    """Cells ``colors[row][col]`` (None = white), row 0 at the top; a gap after every ``group`` columns."""
    for r, row in enumerate(colors):
        for c, color in enumerate(row):
            x = x0 + c * cell + (gap * (c // group) if group else 0)
            ax.add_patch(Rectangle((x, y_top - (r + 1) * cell), cell, cell, fc=color or "white",
                                   ec="#555555" if color else "#bbbbbb", lw=0.7))


def heads_split_merge():
    T, h, dh = 4, 4, 2
    banded = [[HEADS[c // dh] for c in range(h * dh)] for _ in range(T)]
    fig, ax = canvas(42, 28)
    shape = {"fontsize": 11, "family": "monospace", "ha": "center", "va": "top", "weight": "bold"}
    note = {"fontsize": 10, "ha": "center", "va": "top", "color": "#444444"}
    code = {"fontsize": 9, "ha": "center", "family": "monospace"}
    name = {"fontsize": 11, "ha": "center", "weight": "bold", "color": "#222288"}

    def deck(x0, y_top):  # h stacked (T, d/h) matrices, head 1 in front
        for i in reversed(range(h)):
            grid(ax, x0 + 0.9 * i, y_top + 0.7 * i, [[HEADS[i]] * dh] * T)
        ax.text(x0 + 2.7 + dh + 0.3, y_top + 0.1, "head 4", fontsize=9, va="center")
        ax.text(x0 + dh + 0.3, y_top - T + 0.35, "head 1", fontsize=9, va="center")
        ax.text(x0 + 2.4, y_top - T - 0.6, "(B, h, T, d/h)", **shape)

    # top row, left to right: split_heads
    top = 22.5
    grid(ax, 1, top, banded)
    ax.text(0.5, top - T / 2, "T", ha="center", va="center", fontsize=11, style="italic")
    ax.text(5, top + 0.3, "d = h · d/h", ha="center", va="bottom", fontsize=10)
    ax.text(5, top - T - 0.6, "(B, T, d)", **shape)
    ax.text(5, top - T - 1.8, "queries q = x W_q:\none row per token", **note)
    arrow(ax, (9.5, top - 2), (15.5, top - 2))
    ax.text(12.5, top - 1.7, ".view(B, T, h, d/h)", va="bottom", **code)
    grid(ax, 16, top, banded, gap=0.4, group=dh)
    for i in range(h):
        ax.text(17 + i * 2.4, top + 0.3, f"h{i + 1}", ha="center", va="bottom", fontsize=9, color=HEADS[i])
    ax.text(20.6, top - T - 0.6, "(B, T, h, d/h)", **shape)
    ax.text(20.6, top - T - 1.8, "each row cut into h slices\n(no data moves)", **note)
    arrow(ax, (25.7, top - 2), (30.7, top - 2))
    ax.text(28.2, top - 1.7, ".transpose(1, 2)", va="bottom", **code)
    deck(31.2, top)
    ax.plot([9.5, 9.5, 30.7, 30.7], [top + 1.4, top + 1.7, top + 1.7, top + 1.4], color="#222288", lw=1)
    ax.text(20.1, top + 1.9, "split_heads(q, h)", va="bottom", **name)

    # right column: attention in every head
    box(ax, 33.6, 14.5, 11.6, 2.6, "attention in each head separately\n"
        r"softmax$(Q_i K_i^{\top} / \sqrt{d/h})\,V_i$", ATTN)
    arrow(ax, (33.6, 16.9), (33.6, 15.8))
    ax.text(27.3, 13.6, "weights (B, h, T, T)", ha="right", va="center", fontsize=9, family="monospace")

    # bottom row, right to left: merge_heads and the output projection
    bottom = 9.0
    arrow(ax, (33.6, 13.2), (33.6, bottom + 2.1))
    deck(31.2, bottom)
    arrow(ax, (30.7, bottom - 2), (21.5, bottom - 2))
    ax.text(26.1, bottom - 1.7, ".transpose(1, 2)", va="bottom", **code)
    ax.text(26.1, bottom - 2.3, ".reshape(B, T, d)", va="top", **code)
    ax.text(26.1, bottom - 3.6, "merge_heads", va="top", **name)
    grid(ax, 13, bottom, banded)
    ax.text(17, bottom - T - 0.6, "(B, T, d)", **shape)
    ax.text(17, bottom - T - 1.8, "heads concatenated", **note)
    arrow(ax, (12.5, bottom - 2), (9.5, bottom - 2))
    ax.text(11, bottom - 1.7, "W_o", va="bottom", **code)
    grid(ax, 1, bottom, [["#9a8fb5"] * (h * dh)] * T)
    ax.text(5, bottom - T - 0.6, "(B, T, d)", **shape)
    ax.text(5, bottom - T - 1.8, "out_proj mixes the heads", **note)
    ax.text(21, 27.7, "Multi-head attention: split into h = 4 heads and merge back (K and V are split the same way)",
            ha="center", va="top", fontsize=11)
    return fig


def sublayer_stack(ax, cx, y, sublayers, side, w=9.6):
    """Post-norm sublayers bottom to top from ``y``: each box, residual add, LayerNorm. Returns the top y
    and the centre y of every sublayer box."""
    centres = []
    for text, color in sublayers:
        bh = 2.2
        branch, cy = y + 0.6, y + 0.6 + 0.6 + bh / 2
        arrow(ax, (cx, y), (cx, cy - bh / 2))
        box(ax, cx, cy, w, bh, text, color)
        centres.append(cy)
        add = cy + bh / 2 + 1.2
        arrow(ax, (cx, cy + bh / 2), (cx, add - 0.45))
        side_x = cx + side * (w / 2 + 0.9)
        arrow(ax, (cx, branch), (side_x, branch), (side_x, add), (cx + side * 0.45, add))
        oplus(ax, cx, add)
        norm = add + 1.6
        arrow(ax, (cx, add + 0.45), (cx, norm - 0.45))
        box(ax, cx, norm, w, 0.9, "LayerNorm", NORM)
        y = norm + 0.45
    return y, centres


def blocks_encoder_decoder():
    fig, ax = canvas(42, 28)
    enc, dec = 6.5, 21
    ax.text(enc, 27.5, "Encoder block × N", ha="center", va="top", fontsize=12, weight="bold")
    ax.text(dec, 27.5, "Decoder block × N", ha="center", va="top", fontsize=12, weight="bold")
    ax.text(enc, 0.3, "source (B, S, d)\nembeddings + positions", ha="center", va="bottom", fontsize=10)
    ax.text(dec, 0.3, "target (B, T, d)\nembeddings + positions", ha="center", va="bottom", fontsize=10)
    top_e, _ = sublayer_stack(ax, enc, 2.2, [("Multi-head\nself-attention", ATTN),
                                             ("Feed-forward network\nd → 4d → d", FFN)], side=-1)
    top_d, (_, cross, _) = sublayer_stack(ax, dec, 2.2, [
        ("Masked multi-head\nself-attention (causal)", ATTN),
        ("Multi-head cross-attention\nQ from x; K, V from memory", CROSS),
        ("Feed-forward network\nd → 4d → d", FFN)], side=1)
    for cx, top in ((enc, top_e), (dec, top_d)):  # the dashed outline of one block
        ax.add_patch(FancyBboxPatch((cx - 6.3, 2.4), 12.6, top - 2.0, boxstyle="round,pad=0,rounding_size=0.5",
                                    fc="#f7f7f7", ec="#999999", lw=1, ls="--", zorder=0))
    memory = top_e + 2.2
    arrow(ax, (enc, top_e), (enc, memory - 0.2))
    ax.text(enc, memory, "memory (B, S, d)", ha="center", va="bottom", fontsize=10, weight="bold")
    arrow(ax, (enc + 3.6, memory + 0.35), (14, memory + 0.35), (14, cross), (dec - 4.8, cross), color="#2a7a2a")
    arrow(ax, (dec, top_d), (dec, top_d + 1.6))
    ax.text(dec, top_d + 1.8, "(B, T, d) → next block", ha="center", va="bottom", fontsize=10)

    # right: one sublayer, post-norm (drawn left) and pre-norm
    ax.text(35.5, 27.5, "One sublayer F", ha="center", va="top", fontsize=12, weight="bold")
    for cx, title, formula, order in ((32, 'norm="post"', "x ← LN(x + F(x))", "post"),
                                      (39, 'norm="pre"', "x ← x + F(LN(x))", "pre")):
        ax.text(cx, 25.3, title, ha="center", va="top", fontsize=10, family="monospace", weight="bold")
        ax.text(cx, 24.1, formula, ha="center", va="top", fontsize=10)
        y = 12.5
        ax.text(cx, y - 0.3, "x", ha="center", va="top", fontsize=10, style="italic")
        branch = y + 0.8
        if order == "pre":
            arrow(ax, (cx, y), (cx, 14.4 - 0.45))
            box(ax, cx, 14.4, 4.4, 0.9, "LayerNorm", NORM)
            arrow(ax, (cx, 14.85), (cx, 16.4))
        else:
            arrow(ax, (cx, y), (cx, 16.4))
        box(ax, cx, 17.5, 4.4, 2.2, "F: attention\nor FFN", ATTN)
        arrow(ax, (cx, 18.6), (cx, 19.8 - 0.45))
        arrow(ax, (cx, branch), (cx + 2.9, branch), (cx + 2.9, 19.8), (cx + 0.45, 19.8))
        oplus(ax, cx, 19.8)
        if order == "post":
            arrow(ax, (cx, 20.25), (cx, 21.7 - 0.45))
            box(ax, cx, 21.7, 4.4, 0.9, "LayerNorm", NORM)
            arrow(ax, (cx, 22.15), (cx, 23.0))
        else:
            arrow(ax, (cx, 20.25), (cx, 23.0))
    ax.text(35.5, 10.6, "Post-norm (drawn in the blocks):\nthe original Transformer.\n"
            "Pre-norm: LayerNorm moves into\nthe branch, the residual path is\nan identity (GPT-2, ViT, Whisper);\n"
            "a pre-norm stack ends with\none final LayerNorm.", ha="center", va="top", fontsize=9.5,
            linespacing=1.35)
    return fig


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    for name, draw in (("heads_split_merge", heads_split_merge), ("blocks_encoder_decoder", blocks_encoder_decoder)):
        fig = draw()
        fig.savefig(OUT / f"{name}.svg", format="svg", facecolor="white", metadata={"Date": None, "Creator": None})
        plt.close(fig)
        print(OUT / f"{name}.svg")


if __name__ == "__main__":
    main()

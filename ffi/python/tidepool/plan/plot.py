"""The picture `python -m tidepool.plan --plot OUT.svg` draws: for each
variant, live memory by category over its recorded steps (stacked:
weights, gradients, optimizer, precision copies, activations) with the smallest device each
allocator needs; below, those devices side by side for every variant."""
from xml.sax.saxutils import escape

from .._units import gib

COLOURS = {"weights": "#4e79a7", "gradients": "#f28e2b", "optimizer": "#e15759", "copies": "#edc948",
           "activations": "#76b7b2"}
PYTORCH, TIDEPOOL = "#b07aa1", "#59a14f"
WIDTH, LEFT, RIGHT, PANEL, GAP = 960, 230, 20, 110, 18


def write_svg(path, model, timelines, results):
    """timelines: [(label, [(event, {category: bytes})])] of the variants
    that recorded; results: every variant's row (with pytorch/tidepool_expandable
    figures or an error)."""
    ok = [r for r in results if "error" not in r]
    labels = {id(r): (" ".join(f"{k}={v}" for k, v in r["label"].items()) or "the model") for r in results}
    top = max([max((sum(v.values()) for _, v in points), default=0) for _, points in timelines] +
              [max(r["pytorch"], r["tidepool_expandable"]) for r in ok] + [1])
    plot_w = WIDTH - LEFT - RIGHT
    bars_h = 40 + 22 * len(results)
    height = 60 + len(timelines) * (PANEL + GAP) + bars_h + 40
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
           f'font-family="sans-serif" font-size="12">',
           f'<rect width="{WIDTH}" height="{height}" fill="white"/>',
           f'<text x="{LEFT}" y="22" font-size="15">{escape(model)}: live memory by category over the '
           f'recorded steps, and the smallest device</text>']
    x = LEFT
    for name, colour in list(COLOURS.items()) + [("PyTorch needs", PYTORCH), ("tidepool needs", TIDEPOOL)]:
        out.append(f'<rect x="{x}" y="32" width="12" height="12" fill="{colour}"/>'
                   f'<text x="{x + 16}" y="43">{escape(name)}</text>')
        x += 22 + 7 * len(name)
    y0 = 60
    by_label = {labels[id(r)]: r for r in results}
    for label, points in timelines:
        base = y0 + PANEL
        scale = PANEL / top
        last = max(points[-1][0], 1) if points else 1
        below = [0.0] * len(points)
        for category, colour in COLOURS.items():
            upper = [below[i] + points[i][1][category] for i in range(len(points))]
            xs = [LEFT + plot_w * p[0] / last for p in points]
            shape = [f"{xs[i]:.1f},{base - upper[i] * scale:.1f}" for i in range(len(points))]
            shape += [f"{xs[i]:.1f},{base - below[i] * scale:.1f}" for i in reversed(range(len(points)))]
            if shape:
                out.append(f'<polygon points="{" ".join(shape)}" fill="{colour}" fill-opacity="0.85"/>')
            below = upper
        r = by_label.get(label)
        if r is not None and "error" not in r:
            for value, colour in ((r["pytorch"], PYTORCH), (r["tidepool_expandable"], TIDEPOOL)):
                y = base - value * scale
                out.append(f'<line x1="{LEFT}" x2="{LEFT + plot_w}" y1="{y:.1f}" y2="{y:.1f}" stroke="{colour}" '
                           f'stroke-dasharray="5,3"/>')
            out.append(f'<text x="{LEFT - 8}" y="{base - PANEL / 2 + 14}" text-anchor="end">peak '
                       f'{gib(r["peak"])}</text>')
        out.append(f'<text x="{LEFT - 8}" y="{base - PANEL / 2}" text-anchor="end">{escape(label)}</text>')
        out.append(f'<line x1="{LEFT}" x2="{LEFT + plot_w}" y1="{base}" y2="{base}" stroke="#333"/>')
        y0 += PANEL + GAP
    out.append(f'<text x="{LEFT}" y="{y0 + 16}" font-size="14">smallest device per variant</text>')
    y = y0 + 30
    for r in results:
        out.append(f'<text x="{LEFT - 8}" y="{y + 13}" text-anchor="end">{escape(labels[id(r)])}</text>')
        if "error" in r:
            out.append(f'<text x="{LEFT}" y="{y + 13}" fill="#a00">failed: {escape(r["error"][:90])}</text>')
        else:
            for i, (value, colour) in enumerate(((r["pytorch"], PYTORCH), (r["tidepool_expandable"], TIDEPOOL))):
                w = plot_w * 0.8 * value / top
                out.append(f'<rect x="{LEFT}" y="{y + 9 * i}" width="{w:.1f}" height="8" fill="{colour}"/>')
            out.append(f'<text x="{LEFT + plot_w * 0.8 * max(r["pytorch"], r["tidepool_expandable"]) / top + 6:.1f}" '
                       f'y="{y + 13}">{gib(r["pytorch"])} / {gib(r["tidepool_expandable"])}</text>')
        y += 22
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")

"""``hvdtrain plan --html``: one self-contained page (inline SVG and one inline script, nothing
fetched) with the predicted scaling curves per setting and the time-line of one step of each
setting. The script measures the drawn curves once the browser has laid them out and says how
many have a length (``#rendered``): what the browser test reads back."""

from __future__ import annotations

import html
from pathlib import Path

from hvdtrain.plan.predict import Plan, Prediction
from hvdtrain.plan.render import table

COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
           "#7f7f7f", "#bcbd22", "#17becf")
LANES = {"compute": "#4c78a8", "comm": "#f58518", "bubble": "#bbbbbb"}
W, H, PAD = 720, 380, 50
CHECK = ("(function(){var c=document.querySelectorAll('polyline.curve'),n=0;"
         "for(var i=0;i<c.length;i++){if(c[i].getTotalLength()>0){n++;}}"
         "document.getElementById('rendered').textContent='curves drawn: '+n+' of '+c.length;})();")
"""The page's one script: counts the curves the browser drew with a non-zero length."""


def _esc(text: str) -> str:
    return html.escape(text, quote=True)


def curves_svg(result: Plan) -> str:
    """Samples/s against nodes, one polyline per setting (``class="curve"``, ``data-setting``)."""
    preds = [p for p in result.predictions if p.best is not None]
    top = max((pt.samples_per_s or 0) for p in preds for pt in p.points) if preds else 1.0
    nodes = result.cluster.nodes

    def xy(n: int, v: float) -> str:
        x = PAD + (W - 2 * PAD) * ((n - 1) / max(1, nodes - 1))
        y = H - PAD - (H - 2 * PAD) * v / (top or 1.0)
        return f"{x:.1f},{y:.1f}"
    out = [f'<svg id="curves" xmlns="http://www.w3.org/2000/svg" width="{W + 260}" height="{H}">',
           f'<line x1="{PAD}" y1="{H - PAD}" x2="{W - PAD}" y2="{H - PAD}" stroke="black"/>',
           f'<line x1="{PAD}" y1="{PAD}" x2="{PAD}" y2="{H - PAD}" stroke="black"/>',
           f'<text x="{W / 2}" y="{H - 12}" text-anchor="middle">nodes (1 to {nodes})</text>',
           f'<text x="12" y="{PAD - 12}">samples/s (max {top:.0f})</text>']
    for i, pred in enumerate(preds):
        colour = COLOURS[i % len(COLOURS)]
        pts = " ".join(xy(p.nodes, p.samples_per_s or 0) for p in pred.points
                       if p.samples_per_s is not None)
        out.append(f'<polyline class="curve" data-setting="{_esc(pred.setting)}" fill="none" '
                   f'stroke="{colour}" stroke-width="2" points="{pts}"/>')
        out.append(f'<text x="{W - 20}" y="{PAD + 16 * i}" fill="{colour}" font-size="12">'
                   f'{_esc(pred.setting)}</text>')
    out.append("</svg>")
    return "\n".join(out)


def timeline_svg(pred: Prediction) -> str:
    """One step of ``pred`` at its most nodes: a lane each for compute, communication, bubble."""
    segs = pred.timeline
    end = max((s.end_s for s in segs), default=1.0) or 1.0
    lanes = [lane for lane in LANES if any(s.lane == lane for s in segs)]
    height = 30 * len(lanes) + 30
    out = [f'<svg class="timeline" data-setting="{_esc(pred.setting)}" '
           f'xmlns="http://www.w3.org/2000/svg" width="{W + 100}" height="{height}">']
    for row, lane in enumerate(lanes):
        y = 10 + 30 * row
        out.append(f'<text x="0" y="{y + 15}" font-size="12">{lane}</text>')
        for s in segs:
            if s.lane != lane:
                continue
            x = 90 + W * s.start_s / end
            w = max(0.5, W * (s.end_s - s.start_s) / end)
            out.append(f'<rect class="segment {lane}" x="{x:.1f}" y="{y}" width="{w:.1f}" '
                       f'height="20" fill="{LANES[lane]}" stroke="white" stroke-width="0.5">'
                       f'<title>{_esc(s.label)}: {1e3 * s.start_s:.2f}-{1e3 * s.end_s:.2f} ms'
                       '</title></rect>')
    out.append(f'<text x="90" y="{height - 4}" font-size="11">0 ms</text>'
               f'<text x="{90 + W}" y="{height - 4}" font-size="11" text-anchor="end">'
               f'{1e3 * end:.2f} ms</text></svg>')
    return "\n".join(out)


def page(result: Plan) -> str:
    """The whole page."""
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>hvdtrain plan: "
             f"{_esc(result.model)}</title><style>body{{font-family:sans-serif;margin:2em}}"
             "pre{font-size:12px}</style></head><body>",
             f"<h1>hvdtrain plan: {_esc(result.model)}</h1>",
             "<h2>Scaling</h2>", curves_svg(result),
             "<h2>Ranking</h2>", f"<pre>{_esc(table(result))}</pre>",
             "<h2>One step of each setting, at its most nodes</h2>"]
    for pred in result.predictions:
        best = pred.best
        if best is None:
            continue
        parts.append(f"<h3>{_esc(pred.setting)}: {best.nodes} node(s), "
                     f"{1e3 * (best.step_s or 0):.2f} ms</h3>")
        parts.append(timeline_svg(pred))
    parts.append(f"<p id='rendered'></p><script>{CHECK}</script></body></html>")
    return "\n".join(parts)


def write_html(result: Plan, path: str | Path) -> None:
    """Writes :func:`page` to ``path``."""
    Path(path).write_text(page(result))

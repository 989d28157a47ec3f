"""Charts drawn on the server as SVG: a line per series over rounds, with its axes' ranges labeled. Every
label is escaped (peer ids and units come from other peers' records)."""

from __future__ import annotations

from html import escape

WIDTH, HEIGHT = 560, 220
LEFT, RIGHT, TOP, BOTTOM = 64, 16, 28, 30  # margins
LEGEND_STEP = 110  # between the series' names, centered under the chart
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd")

Series = dict[str, list[tuple[float, float | None]]]  # name -> (x, y) points; y None: no value there


def line_chart(title: str, series: Series, unit: str = "") -> str:
    """An SVG chart of ``series`` (a gap where a value is None); 'no data yet' when there is none."""
    points = {name: [(x, y) for x, y in pts if y is not None] for name, pts in series.items()}
    every = [p for pts in points.values() for p in pts]
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" '
        f'aria-label="{escape(title)}">',
        f'<text x="{LEFT}" y="18" font-size="13" font-weight="bold">{escape(title)}</text>',
    ]
    if not every:
        parts.append(
            f'<text x="{WIDTH // 2}" y="{HEIGHT // 2}" text-anchor="middle">no data yet</text></svg>'
        )
        return "".join(parts)
    xs, ys = [x for x, _ in every], [y for _, y in every]
    x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    y0, y1 = min(ys), max(ys) if max(ys) > min(ys) else min(ys) + 1
    w, h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def at(x: float, y: float) -> str:
        return f"{LEFT + _share(x, x0, x1) * w:.1f},{TOP + (1 - _share(y, y0, y1)) * h:.1f}"

    parts += [
        f'<rect x="{LEFT}" y="{TOP}" width="{w}" height="{h}" fill="none" stroke="#bbb"/>',
        _label(LEFT - 6, TOP + 10, _number(y1, unit), "end"),
        _label(LEFT - 6, TOP + h, _number(y0, unit), "end"),
        _label(LEFT, HEIGHT - 10, f"round {x0:g}", "start"),
        _label(LEFT + w, HEIGHT - 10, f"round {x1:g}", "end"),
    ]
    for i, (name, pts) in enumerate(points.items()):
        color = COLORS[i % len(COLORS)]
        if len(pts) == 1:
            x, y = at(*pts[0]).split(",")
            parts.append(f'<circle class="series" cx="{x}" cy="{y}" r="3" fill="{color}"/>')
        elif pts:
            line = " ".join(at(x, y) for x, y in pts)
            parts.append(
                f'<polyline class="series" points="{line}" fill="none" stroke="{color}" stroke-width="2"/>'
            )
        middle = LEFT + w / 2 + (i - (len(points) - 1) / 2) * LEGEND_STEP
        parts.append(_label(middle, HEIGHT - 10, f"— {name}", "middle", color))
    parts.append("</svg>")
    return "".join(parts)


def _share(value: float, low: float, high: float) -> float:
    """Where ``value`` lies between ``low`` and ``high`` (0 to 1), in halves: the difference of two finite
    floats a peer wrote can overflow."""
    return (value / 2 - low / 2) / (high / 2 - low / 2)


def _label(x: float, y: float, text: str, anchor: str, color: str = "#444") -> str:
    return f'<text x="{x}" y="{y}" font-size="11" fill="{color}" text-anchor="{anchor}">{escape(text)}</text>'


def _number(value: float, unit: str) -> str:
    if unit == "B":
        for factor, suffix in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
            if abs(value) >= factor:
                return f"{value / factor:.1f} {suffix}"
        return f"{value:.0f} B"
    return f"{value:.3g}"

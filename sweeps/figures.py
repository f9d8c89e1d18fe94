"""Saving figures the same way from every notebook: PNG (vl-convert, offline) and self-contained HTML.

altair's default HTML loads JavaScript from a CDN, which an offline machine cannot reach, so HTML is written
with `inline=True`; PNG needs `vl-convert-python` (installed with the `notebooks`/`dev` extras).
"""

from __future__ import annotations

from pathlib import Path


def save_chart(chart, out_dir: str | Path, name: str, scale: float = 2.0) -> dict[str, Path]:
    """Write `out_dir/name.png` and `out_dir/name.html`; returns both paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    png, html = out / f"{name}.png", out / f"{name}.html"
    chart.save(str(png), scale_factor=scale)
    chart.save(str(html), inline=True)
    return {"png": png, "html": html}


def line_chart(frame, x: str, y: str, color: str | None = None, *, title: str = "", x_title: str | None = None,
               y_title: str | None = None, log_x: bool = True, unit_y: bool = True, facet: str | None = None,
               tooltip=(), width: int = 360, height: int = 240):
    """The one line-with-points chart the notebooks draw: x on a log2 axis (window and vocabulary sizes),
    y in [0, 1] (coverage, miss ratio) unless `unit_y=False`, one line per `color`, optionally faceted."""
    import altair as alt

    enc = dict(
        x=alt.X(f"{x}:Q", title=x_title or x, scale=alt.Scale(type="log", base=2) if log_x else alt.Undefined),
        y=alt.Y(f"{y}:Q", title=y_title or y, scale=alt.Scale(domain=[0, 1]) if unit_y else alt.Undefined),
    )
    if color is not None:
        enc.update(color=f"{color}:N", strokeDash=f"{color}:N" if facet else alt.Undefined)
    if facet is not None:
        enc["facet"] = alt.Facet(f"{facet}:N", columns=4)
    if tooltip:
        enc["tooltip"] = list(tooltip)
    return alt.Chart(frame).mark_line(point=True).encode(**enc).properties(title=title, width=width, height=height)


def bar_chart(frame, x: str, y: str, color: str, *, title: str = "", y_title: str | None = None,
              stack: bool = False, rule: float | None = None, tooltip=(), width: int = 480, height: int = 220):
    """Bars of `y` per `x`, one bar per `color` side by side (`stack=False`: the runs of a bench per
    category) or stacked (`stack=True`: phases of a step); `rule` draws a horizontal reference line
    (e.g. speedup 1.0 = ar)."""
    import altair as alt

    enc = dict(x=alt.X(f"{x}:N", title=x), y=alt.Y(f"{y}:Q", title=y_title or y, stack=True if stack else None),
               color=f"{color}:N")
    if not stack:
        enc["xOffset"] = f"{color}:N"
    if tooltip:
        enc["tooltip"] = list(tooltip)
    chart = alt.Chart(frame).mark_bar().encode(**enc).properties(title=title, width=width, height=height)
    if rule is not None:
        chart = chart + alt.Chart(alt.Data(values=[{"y": rule}])).mark_rule(strokeDash=[4, 3]).encode(y="y:Q")
    return chart

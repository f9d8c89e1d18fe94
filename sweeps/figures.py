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

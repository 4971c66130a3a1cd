"""``report.html`` of a discover run: report.md and its figures as one self-contained page, with an
interactive layer × head grid.

The page loads nothing: its styles (``templates/report.css``), its script (``templates/report.js``),
its data (JSON in a ``<script type="application/json">``) and its images (PNG data URIs) are all in
the file, so it opens from a laptop's disk, a mail attachment or an air-gapped machine alike. Links
to the web in the text stay readable but are not links. The text is report.md rendered (Python-Markdown,
with its tables); each figure it shows is embedded where it stands, and the run's other figures
after it.

A run's size must not decide the page's: every image is downscaled to at most `MAX_SIDE` pixels and
embedded only while the page's image bytes stay under `IMAGE_BUDGET` (and at most `MAX_IMAGES` images);
the attention images of at most `MAX_IMAGE_HEADS` heads (the most important) are asked for, at most
`MAX_IMAGES_PER_HEAD` each. What is left out is named on the page, so a reader knows to open it
beside the file. The per-head data (`countlens.pipeline.head_panels`) is small: a few hundred bytes a head.
"""

from __future__ import annotations

import base64
import io
import json
import re
from pathlib import Path

import markdown
from jinja2 import Environment, FileSystemLoader, StrictUndefined, select_autoescape
from markupsafe import Markup
from PIL import Image

from countlens.pipeline import head_panels
from countlens.pipeline.stages.base import ReportContext

TEMPLATES = Path(__file__).parent / "templates"
#: The longest side of an embedded image, in pixels (larger ones are downscaled, aspect kept).
MAX_SIDE = 1200
#: At most this many images on a page, and at most this many bytes of them (before base64).
MAX_IMAGES = 40
IMAGE_BUDGET = 3_500_000
#: Attention images: of the this many most important heads, this many each.
MAX_IMAGE_HEADS = 32
MAX_IMAGES_PER_HEAD = 4

_PAGE = Environment(
    loader=FileSystemLoader(TEMPLATES),
    autoescape=select_autoescape(["j2"]),
    undefined=StrictUndefined,
    keep_trailing_newline=True,
)
_IMG = re.compile(r'<img alt="([^"]*)" src="(figures/[^"]+)" */?>')
_WEB_LINK = re.compile(r'<a href="(https?://[^"]*)"[^>]*>(.*?)</a>', re.S)


class Images:
    """Embeds PNGs as data URIs, downscaled, until the page's count or byte budget is spent."""

    def __init__(self, max_images: int = MAX_IMAGES, budget: int = IMAGE_BUDGET):
        self.left, self.budget = max_images, budget
        self.skipped: list[str] = []

    def uri(self, data: bytes, name: str) -> str | None:
        """``data`` (an image file's bytes) as a PNG data URI, or None (recorded in ``skipped``) when
        the page has no room left for it."""
        image = Image.open(io.BytesIO(data))
        if max(image.size) > MAX_SIDE:
            image.thumbnail((MAX_SIDE, MAX_SIDE))
            buf = io.BytesIO()
            image.save(buf, format="PNG", optimize=True)
            data = buf.getvalue()
        elif image.format != "PNG":
            buf = io.BytesIO()
            image.save(buf, format="PNG")
            data = buf.getvalue()
        if self.left <= 0 or len(data) > self.budget:
            self.skipped.append(name)
            return None
        self.left -= 1
        self.budget -= len(data)
        return "data:image/png;base64," + base64.b64encode(data).decode("ascii")


def _body(text: str, figures: Path, images: Images) -> tuple[str, set[str]]:
    """report.md as HTML, its figures embedded; also the figure files it showed."""
    html = markdown.markdown(text, extensions=["tables", "fenced_code", "toc"])
    shown: set[str] = set()

    def embed(m: re.Match) -> str:
        alt, src = m.group(1), m.group(2)
        path = figures.parent / src
        shown.add(path.name)
        uri = path.exists() and images.uri(path.read_bytes(), src)
        if not uri:
            return f'<span class="missing">[{alt}: {src} is not embedded; open it beside report.html]</span>'
        return f'<img alt="{alt}" src="{uri}">'

    html = _IMG.sub(embed, html)
    # A page that loads nothing links nowhere either: the address stays, as text.
    html = _WEB_LINK.sub(lambda m: f'{m.group(2)} <span class="url">({m.group(1)})</span>', html)
    return html, shown


def _json(value) -> Markup:
    """JSON for a ``<script type="application/json">``: ``</`` escaped so no string can close the tag."""
    return Markup(json.dumps(value, ensure_ascii=False, allow_nan=False).replace("</", "<\\/"))


def _embed_head_images(ctx: ReportContext, heads: dict, images: Images) -> None:
    """Each panel's attention images (`head_panels.head_images`) as (caption, data URI), asked for the
    `MAX_IMAGE_HEADS` most important heads only; ``images_left_out``: the head had more than it shows."""
    maps = ctx.results.get("attention_maps")  # loaded with the run's results: read once, not per head
    order = sorted(heads.values(), key=lambda h: -(dict(h["numbers"]).get("importance") or 0.0))
    for rank, head in enumerate(order):
        head["images"], head["images_left_out"] = [], False
        if rank >= MAX_IMAGE_HEADS:
            continue
        raw = head_panels.head_images(maps, head["layer"], head["head"])
        for caption, data in raw[:MAX_IMAGES_PER_HEAD]:
            uri = images.uri(data, f"{head['id']}: {caption}")
            if uri:
                head["images"].append([caption, uri])
        head["images_left_out"] = len(head["images"]) < len(raw)


def render_html(ctx: ReportContext, text: str) -> str:
    """The page for the run in ``ctx`` whose report.md is ``text``."""
    images = Images()
    body, shown = _body(text, ctx.figures, images)
    others = []
    for path in sorted(ctx.figures.glob("*.png")) if ctx.figures.is_dir() else []:
        if path.name not in shown:
            uri = images.uri(path.read_bytes(), f"figures/{path.name}")
            if uri:
                others.append((path.stem, uri))
    data = head_panels.head_data(ctx)
    data["image_heads"] = MAX_IMAGE_HEADS
    _embed_head_images(ctx, data["heads"], images)
    # The explorer goes under the report's title and header, before its numbered sections.
    cut = body.find("<h2") if "<h2" in body else len(body)
    return _PAGE.get_template("report.html.j2").render(
        title=f"countlens: {ctx.model} ({ctx.arch})",
        header=Markup(body[:cut]),
        body=Markup(body[cut:]),
        others=others,
        skipped=images.skipped,
        data=_json(data),
        css=Markup((TEMPLATES / "report.css").read_text()),
        js=Markup((TEMPLATES / "report.js").read_text()),
    )


def write_html(ctx: ReportContext, text: str) -> Path:
    """Write ``report.html`` beside report.md (whose text is ``text``); returns its path."""
    path = ctx.out / "report.html"
    path.write_text(render_html(ctx, text), encoding="utf-8")
    return path

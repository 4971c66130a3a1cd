"""``report.html`` of a discover run: report.md and its figures as one self-contained page, with an
interactive layer × head grid.

The page loads nothing (`countlens.html_page`): its styles (``templates/report.css``), its script
(``templates/report.js``), its data (JSON in a ``<script type="application/json">``) and its images
(PNG data URIs) are all in the file, so it opens from a laptop's disk, a mail attachment or an
air-gapped machine alike. The text is report.md rendered (Python-Markdown, with its tables); each
figure it shows is embedded where it stands, and the run's other figures after it.

A run's size must not decide the page's: images are downscaled and budgeted (`countlens.html_page`),
and the attention images of at most `MAX_IMAGE_HEADS` heads (the most important) are asked for, at
most `MAX_IMAGES_PER_HEAD` each — counted apart from the figures, within the same byte budget. What
is left out is named on the page, so a reader knows to open it beside the file. The per-head data
(`countlens.pipeline.head_panels`) is small: a few hundred bytes a head.
"""

from __future__ import annotations

from pathlib import Path

from jinja2 import Environment, FileSystemLoader, StrictUndefined, select_autoescape
from markupsafe import Markup

from countlens.html_page import BASE_CSS, Images, json_script, markdown_body
from countlens.pipeline import head_panels
from countlens.pipeline.stages.base import ReportContext

TEMPLATES = Path(__file__).parent / "templates"
#: Attention images: of the this many most important heads, this many each.
MAX_IMAGE_HEADS = 32
MAX_IMAGES_PER_HEAD = 4

_PAGE = Environment(
    loader=FileSystemLoader(TEMPLATES),
    autoescape=select_autoescape(["j2"]),
    undefined=StrictUndefined,
    keep_trailing_newline=True,
)


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
    body, shown = markdown_body(text, ctx.figures.parent, images, "report.html")
    others = []
    for path in sorted(ctx.figures.glob("*.png")) if ctx.figures.is_dir() else []:
        if path.name not in shown:
            uri = images.uri(path.read_bytes(), f"figures/{path.name}")
            if uri:
                others.append((path.stem, uri))
    data = head_panels.head_data(ctx)
    data["image_heads"] = MAX_IMAGE_HEADS
    # The heads' images are counted apart from the figures, so that a run's many figures cannot leave
    # every panel without its attention images; the byte budget stays one for the page.
    images.left = MAX_IMAGE_HEADS * MAX_IMAGES_PER_HEAD
    _embed_head_images(ctx, data["heads"], images)
    # The explorer goes under the report's title and header, before its numbered sections.
    cut = body.find("<h2") if "<h2" in body else len(body)
    return _PAGE.get_template("report.html.j2").render(
        title=f"countlens: {ctx.model} ({ctx.arch})",
        header=Markup(body[:cut]),
        body=Markup(body[cut:]),
        others=others,
        skipped=images.skipped,
        data=json_script(data),
        css=Markup(BASE_CSS + (TEMPLATES / "report.css").read_text()),
        js=Markup((TEMPLATES / "report.js").read_text()),
    )


def write_html(ctx: ReportContext, text: str) -> Path:
    """Write ``report.html`` beside report.md (whose text is ``text``); returns its path."""
    path = ctx.out / "report.html"
    path.write_text(render_html(ctx, text), encoding="utf-8")
    return path

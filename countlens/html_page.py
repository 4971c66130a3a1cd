"""Self-contained HTML pages from Markdown: what ``report.html`` (`countlens.pipeline.html_report`)
and ``compare.html`` (`countlens.analysis.compare`) share.

A page loads nothing: its styles, data and images are in the file, so it opens from a laptop's
disk, a mail attachment or an air-gapped machine alike. `markdown_body` renders Markdown (with its
tables) and embeds each figure it links (``figures/…png``) as a PNG data URI; links to the web stay
readable as text but are not links. `Images` keeps a page's size bounded: every image is downscaled
to at most `MAX_SIDE` pixels and embedded only while the page's image bytes stay under
`IMAGE_BUDGET` (and at most `MAX_IMAGES` images); what is left out is named on the page.
"""

from __future__ import annotations

import base64
import io
import json
import re
from pathlib import Path

from markupsafe import Markup

#: The longest side of an embedded image, in pixels (larger ones are downscaled, aspect kept).
MAX_SIDE = 1200
#: At most this many images on a page, and at most this many bytes of them (before base64).
MAX_IMAGES = 40
IMAGE_BUDGET = 3_500_000

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
        from PIL import Image

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


def markdown_body(text: str, base: Path, images: Images, page: str) -> tuple[str, set[str]]:
    """Markdown ``text`` as HTML, each ``figures/…`` image it shows embedded from ``base`` (the folder
    the Markdown file sits in); also the names of the figure files it showed. ``page``: the page's
    file name, for the note on a figure left out."""
    import markdown

    html = markdown.markdown(text, extensions=["tables", "fenced_code", "toc"])
    shown: set[str] = set()

    def embed(m: re.Match) -> str:
        alt, src = m.group(1), m.group(2)
        path = base / src
        shown.add(path.name)
        uri = path.exists() and images.uri(path.read_bytes(), src)
        if not uri:
            return f'<span class="missing">[{alt}: {src} is not embedded; open it beside {page}]</span>'
        return f'<img alt="{alt}" src="{uri}">'

    html = _IMG.sub(embed, html)
    # A page that loads nothing links nowhere either: the address stays, as text.
    html = _WEB_LINK.sub(lambda m: f'{m.group(2)} <span class="url">({m.group(1)})</span>', html)
    return html, shown


def json_script(value) -> Markup:
    """JSON for a ``<script type="application/json">``: ``</`` escaped so no string can close the tag."""
    return Markup(json.dumps(value, ensure_ascii=False, allow_nan=False).replace("</", "<\\/"))


#: The styles every page shares (report.html adds its own after them: ``templates/report.css``).
BASE_CSS = """\
body { font: 15px/1.5 system-ui, sans-serif; color: #1d2430; margin: 0; background: #fff; }
main { max-width: 1200px; margin: 0 auto; padding: 1rem 1.5rem 4rem; }
h1 { font-size: 1.6rem; } h2 { font-size: 1.3rem; border-bottom: 1px solid #dde; padding-bottom: .2rem; }
code { background: #f3f4f7; padding: 0 .2em; border-radius: 3px; }
table { border-collapse: collapse; margin: .5rem 0; font-size: 13px; }
th, td { border: 1px solid #dde; padding: 2px 6px; text-align: right; }
"""
#: A plain page's (`standalone_page`): wide tables scroll, the label column reads left, images fit.
PAGE_CSS = (
    BASE_CSS
    + """\
main { overflow-x: auto; }
th:first-child, td:first-child { text-align: left; }
img { max-width: 100%; height: auto; }
.missing, .url { color: #667; font-size: 13px; }
"""
)


def standalone_page(title: str, markdown_text: str, base: Path, page: str) -> str:
    """A whole page that loads nothing: ``markdown_text`` rendered, its ``figures/…`` images (read from
    ``base``) embedded within the `Images` budget, and a line naming any left out. ``page``: the
    page's file name (what a reader opens beside the figures left out)."""
    from html import escape

    images = Images()
    body, _ = markdown_body(markdown_text, base, images, page)
    skipped = ""
    if images.skipped:
        names = escape(", ".join(images.skipped))
        skipped = f'<p class="missing">Not embedded (the image budget is spent; open them beside {page}): {names}.</p>'
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>{escape(title)}</title>\n<style>\n{PAGE_CSS}</style>\n</head>\n<body>\n<main>\n"
        f"{body}\n{skipped}\n</main>\n</body>\n</html>\n"
    )

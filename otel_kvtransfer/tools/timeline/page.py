"""The HTML page: the overview and every request block as inline SVG, paged and filtered by the page's one
static script. Every value from the span file passes `_esc` on its way into text or an attribute; the page loads
nothing from the network, and its Content-Security-Policy runs no script but its own (by hash)."""

from __future__ import annotations

import base64
import hashlib
import html
from typing import Optional, Sequence

from otel_kvtransfer.tools.requests import Request
from otel_kvtransfer.tools.timeline.block import layout_request
from otel_kvtransfer.tools.timeline.drawing import Circle, Line, Panel, Rect, Text
from otel_kvtransfer.tools.timeline.overview import layout_overview


def _esc(value) -> str:
    """Every value written into the page, text or attribute, goes through here."""
    return html.escape(str(value), quote=True)


def _num(value: float) -> str:
    return f"{value:.1f}".rstrip("0").rstrip(".")


def _svg(panel: Panel) -> str:
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{panel.width}" height="{panel.height}" '
           f'viewBox="0 0 {panel.width} {panel.height}" class="panel {_esc(panel.cls)}">']
    for op in panel.ops:
        if isinstance(op, Rect):
            extra = "".join(f' data-{_esc(k)}="{_esc(v)}"' for k, v in op.data.items() if v is not None)
            stroke = f' stroke="{_esc(op.stroke)}" stroke-width="2"' if op.stroke else ""
            cls = f' class="{_esc(op.cls)}"' if op.cls else ""
            title = f"<title>{_esc(op.title)}</title>" if op.title else ""
            out.append(f'<rect x="{_num(op.x)}" y="{_num(op.y)}" width="{_num(op.w)}" height="{_num(op.h)}" '
                       f'fill="{_esc(op.fill)}"{stroke}{cls}{extra} rx="2">{title}</rect>')
        elif isinstance(op, Text):
            weight = ' font-weight="bold"' if op.bold else ""
            cls = f' class="{_esc(op.cls)}"' if op.cls else ""
            out.append(f'<text x="{_num(op.x)}" y="{_num(op.y)}" font-size="{op.size}" fill="{_esc(op.color)}" '
                       f'text-anchor="{_esc(op.anchor)}"{weight}{cls}>{_esc(op.text)}</text>')
        elif isinstance(op, Line):
            out.append(f'<line x1="{_num(op.x1)}" y1="{_num(op.y1)}" x2="{_num(op.x2)}" y2="{_num(op.y2)}" '
                       f'stroke="{_esc(op.color)}" stroke-width="{op.width}"/>')
        elif isinstance(op, Circle):
            stroke = f' stroke="{_esc(op.stroke)}"' if op.stroke else ""
            title = f"<title>{_esc(op.title)}</title>" if op.title else ""
            out.append(f'<circle cx="{_num(op.x)}" cy="{_num(op.y)}" r="{op.r}" fill="{_esc(op.fill)}"{stroke}>'
                       f"{title}</circle>")
    out.append("</svg>")
    return "".join(out)


_CSS = """
body{font-family:"DejaVu Sans",Verdana,Arial,sans-serif;margin:16px;color:#222;background:#fafafa}
h1{font-size:18px;margin:0 0 4px}
.meta{color:#666;font-size:12px;margin-bottom:10px}
.controls{position:sticky;top:0;background:#fafafa;padding:6px 0;z-index:2;font-size:13px;border-bottom:1px solid #ddd}
.controls input{width:120px}
section.request,section.overview{background:#fff;border:1px solid #ddd;border-radius:4px;margin:10px 0;padding:4px}
section.request.status-ERROR{border-color:#e15759}
svg text{font-family:"DejaVu Sans",Verdana,Arial,sans-serif}
svg rect.send:hover,svg rect.compute:hover{opacity:.75}
.empty{color:#666;font-style:italic}
"""

# The page's one script: static text (no value from the file is ever in it), allowed by its hash in the policy.
_JS = """
(function(){
  var all=Array.prototype.slice.call(document.querySelectorAll('section.request'));
  var size=parseInt(document.body.getAttribute('data-page-size'),10)||20;
  var page=0, shown=all;
  var info=document.getElementById('page-info'), key=document.getElementById('key-filter');
  function render(){
    var pages=Math.max(1,Math.ceil(shown.length/size));
    if(page>=pages)page=pages-1; if(page<0)page=0;
    all.forEach(function(s){s.hidden=true;});
    shown.slice(page*size,(page+1)*size).forEach(function(s){s.hidden=false;});
    info.textContent='page '+(page+1)+' of '+pages+' · '+shown.length+' of '+all.length+' requests';
  }
  function filter(){
    var q=key.value.trim();
    var st=document.getElementById('status-filter').value;
    shown=all.filter(function(s){
      if(q && (s.getAttribute('data-key')||'').indexOf(q)!==0)return false;
      if(st && s.getAttribute('data-status')!==st)return false;
      return true;});
    page=0; render();
  }
  document.getElementById('prev').addEventListener('click',function(){page--;render();});
  document.getElementById('next').addEventListener('click',function(){page++;render();});
  key.addEventListener('input',filter);
  document.getElementById('status-filter').addEventListener('change',filter);
  render();
  document.body.setAttribute('data-ready','1');
})();
"""


def _sha256(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode("utf-8")).digest()).decode("ascii") + "'"


# Nothing from the network, no inline script but the one above (by hash), no inline style but the sheet above.
CONTENT_SECURITY_POLICY = (f"default-src 'none'; script-src {_sha256(_JS)}; style-src {_sha256(_CSS)}; "
                           "img-src data:; base-uri 'none'; form-action 'none'")


def render_html(requests: Sequence[Request], title: str = "KV transfer timeline", page_size: int = 20,
                source: str = "", note: str = "", origin_ns: Optional[int] = None,
                throughputs: Sequence[float] = ()) -> str:
    """The whole page: overview, controls, and one section per request (all given, shown a page at a time)."""
    if origin_ns is None:
        origin_ns = min((r.start_ns for r in requests), default=0)
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f'<meta http-equiv="Content-Security-Policy" content="{CONTENT_SECURITY_POLICY}">',
        f"<title>{_esc(title)}</title>",
        f"<style>{_CSS}</style></head>",
        f'<body data-page-size="{int(page_size)}" data-requests="{len(requests)}">',
        f"<h1>{_esc(title)}</h1>",
        f'<div class="meta">{_esc(source)}</div>',
    ]
    overview = layout_overview(requests, origin_ns=origin_ns, note=note, throughputs=throughputs)
    parts.append(f'<section class="overview">{_svg(overview)}</section>')
    parts.append(
        '<div class="controls">'
        '<button id="prev" type="button">◀ prev</button> <button id="next" type="button">next ▶</button> '
        '<span id="page-info"></span> · key <input id="key-filter" placeholder="key prefix"> '
        '<select id="status-filter"><option value="">any status</option><option>OK</option>'
        "<option>UNSET</option><option>ERROR</option></select></div>"
    )
    if not requests:
        parts.append('<p class="empty">No request matches the filters.</p>')
    for index, request in enumerate(requests):
        panel = layout_request(request, origin_ns=origin_ns)
        hidden = " hidden" if index >= page_size else ""
        status = _esc(request.final_status)
        parts.append(f'<section class="request status-{status}" data-key="{_esc(request.key or "")}" '
                     f'data-status="{status}" data-index="{index}"{hidden}>{_svg(panel)}</section>')
    parts.append(f"<script>{_JS}</script></body></html>")
    return "\n".join(parts) + "\n"

"""Documentation formats -> blocks of text: HTML, man pages (roff), info files, Perl pod, plain text/rst.

Every converter returns a list of `Block(kind, text)`, kind "heading" or "para" (paragraphs and list items),
in document order, each block on one line with its whitespace collapsed. Code and tables are dropped here,
where the format still says what they are (<pre>, <table>, .nf/.EX, verbatim pod and indented paragraphs);
prose.py judges the blocks that remain. Nothing depends on dict or set order, so the same bytes always give
the same blocks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from html.parser import HTMLParser


@dataclass(frozen=True)
class Block:
    kind: str  # "heading" or "para"
    text: str


_SPACE = re.compile(r"\s+")


def _squash(text: str) -> str:
    return _SPACE.sub(" ", text).strip()


# --- HTML ---------------------------------------------------------------------------------------------------

# Elements dropped with everything inside them: code, tables, page furniture, forms, embedded media.
_SKIP_TAGS = frozenset({"script", "style", "nav", "header", "footer", "pre", "table", "form", "button",
                        "select", "textarea", "svg", "math", "head", "noscript", "iframe", "object", "map",
                        "aside", "menu"})
# class/id/role values of navigation, boilerplate, code and summary tables (Javadoc lists each member
# twice: once in a summary, once in its details) in Sphinx, Javadoc, DocBook, texinfo, Doxygen and
# rustdoc pages, matched as whole values (a class "wy-nav-content-wrap" holds the page itself).
_SKIP_CLASSES = frozenset("""related sphinxsidebar sphinxsidebarwrapper sidebar footer headerlink navigationbar navigation
navheader navfooter nav navbar breadcrumb breadcrumbs wy-breadcrumbs wy-nav-side wy-nav-top rst-footer-buttons
rst-versions toc toctree-wrapper search searchbox doctest literal-block codehilite programlisting screen
synopsis cmdsynopsis funcsynopsis skip-nav subNav topNav bottomNav sub-nav top-nav copyright legalnotice
menu linenos footnote-backref sig sig-object member-signature example lisp verbatim smallexample sourceCode
example-wrap banner contentinfo summary-table method-summary field-summary constructor-summary
nested-class-summary enum-constant-summary inherited-list memberSummary""".split())
_SKIP_CLASS_PREFIX = re.compile(r"(?:highlight|sphinxsidebar|search)(?:$|-)")
_BLOCK_TAGS = frozenset({"p", "div", "li", "dt", "dd", "blockquote", "section", "article", "main", "body",
                         "ul", "ol", "dl", "br", "hr", "figcaption", "caption", "center", "td", "th", "tr",
                         "h1", "h2", "h3", "h4", "h5", "h6", "title", "summary", "details", "address"})
_HEADINGS = frozenset({"h1", "h2", "h3", "h4", "h5", "h6"})
_VOID = frozenset({"br", "hr", "img", "meta", "link", "input", "area", "base", "col", "embed", "param",
                   "source", "track", "wbr"})
_MARKS = str.maketrans({"\u00b6": " ", "\u00a7": " ", "\u00a0": " ", "\u200b": ""})  # permalinks, nbsp


class _HtmlText(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[tuple[str, bool]] = []  # (tag, skips its content)
        self.skipping = 0
        self.heading = 0
        self.buffer: list[str] = []
        self.blocks: list[Block] = []

    def _flush(self) -> None:
        text = _squash("".join(self.buffer).translate(_MARKS))
        self.buffer = []
        if text:
            self.blocks.append(Block("heading" if self.heading else "para", text))

    def handle_starttag(self, tag: str, attrs: list) -> None:
        if tag in _BLOCK_TAGS:
            self._flush()
        if tag in _VOID:
            return
        marks = [m for k, v in attrs if k in ("class", "id", "role") and v for m in v.split()]
        skip = tag in _SKIP_TAGS or any(m in _SKIP_CLASSES or _SKIP_CLASS_PREFIX.match(m) for m in marks)
        if tag == "code" and any(k == "class" and v and "block" in v for k, v in attrs):
            skip = True
        self.stack.append((tag, skip))
        self.skipping += skip
        self.heading += tag in _HEADINGS

    def handle_endtag(self, tag: str) -> None:
        if tag in _BLOCK_TAGS:
            self._flush()
        if not any(t == tag for t, _ in self.stack):
            return  # a stray end tag
        while self.stack:  # close everything left open inside it (<p> and <li> often are)
            t, skip = self.stack.pop()
            self.skipping -= skip
            self.heading -= t in _HEADINGS
            if t == tag:
                break

    def handle_data(self, data: str) -> None:
        if not self.skipping:
            self.buffer.append(data)


def html_blocks(text: str) -> list[Block]:
    parser = _HtmlText()
    parser.feed(text)
    parser.close()
    parser._flush()
    return parser.blocks


# --- roff (man pages) ---------------------------------------------------------------------------------------

_ROFF_NAMED = {"em": "\u2014", "en": "\u2013", "aq": "'", "dq": '"', "lq": "\u201c", "rq": "\u201d",
               "oq": "\u2018", "cq": "\u2019", "hy": "-", "bu": "\u2022", "co": "\u00a9", "rg": "\u00ae",
               "mi": "-", "pl": "+", "ti": "~", "ha": "^", "ga": "`", "bv": "|", "ba": "|", "lh": "",
               "rh": "", "de": "\u00b0", "mu": "\u00d7", "sl": "/", "rs": "\\", "at": "@", "sh": "#",
               "Do": "$", "tm": "\u2122", "ua": "\u2191", "da": "\u2193", "->": "\u2192", "<-": "\u2190"}
_ROFF_ESCAPE = re.compile(r"\\(?:f(?:\[[^\]]*\]|\(..|.)|s[+-]?(?:\d\d?|\(\d\d|\[\d+\])|\*(?:\[[^\]]*\]|\(..|.)|"
                          r"\((..)|\[([^\]]*)\]|[kgnzmMV](?:\[[^\]]*\]|\(..|.)|[hvwlLxNoHSbDZXRY]'[^']*'|"
                          r"(.))")
_ROFF_SIMPLE = {"-": "-", "e": "\\", "\\": "\\", "&": "", "%": "", "c": "", "|": "", "^": "", " ": " ",
                "~": " ", "0": " ", "'": "'", "`": "`", ".": ".", "t": " ", ":": "", "!": "", "d": "",
                "u": "", "p": "", "r": "", "a": "", "{": "", "}": "", '"': ""}
_ROFF_FONT_MACROS = {"B", "I", "R", "SM", "SB", "BR", "RB", "IR", "RI", "BI", "IB", "UR", "MT", "Nm", "Ar",
                     "Fl", "Cm", "Em", "Sy", "Pa", "Li", "Xr", "Va", "Fn", "Ev", "Dv", "Er", "Ic"}
_ROFF_BREAK_MACROS = {"PP", "LP", "P", "TP", "IP", "HP", "sp", "br", "RS", "RE", "TQ", "Pp", "Bl", "El", "It",
                      "Bd", "Ed", "ne", "in", "ti"}
# Blocks dropped whole, by the request that ends them: examples and verbatim text (.nf, .EX, pod2man's .Vb,
# Tcl's .CS code excerpts and .DS displays), tables, equations, pictures, and macro definitions (ended by "..").
_ROFF_CODE_BLOCKS = {"nf": "fi", "EX": "EE", "Vb": "Ve", "CS": "CE", "DS": "DE", "TS": "TE", "EQ": "EN",
                     "PS": "PE", "de": ".", "de1": ".", "ig": ".", "am": ".", "Bd": "Ed"}


def _roff_unescape(text: str) -> str:
    def sub(m: re.Match) -> str:
        if m.group(1) is not None:
            return _ROFF_NAMED.get(m.group(1), "")
        if m.group(2) is not None:
            return _ROFF_NAMED.get(m.group(2), "")
        if m.group(3) is not None:
            return _ROFF_SIMPLE.get(m.group(3), m.group(3))
        return ""  # font, size, string, motion and other escapes carry no text

    return _ROFF_ESCAPE.sub(sub, text)


def _roff_args(line: str) -> list[str]:
    return [a[1:-1] if len(a) >= 2 and a[0] == a[-1] == '"' else a for a in re.findall(r'"[^"]*"|\S+', line)]


def roff_blocks(text: str) -> list[Block]:
    blocks: list[Block] = []
    para: list[str] = []

    def flush(kind: str = "para") -> None:
        joined = _squash(_roff_unescape(" ".join(para)))
        para.clear()
        if joined:
            blocks.append(Block(kind, joined))

    end_of_block = None
    for line in text.split("\n"):
        if end_of_block is not None:  # inside an example, table or macro definition: dropped
            if line.startswith((".", "'")) and line[1:].strip().split(" ")[0] == end_of_block:
                end_of_block = None
            continue
        if line.startswith((".", "'")):
            request, _, rest = line[1:].strip().partition(" ")
            if request.startswith('\\"') or request == "":
                continue  # a comment
            if request == "Bd" and "-literal" not in rest and "-unfilled" not in rest:
                flush()
                continue
            if request in _ROFF_CODE_BLOCKS:
                flush()
                end_of_block = _ROFF_CODE_BLOCKS[request]
                continue
            if request in ("SH", "SS", "Sh", "Ss"):
                flush()
                para.append(" ".join(_roff_args(rest)))
                flush("heading")
            elif request in _ROFF_FONT_MACROS:
                args = _roff_args(rest)
                alternating = len(request) == 2 and request.isupper() and request not in ("SM", "SB", "UR", "MT")
                para.append(("".join(args) if alternating else " ".join(args)))
            elif request in _ROFF_BREAK_MACROS:
                flush()
                if request == "IP" and rest:  # .IP "tag" indent: the tag opens the item
                    args = _roff_args(rest)
                    if args and args[0] not in ("\\(bu", "\\[bu]", "-", "*", "\\-"):
                        para.append(args[0])
            continue  # any other request: formatting only
        if line.strip():
            para.append(line)
        else:
            flush()
    flush()
    return blocks


# --- info ---------------------------------------------------------------------------------------------------

def info_blocks(text: str) -> list[Block]:
    """Info nodes: node headers, menus, the tag table and indented examples are dropped."""
    blocks: list[Block] = []
    for node in text.split("\x1f")[1:]:  # before the first node: the "produced by makeinfo" preamble
        node = node.lstrip("\n")
        if node.startswith(("Tag Table:", "End Tag Table", "Indirect:", "Local Variables")):
            continue
        lines = node.split("\n")
        if lines and lines[0].startswith("File: "):
            lines = lines[1:]
        in_menu = False
        for para in "\n".join(lines).split("\n\n"):
            rows = [r for r in para.split("\n") if r.strip()]
            if not rows:
                continue
            if rows[0].startswith("* Menu:"):
                in_menu = True
                continue
            if in_menu and rows[0].startswith("* "):
                continue
            in_menu = False
            if len(rows) == 2 and re.fullmatch(r"[*=\-.]{3,}", rows[1].strip()):
                blocks.append(Block("heading", _squash(rows[0])))
                continue
            if all(r.startswith("     ") for r in rows):  # five or more spaces: an @example block
                continue
            blocks.append(Block("para", _squash(" ".join(rows))))
    return blocks


# --- Perl pod -----------------------------------------------------------------------------------------------

_POD_CODE = re.compile(r"([A-Z])<(<+ )(.*?)( >+)>|([A-Z])<([^<>]*)>", re.S)
_POD_ENTITIES = {"lt": "<", "gt": ">", "verbar": "|", "sol": "/", "quot": '"', "amp": "&", "apos": "'"}


def _pod_inline(text: str) -> str:
    def sub(m: re.Match) -> str:
        code, body = (m.group(1), m.group(3)) if m.group(1) else (m.group(5), m.group(6))
        if code in ("X", "Z"):
            return ""
        if code == "E":
            if body in _POD_ENTITIES:
                return _POD_ENTITIES[body]
            try:  # E<0x201E>, E<075> (octal), E<233>
                return chr(int(body, 16 if body.lower().startswith("0x") else 8 if body.startswith("0") else 10))
            except ValueError:
                return ""
        if code == "L":
            label, bar, _ = body.partition("|")
            if bar:
                return label
            name, _, section = body.partition("/")  # L<perlfunc/open> reads "open in perlfunc", as perldoc says
            section = section.strip('"')
            return f"{section} in {name}" if name and section else section or name
        return body

    for _ in range(8):  # codes nest (B<C<x>>): resolve innermost first until none are left
        new = _POD_CODE.sub(sub, text)
        if new == text:
            break
        text = new
    return text


def pod_blocks(text: str) -> list[Block]:
    blocks: list[Block] = []
    skip_until = None
    in_pod = not text.lstrip().startswith(("#!", "package ", "use "))
    for para in re.split(r"\n[ \t]*\n", text.replace("\r\n", "\n")):
        if not para.strip():
            continue
        if para.startswith("="):
            command, _, rest = para[1:].partition(" ")
            command = command.split("\n")[0]
            rest = rest if " " in para.split("\n")[0] else para.partition("\n")[2]
            if command == "cut":
                in_pod = False
            else:
                in_pod = True
            if skip_until is not None:
                if command == "end":
                    skip_until = None
                continue
            if command == "begin":
                skip_until = "end"
            elif command.startswith("head"):
                blocks.append(Block("heading", _squash(_pod_inline(rest))))
            elif command == "item":
                item = _squash(_pod_inline(rest))
                if item not in ("*", "") and not item.isdigit():
                    blocks.append(Block("para", item))
            continue
        if not in_pod or skip_until is not None or para[0] in " \t":
            continue  # Perl code outside pod, a =begin block, or a verbatim (code) paragraph
        blocks.append(Block("para", _squash(_pod_inline(para))))
    return blocks


# --- plain text and reStructuredText ------------------------------------------------------------------------

def text_blocks(text: str) -> list[Block]:
    """Paragraphs split at blank lines; indented paragraphs (verbatim) and rst directives are dropped."""
    blocks: list[Block] = []
    for para in re.split(r"\n[ \t]*\n", text.replace("\r\n", "\n")):
        rows = [r for r in para.split("\n") if r.strip()]
        if not rows or rows[0][0] in " \t" or rows[0].startswith(".. "):
            continue
        rows = [r for r in rows if not re.fullmatch(r"\s*([=\-~^\"'`#*+_:.])\1{2,}\s*", r)]
        if not rows:
            continue
        if len(rows) == 1 and len(para.split("\n")) >= 2 and len(rows[0]) < 120:
            blocks.append(Block("heading", _squash(rows[0])))  # a title over its underline
            continue
        blocks.append(Block("para", _squash(" ".join(rows))))
    return blocks


CONVERTERS = {"html": html_blocks, "roff": roff_blocks, "info": info_blocks, "pod": pod_blocks,
              "text": text_blocks}

"""A ~100 MB English corpus for convergence runs, rebuilt from pinned Debian packages (scripts/build_corpus.py).

Why this corpus: the convergence benchmark needs >= 20M tokens of real, mostly natural
English, and the build machines reach only the Python package index and the Debian/Ubuntu archives
(no Hugging Face, no GitHub). Debian ships large English prose as documentation. The recipe below
pins each package by file name and sha256 (Debian bookworm, main, checked 2026-11-22), so anyone can
rebuild byte-identical text:

* ``linux-doc-6.1``: the Linux kernel's Documentation tree (``*.rst`` / ``*.txt``, English only:
  ``translations/`` and device-tree YAML bindings are skipped); technical prose;
* ``python3.11-doc``: the Python 3.11 documentation sources (``_sources/**/*.rst.txt``);
* ``perl-doc``: the Perl manual pages (``*.pod``);
* ``postgresql-doc-15``: the PostgreSQL 15 manual (HTML pages reduced to their text);
* ``dict-gcide``: the GNU Collaborative International Dictionary of English (Webster's 1913 +
  additions): definitions and literary quotations, grouped into documents of ~``GCIDE_DOC_BYTES``.

Documents are emitted in a fixed order (package order above, then sorted member path), so the JSONL is
a deterministic function of the pinned packages. Pure stdlib: a ``.deb`` is an ``ar`` archive whose
``data.tar.*`` member holds the files.
"""

from __future__ import annotations

import gzip
import hashlib
import html.parser
import io
import tarfile
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

DEBIAN_MIRROR = "http://deb.debian.org/debian/"
AR_MAGIC = b"!<arch>\n"
AR_HEADER_BYTES = 60  # ar member header: name 16, mtime 12, uid 6, gid 6, mode 8, size 10, magic 2
GCIDE_DOC_BYTES = 8192  # dictionary entries are grouped into ~8 KiB documents (not one tiny doc per word)
DOWNLOAD_TIMEOUT_S = 300


@dataclass(frozen=True)
class DebPackage:
    name: str
    pool_path: str  # relative to DEBIAN_MIRROR
    size: int
    sha256: str


# From http://deb.debian.org/debian/dists/bookworm/main/binary-all/Packages.xz (2026-11-22).
PACKAGES = (
    DebPackage("linux-doc-6.1", "pool/main/l/linux/linux-doc-6.1_6.1.176-1_all.deb", 37222656,
               "0d843674607703b9ef8c1db5e715c38ed52ff23574feabfe0d961d552126859f"),
    DebPackage("python3.11-doc", "pool/main/p/python3.11/python3.11-doc_3.11.2-6+deb12u8_all.deb", 12642400,
               "50eb63e7f636c4281e9ce1b8f10386f1def42159eddce34fc1f41c46261df71b"),
    DebPackage("perl-doc", "pool/main/p/perl/perl-doc_5.36.0-7+deb12u3_all.deb", 7909200,
               "e9e3564ff5ade27de0585835f2acad769bcc545c0a0045a9f55d5401f27f7591"),
    DebPackage("postgresql-doc-15", "pool/main/p/postgresql-15/postgresql-doc-15_15.18-0+deb12u1_all.deb",
               2096084, "3c598277a463c44d672daa2c335deb8d8252e1852fb025fd4578ea2d9a1b90f0"),
    DebPackage("dict-gcide", "pool/main/d/dict-gcide/dict-gcide_0.48.5+nmu2_all.deb", 14800692,
               "7b0af5cfde3cbdef5e9d6e78f92ec335ced7c2790f37a40f49bebc6f7347ac0f"),
)  # fmt: skip


def fetch(pkg: DebPackage, cache_dir: Path) -> Path:
    """The package file in ``cache_dir`` (downloaded once), its sha256 checked every time."""
    path = cache_dir / PurePosixPath(pkg.pool_path).name
    if not path.exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".part")
        with urllib.request.urlopen(DEBIAN_MIRROR + pkg.pool_path, timeout=DOWNLOAD_TIMEOUT_S) as resp:
            tmp.write_bytes(resp.read())
        tmp.replace(path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != pkg.sha256:
        raise ValueError(f"{path}: sha256 {digest} != pinned {pkg.sha256}; delete it and rebuild")
    return path


def ar_members(data: bytes) -> Iterator[tuple[str, bytes]]:
    """(name, content) of each member of a System V / GNU ``ar`` archive (the .deb container)."""
    if not data.startswith(AR_MAGIC):
        raise ValueError("not an ar archive (a .deb starts with '!<arch>\\n')")
    pos = len(AR_MAGIC)
    while pos + AR_HEADER_BYTES <= len(data):
        header = data[pos : pos + AR_HEADER_BYTES]
        if header[58:60] != b"`\n":
            raise ValueError(f"corrupt ar member header at byte {pos}")
        name = header[:16].decode("ascii").strip().rstrip("/")
        size = int(header[48:58].decode("ascii").strip())
        start = pos + AR_HEADER_BYTES
        yield name, data[start : start + size]
        pos = start + size + (size & 1)  # members are 2-byte aligned


def deb_files(deb_bytes: bytes) -> Iterator[tuple[str, bytes]]:
    """(path without leading './', content) of each regular file in the package's data archive."""
    for name, content in ar_members(deb_bytes):
        if name.startswith("data.tar"):
            with tarfile.open(fileobj=io.BytesIO(content), mode="r:*") as tar:
                for info in sorted((m for m in tar.getmembers() if m.isfile()), key=lambda m: m.name):
                    yield info.name.removeprefix("./"), tar.extractfile(info).read()
            return
    raise ValueError("no data.tar.* member in the .deb")


def _text(path: str, content: bytes) -> str:
    raw = gzip.decompress(content) if path.endswith((".gz", ".dz")) else content
    return raw.decode("utf-8", errors="replace")


def select(package: str, path: str) -> bool:
    """Whether a member file is corpus text (rules in the module docstring)."""
    p = path.removesuffix(".gz")
    if package == "linux-doc-6.1":
        return ("/Documentation/" in p and p.endswith((".rst", ".txt"))
                and "/translations/" not in p and "/devicetree/bindings/" not in p)  # fmt: skip
    if package == "python3.11-doc":
        return "/_sources/" in p and p.endswith(".rst.txt")
    if package == "perl-doc":
        return p.endswith(".pod")
    if package == "postgresql-doc-15":
        return p.endswith(".html")
    if package == "dict-gcide":
        return p.endswith("gcide.dict.dz")
    raise ValueError(f"no selection rule for package {package!r}")


BLOCK_TAGS = frozenset({"p", "div", "br", "li", "tr", "h1", "h2", "h3", "h4", "h5", "h6", "pre", "dt", "dd",
                        "table", "title", "blockquote"})
SKIPPED_TAGS = frozenset({"script", "style", "head"})


class _HtmlText(html.parser.HTMLParser):
    """Text of an HTML page: block elements end lines, script/style/head dropped, entities decoded."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.skip_depth = 0
        self.pre_depth = 0

    def handle_starttag(self, tag, attrs):
        if tag in SKIPPED_TAGS:
            self.skip_depth += 1
        elif tag == "pre":
            self.pre_depth += 1
            self.parts.append("\n")
        elif tag in BLOCK_TAGS:
            self.parts.append("\n")

    def handle_endtag(self, tag):
        if tag in SKIPPED_TAGS:
            self.skip_depth = max(0, self.skip_depth - 1)
        elif tag == "pre":
            self.pre_depth = max(0, self.pre_depth - 1)
            self.parts.append("\n")
        elif tag in BLOCK_TAGS:
            self.parts.append("\n")

    def handle_data(self, data):
        if self.skip_depth or not data:
            return
        if self.pre_depth:
            self.parts.append(data)
            return
        # whitespace runs collapse to one space outside <pre> (as a browser renders them), none at a line start
        text = (" " if data[0].isspace() else "") + " ".join(data.split()) + (" " if data[-1].isspace() else "")
        at_line_start = not self.parts or self.parts[-1].endswith("\n")
        self.parts.append(text.lstrip() if at_line_start else text)


def html_to_text(page: str) -> str:
    parser = _HtmlText()
    parser.feed(page)
    parser.close()
    lines = (line.rstrip() for line in "".join(parser.parts).splitlines())
    out, blank = [], False
    for line in lines:
        if line:
            out.append(line)
            blank = False
        elif not blank:
            out.append("")
            blank = True
    return "\n".join(out).strip()


def gcide_documents(text: str, target_bytes: int = GCIDE_DOC_BYTES) -> Iterator[str]:
    """Whole dictionary entries (blank-line separated) grouped into documents of ~target_bytes."""
    buf, size = [], 0
    for entry in text.split("\n\n"):
        entry = entry.strip("\n")
        if not entry:
            continue
        buf.append(entry)
        size += len(entry) + 2
        if size >= target_bytes:
            yield "\n\n".join(buf)
            buf, size = [], 0
    if buf:
        yield "\n\n".join(buf)


def iter_documents(cache_dir: Path, packages=PACKAGES) -> Iterator[dict]:
    """{"text", "source"} records in the corpus order."""
    for pkg in packages:
        deb = fetch(pkg, cache_dir).read_bytes()
        for path, content in deb_files(deb):
            if not select(pkg.name, path):
                continue
            text = _text(path, content)
            if path.endswith(".html"):
                text = html_to_text(text)
            if pkg.name == "dict-gcide":
                for i, doc in enumerate(gcide_documents(text)):
                    yield {"text": doc, "source": f"{pkg.name}:{path}#{i}"}
            elif text.strip():
                yield {"text": text, "source": f"{pkg.name}:{path}"}

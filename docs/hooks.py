"""MkDocs hooks of the gpu-days site (mkdocs.yml: `hooks: [docs/hooks.py]`).

Everything day-specific on the site is generated here at build time, so adding a day
never touches mkdocs.yml or docs/:

* on_files: for every `days/dayNNN/README.md` a page `days/dayNNN.md` is generated from the
  README. In it
    - the line `<!-- results: dayNNN -->` becomes, per device folder of the results store,
      a heading with the device and the environment stamp of the latest run, a table of that
      run and its plots (benchmark/plots.py, PNGs added as generated files); with no results,
      a note on how to produce them. A README without the marker gets the results appended
      when there are any.
    - relative links are rewritten (the README stays correct on a plain git checkout):
      another day's README or folder -> that day's page; an image -> the image, copied into
      the site under files/; a text file (source, test, notes) -> a generated page
      `source/<repo path>.md` that shows the file verbatim with line numbers (`#L12` anchors
      are kept); a folder or a missing path -> inline code of its repository path.
    - snippet lines mangled by a Python formatter (`--8 < --"f:s"`) are repaired (logged).
  Kernel-family pages `families/<name>.md` (FAMILIES below) compare every implementation of
  the family's ops across days, and the nav is built: Home, Days, Kernel families, About.
* on_page_markdown: `<!-- days-table -->` in docs/index.md becomes the table of days (title,
  first paragraph of the README, headline result from the store).

Code blocks in a README include real source by section marker with pymdownx.snippets, paths
relative to the repository root: `--8<-- "days/day009/online_softmax.mojo:gpu_kernel"`.

Environment: GPU_DAYS_RESULTS_DIR points the site at another results folder (tests use a
temporary one); the default is the store's `results/`. A missing or empty folder is fine.
"""

from __future__ import annotations

import html
import logging
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

from mkdocs.structure.files import File, Files, InclusionLevel

log = logging.getLogger("mkdocs.hooks.gpu_days")

RESULTS_ENV = "GPU_DAYS_RESULTS_DIR"
DAY_DIR_RE = re.compile(r"^day(\d+)$")
RESULTS_MARKER_RE = re.compile(r"^[ \t]*<!--\s*results:\s*(day\d+)\s*-->[ \t]*$", re.MULTILINE)
DAYS_TABLE_MARKER = "<!-- days-table -->"
STANDINGS_URI = "standings.md"
IMAGE_EXTS = {".png", ".jpg", ".jpeg", ".gif", ".svg", ".webp"}
LANGS = {
    ".mojo": "mojo",
    ".🔥": "mojo",
    ".py": "python",
    ".md": "markdown",
    ".toml": "toml",
    ".yaml": "yaml",
    ".yml": "yaml",
    ".sh": "bash",
    ".cu": "cuda",
    ".cuh": "cuda",
    ".cpp": "cpp",
    ".cc": "cpp",
    ".h": "cpp",
    ".hpp": "cpp",
    ".json": "json",
    ".ptx": "text",
    ".txt": "text",
    ".csv": "text",
    ".cfg": "ini",
    ".ini": "ini",
}
MAX_SOURCE_BYTES = 512 * 1024


@dataclass(frozen=True)
class Family:
    title: str
    ops: tuple[str, ...]  # an op belongs to the family when its name contains one of these
    blurb: str = ""


FAMILIES: dict[str, Family] = {
    "softmax": Family(
        "Softmax",
        ("softmax",),
        "Row softmax: a reduction (max, sum of exponentials) followed by an elementwise pass. "
        "It is memory bound, so the yardstick is the device's copy bandwidth.",
    ),
    "normalisation": Family(
        "Normalisation",
        ("layer_norm",),
        "LayerNorm forward and backward: per-row statistics, then an elementwise pass (and, backward, "
        "column sums for the weight and bias gradients). Memory bound: the yardstick is copy bandwidth.",
    ),
    "gemm": Family(
        "GEMM",
        ("gemm",),
        "Matrix products: compute bound at large sizes, so the yardstick is TFLOP/s and torch's cuBLAS "
        "in the same run.",
    ),
    "attention": Family(
        "Attention",
        ("attention",),
        "Attention (softmax(QK^T)V) in one fused kernel that never writes the scores: the yardstick is "
        "TFLOP/s next to torch's scaled_dot_product_attention backends.",
    ),
}


@dataclass
class Day:
    name: str  # "day009"
    num: int
    title: str  # "Online softmax" (without the "Day 009 —" prefix)
    heading: str  # the README's first heading, as written
    summary: str
    readme: Path


_STATE: dict = {}  # what on_files found, for on_page_markdown of the same build


# ---------------------------------------------------------------------------- mkdocs events


def on_files(files: Files, config) -> Files:
    root = Path(config["config_file_path"]).resolve().parent
    results = _load_results(root)
    days = find_days(root)
    sources: dict[str, str] = {}  # repo path -> src_uri of its generated source page
    with tempfile.TemporaryDirectory(prefix="gpu-days-plots-") as tmp:
        for day in days:
            content = day_page(day, root, results, Path(tmp), files, config, sources)
            _add(files, File.generated(config, f"days/{day.name}.md", content=content))
        fam_pages = []
        for key, fam in FAMILIES.items():
            uri = f"families/{key}.md"
            _add(
                files,
                File.generated(config, uri, content=family_page(key, fam, days, results, Path(tmp), files, config)),
            )
            fam_pages.append({fam.title: uri})
        _add(files, File.generated(config, STANDINGS_URI, content=standings_page(results, Path(tmp), files, config)))
    for rel, uri in sorted(sources.items()):
        _add(files, File.generated(config, uri, content=source_page(root, rel), inclusion=InclusionLevel.NOT_IN_NAV))

    nav: list = [{"Home": "index.md"}, {"Where each kernel stands": STANDINGS_URI}]
    if days:
        nav.append({"Days": [{f"Day {d.num:03d} · {d.title}": f"days/{d.name}.md"} for d in days]})
    nav.append({"Kernel families": fam_pages})
    if files.get_file_from_path("about.md"):
        nav.append({"About this site": "about.md"})
    config["nav"] = nav
    _STATE.clear()
    _STATE.update(days=days, results=results)
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    if DAYS_TABLE_MARKER in markdown:
        markdown = markdown.replace(
            DAYS_TABLE_MARKER, days_table(_STATE.get("days", []), _STATE.get("results"), page.file.src_uri)
        )
    return markdown


def on_serve(server, config, builder):
    """`mkdocs serve`: rebuild when a day, the store or the plotting code changes."""
    root = Path(config["config_file_path"]).resolve().parent
    for path in (root / "days", _results_dir(root), root / "benchmark" / "plots.py"):
        if path.exists():
            server.watch(str(path))
    return server


def _add(files: Files, file: File) -> None:
    if files.get_file_from_path(file.src_uri):
        raise ValueError(f"gpu-days: {file.src_uri} is generated from days/; remove docs/{file.src_uri}")
    files.append(file)


# ---------------------------------------------------------------------------- results store


def _results_dir(root: Path) -> Path:
    env = os.environ.get(RESULTS_ENV)
    return Path(env).resolve() if env else root / "results"


def _load_results(root: Path):
    """Latest run per device folder and day, numeric columns as floats (empty without results)."""
    from benchmark import plots, store

    results_dir = _results_dir(root)
    df = store.load(results_dir=results_dir)
    for note in df.attrs.get("skipped", []):  # reported, not fatal: one bad row must not hide a day
        log.info("gpu-days: skipped a malformed result row: %s", note)
    df = store.latest_run(plots.prepare(df))
    log.info("gpu-days: %d result rows (latest runs) from %s", len(df), results_dir)
    return df


def _device_order(rows) -> list[str]:
    """Device folders, GPUs first, then by name."""
    kinds = {d: str(_first(g, "device_type")) for d, g in rows.groupby("device_dir")}
    return sorted(kinds, key=lambda d: (kinds[d] != "cuda", d))


def _first(rows, col: str) -> str:
    if col not in rows.columns:
        return ""
    for v in rows[col].tolist():
        if isinstance(v, str) and v.strip():
            return v.strip()
        if isinstance(v, (int, float)) and v == v:  # the CSV reader made a number of "12.4" or "550"
            return format(v, "g")
    return ""


# ---------------------------------------------------------------------------- days


def find_days(root: Path) -> list[Day]:
    days = []
    for readme in (root / "days").glob("day*/README.md"):
        m = DAY_DIR_RE.match(readme.parent.name)
        if not m:
            continue
        text = readme.read_text(encoding="utf-8")
        heading, title, summary = parse_readme(text, readme.parent.name)
        days.append(Day(readme.parent.name, int(m.group(1)), title, heading, summary, readme))
    return sorted(days, key=lambda d: d.num)


def parse_readme(text: str, name: str) -> tuple[str, str, str]:
    """(first heading, title without the "Day NNN —" prefix, one-line summary)."""
    lines = text.splitlines()
    heading = next((ln[2:].strip() for ln in lines if ln.startswith("# ")), "")
    title = re.sub(r"^day\s*0*\d+\s*[—–:·|-]+\s*", "", heading, flags=re.IGNORECASE).strip() or heading or name
    return heading, title, first_paragraph(text)


def first_paragraph(text: str, limit: int = 320) -> str:
    """The first prose paragraph (not a heading, date line, fence, list, table or comment), one line."""
    in_fence = False
    blocks, cur = [], []
    for ln in text.splitlines():
        if re.match(r"^\s*(```|~~~)", ln):
            in_fence = not in_fence
            cur = []
            continue
        if in_fence:
            continue
        if ln.strip():
            cur.append(ln.strip())
        elif cur:
            blocks.append(cur)
            cur = []
    if cur:
        blocks.append(cur)
    for block in blocks:
        first = block[0]
        if re.match(r"^(#|<|!!!|\?\?\?|\||>|[-*+] |\d+\. |---|===|\[.*\]:)", first):
            continue
        para = " ".join(block)
        plain = re.sub(r"!\[[^\]]*\]\([^)]*\)", "", para)
        plain = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", plain)
        plain = re.sub(r"\s+", " ", plain).strip()
        if re.fullmatch(r"[*_]+[^*_]*[*_]+", plain) or not plain:  # "*2025-01-01*": the date line
            continue
        if len(plain) > limit:
            sentence = re.match(r"(.{40,}?[.!?])\s", plain)
            plain = (
                sentence.group(1)
                if sentence and len(sentence.group(1)) <= limit
                else plain[:limit].rsplit(" ", 1)[0] + " …"
            )
        return plain
    return ""


def day_page(day: Day, root: Path, results, tmp: Path, files: Files, config, sources: dict[str, str]) -> str:
    text = repair_snippet_lines(day.readme.read_text(encoding="utf-8"), day)
    text = rewrite_links(text, day, root, files, config, sources)
    found = False

    def results_block(m: re.Match) -> str:
        nonlocal found
        found = True
        return results_markdown(m.group(1), results, tmp, files, config, page_dir="days")

    text = RESULTS_MARKER_RE.sub(results_block, text)
    if not found and not results.empty and (results["day"] == day.name).any():
        text = (
            text.rstrip()
            + "\n\n## Results\n\n"
            + results_markdown(day.name, results, tmp, files, config, page_dir="days")
        )
    return text


_MANGLED_SNIPPET_RE = re.compile(
    r"""^(?P<space>[ \t]*)-+[ \t]*8[ \t]*<[ \t]*-+[ \t]*(?P<q>["'])(?P<path>[^"']+)(?P=q)[ \t]*$"""
)
_SNIPPET_RE = re.compile(r"""^[ \t]*-+8<-+[ \t]+["']""")


def repair_snippet_lines(text: str, day: Day) -> str:
    """Undo what a Python formatter does to a snippet line in a ```python fence: ruff format on a
    markdown file turns `--8<-- "file:section"` into `--8 < --"file:section"`, which snippets then
    shows as code instead of including the file."""
    out = []
    for n, line in enumerate(text.splitlines(keepends=True), 1):
        m = _MANGLED_SNIPPET_RE.match(line.rstrip("\r\n"))
        if m and not _SNIPPET_RE.match(line):
            log.info(
                "gpu-days: %s/README.md:%d: repaired the snippet line %r (a code formatter mangled it)",
                day.name,
                n,
                line.strip(),
            )
            line = f'{m.group("space")}--8<-- "{m.group("path")}"\n'
        out.append(line)
    return "".join(out)


# ---------------------------------------------------------------------------- links

_LINK_RE = re.compile(
    r"(?P<code>`+)(?P<codebody>.*?)(?P=code)"  # inline code: left alone
    r"|(?P<bang>!?)\[(?P<text>(?:[^\[\]]|\[[^\]]*\])*)\]\(\s*(?P<target><[^>]*>|[^)\s]+)(?P<title>\s+\"[^\"]*\")?\s*\)"
)
_REFDEF_RE = re.compile(r"^(?P<lead> {0,3}\[[^\]]+\]:\s*)(?P<target><[^>]*>|\S+)(?P<rest>.*)$")
_FENCE_RE = re.compile(r"^\s*(`{3,}|~{3,})")


def rewrite_links(text: str, day: Day, root: Path, files: Files, config, sources: dict[str, str]) -> str:
    """Rewrite the README's relative links for its page at days/dayNNN.md (see the module doc)."""
    out, fence = [], None
    for line in text.splitlines(keepends=True):
        m = _FENCE_RE.match(line)
        if fence:
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence):
                fence = None
            out.append(line)
            continue
        if m:
            fence = m.group(1)
            out.append(line)
            continue
        ref = _REFDEF_RE.match(line)
        if ref:
            new = _link_target(ref.group("target").strip("<>"), day, root, files, config, sources)
            if new is None:  # nothing to link to: drop the definition, the reference shows as text
                continue
            out.append(f"{ref.group('lead')}<{new}>{ref.group('rest')}\n" if new != ref.group("target") else line)
            continue
        out.append(_LINK_RE.sub(lambda mm: _rewrite_one(mm, day, root, files, config, sources), line))
    return "".join(out)


def _rewrite_one(m: re.Match, day: Day, root, files, config, sources) -> str:
    if m.group("code"):
        return m.group(0)
    target = m.group("target").strip("<>")
    new = _link_target(target, day, root, files, config, sources)
    if new == target:
        return m.group(0)
    if new is None:
        rel = _repo_path(target, day, root)
        code = f"`{rel}`" if rel else f"`{target}`"
        text = m.group("text").strip()
        return (
            code
            if not text or text.strip("`") == Path(rel or target).name or text.strip("`") == rel
            else f"{text} ({code})"
        )
    return f"{m.group('bang')}[{m.group('text')}](<{new}>{m.group('title') or ''})"


def _repo_path(target: str, day: Day, root: Path) -> str | None:
    path = unquote(target.split("#", 1)[0].split("?", 1)[0])
    if not path:
        return None
    p = (day.readme.parent / path).resolve()
    try:
        return p.relative_to(root).as_posix() + ("/" if p.is_dir() else "")
    except ValueError:
        return None


def _link_target(target: str, day: Day, root: Path, files: Files, config, sources: dict[str, str]) -> str | None:
    """The link for `target` from days/dayNNN.md: unchanged (external, anchor), a new one, or None (no link)."""
    if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith(("#", "/")) or not target:
        return target
    frag = "#" + target.split("#", 1)[1] if "#" in target else ""
    rel = _repo_path(target, day, root)
    if rel is None or ".git/" in rel + "/":
        return None
    p = root / rel
    if not p.exists():
        log.info("gpu-days: %s/README.md links to %s, which does not exist", day.name, target)
        return None
    # another day (its README or its folder) -> its page
    m = re.fullmatch(r"days/(day\d+)/(README\.md)?", rel)
    if m and (root / "days" / m.group(1) / "README.md").exists():
        return (f"{m.group(1)}.md" if m.group(1) != day.name else "") + frag or "#"
    if p.is_dir():
        return None
    if p.suffix.lower() in IMAGE_EXTS:
        uri = f"files/{rel}"
        if not files.get_file_from_path(uri):
            files.append(File.generated(config, uri, abs_src_path=str(p)))
        return f"../{uri}"
    if p.stat().st_size <= MAX_SOURCE_BYTES and _is_text(p):
        sources[rel] = f"source/{rel}.md"
        line = re.fullmatch(r"#L(\d+)(?:-L?\d+)?", frag)
        return f"../source/{rel}.md" + (f"#__codelineno-0-{line.group(1)}" if line else "")
    return None


def _is_text(p: Path) -> bool:
    try:
        p.read_text(encoding="utf-8")
        return True
    except (UnicodeDecodeError, OSError):
        return False


def source_page(root: Path, rel: str) -> str:
    """A page showing a repository file verbatim, with line numbers matching the file."""
    from pymdownx.snippets import SnippetPreprocessor

    text = (root / rel).read_text(encoding="utf-8")
    lines = []
    for ln in text.splitlines():
        # escape what pymdownx.snippets would act on, so that the file shows exactly as it is
        if "8<-" in ln:
            sec = SnippetPreprocessor.RE_SNIPPET_SECTION.match(ln)
            if sec:
                ln = ln[: sec.start("inline_marker")] + ";" + ln[sec.start("inline_marker") :]
            elif SnippetPreprocessor.RE_ALL_SNIPPETS.match(ln):
                stripped = ln.lstrip(" \t")
                ln = ln[: len(ln) - len(stripped)] + ";" + stripped
        lines.append(ln)
    ticks = "`" * max(3, 1 + max((len(r) for r in re.findall(r"`+", text)), default=0))
    lang = LANGS.get(Path(rel).suffix.lower(), "text")
    day = re.match(r"days/(day\d+)/", rel)
    up = "../" * (rel.count("/") + 1)  # from source/<rel>.md back to the site root
    back = f"From [{day.group(1)}]({up}days/{day.group(1)}.md). " if day else ""
    body = "\n".join(lines)
    return (
        f"# `{rel}`\n\n{back}The file as it is in the repository at build time.\n\n"
        f'{ticks}{lang} linenums="1" title="{rel}"\n{body}\n{ticks}\n'
    )


# ---------------------------------------------------------------------------- tables


def _num(v) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if f == f else None


def fmt(v) -> str:
    """A number for a table: 3 significant digits, no exponent for ordinary values."""
    f = _num(v)
    if f is None:
        return ""
    a = abs(f)
    if a >= 100:
        return f"{f:,.0f}"
    if a >= 10:
        return f"{f:.1f}"
    if a >= 1:
        return f"{f:.2f}"
    if a == 0:
        return "0"
    return f"{f:.3g}" if a >= 1e-3 else f"{f:.2e}"


def _cell(v) -> str:
    if v is None or (isinstance(v, float) and v != v):
        return ""
    text = str(v).replace("\n", " ").strip()
    # a pipe ends a table cell, except inside a code span (Python-Markdown's tables know those)
    return "".join(
        part if part.startswith("`") else part.replace("|", "\\|") for part in re.split(r"(`+[^`]*`+)", text)
    )


def _status(r) -> str:
    status = _cell(r.get("status")) or "?"
    reason = _cell(r.get("reason"))
    if status == "ok":
        return "ok"
    return (
        f'**{status}** <span class="gpu-days-wrap">{html.escape(reason, quote=False)}</span>'
        if reason
        else f"**{status}**"
    )


def _ms(r) -> str:
    med, p20, p80 = fmt(r.get("ms_median")), fmt(r.get("ms_p20")), fmt(r.get("ms_p80"))
    if med and p20 and p80:
        return f'{med}<br><span class="gpu-days-spread">{p20}–{p80}</span>'
    return med


COLUMNS = [  # header, value of a row; a column empty in every row of a table is left out
    ("op", lambda r: f"`{_cell(r.get('op'))}`"),
    ("impl", lambda r: f"`{_cell(r.get('impl'))}`"),
    ("shape", lambda r: _cell(r.get("shape"))),
    ("dtype", lambda r: _cell(r.get("dtype"))),
    ("status", _status),
    ("median ms (p20–p80)", _ms),
    ("GB/s", lambda r: fmt(r.get("gbps"))),
    ("TFLOP/s", lambda r: fmt(r.get("tflops"))),
    ("% of copy BW", lambda r: f"{_num(r.get('pct_copy_bw')):.0f}%" if _num(r.get("pct_copy_bw")) is not None else ""),
    ("kernel ms", lambda r: fmt(r.get("kernel_ms"))),
    ("tokens/s", lambda r: fmt(r.get("tokens_per_s"))),
    (
        "speedup vs torch",
        lambda r: f"{_num(r.get('speedup_vs_torch')):.2f}×" if _num(r.get("speedup_vs_torch")) is not None else "",
    ),
    ("peak extra MiB", lambda r: fmt(r.get("peak_extra_mib"))),
    ("host µs", lambda r: fmt(r.get("host_us"))),
    (
        "note",
        lambda r: (
            f'<span class="gpu-days-wrap">{html.escape(_cell(r.get("note")), quote=False)}</span>'
            if _cell(r.get("note"))
            else ""
        ),
    ),
]
ALWAYS = {"op", "impl", "shape", "dtype", "status"}
RIGHT = {"median ms (p20–p80)", "GB/s", "TFLOP/s", "% of copy BW", "kernel ms", "tokens/s"}
RIGHT |= {"speedup vs torch", "peak extra MiB", "host µs"}


def markdown_table(rows, first: list[tuple] = (), drop: tuple[str, ...] = ()) -> str:
    """`rows` (DataFrame) as a markdown table; `first` are extra leading (header, fn) columns,
    `drop` headers of columns to leave out (e.g. "op" when a table holds one op)."""
    records = rows.to_dict("records")
    cols = list(first) + [c for c in COLUMNS if c[0] not in drop]
    cells = [[fn(r) for _, fn in cols] for r in records]
    keep = [
        i
        for i, (h, _) in enumerate(cols)
        if h in ALWAYS or i < len(first) or any(row[i] not in ("", "``") for row in cells)
    ]
    head = "| " + " | ".join(cols[i][0] for i in keep) + " |"
    align = "| " + " | ".join("---:" if cols[i][0] in RIGHT else "---" for i in keep) + " |"
    body = ["| " + " | ".join(row[i] for i in keep) + " |" for row in cells]
    table = "\n".join([head, align, *body])
    return f'<div class="gpu-days-results" markdown>\n\n{table}\n\n</div>'


def stamp_line(rows) -> str:
    """The environment of one run: driver, CUDA, versions, commit, run id, date."""
    parts = []
    for key, label in (
        ("driver", "driver"),
        ("cuda", "CUDA"),
        ("python", "Python"),
        ("torch", "torch"),
        ("triton", "triton"),
        ("max", "max"),
        ("mojo", "mojo"),
    ):
        v = _first(rows, key)
        if v and v != "-":
            parts.append(f"{label} {_cell(v)}")
    commit = _first(rows, "git_commit")
    if commit:
        parts.append(f"commit `{_cell(commit)}`")
    run = _first(rows, "run_id")
    if run:
        parts.append(f"run `{_cell(run)}`")
    ts = _first(rows, "timestamp")
    if ts:
        parts.append(ts.replace("T", " ").replace("+00:00", " UTC"))
    return " · ".join(parts)


def _sort_rows(rows):
    return (
        rows.assign(_size=rows["size"].fillna(-1))
        .sort_values(["op", "dtype", "_size", "shape"], kind="stable")
        .drop(columns="_size")
    )


def results_markdown(day: str, results, tmp: Path, files: Files, config, page_dir: str) -> str:
    """Tables and plots of `day`'s latest run per device, for a page in `page_dir`."""
    rows = results[results["day"] == day] if not results.empty else results
    if rows.empty:
        return (
            '!!! info "No results yet"\n\n'
            f"    The results store holds no run of `{day}`. On a machine with a GPU:\n\n"
            "    ```bash\n"
            f"    nox -s bench -- --day {day}\n"
            "    ```\n\n"
            "    appends them to `results/<device>/" + day + ".csv`; rebuild the site (`nox -s docs`) to see the "
            "tables and plots here.\n"
        )
    from benchmark.plots import COPY_OP, plot_day, plot_name

    plots = {p.name: p for p in plot_day(rows, day, tmp / day)}
    out = []
    for device_dir in _device_order(rows):
        dev = rows[rows["device_dir"] == device_dir]
        device = _cell(_first(dev, "device") or device_dir)
        out.append(f"### {device}\n")
        runs = list(dev.groupby("run_id", sort=True))
        for _run, run_rows in runs:  # each op's newest run: a session may time ops separately
            run_ops = sorted(set(run_rows["op"].astype(str)), key=lambda op: (op == COPY_OP, op))
            prefix = f"{', '.join(f'`{o}`' for o in run_ops)}: " if len(runs) > 1 else ""
            out.append(f"{prefix}{stamp_line(run_rows)}\n{{: .gpu-days-stamp }}\n")
        ops = list(dict.fromkeys(dev["op"].astype(str)))  # in the order the benchmark wrote them
        ops.sort(key=lambda op: op == COPY_OP)  # the copy reference last
        for op in ops:
            if len(ops) > 1:
                out.append(f"#### `{op}`\n")
            out.append(markdown_table(dev[dev["op"].astype(str) == op], drop=("op",) if len(ops) > 1 else ()) + "\n")
            png = plots.get(plot_name(day, device_dir, op))
            if png:
                uri = f"{page_dir}/{day}/plots/{png.name}"
                files.append(File.generated(config, uri, content=png.read_bytes()))
                out.append(f"![{day} {op} on {device}]({day}/plots/{png.name}){{ .gpu-days-plot }}\n")
    return "\n".join(out)


def family_page(key: str, fam: Family, days: list[Day], results, tmp: Path, files: Files, config) -> str:
    from benchmark.plots import COPY_OP, plot_family, plot_name

    ops = ", ".join(f"`{s}`" for s in fam.ops)
    out = [
        f"# {fam.title}\n",
        f"{fam.blurb}\n" if fam.blurb else "",
        f"Every implementation of the ops whose name contains {ops}, from the latest run of each day on "
        "each device, one table per dtype; within a shape the fastest comes first. This page is generated "
        "from the results store.\n",
    ]
    if results.empty:
        sel = results
    else:
        sel = results[results["op"].astype(str).map(lambda op: op != COPY_OP and any(s in op for s in fam.ops))]
    if sel.empty:
        out.append(
            '!!! info "No results yet"\n\n    No stored run has an op of this family. Run the benchmarks on '
            "a GPU machine (`nox -s bench`) and rebuild the site.\n"
        )
        return "\n".join(out)
    titles = {d.name: d for d in days}

    def day_link(r):
        d = r.get("day")
        return f"[{d}](../days/{d}.md)" if d in titles else f"{_cell(d)}"

    drop_op = ("op",) if sel["op"].nunique() == 1 else ()
    plots = {p.name: p for p in plot_family(results, key, list(fam.ops), tmp / "families")}
    for device_dir in _device_order(sel):
        dev = sel[sel["device_dir"] == device_dir]
        device = _cell(_first(dev, "device") or device_dir)
        out.append(f"## {device}\n")
        runs = [f"- {day_link({'day': d})}: {stamp_line(g)}" for d, g in dev.groupby("day")]
        out.append('??? note "Runs shown"\n\n' + "\n".join("    " + r for r in runs) + "\n")
        png = plots.get(plot_name("family", key, device_dir))
        if png:
            uri = f"families/{key}/plots/{png.name}"
            files.append(File.generated(config, uri, content=png.read_bytes()))
            out.append(f"![{fam.title} on {device}]({key}/plots/{png.name}){{ .gpu-days-plot }}\n")
        dev = dev.assign(_size=dev["size"].fillna(-1), _ms=dev["ms_median"].fillna(float("inf")))
        for dtype, g in dev.groupby(dev["dtype"].astype(str), sort=True):
            out.append(f"### {device}: {dtype}\n")
            g = g.sort_values(["_size", "shape", "_ms"], kind="stable")
            out.append(markdown_table(g, first=[("day", day_link)], drop=("dtype", *drop_op)) + "\n")
    return "\n".join(out)


# ---------------------------------------------------------------------------- standings


def _pct(v) -> str:
    return f"{v:.0f}%" if _num(v) is not None else ""


def _times(v) -> str:
    return f"{v:.2f}×" if _num(v) is not None else ""


def standings_page(results, tmp: Path, files: Files, config) -> str:
    """One line per op and dtype at its headline shape, per device (benchmark/standings.py)."""
    from benchmark.plots import plot_name
    from benchmark.standings import plot_standings, standings

    out = [
        "# Where each kernel stands\n",
        "Each op of the log at its headline shape (the largest one its implementations ran), from the "
        "latest run on each device: the fastest of the log's implementations, and how it compares with "
        "the baselines timed **in the same run**. *% of copy* is the bandwidth reached against a "
        "device-to-device copy (memory-bound ops); *% of library* is torch's library kernel time over "
        "ours (cuBLAS for GEMM, SDPA for attention). *Host µs* is the host cost of one call of the "
        "op with no autograd ([day 016](days/day016.md)), next to torch's. Generated from the results "
        "store.\n",
    ]
    rows = standings(results)
    if not rows:
        out.append('!!! info "No results yet"\n\n    Run `nox -s bench` on a GPU machine and rebuild the site.\n')
        return "\n".join(out)
    head = (
        "| day | op | dtype | shape | best | ms | kernel ms | % of copy | TFLOP/s | % of library "
        "| vs torch eager | vs torch.compile | host µs (torch) | commit |"
    )
    align = "| --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"
    for device_dir in dict.fromkeys(r["device_dir"] for r in rows):
        mine = [r for r in rows if r["device_dir"] == device_dir]
        out.append(f"## {_cell(mine[0]['device'])}\n")
        png = plot_standings(rows, device_dir, tmp / "standings" / plot_name("standings", device_dir))
        if png:
            files.append(File.generated(config, f"standings/plots/{png.name}", content=png.read_bytes()))
            out.append(f"![speedups on {_cell(mine[0]['device'])}](standings/plots/{png.name}){{ .gpu-days-plot }}\n")
        lines = [head, align]
        for r in mine:
            lib = f"{_pct(r['pct_of_library'])} {r['library']}" if r["pct_of_library"] is not None else ""
            host = fmt(r["host_us"]) + (f" ({fmt(r['torch_host_us'])})" if r["torch_host_us"] is not None else "")
            commit = f"`{_cell(r['commit'])}`" if _cell(r["commit"]) else ""
            cells = [
                f"[{r['day']}](days/{r['day']}.md)",
                f"`{_cell(r['op'])}`",
                _cell(r["dtype"]),
                _cell(r["shape"]),
                f"`{_cell(r['best'])}`",
                fmt(r["ms"]),
                fmt(r["kernel_ms"]),
                _pct(r["pct_copy_bw"]),
                fmt(r["tflops"]),
                lib,
                _times(r["vs_eager"]),
                _times(r["vs_compile"]),
                host,
                commit,
            ]
            lines.append("| " + " | ".join(cells) + " |")
        out.append('<div class="gpu-days-results" markdown>\n\n' + "\n".join(lines) + "\n\n</div>\n")
    return "\n".join(out)


# ---------------------------------------------------------------------------- home page


def headline(day: str, results) -> str:
    """The day's best result: highest % of copy bandwidth (else GB/s, else speedup) on a GPU if any."""
    if results is None or results.empty:
        return ""
    rows = results[(results["day"] == day) & (results["status"] == "ok") & (results["op"] != "copy_bandwidth")]
    if rows.empty:
        return ""
    gpu = rows[rows["device_type"] == "cuda"]
    rows = gpu if not gpu.empty else rows
    mine = rows[~rows["impl"].astype(str).str.lower().str.startswith("torch")]
    rows = mine if not mine.empty else rows
    for key in ("pct_copy_bw", "gbps", "speedup_vs_torch"):
        have = rows[rows[key].notna()]
        if not have.empty:
            best = have.loc[have[key].idxmax()]
            break
    else:
        have = rows[rows["ms_median"].notna()]
        if have.empty:
            return ""
        best = have.loc[have["ms_median"].idxmin()]
    bits = []
    if _num(best.get("gbps")) is not None:
        bits.append(f"{fmt(best['gbps'])} GB/s")
    if _num(best.get("pct_copy_bw")) is not None:
        bits.append(f"{best['pct_copy_bw']:.0f}% of copy BW")
    if _num(best.get("speedup_vs_torch")) is not None:
        bits.append(f"{best['speedup_vs_torch']:.2f}× vs torch")
    if not bits:
        bits.append(f"{fmt(best['ms_median'])} ms")
    device = _first(results[results["device_dir"] == best["device_dir"]], "device") or best["device_dir"]
    return (
        f"`{_cell(best['impl'])}`: {', '.join(bits)} "
        f"<small>({_cell(best['shape'])} {_cell(best['dtype'])}, {_cell(device)})</small>"
    )


def days_table(days: list[Day], results, src_uri: str) -> str:
    if not days:
        return '!!! info "No days yet"\n\n    Scaffold one with `nox -s new_day -- 1 "title"`.\n'
    prefix = "../" * src_uri.count("/")
    lines = ["| Day | Topic | Summary | Headline result |", "| ---: | --- | --- | --- |"]
    for d in days:
        lines.append(
            f"| [{d.num:03d}]({prefix}days/{d.name}.md) | [{_cell(d.title)}]({prefix}days/{d.name}.md) | "
            f"{_cell(d.summary)} | {headline(d.name, results) or '—'} |"
        )
    return "\n".join(lines)

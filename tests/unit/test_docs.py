"""The documentation holds together: every relative link in README.md and docs/*.md reaches a file
(and a heading, for `#anchor` links), the README stays a front page, and docs/index.md lists
every page. Reads files only; imports nothing of partrain."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
README_MAX_LINES = 300

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
# [text](target "title") and ![alt](target); the target may be wrapped in <...>.
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # https:, mailto:, ...


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks (a link or heading inside one is an example)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def _without_code_spans(line: str) -> str:
    return re.sub(r"(`+)(.+?)\1", "", line)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text, lower-cased, with every character but
    letters, digits, '_', '-' and spaces dropped, and spaces made hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link renders as its text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.replace("`", "").replace("*", "")
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in a Markdown file, duplicates numbered as GitHub does (-1, -2)."""
    seen: dict[str, int] = {}
    found = set()
    for line in _prose_lines(path.read_text(encoding="utf-8")):
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(path: Path) -> list[str]:
    """The link targets in a Markdown file's prose (code blocks and code spans left out)."""
    found = []
    for line in _prose_lines(path.read_text(encoding="utf-8")):
        line = _without_code_spans(line)
        found += INLINE_LINK.findall(line)
        ref = REFERENCE_DEF.match(line)
        if ref:
            found.append(ref.group(1))
    return found


def broken_links(path: Path) -> list[str]:
    """The relative links of `path` that reach no file, or no heading of the file they name."""
    broken = []
    for target in links(path):
        if EXTERNAL.match(target):
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            broken.append(f"{target}: no such file {dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with the anchor #{anchor} in {dest.name}")
        elif anchor and dest.suffix != ".md":
            broken.append(f"{target}: an anchor into {dest.name}, which has no headings")
    return broken


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = broken_links(page)
    assert not broken, f"{page.relative_to(ROOT)}: broken links:\n" + "\n".join(broken)


def test_the_readme_is_a_front_page():
    n = len(README.read_text(encoding="utf-8").splitlines())
    assert n < README_MAX_LINES, (f"README.md has {n} lines; keep it under {README_MAX_LINES} "
                                  "and move the rest to docs/")



def test_every_docs_page_is_listed_in_the_index():
    index = ROOT / "docs" / "index.md"
    listed = {(index.parent / t.partition("#")[0]).resolve()
              for t in links(index) if not EXTERNAL.match(t) and t.partition("#")[0]}
    missing = [p.name for p in sorted((ROOT / "docs").glob("*.md"))
               if p != index and p.resolve() not in listed]
    assert not missing, f"docs/index.md does not link: {', '.join(missing)}"


def test_the_readme_test_command_is_the_one_ci_runs():
    """`.ci/run` runs the README's test command; the two must not drift apart."""
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").strip().splitlines()[-1].strip()
    assert ci in README.read_text(encoding="utf-8"), f"README.md does not hold .ci/run's {ci!r}"


# The checks above must be able to fail: each is run on pages made here with a known fault.

def test_slug_follows_githubs_rule():
    assert slug("Activation checkpointing: `train.activation_checkpointing`") == \
        "activation-checkpointing-trainactivation_checkpointing"
    assert slug("Hugging Face: weights in and out, and sampling") == \
        "hugging-face-weights-in-and-out-and-sampling"
    assert slug("On GPUs (measured on an H100)") == "on-gpus-measured-on-an-h100"
    assert slug("ZeRO: `parallel.zero_stage` and offload") == "zero-parallelzero_stage-and-offload"


def test_broken_links_are_found(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## A part\n\n## A part\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n"
        "[fine](other.md) [fine](other.md#a-part) [fine](other.md#a-part-1) [fine](#page)\n"
        "[external](https://example.org/nowhere) [code span](`missing.md`)\n"
        "```\n[in a code block](missing-in-code.md)\n```\n"
        "[missing file](missing.md) [missing anchor](other.md#no-such-part)\n"
        "[missing local anchor](#nowhere)\n"
        "[ref]: gone.md\n")
    broken = broken_links(page)
    assert [b.split(":")[0] for b in broken] == [
        "missing.md", "other.md#no-such-part", "#nowhere", "gone.md"]

"""The README stays short and its promises stay true: at most 150 lines, every relative link in
README.md and docs/*.md reaches a file (and a heading, where the link names one), the exit codes
it lists are those `python -m megatron_rlhf` documents, and the license it names is the one the
package declares. Pure Python, no imports of the package."""

import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
README_MAX_LINES = 150

# [text](target) outside code; a target with a scheme (https:, mailto:) is not checked.
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")


def markdown_files() -> list[Path]:
    return [README, *sorted((REPO / "docs").glob("*.md"))]


def prose(text: str) -> str:
    """The text without code blocks and inline code, where brackets are not links."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def heading_anchors(text: str) -> set[str]:
    """GitHub's anchors for the headings of a Markdown file: lower case, punctuation dropped,
    spaces to hyphens."""
    anchors = set()
    for line in FENCE.sub("", text).splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


def broken_links(path: Path) -> list[str]:
    broken = []
    for target in LINK.findall(prose(path.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):
            continue
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(REPO)}: ({target})"
        if not linked.exists():
            broken.append(f"{where}: no file {linked.relative_to(REPO) if linked.is_relative_to(REPO) else linked}")
        elif anchor and linked.suffix == ".md" and anchor not in heading_anchors(linked.read_text()):
            broken.append(f"{where}: no heading #{anchor} in {linked.relative_to(REPO)}")
    return broken


def exit_codes_in(text: str) -> set[int]:
    return {int(code) for code in re.findall(r"\b(\d+)\b", text)}


def test_readme_is_short():
    lines = README.read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail into a guide in docs/"


def test_every_relative_link_reaches_a_file_and_heading():
    broken = [problem for path in markdown_files() for problem in broken_links(path)]
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_readme_exit_codes_are_the_commands_documented_ones():
    """README's one list ("- N: meaning" under "## Exit codes") equals the codes in the docstring of
    megatron_rlhf/__main__.py (its "Exit codes:" sentence)."""
    readme = README.read_text()
    section = readme.split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    listed = {int(code) for code in re.findall(r"^- (\d+):", section, re.M)}
    main_doc = (REPO / "megatron_rlhf" / "__main__.py").read_text().split('"""')[1]
    documented = exit_codes_in(main_doc.split("Exit codes:", 1)[1])
    assert listed == documented, f"README lists {sorted(listed)}, megatron_rlhf/__main__.py documents {sorted(documented)}"


def test_license_file_and_package_metadata_agree():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project.get("license") == "Apache-2.0", "pyproject.toml [project] license should be \"Apache-2.0\""
    assert "LICENSE" in project.get("license-files", []), "pyproject.toml [project] license-files should list LICENSE"
    text = (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text, "LICENSE is not the Apache License 2.0"

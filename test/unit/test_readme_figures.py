"""Every figure a user reads has its run committed: the README's result block is exactly
what ``benchmark/readme_figures.py`` computes from committed JSON, and every result path the
README or docs/ cite is in the repository."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmark"))

import readme_figures  # noqa: E402 -- a benchmark script, not a package

CITED = re.compile(r"benchmark/results/[A-Za-z0-9_.\-/]*[A-Za-z0-9_\-]")


def test_the_readme_says_what_its_results_compute() -> None:
    runs = [(source, readme_figures.load(source)) for source in readme_figures.SOURCES]
    assert readme_figures.readme_block(readme_figures.README.read_text()) == readme_figures.block(runs)
    assert (ROOT / readme_figures.PLOT).is_file()


def test_each_readme_run_states_its_host_date_commit_prompts_and_order() -> None:
    for source in readme_figures.SOURCES:
        run = readme_figures.load(source)
        machine = run["machine"]
        assert machine["date"] and machine["cpu"] and machine["git_commit"], source.path
        assert run["interleaved"], f"{source.path}: plain PD must run interleaved, prompt by prompt"
        lengths = {r["prompt_tokens"] for records in run["raw"]["bf16"].values() for r in records}
        assert len(lengths) >= 3, f"{source.path}: prompts of varied length"


def cited_paths() -> set[str]:
    texts = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return {match.group(0) for path in texts for match in CITED.finditer(path.read_text())}


def test_every_result_the_readme_and_docs_cite_is_committed() -> None:
    tracked = None
    if (ROOT / ".git").exists():
        listed = subprocess.run(
            ["git", "ls-files", "benchmark/results"], cwd=ROOT, capture_output=True, text=True
        )
        tracked = set(listed.stdout.split())
    missing = []
    for cited in sorted(cited_paths()):
        path = ROOT / cited
        if not path.exists():
            missing.append(f"{cited}: not in the tree")
        elif tracked is not None and path.is_file() and cited not in tracked:
            missing.append(f"{cited}: not committed")
        elif (
            tracked is not None
            and path.is_dir()
            and not any(t.startswith(cited.rstrip("/") + "/") for t in tracked)
        ):
            missing.append(f"{cited}: no committed file")
    assert not missing, "\n".join(missing)

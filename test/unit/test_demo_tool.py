"""The demo's own logic (``lynx.tools.demo``; the demo itself runs in
``test/e2e/test_demo.py``): what it reads from decode's metrics, the prompt it cuts for
``--link``, and the errors it stops with before starting anything."""

from __future__ import annotations

import os

import pytest

from lynx.tools import demo

METRICS = """\
# HELP lynx_anchor_latency_seconds Receive space offered -> Anchor landed
# TYPE lynx_anchor_latency_seconds histogram
lynx_anchor_latency_seconds_bucket{engine_rank="0",le="0.5"} 1.0
lynx_anchor_latency_seconds_sum{engine_rank="0"} 1.25
lynx_anchor_latency_seconds_sum{engine_rank="1"} 0.25 1700000000
lynx_anchor_latency_seconds_count{engine_rank="0"} 3.0
lynx_residual_latency_seconds_count 2.0
"""


def test_metric_totals_sum_each_sample_over_its_label_sets() -> None:
    names = ["lynx_anchor_latency_seconds_sum", "lynx_anchor_latency_seconds_count", "absent_total"]
    assert demo.metric_totals(METRICS, names) == {
        "lynx_anchor_latency_seconds_sum": 1.5,  # the timestamp is not a value
        "lynx_anchor_latency_seconds_count": 3.0,
    }
    assert demo.metric_totals(METRICS, ["lynx_residual_latency_seconds_count"]) == {
        "lynx_residual_latency_seconds_count": 2.0
    }


def _totals(anchor: tuple[float, float], residual: tuple[float, float]) -> dict[str, float]:
    return {
        "lynx_anchor_latency_seconds_sum": anchor[0],
        "lynx_anchor_latency_seconds_count": anchor[1],
        "lynx_residual_latency_seconds_sum": residual[0],
        "lynx_residual_latency_seconds_count": residual[1],
    }


def test_landing_times_are_the_one_requests_growth_of_each_histogram() -> None:
    before = _totals((0.5, 1), (0.75, 1))
    assert demo.landing_times(before, _totals((1.25, 2), (2.0, 2))) == {"Anchor": 0.75, "Residual": 1.25}
    # The Residual not sent (anchor-only), or two requests in between: left out.
    assert demo.landing_times(before, _totals((1.25, 2), (0.75, 1))) == {"Anchor": 0.75}
    assert demo.landing_times(before, _totals((2.0, 3), (2.0, 3))) == {}
    # The first request of a server: no sample before it.
    assert demo.landing_times({}, _totals((0.5, 1), (0.75, 1))) == {"Anchor": 0.5, "Residual": 0.75}
    assert demo.landing_times({}, {}) == {}  # decode without metrics


class _WordTokenizer:
    """One token per space-separated word, as a Hugging Face tokenizer is called."""

    def __call__(self, text: str, add_special_tokens: bool) -> dict[str, list[str]]:
        assert not add_special_tokens
        return {"input_ids": text.split(" ")}

    def decode(self, ids: list[str]) -> str:
        return " ".join(ids)


def test_the_excerpt_is_the_first_tokens_of_the_text() -> None:
    assert demo.excerpt(_WordTokenizer(), "one two three four", 3) == "one two three"
    with pytest.raises(SystemExit, match="has 4 tokens, fewer than the 5 asked for"):
        demo.excerpt(_WordTokenizer(), "one two three four", 5)


def test_the_link_prompt_comes_from_the_repos_readme_and_docs() -> None:
    docs = demo.repo_docs()
    assert docs.startswith((demo.REPO / "README.md").read_text())
    assert (demo.REPO / "docs" / "glossary.md").read_text() in docs
    assert len(docs) > 8 * 1500  # the default 1500 tokens, even at 8 characters a token


def test_the_ttft_comparison_shows_both_and_the_ratio() -> None:
    assert demo.ttft_comparison("20mbit", 9.6, 24.0) == (
        "TTFT over the 20mbit link: Lynx 9.60 s, plain PD 24.00 s (Lynx / plain PD = 0.40)"
    )


def test_link_without_root_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(SystemExit) as exit_info:
        demo.main(["--link", "20mbit", "--model", "tiny"])
    assert exit_info.value.code == 2
    assert "error: --link needs root" in capsys.readouterr().err


def test_link_and_attach_do_not_go_together(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        demo.main(["--link", "20mbit", "--attach", "http://router:8000", "--decode-url", "http://decode:1"])
    assert exit_info.value.code == 2
    assert "--link starts its own cluster" in capsys.readouterr().err

"""``lowwater demo``: the README's first command ends at the low-water mark."""

import json

from lowwater.cli import main


def test_demo_ends_with_both_tables_empty(capsys):
    assert (
        main(
            [
                "demo",
                "--steps",
                "2",
                "--rollouts",
                "3",
                "--turns",
                "4",
                "--image-kb",
                "8",
                "--seq-len",
                "4096",
                "--json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["low_water"] is True
    it, fb = out["intercept_table"], out["fetch_buffer"]
    assert (it["entries"], it["bytes"], it["live_bytes"], it["open_rollouts"]) == (0, 0, 0, 0)
    # 2 steps x 3 rollouts x 4 calls; the last call of odd rollouts is swept.
    assert it["inserts"] == 24 and it["swept"] == 2 and it["discards"] == 22
    assert (fb["entries"], fb["bytes"], fb["live_bytes"]) == (0, 0, 0)
    assert fb["inserts"] == fb["removals"] == 2 * 3 * 3
    assert [row["shards_left"] for row in out["steps"]] == [0, 0]


def test_demo_bad_input_is_one_line(capsys):
    assert main(["demo", "--steps", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["lowwater demo: error: --steps must be >= 1, got 0"]

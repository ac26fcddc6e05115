"""Rollout and session ids are checked where they enter ``lowwater proxy`` (400 otherwise).

A session id holding a NUL used to be accepted; the stale-session pass then
built its dump's file name from it, ``open`` raised ``ValueError: embedded
null byte``, and the sessions popped after it were never dumped.
"""

from __future__ import annotations

import pytest
import trio

from lowwater.ids import MAX_ID_CHARS, check_id, is_valid_id
from lowwater.trainer.sessions import SessionStore, dump_path

from ._proxy import with_proxy

BAD = ["a\x00b", "a/b", "..", ".", "", "x" * (MAX_ID_CHARS + 1), "a b", "é", "-lead", "a\nb", "a%41"]
GOOD = ["a", "A.b_c:d-e", "0" * MAX_ID_CHARS, "task-3:0"]


@pytest.mark.parametrize("value", BAD)
def test_bad_ids_are_refused(value):
    assert not is_valid_id(value)
    with pytest.raises(ValueError, match="letters, digits"):
        check_id(value, "rollout_id")


@pytest.mark.parametrize("value", [*GOOD, None, 7, ["a"]])
def test_good_ids_pass_and_other_types_do_not(value):
    assert is_valid_id(value) == (value in GOOD)


def test_the_session_store_refuses_a_bad_id_and_never_builds_a_path_from_one(tmp_path):
    store = SessionStore()
    with pytest.raises(ValueError, match="session_id"):
        store.start_session(session_id="a\x00b")
    assert len(store) == 0
    assert dump_path(tmp_path, "ok-1") == tmp_path / "ok-1.json"
    for bad in ("a\x00b", "../../etc/passwd", "a/b"):
        path = dump_path(tmp_path, bad)
        assert path.parent == tmp_path and path.name.startswith("session-") and "\x00" not in str(path)


def test_admin_refuses_bad_ids_with_400(tmp_path):
    async def fn(url, http):
        for bad in [*BAD, 7, ["a"], {"x": 1}, True]:
            r = await http.post(f"{url}/lowwater/rollouts", json={"rollout_id": bad})
            assert r.status_code == 400 and "rollout_id must be" in r.json()["error"], (bad, r.text)
            r = await http.post(f"{url}/lowwater/export", json={"session_ids": ["ok", bad]})
            assert r.status_code == 400, (bad, r.text)
        for good in GOOD:
            r = await http.post(f"{url}/lowwater/rollouts", json={"rollout_id": good})
            assert r.status_code == 200 and r.json()["rollout_id"] == good
        # In a path: percent-decoded once by the server, then checked.
        # (".." is not sent: the client resolves it in the URL itself.)
        for path in ("a%00b", "x%2541", "%C3%A9", "x" * (MAX_ID_CHARS + 1)):
            r = await http.delete(f"{url}/lowwater/rollouts/{path}")
            assert r.status_code == 400 and "rollout id must be" in r.json()["error"], (path, r.text)
            r = await http.post(f"{url}/lowwater/sessions/{path}/reward", json={"reward": 1})
            assert r.status_code == 400 and "session id must be" in r.json()["error"], (path, r.text)
        # Decoded once: "x%41" names "xA", and "x%2541" names "x%41", which is not an id.
        assert (await http.post(f"{url}/lowwater/rollouts", json={"rollout_id": "xA"})).status_code == 200
        assert (await http.delete(f"{url}/lowwater/rollouts/x%2541")).status_code == 400
        r = await http.delete(f"{url}/lowwater/rollouts/x%41")
        assert r.status_code == 200 and r.json()["rollout_id"] == "xA"
        stats = (await http.get(f"{url}/lowwater/stats")).json()
        # "xA" is closed; its session is held until exported.
        assert stats["open_rollouts"] == len(GOOD) and stats["sessions"]["sessions"] == len(GOOD) + 1

    trio.run(with_proxy, tmp_path, fn)

"""Every admin endpoint answers a wrongly typed field with 400 and its reason, never 500.

``POST /lowwater/export`` with ``"discount": "x"`` (or null, or [1]) used to
compare a string with a number inside the session store: a 500.
"""

from __future__ import annotations

import orjson
import pytest
import trio

from ._proxy import with_proxy

CASES = [
    # (method, path, body, words the reason must contain)
    ("POST", "/lowwater/export", {"session_ids": ["s"], "discount": "x"}, "discount"),
    ("POST", "/lowwater/export", {"session_ids": ["s"], "discount": None}, "discount"),
    ("POST", "/lowwater/export", {"session_ids": ["s"], "discount": [1]}, "discount"),
    ("POST", "/lowwater/export", {"session_ids": ["s"], "discount": True}, "discount"),
    ("POST", "/lowwater/export", {"session_ids": ["s"], "discount": 0}, "discount"),
    ("POST", "/lowwater/export", {"session_ids": ["s"], "discount": {"a": 1}}, "discount"),
    ("POST", "/lowwater/export", {"session_ids": ["s"], "style": ["concat"]}, "style"),
    ("POST", "/lowwater/export", {"session_ids": ["s"], "style": None}, "style"),
    ("POST", "/lowwater/export", {"session_ids": "s"}, "session_ids"),
    ("POST", "/lowwater/export", {"session_ids": [1]}, "session_ids"),
    ("POST", "/lowwater/export", [1], "session_ids"),
    ("POST", "/lowwater/sessions/s/reward", {"reward": True}, "reward"),
    ("POST", "/lowwater/sessions/s/reward", {"reward": None}, "reward"),
    ("POST", "/lowwater/sessions/s/reward", {"reward": "1"}, "reward"),
    ("POST", "/lowwater/sessions/s/reward", {"reward": [1]}, "reward"),
    ("POST", "/lowwater/sessions/s/reward", {"points": 1}, "reward"),
    ("POST", "/lowwater/sessions/s/reward", 1, "reward"),
    ("POST", "/lowwater/rollouts", {"task_id": True}, "task_id"),
    ("POST", "/lowwater/rollouts", {"task_id": 1.5}, "task_id"),
    ("POST", "/lowwater/rollouts", {"task_id": [1]}, "task_id"),
    ("POST", "/lowwater/rollouts", {"group_id": 7}, "group_id"),
    ("POST", "/lowwater/rollouts", {"rollout_id": 7}, "rollout_id"),
    ("POST", "/lowwater/rollouts", "x", "JSON object"),
]


@pytest.mark.parametrize(("method", "path", "body", "words"), CASES)
def test_a_wrongly_typed_field_is_a_400_naming_it(tmp_path, method, path, body, words):
    got = {}

    async def fn(url, http):
        assert (await http.post(f"{url}/lowwater/rollouts", json={"rollout_id": "s"})).status_code == 200
        got["r"] = await http.request(method, url + path, content=orjson.dumps(body))
        got["held"] = (await http.get(f"{url}/lowwater/sessions")).json()["sessions"]

    trio.run(with_proxy, tmp_path, fn)
    r, held = got["r"], got["held"]
    assert r.status_code == 400 and words in r.json()["error"], r.text
    assert held == 1  # nothing was removed

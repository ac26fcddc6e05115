"""A forwarded header that is not ASCII is a 400, not a bare 500.

``anthropic-version: café`` reached httpx, which encodes header values as
ASCII and raised UnicodeEncodeError inside the handler (found by
tests/interception/test_proxy_fuzz.py).
"""

from __future__ import annotations

from ._harness import body, run


def test_a_non_ascii_forwarded_header_is_refused():
    async def fn(h):
        slot, trajectory = h.open("r")
        url = slot.base_url + "/chat/completions"
        for name in ("anthropic-version", "anthropic-beta", "openai-beta"):
            headers = {"authorization": f"Bearer {slot.secret}", name: b"caf\xe9"}
            r = await h.http.post(url, json=body("chat"), headers=headers)
            assert r.status_code == 400 and f"header {name} must be ASCII" in r.json()["error"]["message"]
        headers = {"authorization": f"Bearer {slot.secret}", "openai-beta": "assistants=v2"}
        assert (await h.http.post(url, json=body("chat"), headers=headers)).status_code == 200
        assert len(trajectory.turns) == 1
        await h.assert_clean()

    run(fn)

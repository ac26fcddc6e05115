"""A real ``lowwater proxy`` driven with generated requests: nothing is a 500, nothing hangs, nothing is lost.

One ``lowwater proxy --sessions --model scripted`` process forwards to one
``lowwater serve-model --scripted`` process for the whole module.  A
Hypothesis state machine opens rollouts, calls the model endpoints with
generated bodies, ids and headers (valid, mutated, mistyped, deep, oversized,
not JSON), sets rewards, exports and closes, and hits the admin endpoints
with generated methods, paths and bodies.  After every step: no 5xx but the
documented 502/504 (upstream faults), no request left hanging (every request
has a client timeout).  After every example: everything closed and exported,
the proxy's stats are empty, and every closed rollout is a line of the
trajectories file.

Examples: ``FUZZ_EXAMPLES`` (200 of 12 steps, about 30 s: a CI budget);
``LOWWATER_HYPOTHESIS_PROFILE=long`` runs 1,000 of 40 steps (about 5 min),
``LOWWATER_FUZZ_EXAMPLES=N`` any number (past pytest-timeout's 600 s, add
``--timeout 0``), and ``LOWWATER_FUZZ_NO_SHRINK=1`` reports a failure as
found.  Found by it: a non-ASCII forwarded header was a bare 500, and a
response given before a large body was read did not say ``connection:
close`` (the client's next request on that connection failed).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from urllib.parse import quote

import httpx
import hypothesis.strategies as st
import orjson
import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

from lowwater.ids import MAX_ID_CHARS, is_valid_id

LONG = os.environ.get("LOWWATER_HYPOTHESIS_PROFILE") == "long"
FUZZ_EXAMPLES = int(os.environ.get("LOWWATER_FUZZ_EXAMPLES", 1000 if LONG else 200))
STEPS = 40 if LONG else 12
#: A request answered later than this is a hung request (seconds; a guard, not a timing assertion).
CLIENT_TIMEOUT_S = 30.0
ADMIN_KEY = "fuzz-admin"
ADMIN = {"x-api-key": ADMIN_KEY}
MAX_BODY_MIB = 0.25
#: Statuses the proxy may answer; of the 5xx only the upstream faults (docs/interception.md).
ALLOWED = {200, 400, 401, 404, 405, 409, 410, 413, 422, 429, 502, 504}
PATHS = ["/v1/chat/completions", "/v1/responses", "/v1/messages"]
ROLES = ["system", "developer", "user", "assistant", "tool", "function", "bogus"]


def _start(argv: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "lowwater", *argv],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=open(log, "wb"),  # closed with the process
        env=env,
    )


def _wait_for(log: Path, marker: bytes, process: subprocess.Popen) -> bytes:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        text = log.read_bytes()
        if marker in text:
            return text
        assert process.poll() is None, text.decode(errors="replace")
        time.sleep(0.05)
    raise AssertionError(f"no {marker!r} in {log}")


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    if process.stdout is not None:
        process.stdout.close()


@pytest.fixture(scope="module")
def proxy(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    model = _start(["serve-model", "--scripted"], tmp / "serve-model.log")
    proxy_process = None
    try:
        upstream = model.stdout.readline().decode().strip()
        assert upstream.startswith("http://"), (tmp / "serve-model.log").read_text()
        env = {**os.environ, "LOWWATER_ADMIN_KEY": ADMIN_KEY}
        argv = ["proxy", "--upstream", f"{upstream}/v1", "--listen", "127.0.0.1:0", "--out", str(tmp / "out")]
        argv += ["--sessions", "--model", "scripted", "--retries", "0", "--max-body-mib", str(MAX_BODY_MIB)]
        proxy_process = _start(argv, tmp / "proxy.log", env)
        banner = _wait_for(tmp / "proxy.log", b"listening on ", proxy_process)
        url = banner.split(b"listening on ")[1].split(b" ")[0].decode()
        yield {"url": url, "out": tmp / "out" / "trajectories.jsonl", "log": tmp / "proxy.log"}
    finally:
        if proxy_process is not None:
            _stop(proxy_process)
        _stop(model)
    assert proxy_process.returncode in (0, 143), (tmp / "proxy.log").read_text()


# --- strategies ---------------------------------------------------------------------------

json_scalars = st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats() | st.text(max_size=20)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def nested(levels: int) -> bytes:
    return b"[" * levels + b"]" * levels


@st.composite
def messages(draw):
    out = []
    for _ in range(draw(st.integers(1, 3))):
        content = draw(st.text(max_size=40) | json_values)
        out.append({"role": draw(st.sampled_from(ROLES)), "content": content})
    return out


@st.composite
def model_bodies(draw, path: str) -> bytes:
    """Valid bodies of the path's protocol, mutated ones, other JSON, deep JSON, oversized, not JSON."""
    kind = draw(st.sampled_from(["valid", "valid", "valid", "mutated", "json", "deep", "big", "garbage"]))
    if kind == "json":
        return orjson.dumps(draw(json_values))
    if kind == "deep":
        levels = draw(st.sampled_from([100, 127, 128, 129, 200, 255, 300, 1000, 1100]))
        return b'{"model": "m", "messages": [{"role": "user", "content": %s}]}' % nested(levels - 3)
    if kind == "garbage":
        return draw(st.binary(max_size=64))
    msgs = draw(messages())
    body: dict = {"model": draw(st.sampled_from(["scripted", "m", "other"]))}
    if path == "/v1/responses":
        body["input"] = draw(st.just(msgs) | st.text(max_size=30))
    else:
        body["messages"] = msgs
    if path == "/v1/messages":
        body["max_tokens"] = draw(st.integers(1, 64))
    if draw(st.booleans()):
        body["stream"] = True
    if kind == "big":
        body["padding"] = "x" * int(MAX_BODY_MIB * (1 << 20) + 1)
    if kind == "mutated":
        key = draw(st.sampled_from(["model", "messages", "input", "stream", "max_tokens", "tools", "extra"]))
        if draw(st.booleans()):
            body.pop(key, None)
        else:
            body[key] = draw(json_values)
    return orjson.dumps(body)


# What h11 lets a client send: visible ASCII and obs-text, no surrounding whitespace.
header_values = st.binary(min_size=0, max_size=16).map(
    lambda b: bytes(c for c in b if c >= 0x20 and c != 0x7F).strip(b" \t")
)
extra_headers = st.dictionaries(
    st.sampled_from(["anthropic-version", "anthropic-beta", "openai-beta", "content-type", "accept", "x-whatever"]),
    header_values,
    max_size=3,
)
bad_ids = st.sampled_from(["", ".", "..", "a/b", "a\x00b", "x" * (MAX_ID_CHARS + 1), "-x", "a b", "é"]) | st.text(
    max_size=10
)
rewards = st.floats() | st.integers(-(2**63), 2**63 - 1) | st.booleans() | st.text(max_size=5) | st.none() | json_values
discounts = st.floats(0, 1) | st.floats() | json_values | st.sampled_from([0.5, 1, 1.0, 0, -1, True])
styles = st.sampled_from(["individual", "concat", "zip", ""]) | json_values


# --- the machine ----------------------------------------------------------------------------


def make_machine(endpoint: dict):
    url = endpoint["url"]

    class ProxyFuzz(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.http = httpx.Client(timeout=CLIENT_TIMEOUT_S)
            self.prefix = uuid.uuid4().hex[:8]
            self.counter = 0
            self.open: dict[str, dict] = {}  # rollout id -> {"base_url", "api_key"}
            self.held: set[str] = set()  # sessions not exported yet
            self.closed: list[str] = []  # rollouts whose DELETE answered 200
            self.last: object = None

        # -- helpers ------------------------------------------------------------------

        def request(self, method: str, path: str, **kw) -> httpx.Response:
            try:
                r = self.http.request(method, url + path, **kw)
            except httpx.TimeoutException:
                raise AssertionError(f"{method} {path}: no answer within {CLIENT_TIMEOUT_S} s") from None
            except httpx.RemoteProtocolError as exc:
                raise AssertionError(f"{method} {path}: {exc}; the request before: {self.last}") from None
            self.check(r, f"{method} {path}")
            self.last = (method, path, kw, r.status_code, r.headers)
            return r

        @staticmethod
        def check(r: httpx.Response, what: str) -> None:
            assert r.status_code in ALLOWED, f"{what}: {r.status_code} {r.text[:500]}"

        def new_id(self) -> str:
            self.counter += 1
            return f"{self.prefix}-{self.counter}"

        def track(self, method: str, path: str, r: httpx.Response) -> None:
            """Keep the model in step with what a generated admin request did."""
            if r.status_code != 200:
                return
            path = r.request.url.path  # as sent: the client resolves "." and ".." segments
            body = r.json()
            if method == "POST" and path.rstrip("/") == "/lowwater/rollouts":
                self.open[body["rollout_id"]] = body
                self.held.add(body["rollout_id"])
            elif method == "DELETE" and path.startswith("/lowwater/rollouts/"):
                self.open.pop(body["rollout_id"], None)
                self.closed.append(body["rollout_id"])
            elif path == "/lowwater/export":
                self.held.difference_update(body["exported"])

        # -- rules --------------------------------------------------------------------

        @rule(data=st.data())
        def open_rollout(self, data):
            choice = data.draw(st.sampled_from(["new", "new", "none", "existing", "bad", "body"]))
            if choice == "body":
                payload = orjson.dumps(data.draw(json_values))
                r = self.request("POST", "/lowwater/rollouts", content=payload, headers=ADMIN)
                return self.track("POST", "/lowwater/rollouts", r)
            options: dict = {}
            if choice == "new":
                options["rollout_id"] = self.new_id()
            elif choice == "existing" and self.open:
                options["rollout_id"] = data.draw(st.sampled_from(sorted(self.open)))
            elif choice == "bad":
                options["rollout_id"] = data.draw(bad_ids)
            if data.draw(st.booleans()):
                options["task_id"] = data.draw(json_values)
            if data.draw(st.booleans()):
                options["group_id"] = data.draw(json_values)
            r = self.request("POST", "/lowwater/rollouts", content=orjson.dumps(options), headers=ADMIN)
            rid = options.get("rollout_id")
            if rid is not None and not is_valid_id(rid):
                assert r.status_code == 400, r.text
            self.track("POST", "/lowwater/rollouts", r)

        @rule(data=st.data())
        def model_call(self, data):
            path = data.draw(st.sampled_from([*PATHS, *PATHS, "/v1/models", "/v1/nothing"]))
            target = data.draw(st.sampled_from(["open", "open", "open", "none", "wrong"]))
            headers = dict(data.draw(extra_headers))
            if target == "open" and self.open:
                opened = self.open[data.draw(st.sampled_from(sorted(self.open)))]
                key = opened["api_key"]
                if data.draw(st.booleans()):
                    headers["authorization"] = f"Bearer {key}".encode()
                else:
                    headers["x-api-key"] = key.encode()
            elif target == "wrong":
                headers["authorization"] = b"Bearer lw-" + data.draw(header_values)
            if path == "/v1/models":
                self.request("GET", path, headers=headers)
                return
            content = data.draw(model_bodies(path))
            received = b""
            try:
                with self.http.stream("POST", url + path, content=content, headers=headers) as r:
                    self.check(r, f"POST {path}")
                    try:
                        for chunk in r.iter_raw():
                            received += chunk
                    except httpx.RemoteProtocolError:
                        # A stream broken off by the proxy carries its error event first.
                        assert b"error" in received, received[-500:]
            except httpx.TimeoutException:
                raise AssertionError(f"POST {path}: no answer within {CLIENT_TIMEOUT_S} s") from None
            self.last = ("POST", path, headers, content[:300], r.status_code, r.headers, received[-300:])

        @precondition(lambda self: self.open)
        @rule(data=st.data())
        def close_rollout(self, data):
            rid = data.draw(st.sampled_from(sorted(self.open)))
            r = self.request("DELETE", f"/lowwater/rollouts/{rid}", headers=ADMIN)
            assert r.status_code == 200, f"DELETE {rid}: {r.status_code} {r.text}"
            self.track("DELETE", f"/lowwater/rollouts/{rid}", r)

        @rule(data=st.data())
        def set_reward(self, data):
            rid = data.draw(st.sampled_from(sorted(self.held)) if self.held else bad_ids)
            body = data.draw(st.fixed_dictionaries({"reward": rewards}) | json_values)
            path = f"/lowwater/sessions/{quote(rid, safe='')}/reward"
            self.request("POST", path, content=orjson.dumps(body), headers=ADMIN)

        @rule(data=st.data())
        def export(self, data):
            ids = data.draw(st.lists(st.sampled_from(sorted(self.held)), max_size=4)) if self.held else []
            if data.draw(st.integers(0, 4)) == 0:
                ids.append(data.draw(bad_ids | st.just(self.new_id())))
            body: dict = {"session_ids": ids}
            if data.draw(st.booleans()):
                body["discount"] = data.draw(discounts)
            if data.draw(st.booleans()):
                body["style"] = data.draw(styles)
            if data.draw(st.integers(0, 5)) == 0:
                body = data.draw(json_values)
            r = self.request("POST", "/lowwater/export", content=orjson.dumps(body), headers=ADMIN)
            if r.status_code == 200:
                answer = r.json()
                assert answer["failed"] == {}, answer["failed"]
                assert set(answer["exported"]) == set(ids)
            self.track("POST", "/lowwater/export", r)

        @rule(data=st.data())
        def raw_admin(self, data):
            method = data.draw(st.sampled_from(["GET", "POST", "DELETE", "PUT", "PATCH"]))
            segment = data.draw(bad_ids | st.just(self.new_id()))
            quoted = quote(segment, safe="")
            path = data.draw(
                st.sampled_from(
                    [
                        "/lowwater/stats",
                        "/lowwater/rollouts",
                        f"/lowwater/rollouts/{quoted}",
                        "/lowwater/sessions",
                        f"/lowwater/sessions/{quoted}/reward",
                        "/lowwater/export",
                        f"/lowwater/{quoted}",
                    ]
                )
            )
            headers = dict(data.draw(extra_headers))
            if data.draw(st.integers(0, 4)):
                headers["x-api-key"] = ADMIN_KEY.encode()
            content = data.draw(st.binary(max_size=64) | json_values.map(orjson.dumps))
            r = self.request(method, path, content=content, headers=headers)
            if "x-api-key" not in headers and r.request.url.path.startswith("/lowwater/"):
                assert r.status_code == 401, r.text  # ("/lowwater/.." is resolved by the client)
            self.track(method, path, r)

        # -- after every example ---------------------------------------------------------

        def teardown(self) -> None:
            try:
                for rid in sorted(self.open):
                    r = self.request("DELETE", f"/lowwater/rollouts/{rid}", headers=ADMIN)
                    assert r.status_code == 200, f"DELETE {rid}: {r.status_code} {r.text}"
                    self.track("DELETE", f"/lowwater/rollouts/{rid}", r)
                for sid in sorted(self.held):
                    r = self.request(
                        "POST", f"/lowwater/sessions/{sid}/reward", content=b'{"reward": 1.0}', headers=ADMIN
                    )
                    assert r.status_code in (200, 409), r.text  # 409: it has another reward already
                if self.held:
                    body = orjson.dumps({"session_ids": sorted(self.held)})
                    r = self.request("POST", "/lowwater/export", content=body, headers=ADMIN)
                    assert r.status_code == 200 and r.json()["failed"] == {}, r.text
                    self.track("POST", "/lowwater/export", r)
                assert not self.held
                self.assert_empty()
                written = {orjson.loads(line)["rollout_id"] for line in endpoint["out"].read_bytes().splitlines()}
                missing = set(self.closed) - written
                assert not missing, f"closed but not written: {sorted(missing)}"
            finally:
                self.http.close()

        def assert_empty(self) -> None:
            deadline = time.monotonic() + CLIENT_TIMEOUT_S
            while True:
                stats = self.request("GET", "/lowwater/stats", headers=ADMIN).json()
                empty = (
                    stats["open_rollouts"],
                    stats["waiting_handlers"],
                    stats["intercepts"]["entries"],
                    stats["intercepts"]["bytes"],
                    stats["sessions"]["sessions"],
                    stats["sessions"]["keys"],
                ) == (0, 0, 0, 0, 0, 0)
                if empty or time.monotonic() > deadline:
                    break
                time.sleep(0.01)  # a handler's finally may run just after its client has the answer
            assert empty, stats

    # LOWWATER_FUZZ_NO_SHRINK=1: report the first failure as found (shrinking a
    # sequence of HTTP calls can take minutes).
    no_shrink = {"phases": [Phase.explicit, Phase.generate]} if os.environ.get("LOWWATER_FUZZ_NO_SHRINK") else {}
    ProxyFuzz.TestCase.settings = settings(
        max_examples=FUZZ_EXAMPLES,
        stateful_step_count=STEPS,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
        database=None,
        **no_shrink,
    )
    return ProxyFuzz


def test_proxy_under_generated_requests(proxy):
    make_machine(proxy).TestCase().runTest()
    log = proxy["log"].read_text(errors="replace")
    assert "Traceback" not in log, log[-4000:]

"""redact_url: credentials never reach a printed or recorded line."""

import pytest

from lowwater.redact import redact_url


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("http://u:p@host:8000/v1", "http://***@host:8000/v1"),
        ("https://user@host/v1", "https://***@host/v1"),
        ("http://u:p@ss@host/v1", "http://***@host/v1"),
        (
            "model server http://a:b@h/v1 is unreachable (was https://c:d@h2?x=1)",
            "model server http://***@h/v1 is unreachable (was https://***@h2?x=1)",
        ),
        ("'http://k:s3cret@10.0.0.1:80'", "'http://***@10.0.0.1:80'"),
        ("http://host:8000/v1", "http://host:8000/v1"),
        ("http://host/v1?email=a@b.c", "http://host/v1?email=a@b.c"),
        ("no url here: a@b", "no url here: a@b"),
    ],
)
def test_redact_url(text, expected):
    assert redact_url(text) == expected
    assert "s3cret" not in redact_url(text)


def test_the_eval_probe_error_names_the_server_without_its_password():
    import trio

    from lowwater.upstream.spec import UpstreamError, probe

    async def main():
        listener = trio.socket.socket()
        await listener.bind(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        listener.close()
        with pytest.raises(UpstreamError) as caught:
            await probe(f"http://user:s3cret@127.0.0.1:{port}/v1", timeout_s=5)
        return str(caught.value)

    message = trio.run(main)
    assert "unreachable" in message and "s3cret" not in message and "http://***@127.0.0.1" in message

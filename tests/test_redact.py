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

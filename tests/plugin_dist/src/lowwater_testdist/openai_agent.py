"""An agent program on the official ``openai`` SDK, as a user would write it:
the task on stdin, the client configured from ``OPENAI_BASE_URL`` and
``OPENAI_API_KEY``, the answer printed as the last JSON line.  The system
message carries a session token the redacting interceptor must remove."""

from __future__ import annotations

import json
import os
import sys

from openai import OpenAI


def main() -> None:
    if os.environ.get("LOWWATER_PREFLIGHT") == "1":
        return  # the start-up check: imports worked
    task = json.load(sys.stdin)
    client = OpenAI(max_retries=0)
    reply = client.chat.completions.create(
        model=os.environ["LOWWATER_MODEL"],
        messages=[
            {"role": "system", "content": "session tok-S3CR3T; answer with a last line 'A: <number>'"},
            {"role": "user", "content": task["prompt"]},
        ],
    )
    print("agent done", file=sys.stderr)
    print(json.dumps(reply.choices[0].message.content))


if __name__ == "__main__":
    main()

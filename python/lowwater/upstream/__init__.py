"""The model side: the upstream client (:mod:`~lowwater.upstream.client`)
over its connection pool (:mod:`~lowwater.upstream.transport`), ``--model``
specs and the ``serve-model`` child (:mod:`~lowwater.upstream.spec`), and
the HTTP client in-process harnesses call the interception server with
(:mod:`~lowwater.upstream.agent_client`)."""

from lowwater.upstream.agent_client import AgentClient
from lowwater.upstream.client import Answer, ModelClient, read_answer
from lowwater.upstream.spec import ModelSpec, UpstreamError, model_server, parse_model, probe
from lowwater.upstream.transport import FreeListTransport

__all__ = [
    "AgentClient",
    "Answer",
    "FreeListTransport",
    "ModelClient",
    "ModelSpec",
    "UpstreamError",
    "model_server",
    "parse_model",
    "probe",
    "read_answer",
]

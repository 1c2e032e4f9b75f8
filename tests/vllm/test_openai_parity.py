"""kvroute's replica answers the context-length cases as a real vLLM server does, through the
``openai`` client: the same status, the same error body keys and the field named, the same usage.

Both serve the default model; each side's prompt is sized to its own ``max_model_len`` (read
from ``/v1/models``), so the cases are the same relative to each context:

- ``max_tokens`` above the context: 400 naming ``max_tokens``;
- a prompt that leaves 20 tokens and ``max_tokens`` 100: 200, 20 tokens, finish ``length``;
- a chat request without ``max_tokens``: the answer may fill the context (``ignore_eos``);
- a completion without ``max_tokens``: 16 tokens;
- the penalties (repetition, presence, frequency) are taken: 200 and the tokens asked for; a
  repetition penalty of 0 is refused with 400.
"""

from __future__ import annotations

import random

import openai
import pytest

from replica.server import BackgroundReplica
from replica.settings import ReplicaSettings

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def clients(vllm_server, default_model_dir):
    settings = ReplicaSettings(replica_id="parity", host="127.0.0.1", port=0, http_port=0,
                               model=str(default_model_dir), torch_threads=1, engine_process=False)
    with BackgroundReplica(settings) as replica:
        yield {
            "vllm": (openai.OpenAI(base_url=f"{vllm_server.url}/v1", api_key="-", max_retries=0), vllm_server.model),
            "kvroute": (openai.OpenAI(base_url=f"http://127.0.0.1:{replica.server.http_port}/v1", api_key="-",
                                      max_retries=0), replica.server.model_name),
        }


def context(client: openai.OpenAI, model: str) -> int:
    return next(m for m in client.models.list().data if m.id == model).model_extra["max_model_len"]


def ids(n: int) -> list[int]:
    rng = random.Random(n)
    return [rng.randrange(10, 500) for _ in range(n)]


def outcomes(client: openai.OpenAI, model: str) -> dict[str, object]:
    n = context(client, model)
    greedy = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}
    out: dict[str, object] = {}
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model, prompt=ids(8), max_tokens=n + 1, **greedy)
    body = err.value.body if isinstance(err.value.body, dict) else {}
    body = body.get("error", body)
    out["over the context"] = (err.value.status_code, {"message", "type", "param", "code"} <= set(body),
                               body.get("param"))
    cut = client.completions.create(model=model, prompt=ids(n - 20), max_tokens=100, **greedy)
    out["prompt leaves 20"] = (cut.usage.completion_tokens, cut.choices[0].finish_reason)
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], **greedy)
    out["chat, no max_tokens"] = (chat.usage.completion_tokens == n - chat.usage.prompt_tokens,
                                  chat.choices[0].finish_reason)
    plain = client.completions.create(model=model, prompt=ids(8), **greedy)
    out["completion, no max_tokens"] = plain.usage.completion_tokens
    penalised = client.completions.create(model=model, prompt=ids(8) * 4, max_tokens=12, temperature=0.0,
                                          presence_penalty=0.5, frequency_penalty=0.5,
                                          extra_body={"ignore_eos": True, "repetition_penalty": 1.3})
    out["penalties"] = (penalised.usage.completion_tokens, penalised.choices[0].finish_reason)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model, prompt=ids(8), max_tokens=4, extra_body={"repetition_penalty": 0})
    out["repetition_penalty 0"] = err.value.status_code
    return out


def test_context_length_cases_match_vllm(clients):
    vllm, kvroute = (outcomes(*clients[side]) for side in ("vllm", "kvroute"))
    assert vllm["over the context"] == (400, True, "max_tokens"), vllm
    assert vllm["penalties"] == (12, "length") and vllm["repetition_penalty 0"] == 400, vllm
    assert kvroute == vllm

"""Client libraries nobody here wrote, against the demo server (issue 44): LangChain's ``langchain-openai``
(a dev dependency) and litellm (not one: it installs ~230 MB with boto3; these tests run where it is
installed, ``pip install litellm``, and are skipped elsewhere). Chat, streaming, forced tools cut by
``max_tokens``, structured output, the Responses API and embeddings, each through the library's own calls."""

from __future__ import annotations

import os

import pytest
from pydantic import BaseModel

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MODEL = "SmolLM2-135M-Instruct"
PARIS = "What is the weather in Paris?"
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


class Report(BaseModel):
    city: str
    sunny: bool


def get_weather(city: str) -> str:
    """Current weather in a city."""
    return "sunny"


# -- LangChain ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lc(server):
    lc_openai = pytest.importorskip("langchain_openai")
    url = f"{server.url}/v1"

    def chat(**kw):
        return lc_openai.ChatOpenAI(model=MODEL, base_url=url, api_key="x", temperature=0, max_retries=0, **kw)

    return lc_openai, chat, url


def test_langchain_chat_and_stream(lc):
    _, chat, _ = lc
    llm = chat(max_tokens=16)
    text = llm.invoke("Say hi").content
    assert text and "".join(c.content for c in llm.stream("Say hi")) == text


def test_langchain_tools_and_structured_output(lc):
    _, chat, _ = lc
    (call,) = chat(max_tokens=34).bind_tools([get_weather], tool_choice="required").invoke(PARIS).tool_calls
    assert call["name"] == "get_weather" and call["args"]["city"] == "Paris"
    report = chat().with_structured_output(Report, method="json_schema").invoke("Paris is sunny today. Report it.")
    assert isinstance(report, Report)


def test_langchain_responses_api_and_embeddings(lc):
    lc_openai, chat, url = lc
    content = chat(max_tokens=16, use_responses_api=True).invoke("Say hi").content
    assert content and content[0]["type"] == "text" and content[0]["text"]
    # NOTE: check_embedding_ctx_length=False, as for any server that is not OpenAI's: otherwise LangChain sends
    # tiktoken's token ids (another vocabulary, and a download).
    emb = lc_openai.OpenAIEmbeddings(model=MODEL, base_url=url, api_key="x", check_embedding_ctx_length=False,
                                     max_retries=0)
    docs = emb.embed_documents(["Paris", "Rome"])
    assert len(docs) == 2 and len(docs[0]) == len(emb.embed_query("Paris")) > 0
    assert docs[0] != docs[1]


# -- litellm -----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ll(server):
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of its price list at import
    litellm = pytest.importorskip("litellm")
    return litellm, dict(model=f"openai/{MODEL}", api_base=f"{server.url}/v1", api_key="x")


def test_litellm_completion_stream_and_tools(ll):
    litellm, kw = ll
    msgs = [{"role": "user", "content": "Say hi"}]
    text = litellm.completion(messages=msgs, max_tokens=8, temperature=0, **kw).choices[0].message.content
    streamed = litellm.completion(messages=msgs, max_tokens=8, temperature=0, stream=True, **kw)
    assert text and "".join(c.choices[0].delta.content or "" for c in streamed) == text
    out = litellm.completion(messages=[{"role": "user", "content": PARIS}], tools=[WEATHER], tool_choice="required",
                             max_tokens=34, temperature=0, **kw)
    (call,) = out.choices[0].message.tool_calls  # the example: cut by max_tokens, the call survives
    assert call.function.name == "get_weather" and out.choices[0].message.content is None


def test_litellm_embeddings_and_responses(ll):
    litellm, kw = ll
    emb = litellm.embedding(input=["hi", "there"], **kw)
    assert len(emb.data) == 2 and len(emb.data[0]["embedding"]) > 0
    r = litellm.responses(input="Say hi", max_output_tokens=8, **kw)
    assert r.output and r.output[0].content[0].text

"""The OpenAI-compatible API (`python -m swarm.api`) through real nodes, spoken to by the
official `openai` package, and its chat page in headless Chromium.

The swarm here is its own: two nodes of a tiny random Llama with a 4096-token context (a reply
can outlast a node record's refresh, so a cancelled one is seen open, then freed), and one node
holding half of another model, whose API must answer 503 naming the blocks nobody serves.
"""

from __future__ import annotations

import json
import re
import shutil
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from devtools.cdp import Browser
from devtools.launch import start_node, start_swarm, stop_all
from swarm.client.client import Client
from swarm.model.tiny import save_tiny_llama, save_tiny_tokenizer
from tests.helpers.api import KEY, ApiServer
from tests.helpers.flags import exact_flags

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# records refresh every 2 s; a 3 s TTL let a record lapse while Chromium took the cores
NODE_FLAGS = exact_flags(ttl=6)
QUESTION = [{"role": "user", "content": "Tell me about the bees, please."}]


@pytest.fixture(scope="module")
def long_model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny-long")
    save_tiny_llama(path, max_position_embeddings=4096)
    save_tiny_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def swarm(long_model):
    nodes = start_swarm([(0, 3), (3, 6)], model=str(long_model), extra=NODE_FLAGS)
    yield nodes
    stop_all(nodes)


@pytest.fixture(scope="module")
def api(swarm, long_model):
    server = ApiServer.start(swarm[0].maddrs[:1], long_model)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def reference(swarm, long_model):
    """`swarm.client` on the same swarm: what the API's greedy answers must equal."""
    client = Client(swarm[0].maddrs[:1], model=str(long_model), wire_dtype="float32")
    yield client
    client.close()


@pytest.fixture(scope="module")
def oa(api) -> openai.OpenAI:
    return api.openai()


def post(url: str, body: bytes, headers: dict[str, str]) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


# ---- answers ------------------------------------------------------------------------------


def test_models_lists_the_served_model_while_its_route_is_full(oa, long_model):
    assert [m.id for m in oa.models.list().data] == [long_model.name]
    assert oa.models.retrieve(long_model.name).id == long_model.name


def test_greedy_chat_equals_generate(oa, reference, long_model):
    want = reference.generate(QUESTION, max_new_tokens=24)
    got = oa.chat.completions.create(
        model=long_model.name, messages=QUESTION, max_tokens=24, temperature=0
    )
    assert got.object == "chat.completion"
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want
    assert len(want) > 10


def test_streamed_chat_equals_generate_chunk_by_chunk(oa, reference, long_model):
    question = [{"role": "system", "content": "Be brief."}, *QUESTION]
    want = list(reference.stream(question, max_new_tokens=20))
    chunks = list(
        oa.chat.completions.create(
            model=long_model.name,
            messages=question,
            max_completion_tokens=20,
            temperature=0,
            stream=True,
        )
    )
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    pieces = [c.choices[0].delta.content for c in chunks[1:-1]]
    assert pieces == want
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert chunks[-1].choices[0].delta.content is None


def test_plain_completion_equals_generate_of_the_raw_prompt(oa, reference, long_model):
    prompt = "The bees of the valley"
    want = reference.generate(prompt, max_new_tokens=16)
    got = oa.completions.create(model=long_model.name, prompt=prompt, max_tokens=16, temperature=0)
    assert got.object == "text_completion"
    assert got.choices[0].text == want


def test_usage_counts_prompt_and_reply_tokens_and_length_is_the_finish(oa, reference, long_model):
    got = oa.chat.completions.create(
        model=long_model.name, messages=QUESTION, max_tokens=7, temperature=0
    )
    assert got.usage.prompt_tokens == len(reference.encode(QUESTION))
    assert got.usage.completion_tokens == 7
    assert got.usage.total_tokens == got.usage.prompt_tokens + 7
    assert got.choices[0].finish_reason == "length"


def test_a_streamed_reply_ends_with_usage_when_asked(oa, reference, long_model):
    chunks = list(
        oa.chat.completions.create(
            model=long_model.name,
            messages=QUESTION,
            max_tokens=9,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].choices == []
    assert chunks[-1].usage.prompt_tokens == len(reference.encode(QUESTION))
    assert chunks[-1].usage.completion_tokens == 9
    assert all(c.usage is None for c in chunks[:-1])


def test_a_stop_string_ends_the_reply_before_it(oa, reference, long_model):
    full = reference.generate(QUESTION, max_new_tokens=30)
    stop = full[12:15]
    assert stop.strip(), f"pick another slice of {full!r}"
    for stream in (False, True):
        kw = dict(model=long_model.name, messages=QUESTION, max_tokens=30, temperature=0)
        if stream:
            chunks = list(oa.chat.completions.create(stop=[stop, "never-seen"], stream=True, **kw))
            text = "".join(c.choices[0].delta.content or "" for c in chunks)
            finish = chunks[-1].choices[0].finish_reason
        else:
            got = oa.chat.completions.create(stop=stop, **kw)
            text, finish = got.choices[0].message.content, got.choices[0].finish_reason
        assert text == full[: full.index(stop)]
        assert finish == "stop"


def test_a_seed_repeats_a_sampled_reply(oa, long_model):
    kw = dict(model=long_model.name, messages=QUESTION, max_tokens=16, temperature=1.0, seed=7)
    a = oa.chat.completions.create(**kw).choices[0].message.content
    b = oa.chat.completions.create(**kw).choices[0].message.content
    c = oa.chat.completions.create(**{**kw, "seed": 8}).choices[0].message.content
    assert a == b
    assert a != c


def test_eight_concurrent_streams_each_get_their_own_reply(oa, reference, long_model):
    topics = ["bees", "sea", "moon", "rain", "hills", "wind", "salt", "fire"]
    questions = [[{"role": "user", "content": f"Tell me of the {w}."}] for w in topics]
    want = [reference.generate(q, max_new_tokens=24) for q in questions]

    def ask(q):
        stream = oa.chat.completions.create(
            model=long_model.name, messages=q, max_tokens=24, temperature=0, stream=True
        )
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(ask, questions))
    assert got == want
    assert len(set(got)) == len(got)


# ---- errors -------------------------------------------------------------------------------


def test_missing_and_malformed_fields_are_400_naming_the_field(api, oa, long_model):
    cases = [
        (dict(model=long_model.name), "messages"),
        (dict(model=long_model.name, messages=[]), "messages"),
        (dict(model=long_model.name, messages=[{"role": "robot", "content": "x"}]),
         "messages[0].role"),
        (dict(model=long_model.name, messages=QUESTION, temperature="hot"), "temperature"),
        (dict(model=long_model.name, messages=QUESTION, temperature=3), "temperature"),
        (dict(model=long_model.name, messages=QUESTION, max_tokens=0), "max_tokens"),
        (dict(model=long_model.name, messages=QUESTION, n=2), "n"),
        (dict(model=long_model.name, messages=QUESTION, stop=["a", "b", "c", "d", "e"]), "stop"),
        (dict(messages=QUESTION), "model"),
    ]  # fmt: skip
    headers = {"content-type": "application/json", "authorization": f"Bearer {KEY}"}
    for body, param in cases:  # raw: the SDK itself refuses a call without messages
        status, got = post(api.url + "/v1/chat/completions", json.dumps(body).encode(), headers)
        assert status == 400, body
        assert set(got) == {"error"}
        assert set(got["error"]) == {"message", "type", "param", "code"}
        assert got["error"]["param"] == param, body
        assert got["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as err:  # and the SDK sees it as one
        oa.chat.completions.create(model=long_model.name, messages=QUESTION, top_p=-1)
    assert err.value.status_code == 400 and err.value.body["param"] == "top_p"


def test_a_body_that_is_not_json_is_400(api):
    status, body = post(
        api.url + "/v1/chat/completions",
        b"{not json",
        {"content-type": "application/json", "authorization": f"Bearer {KEY}"},
    )
    assert status == 400
    assert body["error"]["code"] == "invalid_json"


def test_an_unknown_model_is_404_model_not_found(oa):
    with pytest.raises(openai.NotFoundError) as err:
        oa.chat.completions.create(model="gpt-4o", messages=QUESTION)
    assert err.value.body["code"] == "model_not_found"
    assert err.value.body["param"] == "model"


def test_a_prompt_past_the_context_is_400_context_length_exceeded(oa, long_model):
    long = [{"role": "user", "content": "bees " * 5000}]
    with pytest.raises(openai.BadRequestError) as err:
        oa.chat.completions.create(model=long_model.name, messages=long, max_tokens=10)
    assert err.value.body["code"] == "context_length_exceeded"
    assert "4096" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        oa.chat.completions.create(model=long_model.name, messages=QUESTION, max_tokens=5000)
    assert err.value.body["param"] == "max_tokens"


def test_a_missing_or_wrong_api_key_is_401(api):
    wrong = openai.OpenAI(base_url=api.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as err:
        wrong.models.list()
    assert err.value.body["code"] == "invalid_api_key"
    status, body = post(api.url + "/v1/completions", b"{}", {"content-type": "application/json"})
    assert status == 401
    assert body["error"]["code"] == "invalid_api_key"


@pytest.fixture(scope="module")
def half_api(swarm, tmp_path_factory):
    """Another model on the same DHT with one node holding blocks 0:3 of its 6."""
    path = tmp_path_factory.mktemp("tiny-half")
    save_tiny_llama(path, seed=1)
    save_tiny_tokenizer(path)
    peers = swarm[0].maddrs[:1]
    node = start_node((0, 3), peers, model=str(path), extra=NODE_FLAGS)
    try:
        node.wait_serving()
        server = ApiServer.start(peers, path, key=None)
        yield server, path
        server.stop()
    finally:
        stop_all([node])


def test_no_route_is_503_naming_the_missing_blocks(half_api):
    server, path = half_api
    oa = server.openai()
    assert oa.models.list().data == []
    with pytest.raises(openai.InternalServerError) as err:
        oa.chat.completions.create(model=path.name, messages=QUESTION, max_tokens=4)
    assert err.value.status_code == 503
    assert err.value.body["code"] == "route_unavailable"
    assert "blocks 3:6" in err.value.body["message"]


# ---- a client going away ------------------------------------------------------------------


def open_sessions(client: Client) -> int:
    return sum(r.sessions for r in client.nodes())


def test_a_stream_closed_mid_reply_frees_its_session_on_the_nodes(oa, reference, long_model):
    assert open_sessions(reference) == 0
    # greedy: this model's greedy reply runs on (a sampled one may hit the end token early)
    stream = oa.chat.completions.create(
        model=long_model.name, messages=QUESTION, max_tokens=4000, temperature=0, stream=True
    )
    chunks = iter(stream)
    t0 = time.monotonic()
    for _ in range(21):
        next(chunks)
    rate = 20 / (time.monotonic() - t0)  # tokens a second while the reply streams
    deadline = time.monotonic() + 20  # records refresh every announce-ttl / 3 = 2 s
    while open_sessions(reference) == 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert open_sessions(reference) > 0, "the reply's session never showed in the records"
    stream.close()
    closed = time.monotonic()
    while open_sessions(reference) > 0 and time.monotonic() < closed + 30:
        time.sleep(0.2)
    freed_after = time.monotonic() - closed
    assert open_sessions(reference) == 0
    # finishing the reply instead would have taken ~4000 / rate seconds
    print(f"freed after {freed_after:.1f} s; {rate:.0f} tokens/s")
    assert freed_after < 0.5 * (4000 - 40) / rate, (freed_after, rate)


# ---- the chat page ------------------------------------------------------------------------


def test_the_page_is_self_contained(api):
    with urllib.request.urlopen(api.url + "/", timeout=10) as r:
        page = r.read().decode()
        policy = r.headers["content-security-policy"]
    assert "connect-src 'self'" in policy and "default-src 'none'" in policy
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)
    assert '<meta name="viewport"' in page


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium: apt-get install chromium")
def test_the_page_in_chromium_streams_a_reply_to_a_typed_message(api, reference, tmp_path):
    text = "Tell me of the bees."
    want = reference.generate([{"role": "user", "content": text}], max_new_tokens=300)
    with Browser(CHROMIUM, tmp_path / "profile") as page:
        page.open(api.url + "/")
        # the server wants a key: the page listed no model until one is typed in
        assert page.wait_for("document.getElementById('model').textContent.includes('key')")
        page.eval(f"document.getElementById('key').value = {json.dumps(KEY)}")
        page.eval("document.getElementById('key').dispatchEvent(new Event('change'))")
        try:
            page.wait_for("document.getElementById('model').value")
        except TimeoutError:
            shown = page.eval("document.getElementById('model').textContent")
            raise AssertionError(f"no model ({shown}); server:\n" + "\n".join(api.lines)) from None

        page.eval("document.getElementById('temperature').value = '0'")
        page.eval("document.getElementById('max-tokens').value = '300'")
        page.eval(f"document.getElementById('prompt').value = {json.dumps(text)}")
        page.eval("document.getElementById('send').click()")
        reply = "document.querySelector('.msg.assistant')"
        seen = set()  # the reply's states and lengths while it streams in
        while True:
            state, shown = page.wait_for(
                f"{reply} && [{reply}.dataset.state, {reply}.firstChild?.textContent ?? '']"
            )
            seen.add((state, len(shown)))
            if state != "streaming":
                break
        assert state == "done"
        assert shown == want
        assert any(s == "streaming" and 0 < n < len(want) for s, n in seen), "no partial reply"
        assert page.eval("document.querySelector('.msg.user').textContent") == text
        assert "300 tokens" in page.eval(f"{reply}.textContent") or len(want) < 300
        page.viewport(390, 844, mobile=True)  # a phone: nothing wider than the screen
        assert page.eval("document.documentElement.scrollWidth <= innerWidth")
        shot = page.screenshot(tmp_path / "chat-phone.png")
        assert shot.stat().st_size > 5000
        print(f"screenshot: {shot}")

"""`rlvr serve` driven by the real `openai` client: token ids and log-probs exactly as the engine
sampled them, OpenAI's request fields, tool calls, limits and errors, batching, the CLI."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import torch

from rlvr.rollout.engine import EmbeddedEngine, draw_seeds
from rlvr.serve.app import Served
from rlvr.serve.protocol import Limits
from rlvr.serve.server import BackgroundServer
from rlvr.serve.backend import TOOLS_PREAMBLE
from rlvr.types import Completion, SamplingParams
from tests.test_openai_agent import byte_symbol
from tests.tiny import EOS_ID, make_tiny_model, make_tiny_tokenizer

KEY = "test-key"


def tiny_served() -> Served:
    tokenizer, model = make_tiny_tokenizer(), make_tiny_model()
    engine = EmbeddedEngine(model, tokenizer, eos_token_ids=[EOS_ID], seed=0)
    return Served("tiny", tokenizer, engine, model, context_length=256)


@pytest.fixture(scope="module")
def server() -> Iterator[BackgroundServer]:
    with BackgroundServer(tiny_served(), api_key=KEY, limits=Limits(max_n=8, max_tokens=64)) as s:
        yield s


@pytest.fixture
def client(server: BackgroundServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0)


def chat_ids(messages: list[dict[str, str]]) -> list[int]:
    """The prompt's ids computed here, independently of the server: the template, then the tokenizer."""
    tok = make_tiny_tokenizer()
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


def reference(prompt: list[int], params: SamplingParams, seed: int) -> list[Completion]:
    """What the engine samples for this prompt and request seed, called directly."""
    tokenizer, model = make_tiny_tokenizer(), make_tiny_model()
    engine = EmbeddedEngine(model, tokenizer, eos_token_ids=[EOS_ID])
    return engine.generate([prompt], params, seeds=draw_seeds(torch.Generator().manual_seed(seed), 1, params))[0]


def extra(obj: Any, name: str) -> Any:
    """A field the OpenAI types do not declare (the token ids), as the client keeps it."""
    return (obj.model_extra or {})[name]


MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]


def test_chat_returns_the_exact_ids_and_logprobs(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, n=3, seed=7, max_tokens=12,  # type: ignore[arg-type]
                                       temperature=0.9, logprobs=True, top_logprobs=3)
    prompt = chat_ids(MESSAGES)
    assert extra(r, "prompt_token_ids") == prompt
    want = reference(prompt, SamplingParams(temperature=0.9, max_new_tokens=12, n=3), seed=7)
    tok = make_tiny_tokenizer()
    model = make_tiny_model()
    for choice, c in zip(r.choices, want, strict=True):
        ids = extra(choice, "token_ids")
        assert ids == list(c.token_ids)
        assert choice.message.content == tok.decode(ids, skip_special_tokens=True)
        assert choice.finish_reason == c.finish_reason
        got = [x.logprob for x in choice.logprobs.content]
        assert got == pytest.approx(list(c.logprobs), abs=1e-6)  # floats through JSON: exact up to printing
        # each log-prob is the model's at temperature 0.9, recomputed here by a full forward
        with torch.no_grad():
            logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1].float()
        expected = (logits / 0.9).log_softmax(-1).gather(-1, torch.tensor(ids)[:, None]).squeeze(-1)
        assert got == pytest.approx(expected.tolist(), abs=1e-4)  # fp32, other batch shapes: summation order
        for pos in choice.logprobs.content:
            tops = [t.logprob for t in pos.top_logprobs]
            assert len(tops) == 3 and tops == sorted(tops, reverse=True)
            assert pos.logprob <= tops[0] + 1e-5  # nothing is likelier than the top entry
    assert r.usage.prompt_tokens == len(prompt)
    assert r.usage.completion_tokens == sum(len(extra(c, "token_ids")) for c in r.choices)


def test_a_seed_repeats_and_no_seed_varies(client: openai.OpenAI) -> None:
    def ask(**kw: Any) -> list[int]:
        r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=16, **kw)  # type: ignore[arg-type]
        return extra(r.choices[0], "token_ids")  # type: ignore[no-any-return]
    assert ask(seed=3) == ask(seed=3)
    assert len({tuple(ask()) for _ in range(4)}) > 1


def test_greedy_and_max_completion_tokens(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_completion_tokens=5)  # type: ignore[arg-type]
    want = reference(chat_ids(MESSAGES), SamplingParams(temperature=0, max_new_tokens=5), seed=0)[0]
    assert extra(r.choices[0], "token_ids") == list(want.token_ids)
    assert len(want.token_ids) == 5 and r.choices[0].finish_reason == "length"


def test_stop_string_ends_the_text_but_stays_in_the_ids(client: openai.OpenAI) -> None:
    params = SamplingParams(temperature=1.0, max_new_tokens=40)
    ids = list(reference(chat_ids(MESSAGES), params, seed=11)[0].token_ids)
    tok = make_tiny_tokenizer()
    # a character that first appears a few tokens in (one token per byte: index = position)
    text = tok.decode(ids, skip_special_tokens=True)
    k, char = next((k, ch) for k, ch in enumerate(text) if k >= 3 and ch.isascii() and ch not in text[:k])
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, seed=11, max_tokens=40, stop=[char])  # type: ignore[arg-type]
    assert r.choices[0].message.content == text[:k]
    assert extra(r.choices[0], "token_ids") == ids[: k + 1]
    assert r.choices[0].finish_reason == "stop"


def test_completions_from_text_and_from_token_ids(client: openai.OpenAI) -> None:
    tok = make_tiny_tokenizer()
    r = client.completions.create(model="tiny", prompt="Once upon", max_tokens=8, seed=5, n=2, logprobs=2)
    prompt = tok("Once upon")["input_ids"]
    want = reference(prompt, SamplingParams(max_new_tokens=8, n=2), seed=5)
    for choice, c in zip(r.choices, want, strict=True):
        assert extra(choice, "prompt_token_ids") == prompt
        assert extra(choice, "token_ids") == list(c.token_ids)
        assert choice.logprobs.token_logprobs == pytest.approx(list(c.logprobs), abs=1e-6)
        assert all(1 <= len(t) <= 2 for t in choice.logprobs.top_logprobs)  # keyed by text: bytes may collide
    by_ids = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, seed=5, n=2)
    assert [extra(c, "token_ids") for c in by_ids.choices] == [list(c.token_ids) for c in want]
    two = client.completions.create(model="tiny", prompt=[prompt, prompt[:3]], max_tokens=4, n=2)
    assert [c.index for c in two.choices] == [0, 1, 2, 3]
    assert [extra(c, "prompt_token_ids") for c in two.choices] == [prompt, prompt, prompt[:3], prompt[:3]]


def test_streaming_gives_the_same_completion(client: openai.OpenAI) -> None:
    plain = client.chat.completions.create(model="tiny", messages=MESSAGES, seed=9, max_tokens=10)  # type: ignore[arg-type]
    chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, seed=9, max_tokens=10,  # type: ignore[arg-type]
                                                 stream=True))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks)  # every chunk has a choice
    assert text == plain.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == plain.choices[0].finish_reason
    assert extra(chunks[0], "prompt_token_ids") == extra(plain, "prompt_token_ids")
    assert extra(chunks[0].choices[0], "token_ids") == extra(plain.choices[0], "token_ids")
    with_usage = list(client.chat.completions.create(model="tiny", messages=MESSAGES, seed=9, max_tokens=10,  # type: ignore[arg-type]
                                                     stream=True, stream_options={"include_usage": True}))
    assert with_usage[-1].choices == [] and with_usage[-1].usage == plain.usage


def test_models_and_health(client: openai.OpenAI, server: BackgroundServer) -> None:
    assert [m.id for m in client.models.list()] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    assert httpx.get(server.base_url.removesuffix("/v1") + "/health").json() == {"status": "ok"}


def post(server: BackgroundServer, body: bytes, route: str = "/chat/completions") -> httpx.Response:
    return httpx.post(server.base_url + route, content=body,
                      headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})


def test_what_json_can_carry_but_a_tokenizer_cannot_and_errors_in_openais_layout(server: BackgroundServer) -> None:
    for body, param in ((b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages.0.content"),
                        (b'{"prompt": "a\\udfff"}', "prompt"),
                        (b'{"messages": [{"role": "user", "content": "hi"}], "stop": ["\\ud800"]}', "stop")):
        r = post(server, body, "/completions" if b"prompt" in body else "/chat/completions")
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    for method, route, status in (("GET", "/nothing", 404), ("GET", "/chat/completions", 405)):
        r = httpx.request(method, server.base_url + route, headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == status and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = post(server, b'{"messages": [{"role": "user", "content": "hi"}], "temperature": null, "n": null, "stream": null}')
    assert r.status_code == 200  # null is the default, as OpenAI takes it


def test_top_logprobs_leave_out_what_top_k_removed_and_bytes_rebuild_the_text(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, seed=4, max_tokens=12, logprobs=True,  # type: ignore[arg-type]
                                       top_logprobs=5, extra_body={"top_k": 2})
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert all(1 <= len(pos.top_logprobs) <= 2 for pos in content)  # only what top-k = 2 could sample
    assert json.dumps(r.model_dump())  # every number is finite (no -Infinity in the JSON)
    ids = extra(r.choices[0], "token_ids")
    tok = make_tiny_tokenizer()
    byte_of = {byte_symbol(b): b for b in range(256)}
    sampled = b"".join(bytes(pos.bytes or []) for pos, t in zip(content, ids) if t > 2)
    assert sampled == bytes(byte_of[tok.convert_ids_to_tokens(t)] for t in ids if t > 2)


@pytest.mark.parametrize("kwargs, param", [
    ({"n": 9}, "n"),                                    # over max_n = 8
    ({"max_tokens": 65}, "max_tokens"),                 # over the server's max_tokens = 64
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"frequency_penalty": 0.5}, "frequency_penalty"),  # would sample from another distribution
    ({"top_logprobs": 3}, "top_logprobs"),              # without logprobs: true
    ({"seed": 2**64}, "seed"),                          # torch's generators take 64 bits
    ({"n": True}, "n"),                                 # strict types: a bool is not a count
    ({"extra_body": {"temperature": "1"}}, "temperature"),
    ({"extra_body": {"max_tokens": 4, "max_completion_tokens": 5}}, "max_completion_tokens"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content"),
    ({"extra_body": {"colour": "red"}}, "colour"),  # unknown fields are named, not ignored
    ({"stop": [""]}, "stop"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ({"messages": []}, "messages"),
])
def test_bad_requests_get_a_400_naming_the_field(client: openai.OpenAI, kwargs: dict[str, Any], param: str | None) -> None:
    kwargs = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**kwargs)
    body = err.value.body
    assert isinstance(body, dict) and body["param"] == param, body
    if param:
        assert param.split(".")[0] in body["message"]


def test_context_overflow_and_wrong_model_and_key(client: openai.OpenAI, server: BackgroundServer) -> None:
    long = [{"role": "user", "content": "x" * 200}]  # 219 tokens rendered
    with pytest.raises(openai.BadRequestError, match="219 tokens and max_tokens = 40: over the model's context of 256"):
        client.chat.completions.create(model="tiny", messages=long, max_tokens=40)  # type: ignore[arg-type]
    r = client.chat.completions.create(model="tiny", messages=long, temperature=0)  # type: ignore[arg-type]
    assert len(extra(r.choices[0], "token_ids")) <= 256 - 219  # the default fits the context
    with pytest.raises(openai.BadRequestError, match="the prompt is 259 tokens; the model's context is 256"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x" * 240}])  # type: ignore[arg-type]
    with pytest.raises(openai.NotFoundError, match="serves model 'tiny'"):
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES)  # type: ignore[arg-type]
    for key in ("wrong", ""):
        bad = openai.OpenAI(base_url=server.base_url, api_key=key or "x", max_retries=0,
                            default_headers={} if key else {"Authorization": ""})
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
    r = httpx.post(server.base_url + "/chat/completions", content=b"{" + b" " * (3 * 2**20) + b"}",
                   headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert r.status_code == 413 and "max_body_bytes" in r.json()["error"]["message"]
    r = httpx.post(server.base_url + "/chat/completions", content=b"{not json",
                   headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


class ScriptedEngine:
    """An engine whose completions are given texts (for what a random tiny model never writes, such
    as a tool call), slow on demand, counting its calls."""

    def __init__(self, texts: list[str], delay: float = 0.0) -> None:
        self.tok = make_tiny_tokenizer()
        self.texts, self.delay, self.calls = texts, delay, 0
        self.eos_token_ids, self.pad_token_id, self.version = [EOS_ID], 0, None
        self.generator = torch.Generator().manual_seed(0)
        self.fail = False

    def generate(self, prompts: list[list[int]], params: SamplingParams, progress: Any = None, *,
                 seeds: Any = None) -> list[list[Completion]]:
        self.calls += 1
        time.sleep(self.delay)
        if self.fail:
            raise RuntimeError("out of memory")
        ids = self.tok(self.texts[0], add_special_tokens=False)["input_ids"] + [EOS_ID]
        return [[Completion(tuple(ids), tuple([-0.5] * len(ids)), "stop", self.texts[0]) for _ in range(params.n)]
                for _ in prompts]


def scripted(texts: list[str], delay: float = 0.0, **limits: Any) -> tuple[BackgroundServer, ScriptedEngine]:
    engine = ScriptedEngine(texts, delay)
    served = Served("tiny", engine.tok, engine, None, context_length=4096)  # type: ignore[arg-type]
    return BackgroundServer(served, limits=Limits(**limits)), engine


def test_tool_calls_in_and_out() -> None:
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    server, _ = scripted([f"Let me add.\n{call}"])
    tools = [{"type": "function", "function": {"name": "add", "description": "Add two integers.",
                                               "parameters": {"type": "object", "properties": {
                                                   "a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
    with server:
        client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)
        r = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=tools)  # type: ignore[arg-type]
        message = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls"
        assert message.content == "Let me add."
        (tc,) = message.tool_calls  # type: ignore[misc]
        assert tc.function.name == "add" and json.loads(tc.function.arguments) == {"a": 2, "b": 3}
        # the template knows no tools: they go into the system turn, earlier calls into the text
        history = [*MESSAGES, message.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": tc.id, "content": "5"}]
        again = client.chat.completions.create(model="tiny", messages=history, tools=tools)  # type: ignore[arg-type]
        prompt = make_tiny_tokenizer().decode(extra(again, "prompt_token_ids"))
        schema = json.dumps(tools[0])
        assert TOOLS_PREAMBLE.format(tools=schema) in prompt and "Be brief." in prompt
        assert f'<|im_start|>assistant\nLet me add.\n<tool_call>\n{json.dumps({"name": "add", "arguments": {"a": 2, "b": 3}})}' \
               '\n</tool_call><|im_end|>' in prompt
        assert "<|im_start|>tool\n5<|im_end|>" in prompt
        none = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=tools, tool_choice="none")  # type: ignore[arg-type]
        assert none.choices[0].message.tool_calls is None and "<tool_call>" in (none.choices[0].message.content or "")


def test_concurrent_requests_share_engine_calls_and_the_limit_holds() -> None:
    server, engine = scripted(["ok"], delay=0.5, max_concurrent=4)

    async def burst(k: int) -> list[Any]:
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key="none", max_retries=0)
        return await asyncio.gather(*[client.chat.completions.create(model="tiny", messages=MESSAGES)  # type: ignore[arg-type]
                                      for _ in range(k)], return_exceptions=True)
    with server:
        results = asyncio.run(burst(4))
        assert all(r.choices[0].message.content == "ok" for r in results)
        assert engine.calls <= 2  # those that came while the first ran (or with it) were sampled together
        results = asyncio.run(burst(6))
        refused = [r for r in results if isinstance(r, openai.RateLimitError)]
        assert len(refused) == 2 and "max_concurrent" in str(refused[0])


def test_an_engine_failure_is_a_500_that_says_so() -> None:
    server, engine = scripted(["ok"])
    engine.fail = True
    with server:
        client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)
        with pytest.raises(openai.InternalServerError, match="out of memory"):
            client.chat.completions.create(model="tiny", messages=MESSAGES)  # type: ignore[arg-type]
        engine.fail = False
        assert client.chat.completions.create(model="tiny", messages=MESSAGES).choices[0].message.content == "ok"  # type: ignore[arg-type]


@pytest.mark.one_precision
def test_rlvr_serve_command(tiny_dir: Any) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "rlvr.cli", "serve", "--model", str(tiny_dir), "--name", "t",
                             "--port", str(port), "--max-tokens", "8"], stderr=subprocess.PIPE, text=True)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        deadline = time.monotonic() + 120
        while True:
            try:
                assert [m.id for m in client.models.list()] == ["t"]
                break
            except openai.APIConnectionError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.stderr else ""
                time.sleep(0.2)
        r = client.chat.completions.create(model="t", messages=MESSAGES)  # type: ignore[arg-type]
        assert 1 <= len(extra(r.choices[0], "token_ids")) <= 8  # --max-tokens is the default
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    said = proc.stderr.read() if proc.stderr else ""
    # warmed up before it serves, so the first request does not wait for the engine's set-up
    assert said.index("warming up the engine") < said.index("warm in") < said.index("serving 't' at")


def test_a_call_that_cannot_be_read_keeps_every_call_in_the_text() -> None:
    from rlvr.serve.backend import tool_calls

    good = '<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>'
    text = f'Thinking. <tool_call>{{"name": "add", "arguments": {{"a": 1,}}}}</tool_call>\n{good}'
    assert tool_calls(text) == (text, [])
    assert tool_calls('<tool_call>{"name": "", "arguments": {}}</tool_call>')[1] == []
    content, calls = tool_calls(f"Thinking. {good}")
    assert content == "Thinking." and [c["function"]["name"] for c in calls] == ["add"]


def test_the_text_is_cut_only_at_the_stop_string_that_ended_sampling() -> None:
    from rlvr.serve.backend import visible_text

    tok = make_tiny_tokenizer()
    ids = tok("ab-c", add_special_tokens=False)["input_ids"]
    across = tok("c", add_special_tokens=False)["input_ids"] + [1] + tok("-", add_special_tokens=False)["input_ids"]

    def completion(token_ids: list[int], reason: str) -> Completion:
        return Completion(tuple(token_ids), (0.0,) * len(token_ids), reason, tok.decode(token_ids, skip_special_tokens=True))  # type: ignore[arg-type]
    assert visible_text(completion(ids, "stop"), ("-c",), [EOS_ID], tok) == "ab"  # "-c" ended it: cut
    assert visible_text(completion(ids + [EOS_ID], "stop"), ("b",), [EOS_ID], tok) == "ab-c"  # EOS ended it
    # the engine saw "c<|im_start|>-", not "c-", and ran on to the length limit: no cut
    assert visible_text(completion(across, "length"), ("c-",), [EOS_ID], tok) == "c-"


def test_an_empty_api_key_is_no_key() -> None:
    served = tiny_served()
    with BackgroundServer(served, api_key="") as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="anything", max_retries=0)
        assert [m.id for m in client.models.list()] == ["tiny"]


class _SlowEngine:
    """The tiny engine, each call taking `seconds` more, and the prompts of every call kept."""

    def __init__(self, engine: EmbeddedEngine, seconds: float) -> None:
        self.engine, self.seconds, self.calls = engine, seconds, []  # type: list[list[list[int]]]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def generate(self, prompts: list[list[int]], params: SamplingParams, **kw: Any) -> Any:
        self.calls.append(prompts)
        time.sleep(self.seconds)
        return self.engine.generate(prompts, params, **kw)


def test_a_client_that_disconnects_frees_its_slot_and_its_waiting_job_is_dropped() -> None:
    """A client that gave up kept its slot until the engine finished its work: every other request
    got 429 meanwhile (17-32 s in a red-team review, session 19)."""
    import threading

    served = tiny_served()
    slow = _SlowEngine(served.engine, 2.0)  # type: ignore[arg-type]
    served = Served(served.name, served.tokenizer, slow, served.model, served.context_length)  # type: ignore[arg-type]
    with BackgroundServer(served, limits=Limits(max_concurrent=2)) as s:
        quitter = openai.OpenAI(base_url=s.base_url, api_key="x", max_retries=0, timeout=0.5)
        patient = openai.OpenAI(base_url=s.base_url, api_key="x", max_retries=0)

        def give_up(prompt: str) -> None:
            with pytest.raises(openai.APITimeoutError):
                quitter.completions.create(model="tiny", prompt=prompt, max_tokens=4)

        running = threading.Thread(target=give_up, args=("first",))  # starts in the engine at once
        running.start()
        time.sleep(0.2)
        give_up("second")  # waits behind the first, then leaves
        running.join()
        time.sleep(0.3)  # the server hears of a client that left as soon as the connection closes
        start = time.perf_counter()
        answer = patient.completions.create(model="tiny", prompt="third", max_tokens=2)  # not 429
        assert answer.choices and time.perf_counter() - start < 6
        sent = [make_tiny_tokenizer().decode(p[0]) for p in slow.calls]
        assert sent == ["first", "third"], sent  # the abandoned second request never reached the engine

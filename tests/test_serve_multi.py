"""hfpaged serve with several front-end processes (``api_server_count=2``): a real server on 127.0.0.1 over the
tiny random Llama of ``test_serve.py``, driven by the official ``openai`` client and raw ``httpx``. Requests
land on both front ends and their greedy output equals ``generate_many``; ``/metrics`` answered by either
front end shows the totals of both; a client that disconnects frees its blocks; ``max_waiting`` is one bound
over both (429); a stop ends every front end and leaves the pool free. Then the engine loop alone, with two
front ends' commands: routing, the global bound, one front end stopping while the other goes on."""

import asyncio
import contextlib
import logging
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from bpe_tokenizer import make_tokenizer
from models import make_model
from openai import AsyncOpenAI, OpenAI
from test_serve import CHAT_TEMPLATE, MODEL_NAME, NO_EOS, TEXTS  # the same model name, template and texts

import hfpaged
from hfpaged.serve import Server
from hfpaged.serve.cli import build_parser, serve_command


@pytest.fixture(scope="module")
def tokenizer():
    tok = make_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    return tok


@pytest.fixture(scope="module")
def model(tokenizer):  # test_serve.py's model, in a module of its own
    m = make_model("llama", vocab_size=len(tokenizer), seed=3)
    hfpaged.patch(m, num_blocks=160, block_size=4, max_num_seqs=32, tokenizer=tokenizer)
    return m


@pytest.fixture(scope="module")
def server(model, tokenizer):
    srv = Server(model, tokenizer, port=0, served_model_name=MODEL_NAME, max_waiting=256, api_server_count=2).start()
    yield srv
    srv.stop()
    assert [frontend.process.returncode for frontend in srv.frontends] == [0, 0]
    stats = hfpaged.stats(model)
    assert stats["num_free_blocks"] == stats["num_blocks"]


def metrics(server):
    """{name{labels}: value} of one scrape, over a new connection (so either front end may answer)."""
    with httpx.Client() as http:
        text = http.get(server.url + "/metrics").text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(hfpaged_\S+) (\S+)$", text, re.M)}


def totals(server):
    """The request totals of one scrape."""
    values = metrics(server)
    keep = ("_total", "_count", "_sum")
    return {k: v for k, v in values.items() if k.split("{")[0].endswith(keep) and "engine_loop" not in k}


def wait_until_idle(server, timeout=20.0):
    """Until no front end routes a request (their summed gauges), the engine holds none and every block is free."""
    loop = server.serving.engine_loop
    deadline = time.monotonic() + timeout
    while True:
        values = metrics(server)
        in_flight = values["hfpaged_num_requests_running"] + values["hfpaged_num_requests_waiting"]
        if not in_flight and not loop.unfinished and loop.stats["num_free_blocks"] == loop.stats["num_blocks"]:
            return
        assert time.monotonic() < deadline, (in_flight, loop.unfinished, loop.stats)
        time.sleep(0.01)


def test_requests_land_on_both_front_ends_and_equal_generate_many(server, model, tokenizer):
    assert len({frontend.pid for frontend in server.frontends}) == 2
    assert all(frontend.process.poll() is None for frontend in server.frontends)
    for _ in range(4):  # new connections each time: either front end answers the same
        assert httpx.get(server.url + "/health").json() == {"status": "ok"}
        assert httpx.get(server.url + "/v1/models").json()["data"][0]["id"] == MODEL_NAME
    before = metrics(server)
    num_requests, max_tokens = 24, 6

    async def one(client, i):
        text, usage = "", None
        stream = await client.completions.create(
            model=MODEL_NAME,
            prompt=TEXTS[i % len(TEXTS)],
            max_tokens=max_tokens,
            temperature=0,
            logit_bias=NO_EOS,
            stream=True,
            stream_options={"include_usage": True},
        )
        async for chunk in stream:
            text += chunk.choices[0].text if chunk.choices else ""
            usage = chunk.usage or usage
        return text, usage.completion_tokens

    async def main():
        # a connection per request: the kernel spreads them over the two front ends' sockets
        async with AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
            return await asyncio.gather(*(one(client, i) for i in range(num_requests)))

    results = asyncio.run(main())
    wait_until_idle(server)
    expected = model.generate_many(
        TEXTS, tokenizer=tokenizer, max_new_tokens=max_tokens, do_sample=False, logit_bias={2: -100.0}
    )
    assert len({r.text for r in expected}) > 1
    assert [text for text, _ in results] == [expected[i % len(TEXTS)].text for i in range(num_requests)]
    assert all(count == max_tokens for _, count in results)
    after = totals(server)
    assert all(totals(server) == after for _ in range(4))  # every scrape (either front end) shows the same totals

    def added(name):
        return after.get(name, 0.0) - before.get(name, 0.0)

    per_front_end = [added(f'hfpaged_api_server_requests_total{{api_server="{i}"}}') for i in range(2)]
    assert sum(per_front_end) == num_requests and min(per_front_end) > 0, per_front_end  # both served some
    assert added("hfpaged_generation_tokens_total") == num_requests * max_tokens
    assert added('hfpaged_requests_finished_total{finish_reason="length"}') == num_requests
    assert added("hfpaged_time_to_first_token_seconds_count") == num_requests
    assert added("hfpaged_e2e_request_latency_seconds_count") == num_requests
    assert added("hfpaged_inter_token_latency_seconds_count") == num_requests * (max_tokens - 1)
    prompt_tokens = sum(len(tokenizer(TEXTS[i % len(TEXTS)])["input_ids"]) for i in range(num_requests))
    assert added("hfpaged_prompt_tokens_total") == prompt_tokens
    # the engine loop's time, by part, from the engine's snapshot
    values = metrics(server)
    parts = {p: values[f'hfpaged_engine_loop_seconds_total{{part="{p}"}}'] for p in ("step", "commands", "outputs")}
    assert all(seconds > 0 for seconds in parts.values()), parts
    assert values["hfpaged_engine_loop_steps_total"] >= max_tokens


def test_disconnects_on_either_front_end_abort_and_free_blocks(server, model):
    aborted = 'hfpaged_requests_finished_total{finish_reason="abort"}'
    before = metrics(server).get(aborted, 0.0)
    body = {
        "model": MODEL_NAME,
        "prompt": "the stop sign",
        "max_tokens": 400,
        "temperature": 0,
        "logit_bias": NO_EOS,
        "stream": True,
    }
    for _ in range(4):  # four connections: most likely both front ends see a client leave
        with httpx.Client(timeout=30) as http, http.stream("POST", server.url + "/v1/completions", json=body) as stream:
            assert stream.status_code == 200
            lines = stream.iter_lines()
            assert sum(1 for line, _ in zip((x for x in lines if x.startswith("data: ")), range(3))) == 3
        # leaving the block closed the connection mid-stream
    wait_until_idle(server)
    assert metrics(server)[aborted] == before + 4
    stats = hfpaged.stats(model)
    assert stats["num_free_blocks"] == stats["num_blocks"]


@pytest.fixture(scope="module")
def one_seq_model(tokenizer):
    """A model that decodes one sequence at a time (its own pool): others must wait."""
    m = make_model("llama", vocab_size=len(tokenizer), seed=3)
    hfpaged.patch(m, num_blocks=160, block_size=4, max_num_seqs=1, tokenizer=tokenizer)
    return m


def test_one_waiting_bound_over_both_front_ends_and_a_stop_that_ends_both(one_seq_model, tokenizer):
    srv = Server(
        one_seq_model,
        tokenizer,
        port=0,
        served_model_name=MODEL_NAME,
        max_waiting=1,
        shutdown_timeout=30,
        api_server_count=2,
    ).start()
    loop = srv.serving.engine_loop
    body = {
        "model": MODEL_NAME,
        "prompt": "the stop sign",
        "max_tokens": 300,
        "temperature": 0,
        "logit_bias": NO_EOS,
        "stream": True,
    }
    # each step sleeps while the slot is held, so that the running stream (300 tokens) outlasts the refusals below
    # on a loaded machine too (unslowed it ended ~0.4 s after them on two idle cores: a race under the full suite)
    slow = one_seq_model.model.layers[0].register_forward_pre_hook(lambda module, args: time.sleep(0.01))
    try:
        with httpx.Client(timeout=60) as http, http.stream("POST", srv.url + "/v1/completions", json=body) as running:
            lines = running.iter_lines()  # kept: once collected, httpcore closes the connection (an abort)
            assert next(x for x in lines if x.startswith("data: "))  # it runs: the one slot is taken
            waiting = {}

            def wait_for_slot():
                client = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
                waiting["out"] = client.completions.create(
                    model=MODEL_NAME, prompt="stars and", max_tokens=4, temperature=0, logit_bias=NO_EOS
                )

            thread = threading.Thread(target=wait_for_slot)
            thread.start()
            deadline = time.monotonic() + 10
            while len(loop.waiting) < 1:  # the engine counts it as waiting (whichever front end took it)
                assert time.monotonic() < deadline
                time.sleep(0.005)
            for _ in range(4):  # new clients, new connections: whichever front end answers, the queue is full
                client = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
                with pytest.raises(openai.RateLimitError) as refused:
                    client.completions.create(model=MODEL_NAME, prompt="a quick", max_tokens=4, temperature=0)
                assert refused.value.status_code == 429 and refused.value.body["code"] == "queue_full"
    finally:
        slow.remove()  # the model is the module's fixture
    thread.join(30)  # the running stream was closed (aborted): the waiting request got the slot
    assert waiting["out"].usage.completion_tokens == 4
    assert metrics(srv)['hfpaged_requests_rejected_total{status="429"}'] == 4
    wait_until_idle(srv)
    # a graceful stop: the in-flight request finishes, then every front end ends and the pool is free
    finished = []

    def stream_to_the_end():
        with httpx.stream("POST", srv.url + "/v1/completions", json={**body, "max_tokens": 24}, timeout=60) as r:
            finished.extend(line for line in r.iter_lines() if line.startswith("data: "))

    thread = threading.Thread(target=stream_to_the_end)
    thread.start()
    deadline = time.monotonic() + 10
    while not loop.unfinished:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    srv.stop()
    thread.join(30)
    assert finished[-1] == "data: [DONE]" and '"finish_reason":"length"' in finished[-2]
    assert [frontend.process.returncode for frontend in srv.frontends] == [0, 0]
    assert not srv.thread.is_alive()
    stats = hfpaged.stats(one_seq_model)
    assert stats["num_free_blocks"] == stats["num_blocks"]
    with pytest.raises(httpx.ConnectError):  # nobody listens any more
        httpx.get(srv.url + "/health", timeout=5)


@pytest.mark.slow
def test_a_front_end_that_dies_frees_what_it_left_and_the_other_serves_on(one_seq_model, tokenizer):
    srv = Server(one_seq_model, tokenizer, port=0, served_model_name=MODEL_NAME, api_server_count=2).start()
    loop = srv.serving.engine_loop
    body = {"model": MODEL_NAME, "prompt": "the stop sign", "max_tokens": 400, "temperature": 0, "stream": True}
    body["logit_bias"] = NO_EOS
    with httpx.Client(timeout=30) as http, http.stream("POST", srv.url + "/v1/completions", json=body) as stream:
        lines = stream.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        (request_id,) = loop.owners
        victim = srv.frontends[loop.owners[request_id]]
        os.kill(victim.pid, signal.SIGKILL)  # the front end serving this stream dies
        with pytest.raises(httpx.HTTPError):
            for _ in lines:
                pass
    victim.reader.join(30)  # its channel closed: the engine aborted what it had added
    deadline = time.monotonic() + 30
    while loop.unfinished or loop.stats["num_free_blocks"] != loop.stats["num_blocks"]:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert loop.thread.is_alive()
    client = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    for _ in range(3):  # new connections all reach the front end that is left
        done = client.completions.create(model=MODEL_NAME, prompt="stars and", max_tokens=3, logit_bias=NO_EOS)
        assert done.usage.completion_tokens == 3
    srv.stop()
    assert not srv.thread.is_alive()
    stats = hfpaged.stats(one_seq_model)
    assert stats["num_free_blocks"] == stats["num_blocks"]


def test_engine_loop_routes_each_front_ends_outputs_back_to_it(model, tokenizer):
    """Two front ends' commands into one engine loop: outputs and answers go to the front end that added the
    request, ``max_waiting`` counts both, an abort only reaches the sender's own requests, and one front end
    that stops has its requests aborted while the other goes on; the loop ends with the last."""
    from hfpaged.serve.engine_loop import EngineLoop
    from hfpaged.serve.messages import (
        AbortRequests,
        Added,
        AddRequests,
        EngineStopped,
        StepOutputs,
        StopEngine,
        Submission,
    )

    inboxes = [[], []]
    loop = EngineLoop(model, tokenizer, max_waiting=2)
    prompt = tokenizer("the stop sign")["input_ids"]
    greedy = dict(do_sample=False, logit_bias={2: -100.0})
    # queued before the thread starts: the first iteration takes all of them together
    loop.put(AddRequests(0, [Submission("a", prompt, {**greedy, "max_new_tokens": 3})]), 0)
    loop.put(AddRequests(0, [Submission("b", prompt, {**greedy, "max_new_tokens": 400})]), 1)  # tags: per front end
    loop.put(AddRequests(1, [Submission("c", prompt, greedy), Submission("d", prompt, greedy)]), 1)  # 2 + 2 > 2
    deadline = time.monotonic() + 30  # (adds pass the preparing thread: serve/preparer.py)
    while loop.commands.qsize() < 3 and time.monotonic() < deadline:
        time.sleep(0.001)
    loop.start([lambda message, inbox=inbox: inbox.append(pickle.loads(pickle.dumps(message))) for inbox in inboxes])

    def outputs(inbox):
        return [d for m in list(inbox) if isinstance(m, StepOutputs) for d in m.deltas()]

    def wait_for(condition):
        deadline = time.monotonic() + 30
        while not condition():
            assert time.monotonic() < deadline
            time.sleep(0.005)

    wait_for(lambda: any(d.prompt_id == "a" and d.finished for d in outputs(inboxes[0])))
    loop.put(AbortRequests(["b"]), 0)  # not front end 0's request: ignored
    loop.put(AddRequests(1, [Submission("e", prompt, {**greedy, "max_new_tokens": 2})]), 0)
    wait_for(lambda: any(d.prompt_id == "e" and d.finished for d in outputs(inboxes[0])))
    assert "b" in loop.unfinished and loop.owners["b"] == 1
    loop.put(StopEngine(), 1)  # front end 1 leaves: its request is aborted, the loop serves front end 0 on
    wait_for(lambda: any(isinstance(m, EngineStopped) for m in list(inboxes[1])))
    assert "b" not in loop.unfinished and loop.thread.is_alive()
    loop.put(AddRequests(2, [Submission("f", prompt, {**greedy, "max_new_tokens": 2})]), 0)
    wait_for(lambda: any(d.prompt_id == "f" and d.finished for d in outputs(inboxes[0])))
    loop.put(StopEngine(), 0)
    loop.thread.join(30)
    assert not loop.thread.is_alive()
    assert [m for m in inboxes[0] if isinstance(m, Added)] == [Added(0, None), Added(1, None), Added(2, None)]
    added = sorted((m for m in inboxes[1] if isinstance(m, Added)), key=lambda m: m.tag)
    assert added[0] == Added(0, None) and added[1].tag == 1 and added[1].error[0] == "queue_full"
    assert {d.prompt_id for d in outputs(inboxes[0])} == {"a", "e", "f"}
    b = outputs(inboxes[1])
    assert {d.prompt_id for d in b} == {"b"} and not any(d.finished for d in b) and len(b) < 400
    assert isinstance(inboxes[0][-1], EngineStopped) and isinstance(inboxes[1][-1], EngineStopped)
    stats = inboxes[0][-1].stats
    assert stats["num_free_blocks"] == stats["num_blocks"] == hfpaged.stats(model)["num_blocks"]
    seconds = stats["engine_loop_seconds"]
    assert set(seconds) == {"step", "commands", "outputs", "idle"} and seconds["step"] > 0
    assert stats["engine_loop_steps"] == loop.num_steps


def test_several_front_ends_need_front_end_processes(model, tokenizer, caplog, monkeypatch):
    with pytest.raises(ValueError, match="api_server_count"):
        Server(model, tokenizer, port=0, frontend_process=False, api_server_count=2)
    with pytest.raises(ValueError, match="api_server_count"):
        Server(model, tokenizer, port=0, api_server_count=0)
    args = build_parser().parse_args(["serve", "/models/x", "--api-server-count", "3"])
    assert args.api_server_count == 3
    assert build_parser().parse_args(["serve", "--demo"]).api_server_count == 1
    args = build_parser().parse_args(["serve", "/models/x", "--single-process", "--api-server-count", "2"])
    with pytest.raises(SystemExit, match="--api-server-count must be 1"):
        serve_command(args)
    # a tokenizer the front-end processes cannot get: served from this process, one front end, with a warning
    tok = make_tokenizer()
    tok.callback = lambda: None
    with caplog.at_level(logging.WARNING, logger="hfpaged.serve"):
        srv = Server(model, tok, port=0, api_server_count=2)
    srv.stop()
    assert srv.frontends == [] and len(srv.sockets) == 1
    assert "cannot be pickled" in caplog.text and "instead of api_server_count=2" in caplog.text


@pytest.mark.skipif(not hasattr(socket, "SO_REUSEPORT"), reason="SO_REUSEPORT only")
def test_several_front_ends_never_join_a_port_another_server_listens_on():
    # The front ends' sockets share their port through SO_REUSEPORT; a second server (another process of the
    # same user, e.g. one started twice) asking for a port already taken must fail as with one front end, not
    # join the first one's socket group and take a share of its connections.
    from hfpaged.serve.frontend_process import listening_sockets

    first = listening_sockets("127.0.0.1", 0, 2)
    try:
        port = first[0].getsockname()[1]
        for count in (1, 2):
            with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}: the address is in use"):
                for sock in listening_sockets("127.0.0.1", port, count):
                    sock.close()
    finally:
        for sock in first:
            sock.close()
    again = listening_sockets("127.0.0.1", port, 2)  # the port is free again once the first group is closed
    assert [sock.getsockname()[1] for sock in again] == [port, port]
    for sock in again:
        sock.close()


def test_the_cli_reports_a_port_in_use_in_one_line(monkeypatch, capsys):
    import errno

    from hfpaged.serve import cli

    def taken(args):
        raise OSError(errno.EADDRINUSE, "cannot listen on 127.0.0.1:8011: the address is in use (another server?)")

    monkeypatch.setattr(cli, "serve_command", taken)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "--demo", "--port", "8011"])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert err == "hfpaged serve: cannot listen on 127.0.0.1:8011: the address is in use (another server?)\n"


def test_a_front_end_that_cannot_start_leaves_no_process_socket_or_metrics_dir(model, tokenizer, monkeypatch):
    from hfpaged.serve.frontend_process import FrontendProcess

    real_spawn = FrontendProcess.spawn
    spawned = []

    def spawn(self, config, http_socket):
        if spawned:
            raise OSError("no more processes")
        spawned.append(self)
        real_spawn(self, config, http_socket)

    monkeypatch.setattr(FrontendProcess, "spawn", spawn)
    srv = Server(model, tokenizer, port=0, served_model_name=MODEL_NAME, api_server_count=2)
    with pytest.raises(OSError, match="no more processes"):
        srv.start()
    assert spawned[0].process.poll() is not None  # not left serving the port with no engine thread behind it
    assert not os.path.exists(srv.metrics_dir)
    assert all(sock.fileno() == -1 for sock in srv.sockets)


def _session_processes(session: int) -> list[int]:
    """The live (not zombie) processes of a session."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rpartition(")")[2].split()
            except OSError:
                continue
            if int(fields[3]) == session and fields[0] not in ("Z", "X"):
                found.append(int(entry))
    return found


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_two_quick_ctrl_cs_end_hfpaged_serve_and_its_front_end(tmp_path, tokenizer):
    # a terminal's Ctrl-C reaches the whole process group: the second, while the parent waited for the front end
    # to stop gracefully, left that front end running (reparented, its lifespan waiting 60 s for an engine message
    # nobody would send) and the parent gone
    make_model("llama", vocab_size=len(tokenizer), seed=3).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "hfpaged.serve.cli", "serve", str(tmp_path / "model"), "--port", str(port)]
    command += ["--num-blocks", "64", "--block-size", "4"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None and time.monotonic() < deadline, process.stderr.read().decode()[-3000:]
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            time.sleep(0.1)
        assert len(_session_processes(process.pid)) >= 2  # hfpaged serve and its front end
        os.killpg(process.pid, signal.SIGINT)
        time.sleep(0.05)
        os.killpg(process.pid, signal.SIGINT)
        process.wait(30)
        deadline = time.monotonic() + 15
        while _session_processes(process.pid):
            assert time.monotonic() < deadline, f"left running: {_session_processes(process.pid)}"
            time.sleep(0.1)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        process.stderr.close()


def test_a_second_ctrl_c_while_stopping_leaves_no_front_end_behind(tokenizer, monkeypatch):
    # the second Ctrl-C of `hfpaged serve --api-server-count 2` interrupts stop() while it waits for the first front
    # end: that one was killed, the other kept running, and the shared metrics directory stayed
    from hfpaged.serve import frontend_process

    m = make_model("llama", vocab_size=len(tokenizer), seed=3)
    hfpaged.patch(m, num_blocks=64, block_size=4, tokenizer=tokenizer)
    srv = Server(m, tokenizer, port=0, served_model_name=MODEL_NAME, api_server_count=2).start()
    frontends, metrics_dir = list(srv.frontends), srv.metrics_dir
    wait = frontend_process.FrontendProcess.wait_stopped
    interrupted = []

    def ctrl_c_in_the_first_wait(self, timeout):
        if not interrupted:
            interrupted.append(self)
            self.process.wait = lambda timeout=None: (_ for _ in ()).throw(KeyboardInterrupt())
            try:
                return wait(self, timeout)
            finally:
                del self.process.wait
        return wait(self, timeout)

    monkeypatch.setattr(frontend_process.FrontendProcess, "wait_stopped", ctrl_c_in_the_first_wait)
    with pytest.raises(KeyboardInterrupt):
        srv.stop()
    monkeypatch.undo()
    assert interrupted == frontends[:1]
    assert [f.process.poll() is not None for f in frontends] == [True, True]  # none left running
    assert not os.path.exists(metrics_dir)
    srv.serving.engine_loop.thread.join(30)
    assert not srv.serving.engine_loop.thread.is_alive()

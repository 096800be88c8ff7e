"""`make demo`: a home node and a phone node, as two real daemons on 127.0.0.1.

Each step is one function; later features add steps to STEPS. Everything runs in a
temporary directory and both daemons are shut down cleanly at the end (or on error).
"""
from __future__ import annotations

import contextlib
import json
import re
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import anyio
from rich.console import Console
from rich.markup import escape

from localweb import local_web
from psymesh.node.control.client import Client
from psymesh.node.control.process import DaemonProcess
from psymesh.protocol.control import StatusReply
from psymesh.protocol.errors import RemoteError

con = Console(highlight=False, soft_wrap=True)


@dataclass
class Demo:
    workdir: Path
    home: DaemonProcess
    phone: DaemonProcess
    web: str = ""           # the demo's local "web" (examples/localweb.py), which home fetches from
    status: dict[str, StatusReply] = field(default_factory=dict)


def step(title: str) -> None:
    con.print(f"\n[bold cyan]== {title}[/bold cyan]")


async def start_nodes(d: Demo) -> None:
    step("Start a home node and a phone node (two processes, temporary homes, 127.0.0.1)")
    for node in (d.home, d.phone):
        st = await node.start()
        d.status[node.name] = st
        con.print(f"{node.name:>5}: peer id [green]{st.peer_id}[/green]\n       fingerprint {st.fingerprint}"
                  f"  listening {st.addrs[0]}")


async def pair_by_code(d: Demo) -> None:
    step("Pair the phone with the home node by a short code (SPAKE2: the code never crosses the wire)")
    invited = anyio.Event()
    code: dict[str, str] = {}

    def show(inv) -> None:
        code.update(code=inv.code, invite=inv.invite)
        con.print(f" home: invite code [bold]{inv.code}[/bold] (grant preset '{inv.grant}')")
        invited.set()

    async def home_side() -> None:
        async with d.home.client() as home:
            paired = await home.pair_invite_and_wait(show, name="phone", grant="phone")
        con.print(f" home: paired with {paired.name}; verification words: [bold]{paired.verification}[/bold]")

    async with anyio.create_task_group() as tg:
        tg.start_soon(home_side)
        await invited.wait()
        async with d.phone.client() as phone:
            # A person would type the code and the home's address; the invite string carries both.
            paired = await phone.pair_join(code["invite"], grant="messaging")
        con.print(f"phone: paired with {paired.name}; verification words: [bold]{paired.verification}[/bold]")
        con.print(f"phone: it may ask home for: {', '.join(paired.received)}")


async def allowed_and_refused(d: Demo) -> None:
    step("One allowed and one refused request (default deny)")
    async with d.phone.client() as phone:
        r = await phone.ping("home", count=3)
        con.print(f"phone -> home ping: [green]allowed[/green] ({r.median_ms:.2f} ms median)")
        try:
            await phone.delegate("home", tool="notes.add", args={"text": "hi"})
            con.print("[red]an ungranted tool ran: this is a bug[/red]")
        except RemoteError as exc:
            con.print(f"phone -> home tool notes.add: [red]refused[/red] ({exc.code.value}) {exc.message}")
    stranger = DaemonProcess(d.workdir / "stranger", profile="phone", name="stranger")
    await stranger.start()
    try:
        async with stranger.client() as client:
            await client.ping(d.status["home"].addrs[0], count=1)
        con.print("[red]stranger was let in: this is a bug[/red]")
    except RemoteError as exc:
        con.print(f"stranger -> home ping: [red]refused[/red] ({exc.code.value}) {exc.message}")
    finally:
        await stranger.stop()
    async with d.home.client() as home:
        rows = await home.audit(limit=3)
    con.print("home audit log (last 3): " + "; ".join(
        f"{r.operation} {'allowed' if r.allowed else r.code}" for r in rows))


async def delegate_tasks(d: Demo) -> None:
    step("Delegate a tool task and an inference task from the phone to home (durable, streamed)")
    async with d.phone.client() as phone:
        handle = await phone.delegate("home", tool="files.search", args={"query": "psymesh"})
        con.print(f"phone: task {handle.id} -> {handle.target_name} (files.search in home's share dir)")
        async for ev in handle.events():
            con.print(f"   event {ev.seq}: {ev.kind.value:<8} state={ev.state.value}")
        found = await handle.result()
        con.print(f"phone: result: {[(h['path'], h.get('text', h['match'])) for h in found['results']]}")

        await streamed_infer(phone, "Say hello to the mesh.", "tiny",
                             {"seed": 7, "temperature": 0.8, "ban_bytes": True},
                             "phone: task {id} -> home (infer on model 'tiny': random weights, so gibberish)",
                             "   tokens: ")


async def streamed_infer(phone: Client, prompt: str, model: str, params: dict, says: str, lead: str) -> None:
    """An infer task delegated to home, its tokens printed as they come (`says`: the line naming it)."""
    handle = await phone.delegate("home", infer=prompt, model=model, max_tokens=48, params=params)
    con.print(says.format(id=handle.id))
    con.print(lead, end="")
    async for ev in handle.events():
        if ev.kind.value == "token":
            con.print(escape(ev.data["text"]), end="")
    out = await handle.result()
    con.print(f"\n   {out.usage.completion_tokens} tokens, finish: {out.finish_reason}")


REAL_QUESTION = "Which city is the capital of France?"


async def real_model_on_home(d: Demo) -> None:
    step("A real model on home (SmolLM2-135M-Instruct): the phone's question, answered and streamed")
    from psymesh.agent.runtime.realmodel import missing_reason, real_model_path

    path = real_model_path()
    if path is None:  # scripts/bootstrap.sh fetches it; without the package index it could not
        con.print(f"(skipped: {escape(missing_reason())})")
        return
    start = time.perf_counter()
    added = await anyio.run_process([sys.executable, "-m", "psymesh", "model", "add", "smol", str(path), "--ctx",
                                     "2048", "--home", str(d.home.home), "--json"], check=False)
    took = time.perf_counter() - start
    if added.returncode != 0:
        con.print(f"[red]model add failed[/red]: {escape(added.stdout.decode() + added.stderr.decode())}")
        return
    con.print(f" home: psymesh model add smol {escape(path.name)} ({took:.2f} s: only the GGUF's header is read; "
              "the running daemon has it at once)")
    async with d.phone.client() as phone:
        await streamed_infer(phone, REAL_QUESTION, "smol", {"temperature": 0},
                             f"phone: {REAL_QUESTION!r} -> home (task {{id}}, model 'smol', greedy, "
                             "SmolLM2's own chat template from its GGUF)", "   home's answer: ")


def psymesh(*args: str) -> list[str]:
    return [sys.executable, "-m", "psymesh", *args]


async def split_across_homes(d: Demo) -> None:
    step("One model split across two homes: llama.cpp's RPC, carried only on psymesh streams")
    from psymesh.agent.runtime.realmodel import real_model_path
    from psymesh.node.control.process import pair_homes

    path = real_model_path()
    model = path if path is not None else d.workdir / "tiny.gguf"
    laptop = DaemonProcess(d.workdir / "laptop", profile="home", name="laptop")
    await laptop.start()
    try:
        await pair_homes(laptop.home, d.home.home, grant="messaging", grant_back=None)
        for cmd, say in ((psymesh("worker", "start", "--home", str(laptop.home)), "laptop: psymesh worker start"),
                         (psymesh("grant", "home", "+compute.rpc", "--limits", "rpc_memory_mb=512", "--home",
                                  str(laptop.home)), "laptop: psymesh grant home +compute.rpc --limits rpc_memory_mb=512"),
                         (psymesh("model", "add", "smol-split", str(model), "--ctx", "2048", "--split", "laptop",
                                  "--home", str(d.home.home)), "  home: psymesh model add smol-split ... --split laptop")):
            done = await anyio.run_process(cmd, check=False)
            con.print(f"{say}\n   " + escape(done.stdout.decode().strip().splitlines()[0] if done.stdout.strip()
                                             else done.stderr.decode().strip()))
        async with d.phone.client() as phone:
            await streamed_infer(phone, REAL_QUESTION, "smol-split", {"temperature": 0},
                                 "phone: the same question -> home (task {id}, model 'smol-split': home runs the "
                                 "first half of its layers, laptop the rest)", "   home+laptop's answer: ")
        for cmd in (psymesh("model", "ps", "--home", str(d.home.home)), psymesh("worker", "--home", str(laptop.home))):
            done = await anyio.run_process(cmd, check=False)
            con.print(escape(done.stdout.decode().rstrip()))
    finally:
        await laptop.stop()


async def agent_on_the_phone(d: Demo) -> None:
    step("The agent on the phone: a generated BotPsy-format model, grammar-constrained tool calls")
    con.print("(random weights: the grammar guarantees well-formed calls to real tools, not sensible choices;\n"
              " irreversible tools wait for a yes, and there is nobody to say it here)")
    cmd = [sys.executable, "-m", "psymesh", "agent", "run", "Turn wifi on", "--home", str(d.phone.home),
           "--delegate", "never", "--max-steps", "2", "--seed", "25", "--ban-bytes", "--json"]
    proc = await anyio.run_process(cmd, check=False)
    for line in proc.stderr.decode().splitlines():
        con.print("   " + escape(line[:150] + ("..." if len(line) > 150 else "")))
    result = json.loads(proc.stdout)
    con.print(f"phone: stopped={result['stopped']} after {result['steps']} step(s), "
              f"calls: {[(c['name'], c['status']) for c in result['tool_calls']]}")

    step("The same runtime with a scripted stand-in for BotPsy: Wi-Fi off and inbox full")
    from psymesh.agent.acting.builtin_tools import default_registry
    from psymesh.agent.acting.device import DeviceState, Phone, wifi_off_inbox_full
    from psymesh.agent.acting.loop import ScriptedModel, run_agent, tool_call_text
    from psymesh.agent.acting.tools import ToolContext

    with DeviceState(d.workdir / "scenario-device.db") as device:
        fillers = wifi_off_inbox_full(device)
        send = tool_call_text("messages.send", {"to": "Alice", "text": "Running late, sorry!"})
        model = ScriptedModel([send, tool_call_text("wifi.set", {"enabled": True}), send,
                               tool_call_text("messages.delete", {"ids": [fillers[0]]}), send,
                               "Sent: Wi-Fi is back on and I deleted one old video to make room."])

        async def approve(call, tool) -> bool:
            con.print(f"   [yellow]confirm[/yellow] {call.name}? yes")
            return True

        async def show(ev) -> None:
            if ev.kind == "tool_call":
                con.print(f"   -> {ev.data['name']}({json.dumps(ev.data['arguments'])})")
            elif ev.kind == "tool_result":
                body = "ok" if ev.data["ok"] else ev.data["error"]["message"]
                con.print(f"   <- {escape(str(body))[:110]}")

        run = await run_agent("Text Alice that I am running late", model=model,
                              tools=default_registry("phone", phone=Phone.simulated(device)), ctx=ToolContext(profile="phone"),
                              profile="phone", confirm=approve, emit=show)
    con.print(f"phone: {run.answer}")


async def agent_delegated_home(d: Demo) -> None:
    step("An agent goal delegated to home (its model, its tools; events stream back)")
    async with d.phone.client() as phone:
        handle = await phone.delegate("home", goal="What machine are you running on?",
                                      params={"max_steps": 2, "seed": 13, "ban_bytes": True})
        async for ev in handle.events():
            if ev.kind.value in ("tool_call", "tool_result"):
                con.print(f"   event {ev.seq}: {ev.kind.value} {escape(json.dumps(ev.data)[:100])}")
            elif ev.kind.value != "progress":
                con.print(f"   event {ev.seq}: {ev.kind.value} -> {ev.state.value}")
        result = await handle.result()
    con.print(f"phone: home's agent stopped={result.stopped} after {result.steps} step(s), "
              f"answer: {escape(result.answer[:60])!r}...")


async def model_crash_is_one_failed_request(d: Demo) -> None:
    step("Models run in runner processes: a llama.cpp abort fails one request, never the node")
    import os
    import signal

    async with d.phone.client() as phone, d.home.client() as home:
        handle = await phone.delegate("home", infer="Count to a thousand.", model="tiny", max_tokens=120_000,
                                      params={"temperature": 0, "ban_bytes": True})
        with anyio.fail_after(60):
            # running: the runner has started it (killed before that, a request goes to a fresh runner)
            while not (busy := [m for m in await home.models_ps() if m.running]):
                await anyio.sleep(0.05)
        m = busy[0]
        con.print(f"home: model {m.name} in runner pid {m.pid} ({(m.rss_bytes or 0) / 2**20:.0f} MiB, "
                  f"keep-alive {m.keep_alive_s:g} s): killing it with SIGABRT, as a C++ exception in llama.cpp would")
        os.kill(m.pid, signal.SIGABRT)
        outcome = await handle.outcome()
        con.print(f"phone: task {handle.id} {outcome.state.value}: {escape(f'[{outcome.code}] {outcome.message}')}")
        reply = await phone.ping("home", count=3)
        con.print(f"phone: home still answers: ping {reply.median_ms:.2f} ms")
        again = await phone.delegate("home", infer="Hi", model="tiny", max_tokens=8,
                                     params={"temperature": 0, "ban_bytes": True})
        out = await again.result()
        [after] = [m for m in await home.models_ps() if m.name == "tiny"]
        con.print(f"phone: the next infer task ran on a fresh runner (pid {after.pid}): "
                  f"{out.usage.completion_tokens} tokens")
    proc = await anyio.run_process([sys.executable, "-m", "psymesh", "model", "ps", "--home", str(d.home.home)],
                                   check=False)
    con.print(proc.stdout.decode().rstrip())


async def ping_both_ways(d: Demo) -> None:
    step("Ping each way over the encrypted channel (Noise + yamux)")
    for src, dst in ((d.phone, d.home), (d.home, d.phone)):
        async with src.client() as client:
            r = await client.ping(d.status[dst.name].addrs[0], count=20)
        con.print(f"{src.name:>5} -> {dst.name:<5} connect {r.connect_ms:6.2f} ms   rtt min/median/max "
                  f"{r.min_ms:.3f} / {r.median_ms:.3f} / {r.max_ms:.3f} ms  ({len(r.rtts_ms)} x 32 B)")


async def exchange_letters(d: Demo) -> None:
    step("Letters between the phone and home: signed, stored before the receipt, in order within a thread")
    async with d.phone.client() as phone, d.home.client() as home:
        for text in ("Leaving work now.", "Shall I get milk? (todo.txt says so)"):
            sent = await phone.send("home", text, thread="evening")
            con.print(f"phone -> home: {text!r}  (letter {sent.id[:8]}, thread {sent.thread} #{sent.tseq})")
        got = await _inbox(home, 2)
        reply = await home.send("phone", "Yes please, and see you at 7.", thread="evening")
        for m in got:
            con.print(f" home inbox #{m.seq}: from {m.sender_name} ({m.thread} #{m.tseq}): {escape(m.text)}")
        state = (await home.letter(reply.id, wait=True)).state
        [answer] = await _inbox(phone, 1)
        con.print(f"home -> phone: {answer.text!r}  ({state}: the phone's receipt came back)")


async def _inbox(client, count: int, after: int = 0, timeout: float = 60):  # type: ignore[no-untyped-def]
    """The next `count` letters in `client`'s inbox after `after` (live: they may still be on their way)."""
    got = []
    with anyio.fail_after(timeout):
        async for m in client.inbox(after):
            got.append(m)
            if len(got) == count:
                break
    return got


async def letter_to_a_sleeping_phone(d: Demo) -> None:
    step("A letter to a sleeping phone: held for it, delivered when it wakes")
    async with d.phone.client() as phone:
        seen = [m.seq async for m in phone.inbox(follow=False)]
    async with d.home.client() as home:  # the phone hands home its mail key within 5 s of pairing
        with anyio.move_on_after(30):
            while not any(r.operation == "mail.key" and r.allowed for r in await home.audit(peer="phone", limit=500)):
                await anyio.sleep(0.2)
    con.print(" home: holds the phone's mail key (the phone's config names home as its mailbox)")
    code = await d.phone.stop()
    con.print(f"phone: off (exited with status {code})")
    async with d.home.client() as home:
        sent = await home.send("phone", "The parcel came; it is on your desk.", thread="evening")
        con.print(f" home -> phone: letter {sent.id[:8]}, written while the phone is off: {sent.state}")
        with anyio.move_on_after(30):
            sent = await home.letter(sent.id, wait=True)
        if sent.state == "deposited":
            con.print(escape(f" home: letter {sent.id[:8]} is deposited: unreachable past [mail] grace_s (5 s), so "
                             "it is sealed to the phone's\n       mail key and kept in home's mailbox until the "
                             "phone fetches it"))
        else:
            con.print(f" home: still {sent.state}; home's courier keeps retrying it directly")
    await d.phone.start()
    con.print("phone: on again (a new process, a new port)")
    async with d.phone.client() as phone:
        [woke] = await _inbox(phone, 1, after=max(seen, default=0))
    con.print(f"phone inbox #{woke.seq}: from {woke.sender_name}: {escape(woke.text)}")


async def ask_home(d: Demo) -> None:
    step("The phone asks home's agent a question (msg.ask); the answer comes back as a letter")
    con.print("(home's generated model: random weights, so the words are gibberish; the tools it may use are\n"
              " the ones the phone's grant covers, and it stops at the phone's max_steps)")
    async with d.phone.client() as phone:
        answer = await phone.ask("home", "What machine are you running on?", thread="questions",
                                 params={"max_steps": 2, "seed": 13, "ban_bytes": True}, timeout=120)
    calls = [(c["name"], c["status"]) for c in answer.body.get("tool_calls", [])]
    con.print(f"phone: answer in thread {answer.thread}, reply to {answer.reply_to[:8] if answer.reply_to else '-'}"
              f", after {answer.body.get('steps')} step(s), tool calls {calls}")
    con.print(f"   {escape(answer.text[:80])!r}...")


async def web_through_home(d: Demo) -> None:
    step("Web queries: the phone never touches the web; home (its exit) searches and fetches for it")
    async with d.phone.client() as phone:
        found = await phone.web_search("island ferry")
        for hit in found.hits:
            con.print(f"   search hit: {escape(hit.title)}  {hit.url}")
        page = await phone.web_fetch(found.hits[0].url)
    con.print(f"phone: fetched {page.final_url} through home: {escape(page.text[:90])!r}... (untrusted text)")

    step("The phone's agent looks it up (scripted stand-in for BotPsy; web.search and web.fetch go through home)")
    from psymesh.agent.acting.loop import ScriptedModel, run_agent, tool_call_text
    from psymesh.agent.acting.tools import ToolContext, ToolRegistry
    from psymesh.node.web.tools import web_tools
    from psymesh.protocol.web import WebAnswer, WebRequest, WebSearch

    async with d.phone.client() as phone:
        async def through_phone(request: WebRequest, _peer: str | None) -> WebAnswer:
            if isinstance(request, WebSearch):
                return await phone.web_search(request.query, limit=request.limit)
            return await phone.web_fetch(request.url, max_chars=request.max_chars)

        async def show(ev) -> None:
            if ev.kind == "tool_call":
                con.print(f"   -> {ev.data['name']}({json.dumps(ev.data['arguments'])})")
            elif ev.kind == "tool_result":
                con.print(f"   <- {escape(json.dumps(ev.data.get('result', ev.data.get('error')))[:110])}...")

        model = ScriptedModel([tool_call_text("web.search", {"query": "last ferry back from the island"}),
                               tool_call_text("web.fetch", {"url": d.web + "/ferries"}),
                               "The last ferry back from the island leaves at 19:30."])
        run = await run_agent("When is the last ferry back from the island?", model=model,
                              tools=ToolRegistry(web_tools(through_phone)), ctx=ToolContext(profile="phone"),
                              profile="phone", emit=show)
    con.print(f"phone: {run.answer}")

    step("Two hops: sealed to home's key and passed through a third node, so home never learns who asked")
    friend = DaemonProcess(d.workdir / "friend", name="friend")
    friend_id = (await friend.start()).peer_id
    try:
        from psymesh.node.control.process import pair_homes

        await pair_homes(d.home.home, friend.home, grant="messaging")
        await pair_homes(friend.home, d.phone.home, grant="messaging")
        async with d.home.client() as home, friend.client() as f:
            await home.grant("friend", ["web.search", "web.fetch"])   # home serves what friend forwards
            await f.grant("phone", ["web.relay"])                      # friend forwards for the phone
        async with d.phone.client() as phone:
            page = await phone.web_fetch(d.web + "/market", relay="friend")
        con.print(f"phone: {escape(page.text[:70])!r}... (through friend, which passed sealed bytes only)")
        async with d.home.client() as home:
            row = [r for r in await home.audit(limit=100) if r.protocol == "web.exit"][-1]
        con.print(f" home: its log says {row.operation!r} was asked by "
                  f"{'friend' if row.peer_id == friend_id else row.peer_id}, not by the phone")
    finally:
        await friend.stop()


async def doctor_and_reach(d: Demo) -> None:
    step("How home is reached, and what to fix: psymesh status and psymesh doctor")
    async with d.home.client() as home:
        st = await home.status()
    r = st.reachability
    relayed = r.relayed or "- (no \\[relay] relays configured)"
    con.print(f" home: direct {r.direct or '-'}; confirmed by a peer's dial-back {[c.addr for c in r.confirmed] or '-'};"
              f" relayed {relayed}")
    proc = await anyio.run_process([sys.executable, "-m", "psymesh", "doctor", "--home", str(d.home.home), "--json"],
                                   check=False)
    report = json.loads(proc.stdout)
    for check in report["checks"]:
        hint = f"  -> {check['next_step']}" if check["next_step"] else ""
        con.print(f"   {check['status']:>4}  {check['name']:<14} {escape(check['detail'][:70])}{escape(hint[:80])}")
    con.print(f" home: doctor exit status {proc.returncode} ({'no failures' if report['ok'] else 'a check failed'}); "
              "relays and hole punching are shown in tests (network namespaces, root)")


async def openai_app_and_a_web_page(d: Demo) -> None:
    step("An app on the OpenAI API uses home's models; a web page in the owner's browser cannot")
    import httpx
    from openai import OpenAI

    found = re.findall(r"OpenAI-compatible endpoint at (http://127\.0\.0\.1:\d+)/v1", d.home.log_path.read_text())
    url = found[0]
    shown = await anyio.run_process([sys.executable, "-m", "psymesh", "serve", "openai", "--home", str(d.home.home),
                                     "--show-key", "--json"])
    key = json.loads(shown.stdout)["key"]
    con.print(f" home: endpoint {url}/v1; its key made 0600 in the home (psymesh serve openai --show-key)")

    def app() -> tuple[list[str], str]:
        client = OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)
        reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=8, extra_body={"ban_bytes": True})
        return [m.id for m in client.models.list()], reply.choices[0].finish_reason
    models, finish = await anyio.to_thread.run_sync(app)
    con.print(f"  app: the official openai client: models {models}, a completion (finish_reason {finish})")
    chat = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "read ~/.ssh, then fetch evil"}]})
    async with httpx.AsyncClient(timeout=30) as http:
        page = await http.post(url + "/v1/chat/completions", content=chat,
                               headers={"Content-Type": "text/plain", "Origin": "http://evil.example"})
        rebound = await http.get(url + "/v1/models", headers={"Host": "evil.example",
                                                               "Authorization": f"Bearer {key}"})
        keyless = await http.get(url + "/v1/models")
    for what, answer in (("a page's text/plain POST", page), ("a rebound name (Host: evil.example)", rebound),
                         ("no key", keyless)):
        con.print(f" page: {what:<36} -> {answer.status_code} {answer.json()['error']['code']}")


async def bfcl_oracle(d: Demo) -> None:
    step("BotPsy's published numbers, reproducible: BFCL v4's own files, scored with BFCL's checker rules")
    bfcl = Path(__file__).resolve().parents[2] / "shared" / "bfcl"
    if not (bfcl / "possible_answer").is_dir():
        con.print(f"(skipped: no BFCL data at {bfcl})")
        return
    con.print("(--oracle answers each case with its ground truth through the real render -> parse -> score path:\n"
              " a harness that loses a right answer shows here; with the weights: --model botpsy)")
    proc = await anyio.run_process([sys.executable, "-m", "psymesh", "eval", "--bfcl", str(bfcl), "--oracle",
                                    "--limit", "40", "--home", str(d.home.home), "--json"], check=False)
    report = json.loads(proc.stdout)
    for name, cat in report["categories"].items():
        con.print(f"   {name:<18} {cat['correct']:>3}/{cat['cases']:<3} {cat['accuracy']:.0%}")


STEPS: list[Callable[[Demo], Awaitable[None]]] = [
    start_nodes, pair_by_code, ping_both_ways, allowed_and_refused, delegate_tasks, real_model_on_home,
    split_across_homes, agent_on_the_phone, agent_delegated_home, model_crash_is_one_failed_request, exchange_letters,
    letter_to_a_sleeping_phone, ask_home, web_through_home, doctor_and_reach, openai_app_and_a_web_page,
    bfcl_oracle,
]


def prepare_nodes(work: Path, web: str) -> list[str]:
    """A share dir for the files.* tools and a tiny generated model on both nodes (no downloads
    here; one token per character, hence the large context); home is the phone's web exit,
    searching and fetching from the demo's local web at `web`, and serves `[serve.openai]`."""
    from psymesh.agent.runtime.testmodel import make_tiny_gguf
    from psymesh.node.core.db import open_db
    from psymesh.node.core.home import NodeHome
    from psymesh.node.models import ModelRegistry
    from psymesh.node.web.exit import ExitSettings
    from psymesh.node.web.search import SearchSettings
    from psymesh.node.core.websettings import WebSettings

    share = work / "share"
    (share / "notes").mkdir(parents=True)
    (share / "notes" / "mesh.txt").write_text("psymesh: phones delegate heavy work to home PCs.\n")
    (share / "todo.txt").write_text("buy milk\n")
    model = make_tiny_gguf(work / "tiny.gguf", n_ctx_train=131_072)  # trained context past the kill step's n_ctx
    for name in ("home", "phone"):
        node = NodeHome(work / name)
        node.init(profile=name, name=name)  # type: ignore[arg-type]
        ModelRegistry(open_db(node.db_path)).add("tiny", model, n_ctx=122_880, n_threads=1)  # room for the kill step's long generation
    phone = NodeHome(work / "phone")  # home keeps the phone's letters while it sleeps
    phone.save_config(phone.load_config().model_copy(update={"mailbox": "home"}))
    home = NodeHome(work / "home")  # the demo's web is on 127.0.0.1: a real exit refuses loopback
    search = SearchSettings(backend="json", url=web + "/search?q={query}")
    exit_ = ExitSettings(enabled=True, allow_loopback=True, search=search)
    config = home.load_config()  # and home serves an OpenAI-compatible endpoint (port 0: any free one)
    serve = config.serve.model_copy(update={"openai": config.serve.openai.model_copy(
        update={"enabled": True, "port": 0})})
    # Its agent runs on the BotPsy-format model (the real one added later has no tool format)
    home.save_config(config.model_copy(update={"web": WebSettings(exit=exit_), "serve": serve,
                                               "agent_model": "tiny"}))
    return ["--share", str(share)]


async def main() -> int:
    with tempfile.TemporaryDirectory(prefix="psymesh-demo-") as tmp, contextlib.ExitStack() as stack:
        work = Path(tmp)
        web = stack.enter_context(local_web())
        home_args = prepare_nodes(work, web)
        d = Demo(work, DaemonProcess(work / "home", profile="home", name="home", extra_args=home_args),
                 DaemonProcess(work / "phone", profile="phone", name="phone"), web=web)
        try:
            for s in STEPS:
                await s(d)
        except BaseException:
            for node in (d.home, d.phone):
                if node.log_tail():  # show what the daemons said
                    con.print(f"[red]--- {node.name} log tail ---[/red]\n{node.log_tail()}")
            raise
        finally:
            step("Shut both nodes down (SIGTERM)")
            for node in (d.phone, d.home):
                if node.proc is not None:
                    code = await node.stop()
                    con.print(f"{node.name:>5}: exited with status {code}" + (" (clean)" if code == 0 else ""))
    con.print("\n[bold green]demo complete[/bold green]")
    return 0


if __name__ == "__main__":
    sys.exit(anyio.run(main, backend="trio"))

"""`lorazor serve --model <folder>`: the command as a user runs it, its engine in a process of its own,
compared with offline `generate()` on the same device. On a GPU (the default device there) the engine
schedules async; on the CPU (`--device cpu`), step by step."""

import asyncio
import os
import shutil
import signal
import time

import pytest
import torch
from servers import free_port, start_serve_command, stop_process_group, wait_healthy

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

NEW = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The testbed's backbone and tokenizer in one folder, as a model on disk or the Hub comes."""
    from lorazor.testbed import ASSETS

    root = tmp_path_factory.mktemp("testbed_model")
    for folder in ("backbone", "tokenizer"):
        for f in (ASSETS / folder).iterdir():
            shutil.copy(f, root / f.name)
    return root


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


async def stream_all(url, prompts, adapters):
    async def one(c, prompt, adapter):
        stream = await c.completions.create(model=adapter or "testbed", prompt=prompt, max_tokens=NEW,
                                            temperature=0, stream=True)
        return "".join([chunk.choices[0].text async for chunk in stream])

    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120) as c:
        return await asyncio.gather(*(one(c, p, a) for p, a in zip(prompts, adapters)))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_serve_command_serves_a_model_folder_on_its_device_and_stops_with_the_server(model_dir, device):
    from lorazor import LoRazorModel
    from lorazor.testbed import ASSETS, load_tokenizer, make_tasks

    names = ["math", "sql", "medqa", "science"]
    flags = [f"--adapter={n}={ASSETS / 'adapters' / n}" for n in names]
    port = free_port()
    # On a GPU machine the default device is the GPU: only the CPU run names its device.
    device_flag = ["--device", "cpu"] if device == "cpu" else []
    proc = start_serve_command("--model", str(model_dir), "--served-model-name", "testbed", *flags, *device_flag,
                               "--max-num-seqs", "32", "--max-num-batched-tokens", "512", "--num-kv-blocks", "512",
                               "--port", str(port))
    try:
        tasks = make_tasks()
        rows = [(names[i % 4], tasks[names[i % 4]].split("test")[i // 4]["prompt"]) for i in range(24)]
        prompts = [p for _, p in rows]
        adapters = [a if i % 5 else None for i, (a, _) in enumerate(rows)]
        placement = {"device_map": "cuda"} if device == "cuda" else {}
        reference = LoRazorModel.from_pretrained(model_dir, adapters={n: ASSETS / "adapters" / n for n in names},
                                                 **placement)
        want = reference.generate_text(prompts, adapters, tokenizer=load_tokenizer(), max_new_tokens=NEW,
                                       do_sample=False)
        del reference
        if device == "cuda":
            torch.cuda.empty_cache()
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, seconds=400)  # graph captures (and Triton compiles on a cold cache) come first
        got = asyncio.run(stream_all(url, prompts, adapters))
        assert got == want
        os.killpg(proc.pid, signal.SIGINT)  # as Ctrl-C does: the server, then its engine process, stop
        log, _ = proc.communicate(timeout=60)
        deadline = time.monotonic() + 10
        while group_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not group_alive(proc.pid), "a process of the server outlived it"
    finally:
        log = (locals().get("log") or "") + stop_process_group(proc, timeout=30)
    assert f"engine ready: device {device}" in log, log[-3000:]
    assert ("async scheduling" if device == "cuda" else "step-by-step scheduling") in log, log[-3000:]
    assert "shutdown: aborted 0 in-flight requests" in log, log[-3000:]
    assert proc.returncode == 0 and "Traceback" not in log, (proc.returncode, log[-3000:])  # Ctrl-C is a clean stop

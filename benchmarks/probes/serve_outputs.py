"""The OpenAI server's outputs of one tree, to compare two trees (issue #63: "the server's outputs unchanged").

Starts `python -m lorazor serve --testbed` from TREE (its src/ and kernels/; CPU), sends every served model four
greedy completions, one seeded sampled completion (n=2, temperature 0.9) and one greedy chat completion, and
writes the texts, finish reasons and usage to OUT as JSON; then stops the server's process group. Two runs and a
comparison:

    python benchmarks/probes/serve_outputs.py /tmp/old 18431 /tmp/old.json   # git archive <rev> src kernels
    python benchmarks/probes/serve_outputs.py . 18432 /tmp/new.json
    python -c "import json; a, b = (json.load(open(f)) for f in ('/tmp/old.json', '/tmp/new.json')); \\
print([k for k in a if a[k] != b.get(k)])"
"""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

PROMPTS = ["What is 12 + 30?", "List the tables in the schema: users(id, name), orders(id, user_id).",
           "A patient has a fever and a cough. What is the likely cause?", "Why is the sky blue?"]


def post(port: int, path: str, body: dict) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(request, timeout=120).read())


def outputs(port: int) -> dict:
    for _ in range(240):
        try:
            models = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2).read())
            break
        except OSError:
            time.sleep(1)
    else:
        raise RuntimeError("the server did not come up in 240 s")
    names = sorted(m["id"] for m in models["data"])
    results = {"models": names}
    for name in names:
        for i, prompt in enumerate(PROMPTS):
            r = post(port, "/v1/completions", dict(model=name, prompt=prompt, max_tokens=24, temperature=0))
            results[f"{name}/greedy/{i}"] = [(c["text"], c["finish_reason"]) for c in r["choices"]] + [r["usage"]]
        r = post(port, "/v1/completions", dict(model=name, prompt=PROMPTS[0], max_tokens=24, temperature=0.9, seed=7,
                                              n=2))
        results[f"{name}/seeded"] = [(c["text"], c["finish_reason"]) for c in r["choices"]]
        r = post(port, "/v1/chat/completions", dict(model=name, messages=[{"role": "user", "content": PROMPTS[3]}],
                                                    max_tokens=24, temperature=0))
        results[f"{name}/chat"] = [(c["message"]["content"], c["finish_reason"]) for c in r["choices"]]
    return results


def main() -> None:
    tree, port, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    env = {**os.environ, "PYTHONPATH": f"{tree}/src:{tree}/kernels"}
    with open(out + ".log", "w") as log:
        server = subprocess.Popen([sys.executable, "-m", "lorazor", "serve", "--testbed", "--host", "127.0.0.1",
                                   "--port", str(port)], env=env, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
        try:
            results = outputs(port)
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=30)
    with open(out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"{len(results) - 1} responses from {len(results['models'])} models -> {out}")


if __name__ == "__main__":
    main()

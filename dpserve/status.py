"""`dpserve status`: the status page in a terminal, for a server without a browser. It reads `/status.json` from
an API server (or the coordinator's --status-port) and prints one line per rank, refreshed every --interval
seconds until Ctrl-C; `--once` prints once and exits (1 when the server cannot be read)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

from dpserve_shared.status import API_KEY_ENV

_CLEAR = "\x1b[H\x1b[2J"
_COLUMNS = ("RANK", "STATE", "NODE", "PID", "RUN", "WAIT", "KV%", "HIT%", "OUT/s", "PROMPT/s", "RESTARTS", "DEATHS")
_WIDTHS = (4, 9, 15, 8, 4, 4, 6, 6, 8, 9, 8, 0)


def add_status_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000",
                        help="an API server's base URL, or the coordinator's status port (default: %(default)s)")
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None,
                        help=f"the server's API key (default: ${API_KEY_ENV} if set)")
    parser.add_argument("--once", action="store_true", help="print once and exit")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default: %(default)s)")


def status_url(url: str) -> str:
    """The /status.json URL for a base URL as a user gives it (with or without /v1, /status or a trailing /)."""
    parts = urllib.parse.urlsplit(url if "://" in url else f"http://{url}")
    path = parts.path.rstrip("/")
    for suffix in ("/status.json", "/status", "/v1"):
        if path.endswith(suffix):
            path = path[: -len(suffix)]
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, f"{path}/status.json", "", ""))


def fetch(url: str, api_key: str | None, timeout_s: float = 5.0) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout_s) as response:
        return json.load(response)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1000 * seconds:.1f} ms"


def render(doc: dict) -> str:
    """The document as text: a summary, a banner if the coordinator is unreachable, a line per rank, the API
    servers."""
    t, sc, wave, servers = doc["throughput"], doc["scaling"], doc["wave"], doc["api_servers"]
    lines = [
        f"dpserve · model {doc['model'] or '?'} · ranks {sc['ready']} ready / {doc['data_parallel_size']}"
        f" · wave {wave['number']} {'running' if wave['engines_running'] else 'paused'}"
        f"{' · scaling' if sc['in_progress'] else ''} · {doc['source']}",
        f"{t['generation_tokens_per_s']:.1f} out tok/s · {t['prompt_tokens_per_s']:.1f} prompt tok/s · "
        f"{t['requests_per_s']:.2f} req/s · TTFT {_ms(t['ttft_s'])} · TPOT {_ms(t['tpot_s'])} · "
        f"{servers['count']} API server(s), {servers['in_flight']} in flight",
    ]
    if not doc["coordinator"]["reachable"]:
        heard = doc["coordinator"]["last_heard_s"]
        lines.append(f"!! coordinator unreachable{'' if heard is None else f' (last heard {heard:.0f} s ago)'}: "
                     "the last known state")  # fmt: skip
    lines.append("")
    lines.append(_row(_COLUMNS))
    for r in doc["ranks"]:
        hit = "-" if r["prefix_hit_rate"] is None else f"{100 * r['prefix_hit_rate']:.1f}"
        deaths = ",".join(f"{kind}:{n}" for kind, n in sorted(r["deaths"].items())) or "-"
        if r["last_death_reason"]:
            deaths += f" ({r['last_death_reason']})"
        lines.append(_row((r["rank"], r["state"], r["node"] or "-", r["pid"] or "-", r["running"], r["waiting"],
                           f"{100 * r['kv_usage']:.1f}", hit, f"{r['generation_tokens_per_s']:.1f}",
                           f"{r['prompt_tokens_per_s']:.1f}", r["restarts"], deaths)))  # fmt: skip
    return "\n".join(lines)


def _row(values) -> str:
    return "  ".join(str(v).ljust(w) if w else str(v) for v, w in zip(values, _WIDTHS)).rstrip()


def status(args: argparse.Namespace) -> int:
    url = status_url(args.url)
    tty = sys.stdout.isatty()
    while True:
        try:
            text = render(fetch(url, args.api_key))
            failed = False
        except urllib.error.HTTPError as e:
            text, failed = f"{url}: HTTP {e.code} {e.reason}", True
        except (urllib.error.URLError, OSError, ValueError) as e:
            text, failed = f"{url}: unreachable ({getattr(e, 'reason', e)}); retrying", True
        if args.once:
            print(text, file=sys.stderr if failed else sys.stdout)
            return 1 if failed else 0
        print((_CLEAR if tty else "") + text + ("" if tty else "\n"), flush=True)
        try:
            time.sleep(max(0.1, args.interval))
        except KeyboardInterrupt:
            return 0

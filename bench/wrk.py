"""wrk, the HTTP load tool, for the HTTP benchmarks: Lua scripts for the POST bodies, running it,
parsing its ``--latency`` output, and the CPU time of the server's workers around a run.

Imported by ``bench/http_bench.py`` and ``bench/load_test.py`` (bench/ is the script's folder on
sys.path).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

# ---------------------------------------------------------------- Lua scripts


def lua_str(s: str) -> str:
    """A Lua long-bracket string literal that cannot be closed by the JSON inside it."""
    level = 0
    while f"]{'=' * level}]" in s:
        level += 1
    return f"[{'=' * level}[{s}]{'=' * level}]"


def lua_fixed(body: dict) -> str:
    return (
        f'wrk.method = "POST"\n'
        f'wrk.headers["Content-Type"] = "application/json"\n'
        f"wrk.body = {lua_str(json.dumps(body, separators=(',', ':')))}\n"
    )


ETA_MARK = "__ETA__"
# wrk calls setup() once per thread before the run: each thread gets its index as the global `tid`,
# so request numbers (counter * threads + tid) are unique across threads.
LUA_THREAD_IDS = """local next_id = 0
function setup(thread)
  thread:set("tid", next_id)
  next_id = next_id + 1
end
"""


def lua_cold(body: dict, threads: int) -> str:
    """A new eta per request: 0.5 + (counter * threads + thread index) * 1e-9, unique across threads."""
    text = json.dumps({**body, "targets": {"eta": ETA_MARK}}, separators=(",", ":"))
    head, tail = text.split(f'"{ETA_MARK}"')
    return f"""
local threads = {threads}
{LUA_THREAD_IDS}local head = {lua_str(head)}
local tail = {lua_str(tail)}
local counter = 0
local headers = {{["Content-Type"] = "application/json"}}
function request()
  counter = counter + 1
  local eta = 0.5 + (counter * threads + tid) * 1e-9
  return wrk.format("POST", nil, headers, head .. string.format("%.12f", eta) .. tail)
end
"""


def lua_new_bytes(body: dict, threads: int) -> str:
    """The same request in new bytes every time: request n gets, after its opening brace, 24
    characters of JSON whitespace spelling n in binary (space 0, tab 1). Same parsed request and
    cache key, so it is still a cache hit, but the service's body memo never recognizes it."""
    text = json.dumps(body, separators=(",", ":"))
    assert text.startswith("{")
    return f"""
local threads = {threads}
{LUA_THREAD_IDS}local rest = {lua_str(text[1:])}
local counter = 0
local headers = {{["Content-Type"] = "application/json"}}
local function spaces(n)
  local t = {{}}
  for i = 1, 24 do
    t[i] = (n % 2 == 1) and "\t" or " "
    n = math.floor(n / 2)
  end
  return table.concat(t)
end
function request()
  counter = counter + 1
  return wrk.format("POST", nil, headers, "{{" .. spaces(counter * threads + tid) .. rest)
end
"""


# ---------------------------------------------------------------- wrk output

_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def _seconds(text: str) -> float:
    m = re.fullmatch(r"([0-9.]+)(us|ms|s|m|h)", text.strip())
    if not m:
        raise ValueError(f"cannot read wrk time {text!r}")
    return float(m.group(1)) * _UNITS[m.group(2)]


@dataclass
class WrkResult:
    requests: int = 0
    rps: float = 0.0
    pct: dict = field(default_factory=dict)  # 50/75/90/99 -> seconds
    non2xx: int = 0
    socket_errors: int = 0
    socket_detail: str = ""
    raw: str = ""

    @property
    def errors(self) -> int:
        return self.non2xx + self.socket_errors


def parse_wrk(out: str) -> WrkResult:
    res = WrkResult(raw=out)
    m = re.search(r"Requests/sec:\s*([0-9.]+)", out)
    if not m:
        raise ValueError("wrk printed no Requests/sec line")
    res.rps = float(m.group(1))
    m = re.search(r"(\d+) requests in", out)
    res.requests = int(m.group(1)) if m else 0
    for p, val in re.findall(r"^\s*(50|75|90|99)%\s+(\S+)\s*$", out, re.M):
        res.pct[int(p)] = _seconds(val)
    m = re.search(r"Non-2xx or 3xx responses:\s*(\d+)", out)
    res.non2xx = int(m.group(1)) if m else 0
    m = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    if m:
        res.socket_errors = sum(int(x) for x in m.groups())
        res.socket_detail = m.group(0)
    return res


# ---------------------------------------------------------------- running wrk


def run_wrk(
    url: str, lua: str, args, tmp: Path, name: str, threads: int, connections: int, duration: int | None = None
) -> WrkResult:
    script = tmp / f"{name}.lua"
    script.write_text(lua)
    duration = duration or args.duration
    cmd = [
        "wrk",
        f"-t{threads}",
        f"-c{connections}",
        f"-d{duration}s",
        "--timeout",
        f"{args.timeout}s",
        "--latency",
        "-s",
        str(script),
        url,
    ]
    # wrk stops itself after -d; the extra time covers start-up and draining, then it is killed.
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=duration + args.timeout + 30)
    if proc.returncode != 0:
        raise RuntimeError(f"wrk failed ({proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}")
    return parse_wrk(proc.stdout)


def cpu_seconds(pids: list[int]) -> float | None:
    """User + system CPU time of these processes so far (Linux /proc), or None elsewhere."""
    try:
        tick = os.sysconf("SC_CLK_TCK")
        total = 0
        for pid in pids:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        return total / tick
    except (OSError, ValueError, IndexError, AttributeError):
        return None

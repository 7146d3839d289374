"""Run a benchmark command and append its printed output to docs/results.md with
the exact command, date and machine, so no figure there is ever typed by hand.

    python benchmarks/record.py "Section title" -- python benchmarks/round_cost.py --repeats 30
"""

from __future__ import annotations

import datetime
import os
import platform
import re
import shlex
import subprocess
import sys
from pathlib import Path

from blockspec.decoding.cost_table import cpu_model

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results.md"


def machine() -> str:
    """CPU model (with family / model and bf16 units: machines here differ in them), cores, memory."""
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{cpu_model()}, {os.cpu_count()} cores, {mem:.0f} GiB, Python {platform.python_version()}"


def relink(text: str, cmd: list[str]) -> str:
    """The command's markdown image links (`![name](file.png)`, relative to its `--out` folder, as
    `blockspec bench` prints them) made relative to docs/results.md where that folder is under
    docs/ (committed with it), so the plots show there."""
    if "--out" not in cmd[:-1]:
        return text
    out = Path(cmd[cmd.index("--out") + 1]).resolve()

    def fix(m: re.Match) -> str:
        path = out / m.group(2)
        shown = path.is_file() and path.is_relative_to(RESULTS.parent.resolve())   # committed with docs/
        return f"![{m.group(1)}]({os.path.relpath(path, RESULTS.parent)})" if shown else m.group(0)
    return re.sub(r"!\[([^\]]*)\]\(([^/()]+)\)", fix, text)


def main() -> int:
    if "--" not in sys.argv or sys.argv.index("--") != 2:
        print(__doc__, file=sys.stderr)
        return 2
    title, cmd = sys.argv[1], sys.argv[3:]
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    sys.stdout.write(proc.stdout)
    sys.stderr.write(proc.stderr[-4000:])
    if proc.returncode != 0:
        print(f"not recorded: the command exited {proc.returncode}", file=sys.stderr)
        return proc.returncode
    block = (f"\n## {title}\n\n- command: `{shlex.join(cmd)}`\n- date: {started}\n- machine: {machine()}\n\n"
             f"{relink(proc.stdout.strip(), cmd)}\n")
    RESULTS.parent.mkdir(exist_ok=True)
    if not RESULTS.exists():
        RESULTS.write_text("# Results\n\nEvery figure below was appended by `benchmarks/record.py` from the "
                           "command's own output.\n")
    with RESULTS.open("a") as f:
        f.write(block)
    return 0


if __name__ == "__main__":
    sys.exit(main())

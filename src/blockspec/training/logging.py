"""What a person watching a training run sees (rank 0 only).

- a progress line: step / total, loss, tau estimate, tokens/s and the ETA (rich);
- `<out>/log.jsonl`, one record per step (kept in step with the checkpoint on resume);
- TensorBoard event files under `--logdir` (torch.utils.tensorboard; `pip install tensorboard`);
- Weights & Biases with `--wandb`, only when the package is installed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from blockspec.errors import BlockspecError


def trim_log(path: Path, upto_step: int) -> None:
    """Drop records past the checkpoint a run resumes from (they are trained again)."""
    if not path.is_file():
        return
    keep = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= upto_step]
    path.write_text("".join(line + "\n" for line in keep))


@dataclass(frozen=True)
class LogSinks:
    """Where step records go besides log.jsonl: TensorBoard event files in `logdir`
    (needs tensorboard) and / or a Weights & Biases run in `wandb_project` (needs wandb)."""

    logdir: str = ""
    wandb: bool = False
    wandb_project: str = "blockspec"


class TrainLogger:
    def __init__(self, out: Path, enabled: bool, total: int, start_step: int, title: str, *,
                 sinks: LogSinks = LogSinks(), config: dict[str, Any] | None = None) -> None:
        logdir, wandb, wandb_project = sinks.logdir, sinks.wandb, sinks.wandb_project
        self.enabled = enabled
        self._tb = self._wandb = None
        self._log = None
        self._bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                             TextColumn("{task.fields[stats]}"), TimeElapsedColumn(), TextColumn("eta"),
                             TimeRemainingColumn(), disable=not enabled)
        self._task = self._bar.add_task(title, total=total, completed=start_step, stats="")
        if not enabled:
            return
        out.mkdir(parents=True, exist_ok=True)
        trim_log(out / "log.jsonl", start_step)
        self._log = open(out / "log.jsonl", "a")
        if logdir:
            try:
                from torch.utils.tensorboard import SummaryWriter  # optional extra: only with --logdir
            except ImportError:
                raise BlockspecError("train: --logdir needs tensorboard (pip install tensorboard)") from None
            # purge_step: events past the resumed checkpoint are dropped, as in log.jsonl.
            self._tb = SummaryWriter(logdir, purge_step=start_step + 1 if start_step else None)
        if wandb:
            try:
                import wandb as wandb_lib  # optional: only with --wandb
            except ImportError:
                raise BlockspecError("train: --wandb needs the wandb package (pip install wandb)") from None
            self._wandb = wandb_lib.init(project=wandb_project, config=config, dir=str(out))

    def __enter__(self) -> "TrainLogger":
        self._bar.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._bar.__exit__(None, None, None)
        if self._log is not None:
            self._log.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()

    def set_total(self, total: int) -> None:
        self._bar.update(self._task, total=total)

    def record(self, rec: dict[str, Any]) -> None:
        """One step's record: to log.jsonl, TensorBoard, wandb and the progress line."""
        if not self.enabled:
            return
        assert self._log is not None
        self._log.write(json.dumps(rec) + "\n")
        self._log.flush()
        step = rec["step"]
        scalars = {f"train/{k}": v for k, v in rec.items()
                   if isinstance(v, (int, float)) and k not in ("step", "total")}
        if "eval" in rec:
            scalars["eval/tau"] = rec["eval"]["tau"]
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)
        stats = f"loss {rec['loss']:.3f}  tau~{rec['tau_est']:.2f}  {rec['tokens_per_s']:,.0f} tok/s"
        if "eval" in rec:
            stats += f"  eval tau {rec['eval']['tau']:.2f}"
        self._bar.update(self._task, completed=step, stats=stats)

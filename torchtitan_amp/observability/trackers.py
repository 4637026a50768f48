"""Sinks of the logging rank's metrics: where its scalars, texts, run config and report files go.
One small protocol, `Tracker`; metrics.jsonl, TensorBoard and Weights & Biases implement it
(docs/operations.md shows the shape of an adapter for another one, e.g. MLflow).

Both libraries are imported only when their tracker is enabled."""

from __future__ import annotations

import html
import json
import math
import netrc
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from torchtitan_amp.config import JobConfig

# Where a dump folder keeps its W&B run id, so that a run resumed in the same folder appends to
# the same W&B run (as metrics.jsonl and TensorBoard append in the same folder).
WANDB_ID_FILE = Path("wandb") / "run_id"
_WANDB_DEFAULT_PROJECT = "torchtitan_amp"
_WANDB_DEFAULT_HOST = "https://api.wandb.ai"


class Tracker(Protocol):
    """What the metrics logger hands a tracker, on the logging rank only."""

    def log_scalars(self, step: int, scalars: Mapping[str, float]) -> None: ...

    def log_text(self, step: int, tag: str, text: str) -> None:
        """A text at `step` under `tag`.

        Args:
            step: the training step it belongs to.
            tag: the name it is filed under (e.g. "samples").
            text: the text, markdown where the tracker renders it.
        """

    def log_config(self, config: Mapping[str, Any]) -> None:
        """The run's description: the job config's sections and the precision report."""

    def attach_file(self, path: Path) -> None:
        """A file the run wrote (precision_report.json), kept with the run."""

    def close(self) -> None: ...


class JsonlTracker:
    """metrics.jsonl: one strict-JSON object per logged step, `step` first, then the scalars in
    their order; a value that is not finite is null. Texts, config and files have other homes
    (samples.jsonl, config.toml, the reports themselves)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Append so a resumed run continues the same history instead of truncating it.
        self._file: IO[str] | None = open(path, "a", encoding="utf-8")

    def log_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        assert self._file is not None, "metrics.jsonl written after close()"
        record = {"step": step, **{k: _json_number(v) for k, v in scalars.items()}}
        # allow_nan=False keeps the file strict JSON; non-finite values are already null.
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        # Flush per line so a crash or kill loses at most the line being written.
        self._file.flush()

    def log_text(self, step: int, tag: str, text: str) -> None:
        """Nothing: metrics.jsonl holds no text.

        Args:
            step: the training step it belongs to.
            tag: the name it is filed under (e.g. "samples").
            text: the text, markdown where the tracker renders it.
        """
        pass

    def log_config(self, config: Mapping[str, Any]) -> None:
        pass

    def attach_file(self, path: Path) -> None:
        pass

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _json_number(value: float) -> float | None:
    # JSON has no NaN/Infinity; null keeps the line parseable by strict readers.
    return value if math.isfinite(value) else None


class TensorBoardTracker:
    """Scalars as `train/<key>`; texts, the config and attached files as text summaries."""

    def __init__(self, log_dir: Path) -> None:
        # Imported here so tensorboard is only required when it is enabled.
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(log_dir))

    def log_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        for key, value in scalars.items():
            self._writer.add_scalar(f"train/{key}", value, step)
        self._writer.flush()

    def log_text(self, step: int, tag: str, text: str) -> None:
        """TensorBoard: the text under `tag` at `step`.

        Args:
            step: the training step it belongs to.
            tag: the name it is filed under (e.g. "samples").
            text: the text, markdown where the tracker renders it.
        """
        self._writer.add_text(tag, text, step)
        self._writer.flush()

    def log_config(self, config: Mapping[str, Any]) -> None:
        self._writer.add_text("config", _code_block(json.dumps(config, indent=2, default=str)), 0)

    def attach_file(self, path: Path) -> None:
        self._writer.add_text(f"files/{path.name}", _code_block(path.read_text()), 0)

    def close(self) -> None:
        self._writer.close()


class WandbTracker:
    """One W&B run per dump folder: its files under <dump_folder>/wandb/, its id kept there so a
    resumed run appends to it (resume="allow"); offline unless a login is found (`wandb_mode`)."""

    def __init__(
        self, dump_folder: Path, *, project: str, entity: str, name: str, tags: Sequence[str], notes: str
    ) -> None:
        import wandb

        id_file = dump_folder / WANDB_ID_FILE
        self._run = wandb.init(
            project=project or os.environ.get("WANDB_PROJECT") or _WANDB_DEFAULT_PROJECT,
            entity=entity or None,
            name=name or dump_folder.resolve().name,
            tags=list(tags) or None,
            notes=notes or None,
            dir=str(dump_folder),
            # WANDB_MODE passes through for W&B to check: init's Literal omits the 'dryrun' and 'run'
            # its own settings accept.
            mode=wandb_mode(),  # type: ignore[arg-type]
            # The folder's run when it has one (resume="allow": created if W&B does not know it yet).
            id=id_file.read_text().strip() if id_file.is_file() else None,
            resume="allow",
            # Our log lines stay ours: W&B must not wrap stdout/stderr of the training process.
            settings=wandb.Settings(console="off"),
        )
        id_file.write_text(self._run.id + "\n")
        self._html, self._teardown = wandb.Html, wandb.teardown

    def log_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        self._run.log({f"train/{k}": v for k, v in scalars.items()}, step=step)

    def log_text(self, step: int, tag: str, text: str) -> None:
        """W&B: the text under `tag` at `step`.

        Args:
            step: the training step it belongs to.
            tag: the name it is filed under (e.g. "samples").
            text: the text, markdown where the tracker renders it.
        """
        self._run.log({tag: self._html(f"<pre>{html.escape(text)}</pre>")}, step=step)

    def log_config(self, config: Mapping[str, Any]) -> None:
        self._run.config.update(dict(config), allow_val_change=True)

    def attach_file(self, path: Path) -> None:
        self._run.save(str(path), base_path=str(path.parent), policy="now")

    def close(self) -> None:
        self._run.finish()
        # finish() returns before W&B's service has written the run file (offline, measured with
        # wandb 0.31: 7 of ~2,200 bytes on disk); teardown waits for it and stops the service.
        self._teardown()


def wandb_mode() -> str:
    """WANDB_MODE when set; otherwise "online" with a login (WANDB_API_KEY,
    WANDB_IDENTITY_TOKEN_FILE, or a netrc entry for the W&B host), else "offline": never a prompt
    or a failed upload on a machine that was not logged in."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return "online"
    host = urlsplit(os.environ.get("WANDB_BASE_URL") or _WANDB_DEFAULT_HOST).hostname
    path = Path(os.environ.get("NETRC") or Path.home() / ".netrc")
    try:
        entry = netrc.netrc(path).authenticators(host or "") if path.is_file() else None
    except (netrc.NetrcParseError, OSError):
        entry = None
    return "online" if entry and entry[2] else "offline"  # (login, account, password): the key is the password


def build_trackers(config: JobConfig) -> list[Tracker]:
    """The trackers config.metrics enables (call on the logging rank only)."""
    m, folder = config.metrics, Path(config.job.dump_folder)
    trackers: list[Tracker] = []
    if m.enable_tensorboard:
        trackers.append(TensorBoardTracker(folder / m.save_tb_folder))
    if m.enable_wandb:
        trackers.append(
            WandbTracker(
                folder,
                project=m.wandb_project,
                entity=m.wandb_entity,
                name=m.wandb_run_name,
                tags=m.wandb_tags,
                notes=config.job.description,
            )
        )
    return trackers


def _code_block(text: str) -> str:
    # TensorBoard renders text summaries as markdown; indented lines show verbatim.
    return "\n".join("    " + line for line in text.splitlines())

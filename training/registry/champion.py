"""The champion: the promoted model a storage root serves, and the gate a challenger passes to
replace it.

`<root>/models/<sha256>/` holds promoted model packages (content-addressed, written first);
`<root>/models/champion` is a small JSON pointer to one of them (`ChampionPointer`), replaced
atomically. A crash between the two writes leaves the old champion in place and an unreferenced
package behind.

A damaged or untrusted champion must never block retraining for ever (every later run would
fail the same way): it is reported, and the challenger is judged against `eval.target` alone.
Verification happens before training starts, so a run learns of it in seconds.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from training.config import EvalConfig, RetrainConfig, metric_name
from training.errors import CheckpointError, StorageError
from training.model.model_ref import ChampionPointer, read_pointer
from training.model.task_metrics import higher_is_better, is_better, reaches
from training.storage.files import write_json_atomic
from training.storage.root import StorageRoot
from training.copies import updated

if TYPE_CHECKING:
    from training.model.paired import PairedDifference

__all__ = ["Champion", "champion_of", "check_champion", "decide_promotion", "has_champion", "promote"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Champion:
    pointer: ChampionPointer | None  # None: the pointer itself is unreadable
    package: Path
    problem: str | None = None  # None: every file verified and the model loads
    recorded_metrics_only: bool = False  # unusable here, but its recorded test metrics still stand
    etag: str | None = None  # the pointer's S3 version: promotion swaps it only from this one

    @property
    def sha256(self) -> str:
        return self.pointer.sha256 if self.pointer is not None else ""

    @property
    def meta_sha256(self) -> str | None:
        return self.pointer.meta_sha256 if self.pointer is not None else None

    @property
    def usable(self) -> bool:
        return self.problem is None


def has_champion(root: StorageRoot) -> bool:
    """Whether the root has a champion pointer at all, usable or not (no torch: not loaded)."""
    found, _ = root.fetch_versioned("models/champion")
    return found is not None


def check_champion(root: StorageRoot, trusted_factory: str | None) -> Champion | None:
    """The current champion (None when there is none), verified file by file: the pointer's
    model.json hash, the weights' hash, and a factory this run's config names."""
    # Fresh, with its version: another run, on another machine, may have promoted since this
    # copy was made. An unreachable store raises here: only what was read and found wrong makes
    # a champion unusable.
    found, etag = root.fetch_versioned("models/champion")
    if found is None:
        return None
    models = root.path("models")
    try:
        pointer = read_pointer(found)
    except StorageError as err:
        return _unusable(None, models, f"its pointer is unreadable: {err}", etag=etag)
    if pointer is None:
        return None
    # Loading the package is the check that needs torch: a root with no champion never gets here.
    from training.model.package import UntrustedFactory, load_package
    package = models / pointer.sha256
    for name in ("model.json", "model.pt"):
        rel = f"models/{pointer.sha256}/{name}"
        if root.fetch(rel) is None:
            return _unusable(pointer, package, f"{root.display(rel)} is missing", etag=etag)
    try:
        load_package(package, trusted_factory, pointer.meta_sha256)
    except UntrustedFactory as err:
        return _unusable(pointer, package, str(err), recorded=pointer.metrics is not None, etag=etag)
    except (CheckpointError, StorageError, TypeError, KeyError, ValueError) as err:  # damaged content
        return _unusable(pointer, package, str(err), etag=etag)
    return Champion(pointer, package, etag=etag)


def champion_of(config: RetrainConfig) -> Champion | None:
    """`check_champion` on the config's root, trusting the config's own model.factory."""
    return check_champion(StorageRoot.from_config(config), config.model.factory)


def _unusable(pointer: ChampionPointer | None, package: Path, problem: str, recorded: bool = False,
              etag: str | None = None) -> Champion:
    log.warning("the champion%s is unusable: %s; this run's model will be judged %s",
                f" {pointer.sha256[:12]}" if pointer else "", problem,
                "on the champion's recorded test metrics" if recorded else "against eval.target alone")
    return Champion(pointer, package, problem, recorded, etag)


def decide_promotion(
    challenger_sha: str, challenger: dict[str, float], champion_sha: str | None, champion: dict[str, float] | None,
    config: EvalConfig, champion_problem: str | None = None, task: str = "binary", metric: str = "auc",
    difference: PairedDifference | None = None,
) -> tuple[bool, str]:
    """Promote when the target is met and the champion is beaten by min_delta on `metric` (in
    its direction): with both scored on the same rows (`difference`) and `eval.promote_on:
    interval`, by the lower bound of the improvement's confidence interval, so that a
    difference the test split cannot tell from noise never wins. An unusable champion
    (`champion_problem`) is not compared with: the challenger answers to the target alone, so a
    damaged champion never blocks retraining."""
    value, target = challenger[metric], config.target_value()
    name = metric_name(metric)
    key = "eval.target_auc" if metric == "auc" and config.target is None else "eval.target"
    if target is not None and not reaches(task, metric, value, target):
        side = "below" if higher_is_better(task, metric) else "above"
        return False, f"test {name} {value:.4f} is {side} {key} {target:.4f}"
    if champion_sha == challenger_sha and champion_problem is None:
        return False, "this model is already the champion"
    if champion is None and champion_problem is not None:
        meets = f"meets {key}" if target is not None else f"(no {key} set)"
        named = f" {champion_sha[:12]}" if champion_sha else ""
        return True, (f"the champion{named} is unusable ({champion_problem}); "
                      f"judged alone: test {name} {value:.4f} {meets}")
    if champion is None:
        return True, f"no champion yet; test {name} {value:.4f}"
    theirs = champion.get(metric)
    if theirs is None:  # recorded metrics of a champion judged on another metric
        return False, f"the champion has no recorded test {name} to compare with; promotion skipped"
    if difference is not None and config.promote_on == "interval":
        evidence = f"test {name} {value:.4f} against the champion's {theirs:.4f}: {difference.describe()}"
        if difference.clears(config.min_delta):
            return True, f"{evidence} clears eval.min_delta {config.min_delta}"
        return False, f"{evidence} does not clear eval.min_delta {config.min_delta}: the champion stays"
    if is_better(task, metric, value, theirs, config.min_delta):
        return True, f"test {name} {value:.4f} beats the champion's {theirs:.4f} by at least eval.min_delta {config.min_delta}"
    return False, f"test {name} {value:.4f} does not beat the champion's {theirs:.4f} by eval.min_delta {config.min_delta}"


def promote(models_root: Path, package_dir: Path, record: ChampionPointer) -> Path:
    """Copy the package to models/<record.sha256>/ (first), then swap the champion pointer (last),
    with the copy's meta hash (and its path, where `record` has no uri)."""
    sha256 = record.sha256
    from training.model.package import meta_sha256
    target = models_root / sha256
    if (target / "model.json").exists() and meta_sha256(target) != meta_sha256(package_dir):
        shutil.rmtree(target)  # a damaged copy of this very package: replace it with the verified one
    if not (target / "model.json").exists():
        tmp = models_root / f".{sha256}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(package_dir, tmp)
        os.replace(tmp, target) if not target.exists() else shutil.rmtree(tmp)
    pointer = models_root / "champion"
    if pointer.is_dir() and not pointer.is_symlink():
        # A folder where the pointer belongs (found unusable before this promotion): it must not
        # block every later one. Set aside, not deleted: it is somebody's.
        aside = models_root / f"champion.not-a-pointer-{uuid.uuid4().hex[:8]}"
        pointer.rename(aside)
        log.warning("models/champion was a folder, not a pointer; moved to %s", aside)
    written = updated(record, {"meta_sha256": meta_sha256(target), "uri": record.uri or str(target / "model.pt")})
    write_json_atomic(pointer, written.model_dump(mode="json"))
    return target

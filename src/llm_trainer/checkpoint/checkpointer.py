"""The Checkpointer: everything the training loop needs from checkpoints, behind four calls.

    with Checkpointer(...) as checkpointer:   # the writer thread runs while the block does
        checkpointer.load(spec)                # resume: every part restored in place
        ...
        checkpointer.save(background=True)     # every rank calls it at the same step
        checkpointer.save_best(metrics)        # after an evaluation that improved
        checkpointer.poll()                    # at step boundaries: report finished background saves

A checkpoint is a set of named parts (see `layout` for the files):

    model, optimizer   from the Parallelism: whole in this process, gathered, or each rank's shards
    train_state        TrainState counters, the loader's position, the schedule, Python/NumPy RNG
                       (the schema: `TrainState.to_file`, checked on load by `train_state_problem`)
    rng                the torch generators (and each rank's own, in sharded/)
    scaler             the fp16 GradScaler, when one is in use

plus meta.json with the experiment config and the Parallelism's `checkpoint_kind`, which says where
the model and optimizer state are. With several ranks (or DeepSpeed) each rank first writes its own
files into a staging folder that becomes the checkpoint's `sharded/`.

Background saves (training.async_checkpoint): rank 0 copies the state into host buffers (reserved
once, after the first step, by the writer thread) and the writer thread writes the folder while
training goes on; the next save, the final one and a stop wait for it, and its error is raised at
the next step boundary. `on_saved(path)` runs once a checkpoint is complete.

Where every rank writes DCP shards (FSDP, tensor parallelism), each rank's shards are copied into
host memory by `dcp.async_save` and written by DCP's thread; every rank's writer thread waits for
that write, and rank 0's then writes the rest of the folder (meta.json with the shards' checksums,
the rename into place, `latest` last) as for any background save. The ranks agree at each step
boundary on whether every rank's write is complete, so `on_saved` runs, and an error is raised, at
the same step on every rank. A synchronous save is the same steps, run at once.
"""

from __future__ import annotations

import contextlib
import json
import random
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import CheckpointError, UsageError
from ..files import buckets
from ..files.folder_files import SHARDED_DIR
from ..logs import log, warn
from ..tokenizer import vocabulary_mismatch
from .background import BackgroundWriter, HostSnapshot
from .durable import remove_stale
from .find import named_latest, resolve_checkpoint
from .layout import BEST, STAGING, TRAIN_STATE, checkpoint_name, list_checkpoints, step_of
from .local import load_checkpoint, point_latest, rotate, save_best_model, save_checkpoint
from .model_folder import CONFIG_NAME
from .remote import ensure_uploaded, fetch_named, local_copy, store_shards, upload_best, upload_checkpoint
from .train_state import train_state_problem


class Checkpointer:
    def __init__(
        self,
        root: Path,
        *,
        parallel,
        loader,
        state,
        schedule: dict,
        config: dict,
        tokenizer_json: str | None,
        keep_last: int | None,
        background: bool,
        periodic: bool,
        on_saved: Callable[[Path], None] = lambda path: None,
        remote: str | None = None,
        barrier: Callable[[], None],
    ):
        self.root = Path(root)
        self.remote = remote  # a URL each checkpoint is uploaded to after its local write (see `remote`)
        self.parallel, self.loader, self.state = parallel, loader, state
        self.schedule = schedule  # {"name", "total_steps"}: a resume with another length is announced
        self.config, self.tokenizer_json, self.keep_last = config, tokenizer_json, keep_last
        self.dist = parallel.dist
        self.on_saved = on_saved
        self.barrier = barrier  # waits for every rank (`parallel.distributed.barrier`, which sits above this package)
        # Rank 0 alone writes the folder; where every rank writes DCP shards, every rank waits for its own.
        self.shards_everywhere = parallel.checkpoint_kind.weights_in_shards and self.dist.world_size > 1
        self.use_background = background and (self.dist.is_main or self.shards_everywhere)
        self.periodic = periodic  # saves every save_steps: worth host buffers kept for the whole run
        self._writer: BackgroundWriter | None = None
        self._shards = None  # sharded.BackgroundShards: DCP's host buffers and process groups
        self._snapshot = HostSnapshot()  # host buffers for background saves, reused from one save to the next
        self._buffers_reserved = False
        self.resumed_from: Path | None = None  # the checkpoint `load` restored

    # -- lifetime ---------------------------------------------------------------------------------

    def __enter__(self) -> Checkpointer:
        if self.dist.is_main:
            self._remove_staging()  # no rank writes there before the first save's barrier
            remove_stale(self.root)  # a best_model an interrupted save moved aside is put back now
            if self.remote:
                buckets.check_writable(self.remote, "training.checkpoint_dir")
        if self.use_background:
            self._writer, self._buffers_reserved = BackgroundWriter(), False
            if self.shards_everywhere:
                from .sharded import BackgroundShards

                self._shards = BackgroundShards(cuda=self.parallel.device.type == "cuda")
        return self

    def __exit__(self, *exc) -> None:
        """A write still in flight (only when the loop raised) is completed, never abandoned."""
        writer, self._writer = self._writer, None
        shards, self._shards = self._shards, None
        if writer is None:
            return
        try:
            writer.wait()
        except Exception as error:  # the loop is already raising its own error; do not hide it
            log(f"warning: the checkpoint being written in the background failed: {error}")
        finally:
            writer.close()
            if shards is not None:
                shards.close()

    def _remove_staging(self) -> None:
        """Delete the per-rank staging folders (`.staging-*`) a multi-process save killed mid-way left."""
        if not self.root.is_dir():
            return
        for path in self.root.glob(f"{STAGING}*"):
            shutil.rmtree(path, ignore_errors=True)
            log(f"checkpoint: removed {path.name}, left by an interrupted save")

    # -- saving -----------------------------------------------------------------------------------

    def poll(self) -> None:
        """At a step boundary: `on_saved` for a background write that has completed (its error raised
        here). After the first step, when the optimizer state exists, the writer thread first
        allocates the host buffers, so that the first save stalls no longer than later ones."""
        if self._writer is None:
            return
        if self._shards is not None:  # every rank's write, or none: on_saved and an error at the same step
            if self._writer.submitted() and self._shards.all_done(self._writer.done()):
                self.wait()
            return
        if not self._buffers_reserved:
            self._buffers_reserved = True
            if self.periodic:
                self._writer.submit(self._snapshot.reserve(self.parallel.live_tensors()))
            return
        if (path := self._writer.finished()) is not None:
            self.on_saved(path)

    def wait(self) -> None:
        """Block until a background write in flight is complete."""
        if self._writer is not None and (path := self._writer.wait()) is not None:
            self.on_saved(path)

    def wait_everywhere(self) -> None:
        """`wait`, then a barrier: rank 0 writes in the background, so another rank that reads the latest
        checkpoint must first know that rank 0's write is complete. Every rank calls it at the same step."""
        self.wait()
        self.barrier()

    def save(self, *, background: bool = False) -> Path:
        """Save the current step. Every rank calls this at the same step; rank 0 writes the folder."""
        self.wait()  # one write at a time, in step order
        rng_tensors = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng_tensors["cuda"] = torch.cuda.get_rng_state_all()
        path = self.root / checkpoint_name(self.state.step)
        background = background and self._writer is not None
        staging, weights, shards = None, None, None
        if self.dist.world_size > 1 or self.dist.strategy == "deepspeed":  # each rank's own files first
            staging = self.root / f"{STAGING}{path.name}"
            if self.dist.is_main:
                shutil.rmtree(staging, ignore_errors=True)
                staging.mkdir(parents=True)
            self.barrier()
            torch.save(rng_tensors, staging / f"rng-rank{self.dist.rank}.pt")
            in_background = self._shards if background else None  # DCP's copy in host memory, written later
            with self._discarded_on_failure(staging):
                if self.remote:  # FSDP: every rank's shards straight into the store
                    shards = self.parallel.save_shards_to_store(
                        buckets.join(self.remote, path.name, SHARDED_DIR), in_background
                    )
                if shards is None:
                    shards = self.parallel.save_shards(staging, in_background)
            if not self.parallel.checkpoint_kind.weights_in_shards:  # the checkpoint's model folder needs them whole
                weights = self.parallel.full_state_dict()  # a collective where the weights are partitioned
            self.barrier()
        write = None
        if self.dist.is_main:
            write = self._write_job(rng_tensors, staging, copy=background, weights=weights)

        def job() -> Path:
            """Every rank: its shards complete (every rank's, a collective); then rank 0 writes the folder."""
            with self._discarded_on_failure(staging):
                in_store = shards() if shards is not None else None
                return write(in_store) if write is not None else path

        if background:
            self._writer.submit(job)
        else:
            path = job()
        self.barrier()
        if not background:
            self.on_saved(path)
        return path

    @contextlib.contextmanager
    def _discarded_on_failure(self, staging: Path | None) -> Iterator[None]:
        """Rank 0 deletes the staging folder of a save that failed (every rank sees a shard write fail)."""
        try:
            yield
        except BaseException:
            if staging is not None and self.dist.is_main:
                shutil.rmtree(staging, ignore_errors=True)
            raise

    def _write_job(
        self,
        rng_tensors: dict,
        staging: Path | None,
        copy: bool,
        weights: dict[str, torch.Tensor] | None,
    ) -> Callable[[dict[str, dict] | None], Path]:
        """The write of this step's checkpoint, as a function. Everything it needs is read now; `copy`
        snapshots the tensors too, so the write may run while training changes them. `weights`: the
        model gathered from its shards (a copy already). The function's argument: the shards every rank
        wrote into the store, listed in meta.json (the upload then writes files.json, meta.json and `latest`)."""
        np_state = np.random.get_state()
        train_state = self.state.to_file(
            epoch=self.loader.epoch,
            data=self.loader.state_dict(),
            schedule=self.schedule,
            scaler=self.parallel.scaler.state_dict() if self.parallel.scaler.is_enabled() else None,
            rng={"python": _listify(random.getstate()), "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]]},
        )
        train_state = json.loads(json.dumps(train_state))  # plain data, detached from the live loader
        live = self.parallel.live_tensors()
        model_state, optimizer_state = weights, live[1]  # model_state None: the write reads the live model
        if copy:
            copied, optimizer_state = self._snapshot.take(live)
            model_state = weights if weights is not None else copied
        step = self.state.step
        best = checkpoint_name(self.state.best_step) if self.state.best_step is not None else None
        model, root, keep_last, kind = self.parallel.module, self.root, self.keep_last, self.parallel.checkpoint_kind
        remote = self.remote
        extra = {"world_size": self.dist.world_size, "strategy": self.dist.strategy}

        def write(in_store: dict[str, dict] | None) -> Path:
            path = save_checkpoint(
                root,
                step,
                kind=kind,
                model=model,
                model_state=model_state,
                optimizer_state=optimizer_state,
                train_state=train_state,
                rng_tensors=rng_tensors,
                config=self.config,
                tokenizer_json=self.tokenizer_json,
                sharded_dir=staging,
                extra_meta=extra,
                in_store=in_store,
            )
            rotate(root, keep_last, protect={path.name, best} - {None})
            if remote:
                upload_checkpoint(path, remote, keep_last, protect={path.name, best} - {None})
            return path

        return write

    def save_best(self, metrics: dict) -> None:
        """The current weights as `best_model/` (every rank calls it: the weights may be gathered)."""
        weights = self.parallel.full_state_dict()
        if self.dist.is_main:
            save_best_model(
                self.root,
                self.parallel.module,
                tokenizer_json=self.tokenizer_json,
                config=self.config,
                metrics={**metrics, "step": self.state.step},
                state=weights,
            )
            if self.remote:
                upload_best(self.root / BEST, self.remote)

    # -- loading ----------------------------------------------------------------------------------

    def load(self, spec: str, url: str | None = None):
        """Restore every part from a checkpoint folder or "latest" (a fresh start when there is none
        yet). Returns the restored TrainState, or None. `url`: where in a store the checkpoint is read
        from (`TrainingConfig.resume_url`; `spec` is then that URL, or "latest" of the store's checkpoints)."""
        if url is not None:  # from the store: one download per machine
            if self.dist.local_rank == 0:
                fetch_named(url, self.root)
            self.barrier()
            spec = spec if spec == "latest" else str(local_copy(url, self.root))
        path = resolve_checkpoint(spec, self.root)
        if path is None:
            log(f"resume: no checkpoint in {self.root} yet; starting from step 0")
            return None
        if self.remote and spec == "latest" and self.dist.is_main:
            ensure_uploaded(path, self.remote, self.keep_last)
        if not (path / TRAIN_STATE).exists() and (path / CONFIG_NAME).is_file():  # best_model/, a consolidated folder
            raise UsageError(
                f"{path} is a model folder: it holds weights but no optimizer state or data position to resume "
                f"from; resume from a checkpoint (training.resume_from_checkpoint=latest), or start a new run "
                f"from its weights with model.init_from={path}"
            )
        parts = load_checkpoint(path, map_location=self.parallel.device, rank=self.dist.rank)
        parts["store"] = self._store_shards(path, parts["meta"], url)
        self._check_tokenizer(path)
        if self.dist.is_main:
            self._note_other_data(parts["meta"].get("config"))
        saved = parts["train_state"]
        problem = train_state_problem(saved)
        if problem:
            raise CheckpointError(f"checkpoint {path} is unusable: {problem}")
        if saved["step"] > self.schedule["total_steps"]:
            raise UsageError(
                f"{path} is at step {saved['step']}, past this run's last step ({self.schedule['total_steps']}); "
                f"to continue it, raise training.max_steps (or num_train_epochs) above {saved['step']}"
            )
        try:  # before the weights: a position this run cannot continue (another global batch) is refused first
            self.loader.load_state_dict(saved["data"])
        except UsageError as exc:  # a limit (limits.py) the saved position passes
            raise CheckpointError(f"checkpoint {path} is unusable: {exc}") from None
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        except (KeyError, TypeError) as exc:
            raise CheckpointError(
                f"checkpoint {path} is unusable: train_state.json has a malformed data position ({exc})"
            ) from None
        try:
            self.parallel.load(parts, path)
        except UsageError as exc:  # weights that do not fit: named by the settings that made them, where those differ
            self._refuse_other_model(parts["meta"].get("config"), path, exc)
            raise
        self.state.load_state_dict(saved)
        if saved["schedule"]["total_steps"] != self.schedule["total_steps"]:
            log(
                f"resume: the run length changed ({saved['schedule']['total_steps']} -> "
                f"{self.schedule['total_steps']} steps); the schedule follows the new length"
            )
        if saved.get("scaler") and self.parallel.scaler.is_enabled():
            self.parallel.scaler.load_state_dict(saved["scaler"])
        try:
            _restore_rng(parts, saved, self.dist.rank)
        except (KeyError, TypeError, ValueError, IndexError, RuntimeError) as exc:
            raise CheckpointError(
                f"checkpoint {path} is unusable: its random-number states are malformed ({exc})"
            ) from None
        log(f"resume: continuing from {path} (step {self.state.step}, {self.state.tokens_seen:,} tokens seen)")
        self.resumed_from = path
        if spec == "latest" and self.dist.is_main and named_latest(self.root) != path.name:
            point_latest(self.root, path)  # a run killed before it updated `latest`: set right, once it is taken
        later = [p.name for p in reversed(list_checkpoints(self.root)) if step_of(p) > self.state.step]
        if later and self.dist.is_main:  # a resume from an earlier checkpoint trains those steps again
            shown = ", ".join(later[:3]) + (f" and {len(later) - 3} more" if len(later) > 3 else "")
            warn(
                f"resume: {shown} in {self.root} {'were' if len(later) > 1 else 'was'} saved after step "
                f"{self.state.step}; this run saves over them as it passes their steps (copy them elsewhere to keep them)"
            )
        return self.state

    def _store_shards(self, path: Path, meta: dict, url: str | None) -> str | None:
        """The URL of the `sharded/` folder in the store to read the shards of `path` from: None where its
        shards are all on disk. `url`: the store location the resume was given (a checkpoints folder or
        one checkpoint), if any."""
        missing = [n for n in meta.get("in_store", ()) if not (path / n).is_file()]
        if not missing:
            return None
        if url is None:
            raise CheckpointError(
                f"{path} keeps its shards in the store ({missing[0]} is not on disk); resume with "
                "training.checkpoint_dir set to that store's checkpoints folder, or from the checkpoint's URL"
            )
        folder = url if local_copy(url, self.root) != self.root else buckets.join(url, path.name)
        return store_shards(folder, meta)

    def _check_tokenizer(self, path: Path) -> None:
        """Refuse a checkpoint whose token ids mean other tokens than this run's tokenizer gives them."""
        saved = path / "tokenizer.json"
        if self.tokenizer_json is None or not saved.is_file():
            return
        wrong, total = vocabulary_mismatch(saved.read_text(encoding="utf-8"), self.tokenizer_json, str(saved))
        if wrong:
            raise UsageError(
                f"{path} was trained with another tokenizer ({wrong} of this run's {total} tokens are "
                f"missing from it or have other ids); resume with the data and tokenizer it was trained "
                f"with ({saved}), or train into another output_dir"
            )

    def _refuse_other_model(self, saved: Any, path: Path, misfit: UsageError) -> None:
        """Refuse, naming them first, the model settings that differ from the checkpoint's (architecture,
        d_model, ...), when its weights do not fit this run's model (`misfit`, which lists the tensors);
        nothing when no saved setting differs."""
        old = saved.get("model") if isinstance(saved, dict) else None
        new = self.config.get("model")
        if not isinstance(old, dict) or not isinstance(new, dict):
            return
        changed = [f"model.{k}: {old.get(k)} -> {new.get(k)}" for k in _changed_keys(old, new)]
        if changed:
            shown = ", ".join(changed[:4]) + (", ..." if len(changed) > 4 else "")
            raise UsageError(
                f"{path} was trained with other model settings ({shown}): resume with the checkpoint's model "
                f"settings, or train into another output_dir ({misfit})"
            ) from None

    def _note_other_data(self, saved: Any) -> None:
        """Warn when the checkpoint trained on other prepared data than this run's (its fingerprint): the
        data position it saved names other rows here, so the rest of its epoch is not the one it was
        reading. Training on into other data is allowed (more data, a new mixture); an exact resume
        needs the same."""
        before = saved.get("data_fingerprint") if isinstance(saved, dict) else None
        now = self.config.get("data_fingerprint")
        if before is None or now is None or before == now:
            return
        old, new = saved.get("data"), self.config.get("data")
        old, new = (old if isinstance(old, dict) else {}), (new if isinstance(new, dict) else {})
        changed = _changed_keys(old, new)
        what = (
            ", ".join(f"data.{key}" for key in changed[:4]) + (", ..." if len(changed) > 4 else "")
            if changed
            else "the same settings, prepared anew: the files changed, or the data format of a newer llm-trainer"
        )
        warn(
            f"resume: the checkpoint trained on other data ({what}); its data position names other rows here, so "
            "the run goes on over this data, not as it would have (resume with its data for an exact resume)"
        )


def _changed_keys(old: dict, new: dict) -> list[str]:
    """The keys of a config section whose values differ between the checkpoint's and this run's, sorted."""
    return sorted(key for key in old.keys() | new.keys() if old.get(key) != new.get(key))


def _restore_rng(parts: dict[str, Any], saved: dict, rank: int) -> None:
    rng = parts["rng"]  # this rank's own, where sharded/ holds one: each rank continues its dropout stream
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    random.setstate(_tuplify(saved["rng"]["python"]))
    kind, keys, *rest = saved["rng"]["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), *rest))


def _listify(value):
    return [_listify(v) for v in value] if isinstance(value, (list, tuple)) else value


def _tuplify(value):
    return tuple(_tuplify(v) for v in value) if isinstance(value, list) else value

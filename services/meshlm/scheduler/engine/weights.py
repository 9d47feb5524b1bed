"""New weights without a restart (UpdateWeights), as Engine methods (mixed into Engine).

Three calls, split by thread like a step, then one for in-process use:

    checkpoint = engine.check_weights(path, load_format)   # any thread, no torch: refusals
    retracted = engine.drop_kv()                           # loop thread, between steps
    engine.load_weights(checkpoint)                        # engine thread, between steps
    engine.update_weights(path, load_format)               # the three, on the calling thread

`drop_kv` retracts every running request to the waiting queue and empties the prefix cache, so
no KV computed with the old weights is read again: each request recomputes its prompt and the
tokens it already has with the new weights and goes on, no token lost or repeated. A refused
checkpoint changes nothing; the old weights keep serving.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshlm.common.logs import get_logger
from meshlm.scheduler.models.config import ModelConfig
from meshlm.scheduler.models.reload import (
    Checkpoint,
    check_checkpoint,
    load_checkpoint,
    served_checkpoint,
    weight_shapes,
)

if TYPE_CHECKING:
    from meshlm.scheduler.engine.engine import EngineConfig
    from meshlm.scheduler.engine.policy import Scheduler
    from meshlm.scheduler.models.llama import LlamaForCausalLM

log = get_logger(__name__)


class WeightsLoadError(RuntimeError):
    """A checked checkpoint failed to load (I/O); the message says what is served now."""


@dataclass
class WeightsUpdate:
    model_path: str
    load_format: str
    retracted: int  # running requests moved back to the queue
    tensors: int  # tensors stored
    seconds: float


class EngineWeights:
    """The Engine's weight updates; see the module docstring for threads."""

    config: EngineConfig
    model: LlamaForCausalLM
    model_config: ModelConfig
    scheduler: Scheduler
    _served_checkpoint: Checkpoint | None = None  # set on the first update

    def check_weights(self, model_path: str, load_format: str = "auto") -> Checkpoint:
        """The checkpoint at `model_path` if this model can take its weights in place: the
        same config (dtype aside), vocabulary and tensor shapes. Reads config.json,
        tokenizer.json and the safetensors headers only. Raises ValueError (unknown
        load_format), CheckpointNotFound, IncompatibleCheckpoint (naming what differs)."""
        return check_checkpoint(model_path, load_format, self._served(),
                                weight_shapes(self.model))

    def drop_kv(self) -> int:
        """Retract every running request and empty the prefix cache (loop thread, between
        steps); returns how many were retracted. A pause in force stays."""
        return self.scheduler.drop_kv()

    def load_weights(self, checkpoint: Checkpoint) -> int:
        """Copy a checked checkpoint's weights into the model in place and serve it from now
        on (engine thread, between steps, after drop_kv); returns how many tensors were stored.
        On an I/O error the served checkpoint is loaded back and WeightsLoadError raised; if
        that fails too, generation is paused (abort: no output from mixed weights) until
        another update succeeds and ContinueGeneration is called."""
        served = self._served()
        try:
            tensors = load_checkpoint(self.model, checkpoint)
        except Exception as exc:
            log.exception("weights_load_failed", model_path=str(checkpoint.path))
            try:
                load_checkpoint(self.model, served)
            except Exception:
                log.exception("weights_restore_failed", model_path=str(served.path))
                self.scheduler.pause("abort")
                raise WeightsLoadError(
                    f"loading {checkpoint.path} failed ({exc}), and so did loading "
                    f"{served.path} back: generation is paused (abort) until a successful "
                    "update and ContinueGeneration") from exc
            raise WeightsLoadError(f"loading {checkpoint.path} failed ({exc}); "
                                   f"{served.path} is served again") from exc
        self.config = dataclasses.replace(self.config, model_path=str(checkpoint.path),
                                          load_format=checkpoint.load_format)
        self.model_config = checkpoint.config
        self._served_checkpoint = checkpoint
        return tensors

    def update_weights(self, model_path: str, load_format: str = "auto") -> WeightsUpdate:
        """check_weights, drop_kv and load_weights on the calling thread (in-process use,
        between steps)."""
        start = time.perf_counter()
        checkpoint = self.check_weights(model_path, load_format)
        retracted = self.drop_kv()
        tensors = self.load_weights(checkpoint)
        update = WeightsUpdate(str(checkpoint.path), checkpoint.load_format, retracted, tensors,
                               time.perf_counter() - start)
        log.info("weights_updated", model_path=update.model_path, load_format=update.load_format,
                 retracted=retracted, tensors=tensors, ms=round(update.seconds * 1e3, 1))
        return update

    def _served(self) -> Checkpoint:
        served = self._served_checkpoint
        if served is None:
            served = served_checkpoint(self.config.model_path, self.config.load_format,
                                       self.model_config)
            self._served_checkpoint = served
        return served

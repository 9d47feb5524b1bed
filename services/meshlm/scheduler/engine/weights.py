"""The served weights and their replacement in place (UpdateWeights), a component of the Engine.

`ServedWeights` knows the model and the checkpoint its weights came from. The Engine splits an
update by thread like a step (engine.py: check_weights, drop_kv, load_weights, update_weights):

    checkpoint = weights.check(path, load_format)   # any thread, no torch: refusals
    retracted = planner.drop_kv()                   # loop thread, between steps
    weights.load(checkpoint)                        # engine thread, between steps

`drop_kv` retracts every running request to the waiting queue and empties the prefix cache, so
no KV computed with the old weights is read again: each request recomputes its prompt and the
tokens it already has with the new weights and goes on, no token lost or repeated. A refused
checkpoint changes nothing; the old weights keep serving.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from meshlm.common.logs import get_logger
from meshlm.scheduler.models.config import ModelConfig
from meshlm.scheduler.models.reload import (
    Checkpoint,
    check_checkpoint,
    load_checkpoint,
    served_checkpoint,
    weight_shapes,
)

log = get_logger(__name__)


class WeightsLoadError(RuntimeError):
    """A checked checkpoint failed to load (I/O); the message says what is served now.
    `restored`: the served checkpoint was loaded back (if not, the model's weights are mixed
    and nothing may be generated from them)."""

    def __init__(self, message: str, restored: bool) -> None:
        super().__init__(message)
        self.restored = restored


@dataclass
class WeightsUpdate:
    model_path: str
    load_format: str
    retracted: int  # running requests moved back to the queue
    tensors: int  # tensors stored
    seconds: float


class ServedWeights:
    """`model`'s weights, loaded from `model_path` (`load_format`, `model_config`): checks
    another checkpoint against them and copies it in place."""

    def __init__(self, model: nn.Module, model_path: str, load_format: str,
                 model_config: ModelConfig) -> None:
        self.model = model
        self._source = (model_path, load_format, model_config)
        self._checkpoint: Checkpoint | None = None  # described on first use

    @property
    def checkpoint(self) -> Checkpoint:
        """The checkpoint served now."""
        if self._checkpoint is None:
            self._checkpoint = served_checkpoint(*self._source)
        return self._checkpoint

    def check(self, model_path: str, load_format: str = "auto") -> Checkpoint:
        """The checkpoint at `model_path` if this model can take its weights in place: the
        same config (dtype aside), vocabulary and tensor shapes. Reads config.json,
        tokenizer.json and the safetensors headers only. Raises ValueError (unknown
        load_format), CheckpointNotFound, IncompatibleCheckpoint (naming what differs)."""
        return check_checkpoint(model_path, load_format, self.checkpoint,
                                weight_shapes(self.model))

    def load(self, checkpoint: Checkpoint) -> int:
        """Copy a checked checkpoint's weights into the model in place and serve it from now
        on; returns how many tensors were stored. On an I/O error the served checkpoint is
        loaded back and WeightsLoadError raised (`restored` False if that failed too)."""
        served = self.checkpoint
        try:
            tensors = load_checkpoint(self.model, checkpoint)
        except Exception as exc:
            log.exception("weights_load_failed", model_path=str(checkpoint.path))
            try:
                load_checkpoint(self.model, served)
            except Exception:
                log.exception("weights_restore_failed", model_path=str(served.path))
                raise WeightsLoadError(
                    f"loading {checkpoint.path} failed ({exc}), and so did loading "
                    f"{served.path} back: generation is paused (abort) until a successful "
                    "update and ContinueGeneration", restored=False) from exc
            raise WeightsLoadError(f"loading {checkpoint.path} failed ({exc}); "
                                   f"{served.path} is served again", restored=True) from exc
        self._checkpoint = checkpoint
        return tensors

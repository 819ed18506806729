"""The recording of a user's own training loop: the recorder's public face
(:class:`TrainingRecorder`), the :class:`Recording` it returns, and its files."""

from ._recorder import TrainingRecorder
from ._recording import Recording

__all__ = ["Recording", "TrainingRecorder"]

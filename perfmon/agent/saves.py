"""The saves perfmon times as *checkpoint* besides ``torch.save`` (no torch here: ``bootstrap`` waits for their
modules' imports before the script imports torch)."""

from __future__ import annotations

#: Saves timed whole as *checkpoint*, by module: a framework's checkpoint gathers its state and writes files around
#: its torch.save and safetensors calls (the Trainers' saves took 3-10x the time of those calls alone), and
#: safetensors' ``save_file`` is HF's default format (its ``save_model`` calls it). Nested saves are one checkpoint.
SAVES: dict[str, tuple[str, ...]] = {
    "safetensors.torch": ("save_file",),
    "transformers.trainer": ("Trainer._save_checkpoint",),
    "transformers.modeling_utils": ("PreTrainedModel.save_pretrained",),
    "accelerate.accelerator": ("Accelerator.save_state", "Accelerator.save_model"),
    "lightning.pytorch.trainer.trainer": ("Trainer.save_checkpoint",),
    "pytorch_lightning.trainer.trainer": ("Trainer.save_checkpoint",),
    "lightning.fabric.fabric": ("Fabric.save",),
    "lightning_fabric.fabric": ("Fabric.save",),
    "ignite.handlers.checkpoint": ("Checkpoint.__call__", "ModelCheckpoint.__call__"),
    "skorch.callbacks.training": ("Checkpoint.save_model",),
    "skorch.net": ("NeuralNet.save_params",),
}

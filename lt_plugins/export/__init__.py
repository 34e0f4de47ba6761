"""Export a training checkpoint: a Tandem bundle, a safetensors state dict, a Hugging Face folder or a PEFT adapter.

- `checkpoint`: what every export reads and refuses (the checkpoint, the run's model description, the target).
- `bundle`: a shared_model bundle, and the `ExportBundle` callback that writes one when training ends.
- `state_dict`, `hf`, `adapter`: the other formats, for any LightningModule (the adapter for a LoRA run).
- `formats`: `export_checkpoint`, which picks the format `--format auto` means and writes it.
Each format module imports `checkpoint` and nothing of another format's; nothing here imports a module above it.
"""

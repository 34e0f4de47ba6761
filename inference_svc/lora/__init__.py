"""LoRA adapters served beside their base model: `adapter` reads and checks a PEFT folder, `slots` holds the stacked
adapter weights and adds each row's delta in the step."""
